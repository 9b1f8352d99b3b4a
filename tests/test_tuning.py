"""Tuning tables (flashtriton.tuning): which tile a call takes without autotuning, the files
that save and load write and read, what the autotuner records, and the shipped tables."""

import json

import pytest
import torch
import triton

from flashtriton import _env, configs, runtime, tuning
from flashtriton.launch import triton_attn

H200 = (9, 0)
FWD128 = configs._GPU["fwd"][128]


SHIPPED = tuning.SHIPPED_DIR


@pytest.fixture(autouse=True)
def fresh_tables(monkeypatch, tmp_path_factory):
    """No tables but a test's own: no user files, an empty directory of shipped ones."""
    monkeypatch.setattr(_env, "TUNING_FILES", [])
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path_factory.mktemp("shipped"))
    tuning.reset()
    yield
    tuning.reset()


def _key(sq=4096, sk=4096, d=128, upper=True, **more):
    return (("SQ_BUCKET", sq), ("SK_BUCKET", sk), ("HEAD_DIM", d), ("HAS_UPPER", upper),
            *more.items())


def _table(tmp_path, entries, name="t.json", capability=H200):
    path = tmp_path / name
    path.write_text(json.dumps(tuning.to_json(
        [tuning.Entry(k, dt, key, cfg, capability) for k, dt, key, cfg in entries])))
    return path


def test_exact_key_wins_then_the_nearest(tmp_path):
    tuning.load(_table(tmp_path, [("fwd", "bfloat16", _key(sk=1024), FWD128[1]),
                                  ("fwd", "bfloat16", _key(sk=4096), FWD128[2]),
                                  ("fwd", "bfloat16", _key(sk=4096, upper=False), FWD128[3])]))
    choose = lambda key, dt="bfloat16": tuning.choose("fwd", dt, key, FWD128, H200)  # noqa: E731
    assert choose(_key(sk=4096)) == FWD128[2]
    assert choose(_key(sk=1024)) == FWD128[1]
    assert choose(_key(sk=2048, sq=2048)) == FWD128[1]  # 1 octave from sk=1024, 2 from 4096
    assert choose(_key(sk=16384, sq=16384)) == FWD128[2]  # beyond the table: its longest
    assert choose(_key(upper=False)) == FWD128[3]
    assert choose(_key(sk=4096), dt="float16") == FWD128[2]  # fp16 takes bf16's entries
    # another kernel, another GPU: no entry, the class's default
    assert tuning.choose("dq", "bfloat16", _key(), FWD128, H200) == FWD128[0]
    assert tuning.choose("fwd", "bfloat16", _key(sk=4096), FWD128, (8, 0)) == FWD128[0]


def test_tiles_that_do_not_suit_the_call_are_passed_over(tmp_path):
    tuning.load(_table(tmp_path, [("fwd", "bfloat16", _key(), (256, 64, 8, 3)),
                                  ("fwd", "bfloat16", _key(sk=65536), (128, 64, 4, 3))]))
    # a block mask of 128: tiles of at most 128 rows; the exact entry's 256 rows are out
    allowed = configs.prune("fwd", configs.candidates("fwd", interpret=False), 128, 2, 128)
    assert (256, 64, 8, 3) not in allowed
    assert tuning.choose("fwd", "bfloat16", _key(), allowed, H200) == (128, 64, 4, 3)
    assert tuning.choose("fwd", "bfloat16", _key(), [(64, 64, 4, 3)], H200) == (64, 64, 4, 3)


def test_distance():
    a = dict(_key(sk=1024))
    assert tuning.distance(a, a) == 0
    assert tuning.distance(a, dict(_key(sk=4096))) == 2  # two octaves
    assert tuning.distance(a, dict(_key(sk=1024, d=64))) == 2  # head dims count double
    assert tuning.distance(a, dict(_key(sk=1024, upper=False))) == 1
    assert tuning.distance(a, dict(_key(sk=1024, HAS_SOFTCAP=True))) == 1  # missing field


def test_later_tables_win_and_save_round_trips(tmp_path):
    first = _table(tmp_path, [("fwd", "bfloat16", _key(), FWD128[1])], "first.json")
    second = _table(tmp_path, [("fwd", "bfloat16", _key(), FWD128[2])], "second.json")
    assert tuning.load(first) == 1 and tuning.load(second) == 1
    assert tuning.choose("fwd", "bfloat16", _key(), FWD128, H200) == FWD128[2]
    assert [s for s, _ in tuning.tables()] == [str(second), str(first)]
    # save(entries) writes what load reads; merge keeps the old file's other keys
    out = tmp_path / "saved.json"
    entry = tuning.Entry("dq", "bfloat16", _key(sk=512), (128, 64, 8, 2), H200)
    assert tuning.save(out, [entry]) == 1
    again = tuning.Entry("dkdv", "bfloat16", _key(sk=512), (64, 128, 8, 2), H200)
    assert tuning.save(out, [again], merge=True) == 2
    assert sorted(tuning.parse(json.loads(out.read_text()))) == sorted([entry, again])


