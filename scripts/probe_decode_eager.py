"""Eager decoding steps against SDPA's (H200 investigation of the B=1 8K row: 86 us per step
back to back in the bench at a3c2284, 54 in probe_decode_sync.py): for each shape, the
back-to-back host time per step (best of 5 loops of 200 calls) and do_bench's eager time,
flashtriton with the automatic split count and with 8 splits, before and after a CUDA graph
of the same step was captured (the bench captures one between its eager and loop timings),
and SDPA's."""
import torch
import torch.nn.functional as F
import triton

from flashtriton.bench import _graph, decode_bytes, decode_inputs, per_call_us
from flashtriton.decode import attention_with_kvcache

print(f"{'shape':14s} {'step':28s} {'us/step':>8s} {'eager GB/s':>11s}")
for B, N in [(1, 1024), (1, 8192), (8, 1024)]:
    q, kc, vc, kp, vp, table, lens = decode_inputs(B, N)
    qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    steps = {
        "flashtriton": lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens),
        "flashtriton, 8 splits": lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                                num_splits=8),
        "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True),
    }
    nbytes = decode_bytes(B, N, kc.shape[2], kc.shape[3])
    for name, fn in steps.items():
        for when in ("", ", after a graph"):
            if when:
                graph = _graph(fn)  # kept alive while timing, as in the bench
            for _ in range(5):
                fn()
            us = per_call_us(fn, calls=200, repeats=5)
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            print(f"B={B} N={N:<6d} {name + when:28s} {us:8.1f} {nbytes / ms * 1e-6:11.0f}",
                  flush=True)
        del graph
