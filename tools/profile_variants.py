"""Each GPU kernel of the variants' forward and backward (torch.profiler, 5 calls), on
bench.variants' shapes (B=2, H=16, N=8K, D=128, bf16): microseconds a call per kernel, and
the time a call would take at the kernel's share of the TFLOP/s bench.variants reports.

    python tools/profile_variants.py [--variants window document alibi causal] [--flex]
        [--set ONE_LOOP=1]
"""
import argparse

import torch

from torch.profiler import ProfilerActivity, profile

from flashtriton import flash_attention
from flashtriton.bench import variants as bv


def kernel_us(step, calls=5):
    """{kernel name: GPU microseconds per call} of ``step`` (warmed up by the caller)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / calls for e in prof.key_averages()
            if e.self_device_time_total > 0}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+",
                   default=["causal", "window", "document", "prefix_lm", "alibi"])
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--flex", action="store_true", help="FlexAttention's kernels too")
    p.add_argument("--set", nargs="+", default=[], metavar="NAME=V",
                   help="Gluon kernel options (bench.variants.set_gluon_options)")
    args = p.parse_args()
    try:
        bv.set_gluon_options(args.set)
    except ValueError as e:
        p.error(str(e))
    N, H, D = args.seqlen, 16, 128
    B = 16384 // N
    for name in args.variants:
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        pairs = B * H * (N * (N + 1) / 2 if name == "causal" else bv._pairs(name, N))
        if name == "causal":
            def ours(q, k, v, _c):
                return flash_attention(q.transpose(1, 2), k.transpose(1, 2),
                                       v.transpose(1, 2), causal=True).transpose(1, 2)
            providers = [("flashtriton", ours)]
        else:
            providers = [("flashtriton", bv._ours(name, B, H, N, "cuda"))]
            if args.flex:
                providers.append(("flex", bv._flex(name, B, H, N, "cuda")))
        for prov, fn in providers:
            out = fn(q, k, v, True)
            grad = torch.randn_like(out)
            for _ in range(3):
                out = fn(q, k, v, True)
                out.backward(grad)
            fwd = kernel_us(lambda: fn(q, k, v, True))
            out = fn(q, k, v, True)
            bwd = kernel_us(lambda: out.backward(grad, retain_graph=True))
            for what, times, flops in (("fwd", fwd, 4 * D * pairs), ("bwd", bwd, 10 * D * pairs)):
                total = sum(times.values())
                print(f"{name:9s} {prov:11s} {what} {total:8.1f} us "
                      f"({flops / total * 1e-6:4.0f} TFLOP/s of kernel time)")
                for n, t in sorted(times.items(), key=lambda kv: -kv[1]):
                    print(f"      {t:8.1f} us {100 * t / total:5.1f}%  {n[:90]}")


if __name__ == "__main__":
    main()
