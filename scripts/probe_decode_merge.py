"""Splits merged in the split kernel (decode.MERGE_IN_KERNEL, one launch) against the merge
kernel (two launches), in one process, shape by shape: the GPU time of a step replayed from a
CUDA graph (a capture always takes the merge kernel), do_bench's eager time (its L2 flush
hides ~60 us of host time a call), the back-to-back time of eager steps (the host's), and the
split kernel's registers, warps and stages. The in-kernel merge also without the LSE
(return_lse=False: out only, as SDPA returns), and SDPA's step alongside. The host's noise
only adds time and swings 2x between moments: the ways take turns, --rounds times, and each
reports its best round.

    PYTHONPATH=. python scripts/probe_decode_merge.py [--shapes 1x1024 8x1024] [--splits 0 16]
"""
import argparse

import torch.nn.functional as F
import triton

from flashtriton import decode, launch
from flashtriton.bench import _graph, decode_bytes, decode_inputs, per_call_us
from flashtriton.decode import attention_with_kvcache


def kernel_of(q, kc, vc, lens, splits, return_lse):
    """The step just remembered: its split kernel's registers, warps and stages, its splits,
    and where it merges them (_replay's mode 1: the merge kernel, 2: the split kernel)."""
    run_decode, _, mode, _ = launch.recall(decode.step_signature(
        q, kc, vc, lens, num_splits=splits, return_lse=return_lse))
    c = run_decode.compiled
    return f"{c.n_regs}/{c.metadata.num_warps}/{c.metadata.num_stages}", run_decode.grid[0], mode


def ways(q, kc, vc, lens, split_counts):
    """name -> (step, its MERGE_IN_KERNEL, registers/warps/stages, splits)."""
    out = {}
    for splits in split_counts:
        for in_kernel, with_lse in ((True, True), (True, False), (False, True)):
            decode.MERGE_IN_KERNEL = in_kernel
            fn = lambda s=splits, r=with_lse: attention_with_kvcache(  # noqa: E731
                q, kc, vc, cache_seqlens=lens, num_splits=s, return_lse=r)
            for _ in range(3):
                fn()
            kernel, n, mode = kernel_of(q, kc, vc, lens, splits, with_lse)
            name = ({2: "in kernel", 1: "kernel", 0: "one split"}[mode]
                    + ("" if with_lse else " -lse") + (f" s{splits}" if splits else ""))
            out[name] = (fn, in_kernel, kernel, n)
    decode.MERGE_IN_KERNEL = True
    qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    out["sdpa"] = (lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True), True,
                   "", "")
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["1x1024", "1x8192", "8x1024"])
    parser.add_argument("--splits", nargs="+", type=int, default=[0],
                        help="num_splits of flashtriton's steps (0: the heuristic's)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"{'B':>3s} {'N':>6s} {'way':>16s} {'splits':>6s} {'graph us':>9s} {'eager us':>9s} "
          f"{'loop us':>8s} {'graph GB/s':>10s} {'regs/warps/stages':>18s}")
    for B, N in [map(int, shape.split("x")) for shape in args.shapes]:
        q, kc, vc, _, _, _, lens = decode_inputs(B, N)
        nbytes = decode_bytes(B, N, kc.shape[2], kc.shape[3])
        decode._MERGE_BYTES = 1 << 40  # merged in the kernel where it loads the splits at once
        steps = ways(q, kc, vc, lens, args.splits)
        best = {name: [float("inf")] * 3 for name in steps}
        for _ in range(args.rounds):
            for name, (fn, in_kernel, _, _) in steps.items():
                decode.MERGE_IN_KERNEL = in_kernel
                graph = _graph(fn)
                times = (triton.testing.do_bench(graph.replay, warmup=25, rep=100,
                                                 return_mode="median") * 1e3,
                         triton.testing.do_bench(fn, warmup=25, rep=100,
                                                 return_mode="median") * 1e3,
                         per_call_us(fn, calls=200, repeats=3))
                best[name] = [min(a, b) for a, b in zip(best[name], times)]
                del graph
        decode.MERGE_IN_KERNEL = True
        for name, (fn, _, kernel, splits) in steps.items():
            g, e, loop = best[name]
            print(f"{B:3d} {N:6d} {name:>16s} {splits:>6} {g:9.1f} {e:9.1f} {loop:8.1f} "
                  f"{nbytes / g * 1e-3:10.0f} {kernel:>18s}", flush=True)


if __name__ == "__main__":
    main()
