"""Splits merged in the split kernel (decode.MERGE_IN_KERNEL, one launch) against the merge
kernel (two launches), in one process, shape by shape: the GPU time of a step replayed from a
CUDA graph, do_bench's eager time (its L2 flush hides ~60 us of host time a call), the
back-to-back time of eager steps (the host's), the split kernel's registers, warps and
stages, and the two results' largest difference. The in-kernel merge also without the LSE
(return_lse=False: out only, as SDPA returns). SDPA's step alongside."""
import argparse

import torch.nn.functional as F
import triton

from flashtriton import decode, launch
from flashtriton.bench import _graph, decode_bytes, decode_inputs, per_call_us
from flashtriton.decode import attention_with_kvcache


def kernel_of(q, kc, vc, lens, return_lse):
    """The step just remembered: its split kernel's registers, warps and stages, its splits,
    and where it merges them (_replay's mode 1: the merge kernel, 2: the split kernel)."""
    run_decode, _, mode, _ = launch.recall(decode.step_signature(q, kc, vc, lens,
                                                                 return_lse=return_lse))
    c = run_decode.compiled
    return c.n_regs, c.metadata.num_warps, c.metadata.num_stages, run_decode.grid[0], mode


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["1x1024", "1x8192", "1x65536", "8x1024",
                                                        "8x8192", "64x1024"])
    args = parser.parse_args()
    print(f"{'B':>3s} {'N':>6s} {'merge':>12s} {'splits':>6s} {'graph us':>9s} {'eager us':>9s} "
          f"{'loop us':>8s} {'graph GB/s':>10s} {'regs/warps/stages':>18s}")
    for B, N in [map(int, shape.split("x")) for shape in args.shapes]:
        q, kc, vc, _, _, _, lens = decode_inputs(B, N)
        nbytes = decode_bytes(B, N, kc.shape[2], kc.shape[3])
        outs = {}
        decode._MERGE_BYTES = 1 << 40  # merged in the kernel where it loads the splits at once
        for in_kernel, with_lse in ((True, True), (True, False), (False, True)):
            decode.MERGE_IN_KERNEL = in_kernel
            fn = lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens,  # noqa: E731
                                                return_lse=with_lse)
            for _ in range(3):
                outs[in_kernel, with_lse] = fn()
            regs, warps, stages, splits, mode = kernel_of(q, kc, vc, lens, with_lse)
            graph = _graph(fn)
            g = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
            e = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            loop = per_call_us(fn, calls=200, repeats=5)
            name = {2: "in kernel", 1: "kernel", 0: "none"}[mode] + ("" if with_lse else "-lse")
            print(f"{B:3d} {N:6d} {name:>12s} {splits:6d} {g * 1e3:9.1f} {e * 1e3:9.1f} "
                  f"{loop:8.1f} {nbytes / g * 1e-6:10.0f} {f'{regs}/{warps}/{stages}':>18s}",
                  flush=True)
            del graph
        decode.MERGE_IN_KERNEL = True
        qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)  # noqa: E731
        graph = _graph(sdpa)
        g = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
        e = triton.testing.do_bench(sdpa, warmup=25, rep=100, return_mode="median")
        loop = per_call_us(sdpa, calls=200, repeats=5)
        diff = (outs[True, True].out.float() - outs[False, True].out.float()).abs().max().item()
        print(f"{B:3d} {N:6d} {'sdpa':>12s} {'':6s} {g * 1e3:9.1f} {e * 1e3:9.1f} {loop:8.1f} "
              f"{nbytes / g * 1e-6:10.0f}   max |in kernel - kernel| {diff:.1e}", flush=True)
        del graph


if __name__ == "__main__":
    main()
