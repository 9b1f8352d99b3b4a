"""Benchmark of ring attention on the GPUs of one machine (NCCL), and the 8-GPU estimate.

    python -m flashtriton.bench.ring [--world 2] [--seqlens 32768 131072] [--out bench_out]

Per total sequence length (bf16, batch 1, 32 query heads, 8 KV heads of 128, causal,
zigzag shards) it times, with every rank in lockstep (fixed iteration counts, CUDA events,
median): the ring's forward and forward + backward; the same ring with the transfers
replaced by local copies (its compute alone); the K/V transfers alone; and one GPU over
the whole sequence. Overlap = compute alone / ring (1.0: the transfers are hidden). Before
any timing, each length's ring output and gradients (gathered from every rank, at up to
``--check-len`` tokens) are compared with the float32 reference over the whole sequence; a
length that fails is reported as failed, without speed.
Then the step time and memory per rank for 128K-1M tokens on 8 GPUs, estimated from the
measured per-GPU attention rate and link bandwidth.
"""

import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtriton import distributed

from .common import TOLERANCE, add_commit, add_out, expected, failed, need_gpus, rel_err
from .common import parser as common_parser
from .common import meta as run_meta

H, HKV, D = 32, 8, 128


def _time(fn, warmup=3, reps=10):
    """Median ms of fn over reps; every rank runs the same number of iterations."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
    return float(t)


class LocalRing(distributed._Ring):
    """The ring's work per step with K/V copied locally instead of sent (its compute alone;
    its results are wrong)."""

    def exchange(self, tensors):
        return [t.clone() for t in tensors], None


def check_ring(the_ring, rank, world, N, device, dtype=torch.bfloat16, heads=H, kv_heads=HKV,
               head_dim=D) -> float:
    """Largest relative error of the causal zigzag ring's out, dq, dk, dv over N tokens (every
    rank's shard gathered) against the float32 reference over the whole sequence; every rank
    gets rank 0's figure (inf for NaN)."""
    from flashtriton.launch import Variant

    gen = torch.Generator(device="cpu").manual_seed(1234)  # every rank draws the same inputs
    q, k, v, dout = (torch.randn(1, N, h, head_dim, generator=gen).to(device, dtype)
                     for h in (heads, kv_heads, kv_heads, heads))
    local = [distributed.shard(x, rank, world).detach().clone().requires_grad_() for x in (q, k, v)]
    out = distributed._RingAttention.apply(*local, the_ring, "zigzag", Variant(head_dim ** -0.5), -1,
                                    0)[0]
    out.backward(distributed.shard(dout, rank, world))
    got = [distributed.unshard(x, the_ring.group) for x in (out.detach(), *(x.grad for x in local))]
    err = torch.zeros(1, device=device)
    if rank == 0:
        ref = expected(q, k, v, dout, causal=True)
        e = max(rel_err(a, b) for a, b in zip(got, ref))
        err[0] = e if e == e else float("inf")
    dist.broadcast(err, 0, group=the_ring.group)
    return float(err)


