"""configs.py is pure Python: block sizes, buckets and pruning, no GPU needed."""

import pytest

from flashtriton import configs


@pytest.mark.parametrize("d,bd", [(1, 16), (16, 16), (17, 32), (40, 64), (64, 64), (72, 128),
                                  (96, 128), (128, 128), (192, 256), (256, 256)])
def test_block_d_pads_to_power_of_two(d, bd):
    assert configs.block_d(d) == bd


@pytest.mark.parametrize("n,b", [(0, 64), (1, 64), (64, 64), (65, 128), (1000, 1024),
                                 (4096, 4096), (4097, 8192)])
def test_bucket(n, b):
    assert configs.bucket(n) == b


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
def test_gpu_candidates_and_pruning(kind):
    cands = configs.candidates(kind, interpret=False)
    assert len(cands) == len(set(cands)) > 3
    for bd in (16, 64, 128, 256):
        kept = configs.prune(kind, cands, bd, 2)
        assert kept == configs._GPU[kind][configs._dim_class(bd)]  # best first
    assert configs.prune(kind, cands, 64, 4) == configs._FP32
    for bd in (128, 256):  # the compile time of fp32 FMA products
        assert configs.prune(kind, cands, bd, 4) == configs._FP32_WIDE


def test_fp8_decoding_takes_its_own_tiles_at_head_dim_128():
    cands = configs.candidates("decode", interpret=False)
    assert len(cands) == len(set(cands))
    assert configs.prune("decode", cands, 128, 2, fp8=True) == configs._FP8_DECODE
    for bd in (64, 256):  # measured at 128 only: the bf16 tiles elsewhere
        assert (configs.prune("decode", cands, bd, 2, fp8=True)
                == configs.prune("decode", cands, bd, 2))
    assert configs.prune("decode", cands, 128, 2)[0] == configs._GPU["decode"][128][0]
    assert configs.prune("decode", cands, 128, 4, fp8=True) == configs._FP32_DECODE


def test_interpreter_runs_one_config():
    for kind in configs.KINDS:
        assert len(configs.candidates(kind, interpret=True)) == 1
    with pytest.raises(ValueError, match="unknown kernel kind"):
        configs.candidates("nope")


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("max_block", [32, 64, 128])
def test_tiles_fit_block_masks(kind, max_block):
    # A block mask of max_block x max_block tiles needs kernel tiles that divide it.
    cands = configs.candidates(kind, interpret=False)
    for bd in (64, 128, 256):
        for elem in (2, 4):
            kept = configs.prune(kind, cands, bd, elem, max_block)
            assert kept and all(max(c[0], c[1]) <= max_block for c in kept), (bd, elem, kept)


def test_host_arithmetic_matches_triton():
    import triton
    for a in range(0, 300, 7):
        for b in (1, 16, 64, 128):
            assert configs.cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 1100, 13):
        assert configs.next_pow2(n) == triton.next_power_of_2(n)


def test_decode_candidates():
    cands = configs.candidates("decode", interpret=False)
    assert all(c[0] == 0 for c in cands)  # BLOCK_M comes from the call
    for bd in (64, 128, 256):
        assert configs.prune("decode", cands, bd, 2) == configs._GPU["decode"][bd]
        assert configs.prune("decode", cands, bd, 4) == configs._FP32_DECODE
    granule = configs.decode_split_granule(interpret=False)
    assert all(granule % c[1] == 0 for c in cands) and granule == 128
    assert configs.decode_split_granule(interpret=True) == 16
    assert configs.as_kwargs((0, 64, 4, 3)) == {"BLOCK_N": 64}
    assert configs.as_kwargs((128, 64, 4, 3)) == {"BLOCK_M": 128, "BLOCK_N": 64}


# The Gluon kernels' launch constants (configs.GLUON_FWD_OPTIONS / GLUON_BWD_OPTIONS) and the
# rules that choose the ones left None.

def test_gluon_options_defaults_leave_the_rules_to_choose():
    """The tables' defaults: the registers and warps set, every rule-chosen option None."""
    assert configs.GLUON_FWD_OPTIONS == dict(num_warps=4, CONSUMER_REGS=232, PRODUCER_REGS=40,
                                             HEAVY_FIRST=True, ORDER=None)
    assert configs.GLUON_BWD_OPTIONS == dict(num_warps=4, CONSUMER_REGS=240, PRODUCER_REGS=24,
                                             EARLY_S=None, ONE_LOOP=None, SKIP_EMPTY=None,
                                             ORDER=None)


@pytest.mark.parametrize("has_upper", [False, True])
@pytest.mark.parametrize("has_lower", [False, True])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gluon_bwd_options_rules(has_upper, has_lower, alibi, head_dim):
    """gluon_bwd_options over every walk: SKIP_EMPTY with a lower bound (a window's); ORDER 1
    (whole walks first) with a lower bound, else 0; ONE_LOOP with a lower bound or ALiBi;
    EARLY_S with an upper bound (causal, a window's) and three loops, where dQ is staged (not
    at head dim 256). The set options pass through, and the table is left as it was."""
    before = dict(configs.GLUON_BWD_OPTIONS)
    opts = configs.gluon_bwd_options(has_upper, has_lower, alibi, head_dim)
    assert opts["SKIP_EMPTY"] is has_lower
    assert opts["ORDER"] == (1 if has_lower else 0)
    assert opts["ONE_LOOP"] is (has_lower or alibi)
    assert opts["EARLY_S"] is (has_upper and not (has_lower or alibi) and head_dim != 256)
    for name in ("num_warps", "CONSUMER_REGS", "PRODUCER_REGS"):
        assert opts[name] == before[name]
    assert configs.GLUON_BWD_OPTIONS == before and opts is not configs.GLUON_BWD_OPTIONS