def test_loading_forgets_tiles_chosen_before(tmp_path, monkeypatch):
    monkeypatch.setitem(runtime._TUNED, ("kernel", "key"), ("name", "cfg"))
    monkeypatch.setitem(runtime._CALLS, "signature", ("replays",))
    tuning.load(_table(tmp_path, []))
    assert ("kernel", "key") not in runtime._TUNED and "signature" not in runtime._CALLS


@pytest.mark.parametrize("bad,match", [
    ({"format": "other"}, "not a flashtriton tuning table"),
    ({"format": tuning.FORMAT, "version": 99, "capability": [9, 0]}, "version 99"),
    ({"format": tuning.FORMAT, "version": 1, "capability": "sm90"}, "capability"),
    ({"format": tuning.FORMAT, "version": 1, "capability": [9, 0],
      "entries": [{"kernel": "fwd", "dtype": "bfloat16", "key": {}, "config": [1, 2]}]},
     "entry 0"),
])
def test_bad_tables_raise_naming_the_file(tmp_path, bad, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=match) as e:
        tuning.load(path)
    assert str(path) in str(e.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        tuning.load(path)


def test_environment_files_load_on_the_first_call_the_last_named_wins(tmp_path, monkeypatch):
    a = _table(tmp_path, [("fwd", "bfloat16", _key(), FWD128[1])], "a.json")
    b = _table(tmp_path, [("fwd", "bfloat16", _key(), FWD128[2])], "b.json")
    monkeypatch.setattr(_env, "TUNING_FILES", [str(a), str(b)])
    assert tuning.choose("fwd", "bfloat16", _key(), FWD128, H200) == FWD128[2]
    tuning.reset()
    monkeypatch.setattr(_env, "TUNING_FILES", [str(tmp_path / "missing.json")])
    with pytest.raises(FileNotFoundError, match="FLASHTRITON_TUNING_FILE.*missing.json"):
        tuning.choose("fwd", "bfloat16", _key(), FWD128, H200)


class _Fn:
    """A JIT function whose launches fail with OutOfResources for the tiles in ``too_big``."""
    __name__ = "fake"
    arg_names = ["Q", "N"]

    def __init__(self, too_big):
        self.too_big, self.launched = too_big, []

    def __getitem__(self, grid):
        def run(*args, BLOCK_M, BLOCK_N, num_warps, num_stages, **kw):
            if (BLOCK_M, BLOCK_N, num_warps, num_stages) in self.too_big:
                raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
            self.launched.append((BLOCK_M, BLOCK_N, num_warps, num_stages))
        return run


class _Kernel:
    kind, keys = "fwd", ["N"]

    def __init__(self, tiles, too_big=()):
        self.fn = _Fn(too_big)
        self.tiles = tiles
        self.by_tile = {t: triton.Config(configs.as_kwargs(t), num_warps=t[2], num_stages=t[3])
                        for t in tiles}
        self.cache = {}

    def allowed(self, named_args, kwargs):
        return self.tiles


def test_a_tile_that_does_not_fit_the_gpu_falls_to_the_next(monkeypatch):
    monkeypatch.setattr(_env, "FAST_LAUNCH", False)
    monkeypatch.setattr(_env, "AUTOTUNE", False)
    kernel = _Kernel(FWD128[:3], too_big={FWD128[0]})
    q = torch.zeros(4)
    try:
        runtime._launch(kernel, (1,), ("k",), q, 64)
        assert kernel.fn.launched == [FWD128[1]]
        assert runtime._cfg_tuple(runtime._TUNED[(id(kernel), ("k",))][1]) == FWD128[1]
    finally:
        runtime._TUNED.pop((id(kernel), ("k",)), None)
    everything = _Kernel(FWD128[:2], too_big=set(FWD128[:2]))
    with pytest.raises(triton.runtime.errors.OutOfResources):
        runtime._launch(everything, (1,), ("k",), q, 64)


def test_the_autotuners_choices_are_recorded(monkeypatch, tmp_path):
    monkeypatch.setattr(_env, "FAST_LAUNCH", False)
    monkeypatch.setattr(_env, "AUTOTUNE", True)
    calls = []

    class Tuner(_Kernel):
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(args)
    tuner = Tuner([FWD128[2]])
    tuner.best_config = tuner.by_tile[FWD128[2]]
    q = torch.zeros(4, dtype=torch.bfloat16)
    try:
        runtime._launch(tuner, (1,), ("k",), q, 777)
    finally:
        runtime._TUNED.pop((id(tuner), ("k",)), None)
    assert len(calls) == 1
    (entry,) = tuning.recorded()
    assert entry == tuning.Entry("fwd", "bfloat16", (("N", 777),), FWD128[2], (0, 0))
    # and a saved table gives the same tile back
    out = tmp_path / "mine.json"
    tuning.save(out)
    tuning.reset()
    tuning.load(out)
    assert tuning.choose("fwd", "bfloat16", (("N", 777),), FWD128, (0, 0)) == FWD128[2]


def test_the_shipped_table_loads_below_the_users(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path)
    _table(tmp_path, [("fwd", "bfloat16", _key(), FWD128[1]),
                      ("fwd", "bfloat16", _key(sk=512), FWD128[3])], "sm90.json")
    mine = _table(tmp_path, [("fwd", "bfloat16", _key(), FWD128[2])], "mine.json")
    tuning.load(mine)  # before the first call: the shipped table still goes below it
    assert tuning.choose("fwd", "bfloat16", _key(), FWD128, H200) == FWD128[2]
    assert tuning.choose("fwd", "bfloat16", _key(sk=512), FWD128, H200) == FWD128[3]
    assert [s for s, _ in tuning.tables()] == [str(mine), str(tmp_path / "sm90.json")]


def test_sm90_is_shipped_and_packaged():
    assert (SHIPPED / "sm90.json").exists()
    with open(SHIPPED.parents[1] / "pyproject.toml") as f:
        assert '"tuned/*.json"' in f.read()


@pytest.mark.parametrize("arch", sorted(p.stem for p in SHIPPED.glob("*.json")))
def test_shipped_tables_hold_tiles_the_kernels_take(arch):
    # Every entry's tile is a candidate of its kernel that suits its head dim and dtype: a
    # table cannot send a call to a tile the kernel was not built with.
    with open(SHIPPED / f"{arch}.json") as f:
        entries = tuning.parse(json.load(f), arch)
    assert entries and arch == "sm%d%d" % entries[0].capability
    kinds = {e.kernel for e in entries}
    assert kinds <= set(configs.KINDS) and {"fwd", "dkdv", "dq", "decode"} <= kinds
    for e in entries:
        key = dict(e.key)
        widest = (key["BLOCK_D"] if e.kernel == "decode"
                  else max(configs.block_d(key["HEAD_DIM"]), configs.block_d(key["HEAD_DIM_V"])))
        allowed = configs.prune(e.kernel, configs.candidates(e.kernel, interpret=False), widest,
                                getattr(torch, e.dtype).itemsize, fp8=bool(key.get("FP8")))
        assert e.config in allowed, e
        assert set(key) == set(getattr(triton_attn, "_" + e.kernel).keys), e


def test_an_explicit_load_wins_over_the_environments_files(tmp_path, monkeypatch):
    env = _table(tmp_path, [("fwd", "bfloat16", _key(), FWD128[1])], "env.json")
    mine = _table(tmp_path, [("fwd", "bfloat16", _key(), FWD128[2])], "mine.json")
    monkeypatch.setattr(_env, "TUNING_FILES", [str(env)])
    tuning.load(mine)  # before any call: the environment's file loads first, below it
    assert tuning.choose("fwd", "bfloat16", _key(), FWD128, H200) == FWD128[2]
    assert [s for s, _ in tuning.tables()] == [str(mine), str(env)]


def test_a_bad_environment_file_raises_on_every_call_and_loads_nothing(tmp_path, monkeypatch):
    good = _table(tmp_path, [("fwd", "bfloat16", _key(), FWD128[1])], "good.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setattr(_env, "TUNING_FILES", [str(good), str(bad)])
    for _ in range(2):
        with pytest.raises(ValueError, match="bad.json"):
            tuning.choose("fwd", "bfloat16", _key(), FWD128, H200)
    assert tuning.tables() == []
    bad.write_text(good.read_text())
    assert tuning.choose("fwd", "bfloat16", _key(), FWD128, H200) == FWD128[1]
