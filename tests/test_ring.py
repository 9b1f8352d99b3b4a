"""Ring attention over torch.distributed: world sizes 2 and 4, one process per rank.

Without a GPU the ranks talk through gloo and run the kernels through the interpreter;
with as many GPUs as ranks, through NCCL (tests/test_gpu.py runs those). Each rank
checks its shard of the output, LSE and gradients against float64 attention over the
whole sequence (the accuracy rule of tests/accuracy.py).
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accuracy import assert_rule
from conftest import DEVICE, ON_GPU
from flashtriton import distributed as ring
from flashtriton.reference import attention_reference

# (layout, causal, window_size, softcap, H, HKV, D); small shapes for the interpreter.
CASES = {
    2: [("zigzag", True, (-1, -1), 0.0, 2, 1, 16),
        ("contiguous", False, (-1, -1), 0.0, 2, 2, 16),
        ("contiguous", True, (-1, -1), 5.0, 2, 1, 16),
        ("zigzag", False, (6, 0), 0.0, 2, 2, 16),
        ("contiguous", False, (3, 5), 0.0, 1, 1, 16)],
    4: [("zigzag", True, (-1, -1), 0.0, 4, 2, 16),
        ("contiguous", True, (10, 0), 2.0, 2, 1, 16)],
}


def check_case(rank, world, device, layout, causal, window, softcap, H, HKV, D, N_per_rank=8,
               dtype=torch.float32):
    torch.manual_seed(1234)  # every rank draws the same whole sequence
    N = N_per_rank * world
    q, k, v = (torch.randn(2, N, h, D, dtype=dtype, device=device) for h in (H, HKV, HKV))
    dout = torch.randn(2, N, H, D, dtype=dtype, device=device)
    options = dict(causal=causal, window_size=window, softcap=softcap)

    def part(x, dim=1):
        return ring.shard(x, rank, world, dim=dim, layout=layout)

    local = [part(x).detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = ring.ring_attention(*local, layout=layout, return_lse=True, **options)
    out.backward(part(dout))

    leaves64 = [x.double().requires_grad_() for x in (q, k, v)]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*leaves64, **options)
    pt = attention_reference(*leaves, dtype=dtype, **options)
    ref_grads = torch.autograd.grad(ref.out, leaves64, dout.double())
    pt_grads = torch.autograd.grad(pt.out, leaves, dout)
    what = f"rank {rank}/{world} {layout} causal={causal} window={window} softcap={softcap}"
    assert_rule(f"{what} out", out, part(ref.out), part(pt.out), 2, dtype)
    assert_rule(f"{what} lse", lse, part(ref.lse, 2), part(pt.lse, 2), 2, dtype)
    for name, ours, r, p in zip(("dq", "dk", "dv"), local, ref_grads, pt_grads):
        assert_rule(f"{what} {name}", ours.grad, part(r), part(p), 3, dtype)
    whole = ring.unshard(out.detach(), layout=layout)
    assert torch.equal(ring.shard(whole, rank, world, layout=layout), out.detach()), what
    pos = ring.positions(N_per_rank, rank, world, layout, device=device)
    assert torch.equal(part(torch.arange(N, device=device), 0), pos), what


def _worker(rank, world, init_file, backend, cases):
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        for case in cases:
            check_case(rank, world, device, *case)
    finally:
        dist.destroy_process_group()


def run_world(world, backend, cases=None):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), backend,
                                cases or CASES[world]), nprocs=world, join=True)


@pytest.mark.skipif(ON_GPU, reason="the gloo run of the interpreter; GPUs run test_ring_nccl")
@pytest.mark.parametrize("world", sorted(CASES))
def test_ring_gloo(world):
    run_world(world, "gloo")


# With GPUs: bf16 at real tile sizes (several blocks per chunk, ragged windows).
NCCL_CASES = [("zigzag", True, (-1, -1), 0.0, 8, 2, 128, 1024, torch.bfloat16),
              ("contiguous", False, (-1, -1), 30.0, 4, 4, 64, 1000, torch.bfloat16),
              ("zigzag", True, (700, 0), 0.0, 4, 1, 128, 1024, torch.float16)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("world", [2, 4, 8])
def test_ring_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, the machine has {torch.cuda.device_count()}")
    run_world(world, "nccl", NCCL_CASES)


def test_shard_unshard_layouts():
    x = torch.arange(16)
    assert ring.shard(x, 0, 2, dim=0, layout="zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert ring.shard(x, 1, 2, dim=0, layout="zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert ring.shard(x, 1, 4, dim=0, layout="contiguous").tolist() == [4, 5, 6, 7]
    assert ring.positions(8, 1, 2, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="equal chunks"):
        ring.shard(torch.arange(10), 0, 4, dim=0, layout="zigzag")
    with pytest.raises(ValueError, match="layout"):
        ring.shard(x, 0, 2, layout="striped")


def test_plan_skips_and_merges():
    """Zigzag causal over 4 ranks: rank 1 at each source rank."""
    base = ring.Variant(0.25)
    segs = ring._segments(1, 4, 8, "zigzag")
    own = ring._plan(segs, ring._segments(1, 4, 8, "zigzag"), base, -1, 0)
    assert len(own) == 3  # two diagonal chunks with the mask, one full pair
    earlier = ring._plan(segs, ring._segments(0, 4, 8, "zigzag"), base, -1, 0)
    assert [(b.q, b.k) for b in earlier] == [(slice(0, 8), slice(0, 4))]
    later = ring._plan(segs, ring._segments(3, 4, 8, "zigzag"), base, -1, 0)
    assert [(b.q, b.k) for b in later] == [(slice(4, 8), slice(0, 8))]
    assert all(b.variant.window_right == -1 for b in earlier + later)  # no mask needed
    near = ring._plan(segs, ring._segments(2, 4, 8, "zigzag"), base, 2, 0)  # window: one pair
    assert [(b.q, b.k, b.variant.diag_offset) for b in near] == [(slice(4, 8), slice(4, 8), 4)]
    assert ring._plan(segs, ring._segments(3, 4, 8, "zigzag"), base, 2, 0) == []


def test_errors_without_process_group():
    q = torch.randn(1, 8, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="init_process_group"):
        ring.ring_attention(q, q, q)
    with pytest.raises(ValueError, match="dropout"):
        ring.ring_flash_attn_func(q, q, q, dropout_p=0.1)


def _bench_check_worker(rank, world, init_file, errs):
    from flashtriton.bench import ring as bench_ring
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        args = (rank, world, 32, "cpu", torch.float32, 2, 1, 16)
        the_ring = ring._Ring.of(None)
        errs[rank] = (bench_ring.check_ring(the_ring, *args),
                      bench_ring.check_ring(bench_ring.LocalRing(*the_ring), *args))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(ON_GPU, reason="the gloo run of the interpreter")
def test_bench_ring_check_passes_the_ring_and_fails_a_broken_one():
    """flashtriton.bench.ring's check before timing: the ring matches the reference; a ring
    whose K/V never leave their rank does not, and every rank gets the same verdict."""
    from flashtriton.bench.common import TOLERANCE
    with tempfile.TemporaryDirectory() as tmp:
        errs = mp.Manager().dict()
        mp.spawn(_bench_check_worker, args=(2, os.path.join(tmp, "init"), errs), nprocs=2,
                 join=True)
        errs = dict(errs)
    assert errs[0] == errs[1]
    good, broken = errs[0]
    assert good < 1e-4 and broken > TOLERANCE, errs


def test_bench_ring_estimate_and_table():
    from flashtriton.bench import ring as bench_ring
    step, total, mem, compute, transfer = bench_ring.estimate(8, 131072, 400.0, 300.0)
    assert step == max(compute, transfer) and total == 8 * step
    # 4x the tokens: 16x the compute per step, 4x the bytes per step and per rank
    step4, _, mem4, compute4, transfer4 = bench_ring.estimate(8, 4 * 131072, 400.0, 300.0)
    assert compute4 == pytest.approx(16 * compute) and transfer4 == pytest.approx(4 * transfer)
    assert mem4 == pytest.approx(4 * mem)
    row = dict(world=2, seqlen=32768, ring_fwd_ms=2.0, ring_fwdbwd_ms=7.0, compute_fwd_ms=1.9,
               compute_fwdbwd_ms=6.5, overlap_fwd=0.95, overlap_fwdbwd=0.93, transfer_ms=0.3,
               link_GBps=250.0, ring_fwd_TFLOPs_per_gpu=400.0, ring_fwdbwd_TFLOPs_per_gpu=350.0,
               peak_extra_MiB_per_rank=300.0)
    failed = dict(world=2, seqlen=65536, status="FAILED check")
    table = bench_ring.markdown([row, failed], 376.0, 250.0)
    assert "| 2 | 32768 | 2.00 | 7.00 |" in table and "| 1048576 |" in table
    assert "| 2 | 65536 | FAILED check |" in table


@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_plan_covers_every_visible_pair_once(layout):
    """For every rank, step and mask, the planned launches (with the kernels' mask rule:
    query i sees key j iff i + d - left <= j <= i + d + right, d = SK - SQ + diag_offset,
    a bound of -1 absent) cover each (query, key) pair the global mask allows exactly once
    and nothing else."""
    n = 8
    windows = [(-1, -1), (-1, 0), (3, 0), (0, 0), (5, 2), (-1, 4), (12, -1), (1, 9)]
    for world in (1, 2, 3, 4):
        N = n * world
        pos = [ring.positions(n, r, world, layout) for r in range(world)]
        for left, right in windows:
            i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
            allowed = torch.ones(N, N, dtype=torch.bool)
            if left >= 0:
                allowed &= j >= i - left
            if right >= 0:
                allowed &= j <= i + right
            covered = torch.zeros(N, N, dtype=torch.int64)
            for r in range(world):
                q_segs = ring._segments(r, world, n, layout)
                for src in range(world):
                    k_segs = ring._segments(src, world, n, layout)
                    for blk in ring._plan(q_segs, k_segs, ring.Variant(1.0), left, right):
                        qi = torch.arange(n)[blk.q]
                        kj = torch.arange(n)[blk.k]
                        v = blk.variant
                        a, b = qi[:, None] - qi[0], kj[None, :] - kj[0]  # rows within the launch
                        d = len(kj) - len(qi) + v.diag_offset
                        seen = torch.ones(len(qi), len(kj), dtype=torch.bool)
                        if v.window_left >= 0:
                            seen &= b >= a + d - v.window_left
                        if v.window_right >= 0:
                            seen &= b <= a + d + v.window_right
                        gq, gk = pos[r][qi], pos[src][kj]
                        covered[gq[:, None].expand_as(seen)[seen],
                                gk[None, :].expand_as(seen)[seen]] += 1
            assert torch.equal(covered, allowed.long()), (world, layout, left, right)
