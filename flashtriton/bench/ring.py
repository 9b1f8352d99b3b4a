"""Benchmark of ring attention on the GPUs of one machine (NCCL), and the 8-GPU estimate.

    python -m flashtriton.bench.ring [--world 2] [--seqlens 32768 131072] [--out bench_out]

Per total sequence length (bf16, batch 1, 32 query heads, 8 KV heads of 128, causal,
zigzag shards) it times, with every rank in lockstep (fixed iteration counts, CUDA events,
median): the ring's forward and forward + backward; the same ring with the transfers
replaced by local copies (its compute alone); the K/V transfers alone; and one GPU over
the whole sequence. Overlap = compute alone / ring (1.0: the transfers are hidden).
Then the step time and memory per rank for 128K-1M tokens on 8 GPUs, estimated from the
measured per-GPU attention rate and link bandwidth.
"""

import argparse
import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


def _worker(rank, world, init_file, seqlens, out_path, meta):
    from flashtriton import distributed as ring
    from flashtriton.api import flash_attention
    from flashtriton.launch import Variant

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    the_ring = ring._Ring.of(None)

    class NoTransfer(ring._Ring):  # same work per step, K/V copied locally instead of sent
        def exchange(self, tensors):
            return [t.clone() for t in tensors], None

    local_ring = NoTransfer(*the_ring)
    rows = []
    for N in seqlens:
        n = N // world
        torch.manual_seed(rank)
        q = torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, n, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        dout = torch.randn_like(q)
        base = Variant(D ** -0.5)

        def fwd(r):
            return ring._RingAttention.apply(q, k, v, r, "zigzag", base, -1, 0)[0]

        def fwd_bwd(r):
            fwd(r).backward(dout)

        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fwd_bwd(the_ring)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        row = dict(meta, world=world, seqlen=N, heads=H, kv_heads=HKV, D=D,
                   ring_fwd_ms=_time(lambda: fwd(the_ring)),
                   ring_fwdbwd_ms=_time(lambda: fwd_bwd(the_ring)),
                   compute_fwd_ms=_time(lambda: fwd(local_ring)),
                   compute_fwdbwd_ms=_time(lambda: fwd_bwd(local_ring)),
                   peak_extra_MiB_per_rank=peak)

        def transfers():
            kv = [k.detach(), v.detach()]
            for _ in range(world - 1):
                kv, pending = the_ring.exchange(kv)
                ring._wait(pending)

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
        if rank == 0:
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, dout
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    args = p.parse_args(argv)
    if args.world < 2:
        raise SystemExit(f"flashtriton.bench.ring needs 2 or more GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ring.jsonl")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.world, os.path.join(tmp, "init"), args.seqlens, path,
                                run_meta(args.commit)), nprocs=args.world, join=True)
    rows = [json.loads(line) for line in open(path)]
    best = max(rows, key=lambda r: r["seqlen"])
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
