"""Benchmark: flashtriton against torch SDPA backends, FlexAttention and naive attention.

    python -m flashtriton.bench                      # the default sweep
    python -m flashtriton.bench --dims 128 --seqlens 4096 8192 --causal 0 1 --out results

Shapes keep batch * seqlen = --tokens (16K) and nheads * headdim = --dmodel
(2048). Reports the median time of forward and backward (triton.testing.do_bench),
TFLOP/s (forward 4*B*H*SQ*SK*D, halved when causal; backward 2.5x that) and the
peak extra memory of forward + backward. flashtriton's output and gradients are
checked against SDPA before its speed is reported. Writes JSON lines and a
markdown table to --out.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F


def _naive(q, k, v, causal):
    # (B, H, T, D) layout, materialises S and P.
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = getattr(SDPBackend, backend)

    def run(q, k, v, causal):
        with sdpa_kernel([b]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


_FLEX = {}


def _flex(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        # One compiled kernel per shape: lift the recompile limit (else dynamo falls back to
        # eager flex, which materialises S), and let backward run twice on one graph.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        torch._functorch.config.donated_buffer = False
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    key = (q.shape[-2], k.shape[-2], causal)
    if key not in _FLEX:
        mask = None
        if causal:
            mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q.shape[-2],
                                     k.shape[-2], device=q.device)
        _FLEX[key] = mask
    return _FLEX["fn"](q, k, v, block_mask=_FLEX[key])


def _flashtriton(q, k, v, causal):
    from flashtriton import flash_attention
    return flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           causal=causal).transpose(1, 2)


PROVIDERS = {
    "flashtriton": _flashtriton,
    "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa_flash": _sdpa("FLASH_ATTENTION"),
    "flex": _flex,
    "naive": _naive,
}


def flops_fwd(B, H, SQ, SK, D, causal):
    f = 4 * B * H * SQ * SK * D
    return f / 2 if causal else f


def _measure(fn, B, H, N, D, causal, dtype):
    import triton

    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(B, H, N, D, device="cuda", dtype=dtype)
    out = fn(q, k, v, causal)  # compile / autotune outside the timings
    out.backward(dout)
    del out
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(q, k, v, causal)
    out.backward(dout)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    q.grad = k.grad = v.grad = None
    fwd_ms = triton.testing.do_bench(lambda: fn(q, k, v, causal), warmup=50, rep=200,
                                     return_mode="median")
    out = fn(q, k, v, causal)
    bwd_ms = triton.testing.do_bench(lambda: out.backward(dout, retain_graph=True), warmup=50,
                                     rep=200, grad_to_none=[q, k, v], return_mode="median")
    return fwd_ms, bwd_ms, peak


def _check(B, H, N, D, causal, dtype):
    """flashtriton vs SDPA (flash backend) on the bench shape; relative errors."""
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    res = []
    for fn in (_flashtriton, _sdpa("FLASH_ATTENTION")):
        out = fn(q, k, v, causal)
        res.append([out.detach()] + list(torch.autograd.grad(out, (q, k, v), dout)))
    return max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(*res))


def _git_commit():
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"],
                                       cwd=os.path.dirname(__file__), text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def _meta(commit=None):
    import triton
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "commit": commit or _git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--providers", nargs="+", default=["flashtriton", "sdpa_cudnn", "flex",
                                                      "sdpa_flash", "naive"],
                   choices=list(PROVIDERS))
    p.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--seqlens", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", nargs="+", type=int, default=[0, 1])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dmodel", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the benchmark needs a CUDA GPU (python -m flashtriton.demo runs on the CPU)")
    dtype = getattr(torch, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    meta = _meta(args.commit)
    rows = []
    jsonl = open(os.path.join(args.out, "results.jsonl"), "w")  # row by row: a timeout keeps what ran
    shapes = [(D, N, c) for D in args.dims for N in args.seqlens for c in args.causal]
    for i, (D, N, causal) in enumerate(shapes):
        B, H = max(1, args.tokens // N), args.dmodel // D
        err = _check(B, H, N, D, bool(causal), dtype) if "flashtriton" in args.providers else None
        for prov in args.providers:
            row = dict(meta, provider=prov, B=B, H=H, N=N, D=D, causal=bool(causal),
                       dtype=args.dtype)
            if prov == "flashtriton":
                row["rel_err_vs_sdpa"] = err
            if prov == "flashtriton" and not err < 2e-2:
                row["status"] = f"FAILED check (rel err {err:.2e}); speed not reported"
            else:
                try:
                    fwd, bwd, peak = _measure(PROVIDERS[prov], B, H, N, D, bool(causal), dtype)
                    f = flops_fwd(B, H, N, N, D, bool(causal))
                    row.update(status="ok", fwd_ms=fwd, bwd_ms=bwd, peak_extra_MiB=peak,
                               fwd_tflops=f / fwd * 1e-9, bwd_tflops=2.5 * f / bwd * 1e-9)
                except torch.cuda.OutOfMemoryError:
                    row["status"] = "out of memory"
                except Exception as e:  # a provider that cannot run this shape
                    row["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
                torch.cuda.empty_cache()
            rows.append(row)
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            print(f"[{i + 1}/{len(shapes)}] {prov:12s} D={D:3d} N={N:6d} causal={causal} "
                  + (f"fwd {row['fwd_tflops']:6.1f} bwd {row['bwd_tflops']:6.1f} TFLOP/s "
                     f"mem {row['peak_extra_MiB']:8.1f} MiB" if row.get("status") == "ok"
                     else row["status"]), flush=True)
    jsonl.close()
    table = _markdown(rows, args.providers, meta)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print(table)


def _markdown(rows, providers, meta):
    head = (f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit "
            f"{meta['commit']}, {meta['date']}. TFLOP/s forward / backward (peak extra MiB)\n\n")
    lines = ["| D | N | causal | " + " | ".join(providers) + " |",
             "|---|---|---|" + "---|" * len(providers)]
    keys = sorted({(r["D"], r["N"], r["causal"]) for r in rows})
    for D, N, c in keys:
        cells = []
        for prov in providers:
            r = next(r for r in rows if (r["provider"], r["D"], r["N"], r["causal"]) == (prov, D, N, c))
            cells.append(f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f} ({r['peak_extra_MiB']:.0f})"
                         if r.get("status") == "ok" else r["status"][:30])
        lines.append(f"| {D} | {N} | {int(c)} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
