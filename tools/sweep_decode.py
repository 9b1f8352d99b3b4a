"""GB/s of one decoding step against the number of KV splits (a tuning aid for docs/perf.md).

    python tools/sweep_decode.py [--batches 1 4] [--lens 8192 65536] [--splits 0 16 33 64]
                                   [--paged]

bf16, 32 query heads, 8 KV heads of 128, one query token; contiguous cache (--paged: the same
keys and values in shuffled 16-token pages, bench.decode.decode_inputs'). For each split
count (0: the heuristic's) the step replayed from a CUDA graph (no host time: what the kernels
reach), with the tuned split kernel's tile and shared memory (programs per SM follow from it),
then SDPA's graph on the same shape; GB/s of K and V read (bench.common.cold_ms: clean L2).
"""

import argparse

import torch.nn.functional as F

from flashtriton import decode
from flashtriton.bench import decode_bytes
from flashtriton.bench.common import cold_ms, cuda_graph
from flashtriton.bench.decode import decode_inputs
from flashtriton.decode import attention_with_kvcache
from flashtriton.launch import decode_replay


def graph_gbps(fn, nbytes):
    return nbytes / cold_ms(cuda_graph(fn).replay) * 1e-6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--lens", type=int, nargs="+", default=[8192, 65536])
    p.add_argument("--splits", type=int, nargs="+", default=[0, 8, 16, 32, 33, 64, 128])
    p.add_argument("--paged", action="store_true", help="16-token pages in a shuffled order")
    args = p.parse_args()
    for B in args.batches:
        for N in args.lens:
            q, kc, vc, kp, vp, table, lens = decode_inputs(B, N)
            cache = (kp, vp) if args.paged else (kc, vc)
            table = table if args.paged else None
            nbytes = decode_bytes(B, N)
            cells = []
            for s in args.splits:
                def step(s=s):
                    return attention_with_kvcache(q, *cache, cache_seqlens=lens, num_splits=s,
                                                  block_table=table)
                for _ in range(3):  # tune, compile, remember
                    step()
                # the remembered step, under the signature attention_with_kvcache gave it
                signature = decode.step_signature(q, *cache, lens, block_table=table,
                                                  num_splits=s)
                run_split = decode_replay.remembered(signature).run_decode
                splits = run_split.grid[0]
                meta = run_split.compiled.metadata
                cells.append(f"{s}->{splits}: {graph_gbps(step, nbytes):.0f} "
                             f"({meta.num_warps}w, {meta.shared // 1024} KB)")
            qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
            sdpa = graph_gbps(lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True),
                              nbytes)
            kind = " paged" if args.paged else ""
            print(f"B={B} N={N}{kind} graph GB/s by splits: " + ", ".join(cells)
                  + f" | SDPA {sdpa:.0f}", flush=True)


if __name__ == "__main__":
    main()
