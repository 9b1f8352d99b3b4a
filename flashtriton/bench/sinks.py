"""The cost of attention sinks: flashtriton with sinks against flashtriton without, on the
same inputs, forward and forward + backward (bf16, batch x seqlen = 16K tokens).

    python -m flashtriton.bench.sinks [--out DIR]

Shapes: gpt-oss's attention (64 query heads, 8 KV heads, head dim 64; full causal layers and
128-token sliding windows) and D=128 causal (16 heads); then decoding steps
(attention_with_kvcache, one query token, gpt-oss's heads) over contiguous caches. Each row's output, LSE and the
sinks' gradient are first checked against flashtriton.reference (float32, with the sinks) on
one batch element's first KV head group; a failed check reports no speed. Times: the median
of do_bench runs, the two calls alternated in 3 rounds (the median of each).
"""

import json
import os

import torch

from .common import TOLERANCE, add_out, alternated, failed, meta as run_meta, rel_err, script_args
from .common import parser as common_parser

SHAPES = [  # (name, H, HKV, D, N, window_left)
    ("gpt-oss full", 64, 8, 64, 2048, -1), ("gpt-oss full", 64, 8, 64, 8192, -1),
    ("gpt-oss window 128", 64, 8, 64, 2048, 127), ("gpt-oss window 128", 64, 8, 64, 8192, 127),
    ("D=128 causal", 16, 16, 128, 4096, -1), ("D=128 causal", 16, 16, 128, 16384, -1),
]


def _check(q, k, v, sinks, window) -> float:
    """Largest relative error of out, lse and dsinks on batch element 0's first group of
    query heads (one KV head) against the float32 reference with the sinks."""
    from flashtriton import flash_attention_with_lse
    from flashtriton.reference import attention_reference
    G = q.shape[2] // k.shape[2]
    out, lse = flash_attention_with_lse(q, k, v, causal=True, window_size=(window, 0),
                                        sinks=sinks)
    ours = torch.autograd.grad((out[:1, :, :G].float() ** 2).sum(), (sinks,))[0][:G]
    leaf = sinks.detach()[:G].float().requires_grad_()
    ref = attention_reference(q[:1, :, :G], k[:1, :, :1], v[:1, :, :1], causal=True,
                              window_size=(window, 0), sinks=leaf, dtype=torch.float32)
    ref_ds = torch.autograd.grad((ref.out ** 2).sum(), (leaf,))[0]
    return max(rel_err(out[:1, :, :G], ref.out), rel_err(lse[:1, :G], ref.lse),
               rel_err(ours, ref_ds))


def _times(q, k, v, dout, sinks, window):
    """(forward ms, forward + backward ms) with the given sinks (None: without)."""
    import triton
    from flashtriton import flash_attention

    def fwd():
        return flash_attention(q, k, v, causal=True, window_size=(window, 0), sinks=sinks)

    def fwd_bwd():
        fwd().backward(dout)
    with torch.no_grad():
        f = triton.testing.do_bench(fwd, warmup=25, rep=200, return_mode="median")
    return f, triton.testing.do_bench(fwd_bwd, warmup=25, rep=200, return_mode="median",
                                      grad_to_none=[q, k, v] + ([sinks] if sinks is not None
                                                                else []))


DECODE = [(1, 8192), (8, 8192), (64, 1024), (1, 131072)]  # (batch, cached keys)


def _decode_rows(meta):
    """Decoding steps with sinks against without: checked against the float32 reference
    (batch element 0), then do_bench medians, alternated in 3 rounds."""
    import triton
    from flashtriton.decode import attention_with_kvcache
    from flashtriton.reference import attention_reference
    rows = []
    H, HKV, D = 64, 8, 64
    for B, N in DECODE:
        torch.manual_seed(0)
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
                  for _ in range(2))
        lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
        sinks = torch.randn(H, device="cuda", dtype=torch.bfloat16)
        out = attention_with_kvcache(q, kc, vc, cache_seqlens=lens, sinks=sinks).out
        ref = attention_reference(q[:1], kc[:1], vc[:1], sinks=sinks, dtype=torch.float32)
        row = dict(meta, suite="sinks-decode", B=B, H=H, HKV=HKV, D=D, N=N,
                   rel_err=rel_err(out[:1], ref.out))
        row["status"] = failed(row["rel_err"], TOLERANCE) or "ok"
        if row["status"] == "ok":
            medians = alternated(lambda on: (triton.testing.do_bench(
                lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                               sinks=sinks if on else None, return_lse=False),
                warmup=25, rep=200, return_mode="median"),), (False, True))
            (t0,), (t1,) = medians[False], medians[True]
            row.update(step_ms=t0, step_sinks_ms=t1, ratio=t1 / t0)
            print(f"decode B={B:<3d} N={N:<7d} {t0 * 1e3:8.1f} us {t1 * 1e3:8.1f} us "
                  f"{t1 / t0:6.3f}", flush=True)
        else:
            print(f"decode B={B} N={N} {row['status']}", flush=True)
        rows.append(row)
        q = kc = vc = None
        torch.cuda.empty_cache()
    return rows


def parser():
    p = common_parser("flashtriton.bench.sinks", __doc__)
    add_out(p, "sinks.jsonl")
    return p


def main(argv=None):
    args = script_args(parser(), argv)
    meta, rows = run_meta(), []
    print(f"{'shape':20s} {'N':>6s} {'fwd ms':>8s} {'+sinks':>8s} {'ratio':>6s} "
          f"{'fwd+bwd ms':>10s} {'+sinks':>8s} {'ratio':>6s}")
    for name, H, HKV, D, N, window in SHAPES:
        torch.manual_seed(0)
        B = 16384 // N
        q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        sinks = torch.randn(H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        row = dict(meta, suite="sinks", shape=name, B=B, H=H, HKV=HKV, D=D, N=N,
                   window_left=window, rel_err=_check(q, k, v, sinks, window))
        row["status"] = failed(row["rel_err"], TOLERANCE) or "ok"
        if row["status"] == "ok":
            dout = torch.randn_like(q)
            medians = alternated(lambda on: _times(q, k, v, dout, sinks if on else None, window),
                                 (False, True))
            (f0, b0), (f1, b1) = medians[False], medians[True]
            row.update(fwd_ms=f0, fwd_sinks_ms=f1, fwd_ratio=f1 / f0, fwd_bwd_ms=b0,
                       fwd_bwd_sinks_ms=b1, fwd_bwd_ratio=b1 / b0)
            print(f"{name:20s} {N:6d} {f0:8.3f} {f1:8.3f} {f1 / f0:6.3f} {b0:10.3f} {b1:8.3f} "
                  f"{b1 / b0:6.3f}", flush=True)
        else:
            print(f"{name:20s} {N:6d} {row['status']}", flush=True)
        rows.append(row)
        q = k = v = None
        torch.cuda.empty_cache()
    print(f"{'decode step':20s} {'none':>11s} {'+sinks':>11s} {'ratio':>6s}")
    rows += _decode_rows(meta)
    with open(os.path.join(args.out, "sinks.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
