"""The Gluon kernels' cost per step and per program (H200 investigation of short walks): the
kernel time (torch.profiler, 5 calls) of the Gluon forward and backward over causal sliding
windows of several widths (B=2, H=16, N=8K, D=128, bf16), and the least-squares fit
time = steps * s + programs * o, per SM (132), where steps are the (64-row query block,
128-key block) pairs a backward program walks, or the key blocks a forward program reads.
The backward runs with its dQ reductions (mode 2) and without them (mode 1: timing only).

    python scripts/probe_tile_overhead.py [--windows 128 256 512 1024 2048 4096]
        [--dense 1024 2048 4096 8192] [--set NAME=0|1]

--dense: no mask at all instead (B * N = 16K, so 2048 programs at every N), which separates
the programs' own cost from that of their masked steps (a window's walk has four). --set:
an option of the Gluon kernels (bench_variants.set_gluon_options).
"""
import argparse

import torch

from flashtriton import launch
from flashtriton.bench_variants import set_gluon_options
from probe_backward_kernels import kernel_us

SMS = 132


def cdiv(a, b):
    return -(-a // b)


def counts(N, W, BH):
    """(backward steps, backward programs, forward steps, forward programs) for a causal
    window of W keys (window_size (W - 1, 0))."""
    bwd = sum(cdiv(min(N, 128 * n + 128 + W - 1), 64) - 2 * n for n in range(N // 128))
    fwd = sum(m - max(0, (128 * m - W + 1) // 128) + 1 for m in range(N // 128))
    return bwd * BH, N // 128 * BH, fwd * BH, N // 128 * BH


def fit(rows):
    """Least squares of t = steps * s + programs * o (per SM) over rows of (steps, programs,
    microseconds)."""
    a = torch.tensor([[s / SMS, p / SMS] for s, p, _ in rows], dtype=torch.float64)
    t = torch.tensor([[u] for _, _, u in rows], dtype=torch.float64)
    sol = torch.linalg.lstsq(a, t).solution.flatten().tolist()
    return sol


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--windows", nargs="+", type=int, default=[128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--dense", nargs="*", type=int, default=[])
    p.add_argument("--set", action="append", default=[], metavar="NAME=0|1")
    args = p.parse_args()
    try:
        set_gluon_options(args.set)
    except ValueError as e:
        p.error(str(e))
    H, D = 16, 128
    rows = {"fwd": [], "bwd2": [], "bwd1": []}
    print(f"{'W':>5} {'fwd us':>8} {'bwd us':>8} {'no-dQ us':>8} {'bwd steps':>10} "
          f"{'programs':>8}")
    for W in args.dense or args.windows:
        N = W if args.dense else args.seqlen
        B = 16384 // N if args.dense else 2
        q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        causal = not args.dense
        win = (-1, -1) if args.dense else (W - 1, 0)
        out, lse = launch.attention_forward_gluon(q, k, v, causal=causal, window_size=win)
        if args.dense:  # every key block sees every query block
            bsteps, fsteps = N // 64 * N // 128 * B * H, (N // 128) ** 2 * B * H
            bprog = fprog = N // 128 * B * H
        else:
            bsteps, bprog, fsteps, fprog = counts(N, W, B * H)
        times = {}
        for name, fn in (
                ("fwd", lambda: launch.attention_forward_gluon(q, k, v, causal=causal,
                                                               window_size=win)),
                ("bwd2", lambda: launch.attention_backward_gluon(
                    do, q, k, v, out, lse, causal=causal, window_size=win)),
                ("bwd1", lambda: launch.attention_backward_gluon(
                    do, q, k, v, out, lse, causal=causal, window_size=win, _dq_mode=1))):
            fn()
            fn()
            us = sum(t for n, t in kernel_us(fn).items() if "gluon" in n)
            times[name] = us
            rows[name].append((fsteps, fprog, us) if name == "fwd" else (bsteps, bprog, us))
        print(f"{W:5d} {times['fwd']:8.1f} {times['bwd2']:8.1f} {times['bwd1']:8.1f} "
              f"{bsteps:10d} {bprog:8d}", flush=True)
    for name, r in rows.items():
        s, o = fit(r)
        print(f"fit {name}: {s:.3f} us a step, {o:.2f} us a program (per SM)")


if __name__ == "__main__":
    main()
