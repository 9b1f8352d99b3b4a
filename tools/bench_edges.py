"""The costs of the edge-correctness work, on the GPU, for an A/B of two trees in one run.

    python tools/bench_edges.py safety            # varlen, decode and paged decode times
    python tools/bench_edges.py prefill           # KV-cache calls with many query tokens

``safety`` times what the index bounds could slow (the varlen forward and backward, eager
decoding steps over contiguous and paged caches, GPU time after a clean L2 flush) and prints
one JSON line a row; run it from each tree (PYTHONPATH) in turn and compare. ``prefill``
checks then times attention_with_kvcache with many query tokens (groups of 6 and 1 query
heads a KV head, head dims 128 and 256) on both of its routes (the split kernel with row
blocks, the prefill kernel) against flash_attention over the same keys; every row is checked
against a float32 reference before it is timed.
"""
import json
import sys

import torch
import triton

import flashtriton
from flashtriton import configs, flash_attention, flash_attention_varlen, runtime
from flashtriton.bench.common import cold_ms
from flashtriton.bench.decode import decode_inputs
from flashtriton.decode import attention_with_kvcache


def _ms(fn, cold=False):
    if cold:
        return cold_ms(fn)
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def safety():
    torch.manual_seed(0)
    lens = [1000, 3000, 1500, 2500, 800, 3200, 2000, 2384]  # 16384 tokens
    H, D = 16, 128
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lens), H, D, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    fwd = lambda: flash_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)  # noqa
    out = fwd()

    def fwd_bwd():
        torch.autograd.grad(fwd(), (q, k, v), dout)

    rows = [("varlen fwd", _ms(fwd)), ("varlen fwd+bwd", _ms(fwd_bwd))]
    for B, N in ((1, 65536), (8, 8192), (64, 1024)):
        rows += _decode_rows(B, N)
    for name, ms in rows:
        print(json.dumps(dict(tree=flashtriton.__file__, row=name, ms=ms)), flush=True)
    del out


def _decode_rows(B, N):
    """Eager decoding steps over a contiguous and a paged cache of B x N keys, cold."""
    x = decode_inputs(B, N)
    step = lambda: attention_with_kvcache(x.q, x.k, x.v, cache_seqlens=x.lens,  # noqa
                                          return_lse=False)
    paged = lambda: attention_with_kvcache(x.q, x.k_pages, x.v_pages, cache_seqlens=x.lens,  # noqa
                                           block_table=x.table, return_lse=False)
    return [(f"decode B={B} N={N}", _ms(step, True)),
            (f"paged decode B={B} N={N}", _ms(paged, True))]


def _check(out, q, k, v, lens, causal, what):
    """out against a float32 reference over each sequence's keys."""
    from flashtriton.reference import attention_reference
    for b in range(q.shape[0]):
        n = int(lens[b])
        ref = attention_reference(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=causal,
                                  dtype=torch.float32).out
        err = float((out[b:b + 1].float() - ref).norm() / ref.norm())
        if not err < 1e-2:
            raise SystemExit(f"{what}: relative error {err:.2e} at sequence {b}")


def prefill():
    torch.manual_seed(0)
    print(f"{'D':>4} {'G':>2} {'SQ':>5} {'cache':>6} {'split ms':>9} {'prefill ms':>10} "
          f"{'flash_attention ms':>18} {'chosen/fa':>9}")
    for D in (128, 256):
        for G, SQ, cache in ((6, 16, 4096), (6, 64, 4096), (6, 128, 4096), (6, 192, 4096),
                             (6, 256, 4096), (6, 384, 4096), (6, 512, 4096), (6, 1024, 8192),
                             (6, 4096, 16384), (1, 128, 4096), (1, 512, 4096), (1, 1024, 8192),
                             (2, 512, 4096), (4, 256, 4096), (8, 128, 4096)):
            B, HKV = 2, 4
            H = HKV * G
            N = cache + SQ  # the chunk's keys are the cache's last SQ positions
            q = torch.randn(B, SQ, H, D, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
            times = {}
            saved = configs.KVCACHE_PREFILL_MIN_ROWS
            for route, threshold in (("split", 10**9), ("prefill", 1)):
                configs.KVCACHE_PREFILL_MIN_ROWS = threshold
                runtime._CALLS.clear()  # a remembered step replays before the route is chosen
                call = lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens,  # noqa
                                                      causal=True, return_lse=False)
                _check(call().out, q, kc, vc, lens, True, f"{route} D={D} SQ={SQ}")
                times[route] = _ms(call)
            configs.KVCACHE_PREFILL_MIN_ROWS = saved
            fa = lambda: flash_attention(q, kc, vc, causal=True)  # noqa
            times["fa"] = _ms(fa)
            chosen = times["prefill" if configs.kvcache_prefill(G, SQ) else "split"]
            print(f"{D:4d} {G:2d} {SQ:5d} {cache:6d} {times['split']:9.3f} {times['prefill']:10.3f} "
                  f"{times['fa']:18.3f} {chosen / times['fa']:9.2f}", flush=True)
    torch.cuda.empty_cache()


if __name__ == "__main__":
    {"safety": safety, "prefill": prefill}[sys.argv[1]]()