@pytest.mark.parametrize("has_lower", [False, True])
def test_gluon_fwd_options_rules(has_lower):
    """gluon_fwd_options: ORDER 1 (whole windows first) with a lower bound, else 0; the rest
    as the table holds it, the table left as it was."""
    before = dict(configs.GLUON_FWD_OPTIONS)
    opts = configs.gluon_fwd_options(has_lower)
    assert opts == dict(before, ORDER=1 if has_lower else 0)
    assert configs.GLUON_FWD_OPTIONS == before


def test_gluon_options_set_values_stay(monkeypatch):
    """An option set in a table (not None) is what every walk gets: the rules choose only
    the None ones (EARLY_S off where the walk has an upper bound, ONE_LOOP off with ALiBi,
    SKIP_EMPTY off and ORDER 3 with a window, the forward's ORDER 0 with one)."""
    monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, "EARLY_S", False)
    assert configs.gluon_bwd_options(True)["EARLY_S"] is False
    monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, "ONE_LOOP", False)
    assert configs.gluon_bwd_options(True, alibi=True)["ONE_LOOP"] is False
    monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, "SKIP_EMPTY", False)
    monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, "ORDER", 3)
    window = configs.gluon_bwd_options(True, has_lower=True)
    assert window["SKIP_EMPTY"] is False and window["ORDER"] == 3
    monkeypatch.setitem(configs.GLUON_FWD_OPTIONS, "ORDER", 0)
    assert configs.gluon_fwd_options(True)["ORDER"] == 0


def test_gluon_options_reach_the_snapshot(monkeypatch):
    """configs.snapshot() (hashed into every call signature) holds both option tables and the
    Gluon tiles: a change of any option or tile changes it, and undoing the change gives the
    same snapshot back (the tables' cached items follow every dict method)."""
    base = configs.snapshot()
    assert configs.snapshot() is base  # kept (hash computed once) while nothing changes
    assert hash(base) == hash(tuple(base))
    for table in (configs.GLUON_FWD_OPTIONS, configs.GLUON_BWD_OPTIONS):
        for name, value in list(table.items()):
            with monkeypatch.context() as m:
                m.setitem(table, name, 7 if value is None else not value
                          if isinstance(value, bool) else value + 8)
                assert configs.snapshot() != base, name
            assert configs.snapshot() == base, name
        saved = dict(table)
        for change in (lambda t: t.update(ORDER=5), lambda t: t.pop("ORDER"),
                       lambda t: t.setdefault("NEW", 1), lambda t: t.popitem(),
                       lambda t: t.__ior__({"ORDER": 6}), lambda t: t.clear()):
            change(table)
            assert configs.snapshot() != base
            table.clear()
            table.update(saved)
            assert configs.snapshot() == base
    for name in ("GLUON_FWD_BLOCK_M", "GLUON_FWD_BLOCK_N", "GLUON_FWD_STAGES",
                 "GLUON_BWD_BLOCK_M", "GLUON_BWD_BLOCK_N", "GLUON_BWD_MIN_SEQLEN",
                 "GLUON_BWD_HEAD_DIMS", "GLUON_BWD_KERNEL_HEAD_DIMS", "GLUON_FWD_WIDE_BLOCK_N",
                 "GLUON_BWD_WIDE_BLOCK_N", "DECODE_MERGE_MAX_BYTES", "DECODE_MAX_ROWS",
                 "KVCACHE_PREFILL_MIN_ROWS"):
        with monkeypatch.context() as m:
            m.setattr(configs, name, getattr(configs, name) * 2)
            assert configs.snapshot() != base, name
        assert configs.snapshot() == base, name
    configs.DECODE_MERGE_IN_KERNEL = not configs.DECODE_MERGE_IN_KERNEL  # a plain assignment
    try:
        assert configs.snapshot() != base
    finally:
        configs.DECODE_MERGE_IN_KERNEL = not configs.DECODE_MERGE_IN_KERNEL
    assert configs.snapshot() == base


def test_call_signatures_follow_the_gluon_options(monkeypatch):
    """runtime.call_signature holds the snapshot, so a Gluon option's change gives every site
    a new signature (a replay never runs a kernel compiled for other options)."""
    from flashtriton import _env, runtime
    monkeypatch.setattr(_env, "INTERPRET", False)
    monkeypatch.setattr(_env, "FAST_LAUNCH", True)
    before = runtime.call_signature("s", (1, ), None)
    assert runtime.call_signature("s", (1, ), None) == before
    monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, "EARLY_S", True)
    assert runtime.call_signature("s", (1, ), None) != before
    monkeypatch.setitem(configs.GLUON_FWD_OPTIONS, "HEAVY_FIRST",
                        not configs.GLUON_FWD_OPTIONS["HEAVY_FIRST"])
    monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, "EARLY_S", None)
    assert runtime.call_signature("s", (1, ), None) != before
