"""Time one kernel over a grid of tile configs on the GPU (a tuning aid for docs/perf.md).

    python tools/sweep_configs.py --kind fwd --dims 64 128 --seqlens 1024 4096 [--causal 0 1]

Each config runs alone (an autotuner over that one config replaces the package's), through
the public API, on bf16 at batch * seqlen = 16K tokens and 2048 = heads * headdim, checked
against SDPA first. Prints, per shape, the configs from fastest to slowest with TFLOP/s, and
the SDPA backends' numbers measured in the same run.
"""

import argparse
import itertools
import json
import sys

import torch
import triton

from flashtriton import flash_attention, launch
from flashtriton.bench import sdpa as sdpa_backend

ORIGINAL = {"fwd": launch.triton_attn._fwd, "dkdv": launch.triton_attn._dkdv, "dq": launch.triton_attn._dq}
KERNELS = {"fwd": "_fwd", "dkdv": "_dkdv", "dq": "_dq"}


def use_config(kind, cfg):
    bm, bn, w, s = cfg
    one = triton.autotune([triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w,
                                         num_stages=s)], key=launch.calls._KEY)(ORIGINAL[kind].fn)
    setattr(launch, KERNELS[kind], one)


def sdpa(q, k, v, causal, backend):
    """SDPA with one backend, on this script's (B, N, H, D) tensors."""
    return sdpa_backend(backend)(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                causal).transpose(1, 2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=sorted(KERNELS), default="fwd")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    p.add_argument("--block-m", type=int, nargs="+", default=[64, 128])
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--top", type=int, default=6)
    args = p.parse_args()
    configs = list(itertools.product(args.block_m, args.block_n, args.warps, args.stages))
    bench = dict(warmup=25, rep=100, return_mode="median")
    for D, N, causal in itertools.product(args.dims, args.seqlens, map(bool, args.causal)):
        B, H = 16384 // N, 2048 // D
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        flops = 4 * B * H * N * N * D / (2 if causal else 1) * (1 if args.kind == "fwd" else 2.5)
        ref = sdpa(q, k, v, causal, "FLASH_ATTENTION")
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout)

        def timed(fn):
            if args.kind == "fwd":
                return triton.testing.do_bench(fn, **bench)
            out = fn()
            return triton.testing.do_bench(lambda: out.backward(dout, retain_graph=True),
                                           grad_to_none=[q, k, v], **bench)

        rows = []
        for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            ms = timed(lambda: sdpa(q, k, v, causal, backend))
            rows.append((flops / ms * 1e-9, backend))
        for cfg in configs:
            use_config(args.kind, cfg)
            try:
                out = flash_attention(q, k, v, causal=causal)
                err = float((out - ref).float().norm() / ref.float().norm())
                if args.kind != "fwd":
                    grads = torch.autograd.grad(out, (q, k, v), dout)
                    err = max(err, *(float((a - b).float().norm() / b.float().norm())
                                     for a, b in zip(grads, ref_grads)))
                if err > 2e-2:
                    rows.append((0.0, f"{cfg} WRONG err={err:.2e}"))
                    continue
                ms = timed(lambda: flash_attention(q, k, v, causal=causal))
                rows.append((flops / ms * 1e-9, str(cfg)))
            except Exception as e:  # out of shared memory / registers: not a candidate
                rows.append((0.0, f"{cfg} {type(e).__name__}"))
        rows.sort(reverse=True)
        print(f"== {args.kind} D={D} N={N} causal={causal}", flush=True)
        for tflops, name in rows[:args.top] + [r for r in rows[args.top:] if "_ATT" in r[1]]:
            print(f"  {tflops:7.1f}  {name}", flush=True)
        print(json.dumps({"kind": args.kind, "D": D, "N": N, "causal": causal,
                          "rows": rows}), file=sys.stderr)
        setattr(launch, KERNELS[args.kind], ORIGINAL[args.kind])


if __name__ == "__main__":
    main()
