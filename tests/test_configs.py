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
def test_gpu_candidates_and_pruning(kind, monkeypatch):
    monkeypatch.setattr(configs._env, "AUTOTUNE", True)
    cands = configs.candidates(kind, interpret=False)
    assert len(cands) == len(set(cands)) > 3
    for bd in (16, 64, 128, 256):
        kept = configs.prune(kind, cands, bd, 2)
        assert kept and set(kept) <= set(cands)
        assert set(kept) == set(configs._GPU[kind][configs._dim_class(bd)])
    assert set(configs.prune(kind, cands, 64, 4)) == set(configs._FP32)
    for bd in (128, 256):  # the compile time of fp32 FMA products
        assert configs.prune(kind, cands, bd, 4) == configs._FP32_WIDE


def test_autotune_off_keeps_one_default(monkeypatch):
    monkeypatch.setattr(configs._env, "AUTOTUNE", False)
    cands = configs.candidates("fwd", interpret=False)
    assert configs.prune("fwd", cands, 128, 2) == [configs._GPU["fwd"][128][0]]
    assert configs.prune("fwd", cands, 64, 4) == [configs._FP32[0]]
    assert configs.prune("fwd", cands, 128, 4) == [configs._FP32_WIDE[0]]


def test_interpreter_runs_one_config():
    for kind in configs.KINDS:
        assert len(configs.candidates(kind, interpret=True)) == 1
    with pytest.raises(ValueError, match="unknown kernel kind"):
        configs.candidates("nope")


@pytest.mark.parametrize("autotune", [True, False])
@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("max_block", [32, 64, 128])
def test_tiles_fit_block_masks(kind, max_block, autotune, monkeypatch):
    # A block mask of max_block x max_block tiles needs kernel tiles that divide it.
    monkeypatch.setattr(configs._env, "AUTOTUNE", autotune)
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


def test_decode_candidates(monkeypatch):
    monkeypatch.setattr(configs._env, "AUTOTUNE", True)
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
