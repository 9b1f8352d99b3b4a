"""GB/s of one decoding step against the number of KV splits (a tuning aid for docs/perf.md).

    python scripts/sweep_decode.py [--batches 1 4] [--lens 8192 65536]

bf16, 32 query heads, 8 KV heads of 128, one query token; contiguous cache. Prints the heuristic's
split count (num_splits=0) and each explicit count, with GB/s of K and V read.
"""

import argparse

import torch
import triton

from flashtriton.decode import attention_with_kvcache


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--lens", type=int, nargs="+", default=[8192, 65536])
    p.add_argument("--splits", type=int, nargs="+", default=[0, 8, 16, 32, 64, 128, 256])
    args = p.parse_args()
    for B in args.batches:
        for N in args.lens:
            q = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
            kc, vc = (torch.randn(B, N, 8, 128, device="cuda", dtype=torch.bfloat16)
                      for _ in range(2))
            lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
            nbytes = 2 * B * N * 8 * 128 * 2
            line = []
            for s in args.splits:
                ms = triton.testing.do_bench(
                    lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=s),
                    warmup=25, rep=100, return_mode="median")
                line.append(f"{s}:{nbytes / ms * 1e-6:.0f}")
            graph_ms = None
            g = torch.cuda.CUDAGraph()
            attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
            graph_ms = triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")
            print(f"B={B} N={N} GB/s by splits " + " ".join(line)
                  + f" | graph (splits 0): {nbytes / graph_ms * 1e-6:.0f}", flush=True)


if __name__ == "__main__":
    main()