def _measure(rank, world, N, the_ring, local_ring, meta, check_len, err) -> dict:
    """The timings of one length (every rank in lockstep); rank 0's single-GPU run beside."""
    from flashtriton.api import flash_attention
    from flashtriton.launch import Variant

    n = N // world
    torch.manual_seed(rank)
    q = torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, n, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dout = torch.randn_like(q)
    base = Variant(D ** -0.5)

    def fwd(r):
        return distributed._RingAttention.apply(q, k, v, r, "zigzag", base, -1, 0)[0]

    def fwd_bwd(r):
        fwd(r).backward(dout)

    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fwd_bwd(the_ring)
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    row = dict(meta, world=world, seqlen=N, heads=H, kv_heads=HKV, D=D,
               check_len=min(N, check_len), check_rel_err=err,
               ring_fwd_ms=_time(lambda: fwd(the_ring)),
               ring_fwdbwd_ms=_time(lambda: fwd_bwd(the_ring)),
               compute_fwd_ms=_time(lambda: fwd(local_ring)),
               compute_fwdbwd_ms=_time(lambda: fwd_bwd(local_ring)),
               peak_extra_MiB_per_rank=peak)

    def transfers():
        kv = [k.detach(), v.detach()]
        for _ in range(world - 1):
            kv, pending = the_ring.exchange(kv)
            distributed._wait(pending)

    row["transfer_ms"] = _time(transfers)
    kv_bytes = 2 * n * HKV * D * 2
    row["link_GBps"] = kv_bytes * (world - 1) / row["transfer_ms"] * 1e-6
    if rank == 0:
        qf = torch.randn(1, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kf = torch.randn(1, N, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        vf = torch.randn_like(kf, requires_grad=True)
        df = torch.randn_like(qf)
        single = [None, None]

        def one_fwd():
            return flash_attention(qf, kf, vf, causal=True)

        for i, fn in enumerate((one_fwd, lambda: one_fwd().backward(df))):
            fn()
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            ts = []
            for _ in range(10):
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                ts.append(start.elapsed_time(end))
            single[i] = statistics.median(ts)
        row["single_gpu_fwd_ms"], row["single_gpu_fwdbwd_ms"] = single
        del qf, kf, vf, df
    dist.barrier()
    flops = 4 * H * N * N * D / 2  # causal forward
    row["ring_fwd_TFLOPs_per_gpu"] = flops / world / row["ring_fwd_ms"] * 1e-9
    row["ring_fwdbwd_TFLOPs_per_gpu"] = 3.5 * flops / world / row["ring_fwdbwd_ms"] * 1e-9
    row["overlap_fwd"] = row["compute_fwd_ms"] / row["ring_fwd_ms"]
    row["overlap_fwdbwd"] = row["compute_fwdbwd_ms"] / row["ring_fwdbwd_ms"]
    return row


def _worker(rank, world, init_file, seqlens, out_path, meta, check_len):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    the_ring = distributed._Ring.of(None)
    local_ring = LocalRing(*the_ring)
    rows = []
    for N in seqlens:
        err = check_ring(the_ring, rank, world, min(N, check_len), "cuda")
        if err >= TOLERANCE:
            if rank == 0:
                row = dict(meta, world=world, seqlen=N, check_len=min(N, check_len),
                           check_rel_err=err, status=failed(err))
                rows.append(row)
                print(json.dumps(row), flush=True)
            continue
        row = _measure(rank, world, N, the_ring, local_ring, meta, check_len, err)
        if rank == 0:
            rows.append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    if rank == 0:
        with open(out_path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


def estimate(world, seqlen, tflops, link_gbps, heads=H, kv_heads=HKV, head_dim=D):
    """Causal zigzag ring, forward + backward, per rank: (step ms, total ms, GiB).

    Each of the W steps computes 1 / W^2 of the causal FLOPs (x 3.5 for forward +
    backward) while K/V (forward and backward) and fp32 dK/dV (backward) of one shard
    cross the link; a step costs the larger of the two when they overlap."""
    n = seqlen // world
    flops = 3.5 * 4 * heads * seqlen * seqlen * head_dim / 2 / world ** 2
    compute_ms = flops / (tflops * 1e12) * 1e3
    kv = 2 * n * kv_heads * head_dim * 2
    transfer_ms = 4 * kv / (link_gbps * 1e9) * 1e3  # K/V twice, fp32 dK/dV once
    step = max(compute_ms, transfer_ms)
    # q, k, v, out, dout, dq, dk, dv in bf16, fp32 accumulators (out, dq, dk, dv), buffers
    mem = n * (heads * head_dim * (5 * 2 + 2 * 4) + kv_heads * head_dim * (3 * 2 * 2 + 4 * 4))
    return step, step * world, mem / 2**30, compute_ms, transfer_ms


def markdown(rows, tflops, link_gbps):
    lines = ["| GPUs | seqlen | ring fwd ms | ring fwd+bwd ms | compute alone fwd / fwd+bwd ms | "
             "overlap fwd / fwd+bwd | transfers ms (GB/s) | 1 GPU fwd / fwd+bwd ms | "
             "TFLOP/s per GPU fwd / fwd+bwd | peak extra MiB per rank |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "status" in r:
            lines.append(f"| {r['world']} | {r['seqlen']} | {r['status']} |" + " |" * 8)
            continue
        lines.append(
            f"| {r['world']} | {r['seqlen']} | {r['ring_fwd_ms']:.2f} | {r['ring_fwdbwd_ms']:.2f} | "
            f"{r['compute_fwd_ms']:.2f} / {r['compute_fwdbwd_ms']:.2f} | "
            f"{r['overlap_fwd']:.2f} / {r['overlap_fwdbwd']:.2f} | "
            f"{r['transfer_ms']:.2f} ({r['link_GBps']:.0f}) | "
            f"{r.get('single_gpu_fwd_ms', float('nan')):.2f} / "
            f"{r.get('single_gpu_fwdbwd_ms', float('nan')):.2f} | "
            f"{r['ring_fwd_TFLOPs_per_gpu']:.0f} / {r['ring_fwdbwd_TFLOPs_per_gpu']:.0f} | "
            f"{r['peak_extra_MiB_per_rank']:.0f} |")
    lines += ["", f"Estimate for 8 GPUs at {tflops:.0f} TFLOP/s per GPU (fwd+bwd) and "
              f"{link_gbps:.0f} GB/s per link:", "",
              "| seqlen | step ms (compute / transfer) | fwd+bwd ms | memory per rank GiB |",
              "|---|---|---|---|"]
    for N in (131072, 262144, 524288, 1048576):
        step, total, mem, c, t = estimate(8, N, tflops, link_gbps)
        lines.append(f"| {N} | {step:.2f} ({c:.2f} / {t:.2f}) | {total:.1f} | {mem:.2f} |")
    return "\n".join(lines)


def parser():
    p = common_parser("flashtriton.bench.ring", __doc__)
    p.add_argument("--world", type=int, default=torch.cuda.device_count(),
                   help="ranks, one GPU each (default: every GPU of this machine; at least 2)")
    p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072],
                   help="total sequence lengths, sharded over the ranks")
    add_out(p, "ring.jsonl and ring.md")
    p.add_argument("--check-len", type=int, default=16384,
                   help="tokens of the reference check before each length's timing")
    add_commit(p)
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    need_gpus(p.prog, max(2, args.world))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ring.jsonl")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.world, os.path.join(tmp, "init"), args.seqlens, path,
                                run_meta(args.commit), args.check_len), nprocs=args.world, join=True)
    rows = [json.loads(line) for line in open(path)]
    timed = [r for r in rows if "status" not in r]
    if not timed:
        raise SystemExit(f"flashtriton.bench.ring: every length failed its reference check: "
                         f"{[r['check_rel_err'] for r in rows]}")
    best = max(timed, key=lambda r: r["seqlen"])
    table = markdown(rows, best["ring_fwdbwd_TFLOPs_per_gpu"] / best["overlap_fwdbwd"],
                     best["link_GBps"])
    m = rows[0]
    table = (f"{m['gpu']} x {args.world}, torch {m['torch']}, triton {m['triton']}, commit "
             f"{m['commit']}, {m['date']}\n\n" + table)
    with open(os.path.join(args.out, "ring.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
