"""Benchmark suite: flashtriton against torch SDPA backends, FlexAttention, flash-attn and naive attention.

    python -m flashtriton.bench                                  # training sweep + GQA sweep + host overhead
    python -m flashtriton.bench --dims 128 --seqlens 4096 8192 --causal 1 --suites train
    python -m flashtriton.bench --merge run1/results.jsonl run2/results.jsonl --out all
                                                                 # one table and plots of several runs

Suites:
  train     batch * seqlen = --tokens (16K), nheads * headdim = --dmodel (2048), --dims x --seqlens x --causal
  gqa       Llama-3 70B attention: batch 1, 64 query heads, 8 KV heads, headdim 128, causal, --gqa-seqlens
  overhead  host time per call at a tiny shape (no CUDA graphs), each provider
  coldstart seconds of the first forward + backward of a new shape in a fresh process with an
            empty Triton cache, and in a second process sharing that cache
  decode    one query token over a KV cache (32 query heads, 8 KV heads, headdim 128, bf16):
            --decode-batches x --decode-lens; GB/s of K and V read and % of the copy
            bandwidth measured in the same run, for eager calls (their kernels) and for the
            step replayed from a CUDA graph (as serving engines run it); flashtriton
            contiguous and paged (16-token pages) against torch SDPA with GQA; GPU time after
            an L2 flush that leaves no dirty lines (cold_ms), the copy too; the host's time
            a step, back to back

For every shape and provider: median times (triton.testing.do_bench) of forward, backward and
forward + backward, TFLOP/s (forward 4 * B * H * SQ * SK * D, halved when causal; backward 2.5x
that) and the peak extra memory of forward + backward. A shape that runs out of memory is a row
that says so. flashtriton's output and gradients are checked against SDPA before its speed is
reported. Writes results.jsonl (row by row), results.csv, results.md and, when matplotlib is
installed, tflops.png and memory.png to --out; the GPU name, versions, commit and date are in
every row.
"""

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Shape(NamedTuple):
    suite: str
    B: int
    H: int
    HKV: int
    N: int
    D: int
    causal: bool


# Providers: fn(q, k, v, causal) on (B, H, N, D) tensors; k and v may have fewer heads (GQA).

def _naive(q, k, v, causal):
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def _sdpa(backend):
    def run(q, k, v, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
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
        _FLEX[key] = (create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q.shape[-2],
                                        k.shape[-2], device=q.device) if causal else None)
    return _FLEX["fn"](q, k, v, block_mask=_FLEX[key], enable_gqa=k.shape[1] != q.shape[1])


def _flash_attn(q, k, v, causal):
    from flash_attn import flash_attn_func  # only when installed
    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           causal=causal).transpose(1, 2)


def _flashtriton(q, k, v, causal):
    from flashtriton import flash_attention
    return flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           causal=causal).transpose(1, 2)


PROVIDERS = {
    "flashtriton": _flashtriton,
    "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
    "flex": _flex,
    "sdpa_flash": _sdpa("FLASH_ATTENTION"),
    "sdpa_efficient": _sdpa("EFFICIENT_ATTENTION"),
    "flash_attn": _flash_attn,
    "naive": _naive,
}


def _available(name):
    if name != "flash_attn":
        return True
    try:
        import flash_attn  # noqa: F401
        return True
    except ImportError:
        return False


def flops_fwd(B, H, SQ, SK, D, causal):
    f = 4 * B * H * SQ * SK * D
    return f / 2 if causal else f


def _inputs(shape: Shape, dtype, requires_grad=True):
    def t(heads):
        return torch.randn(shape.B, heads, shape.N, shape.D, device="cuda", dtype=dtype,
                           requires_grad=requires_grad)
    return t(shape.H), t(shape.HKV), t(shape.HKV)


def _measure(fn, shape: Shape, dtype):
    """Median ms of forward, backward, forward + backward, and peak extra MiB."""
    import triton

    q, k, v = _inputs(shape, dtype)
    dout = torch.randn_like(q)
    c = shape.causal
    fn(q, k, v, c).backward(dout)  # compile / autotune outside the timings
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(q, k, v, c).backward(dout)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    bench = dict(warmup=50, rep=200, return_mode="median")
    fwd = triton.testing.do_bench(lambda: fn(q, k, v, c), **bench)
    out = fn(q, k, v, c)
    bwd = triton.testing.do_bench(lambda: out.backward(dout, retain_graph=True),
                                  grad_to_none=[q, k, v], **bench)
    both = triton.testing.do_bench(lambda: fn(q, k, v, c).backward(dout), grad_to_none=[q, k, v],
                                   **bench)
    return dict(fwd_ms=fwd, bwd_ms=bwd, fwdbwd_ms=both, peak_extra_MiB=peak)


def _check(shape: Shape, dtype):
    """Largest relative error of flashtriton's out, dq, dk, dv against SDPA (flash backend)."""
    q, k, v = _inputs(shape, dtype)
    dout = torch.randn_like(q)
    res = []
    for fn in (_flashtriton, _sdpa("FLASH_ATTENTION")):
        out = fn(q, k, v, shape.causal)
        res.append([out.detach()] + list(torch.autograd.grad(out, (q, k, v), dout)))
    return max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(*res))


_COLD = """
import sys, time, torch
from flashtriton import flash_attention
q, k, v = (torch.randn(2, 3000, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
torch.cuda.synchronize()
t = time.perf_counter()
flash_attention(q, k, v, causal=True).sum().backward()
torch.cuda.synchronize()
print(time.perf_counter() - t)
"""


def cold_start_s():
    """Seconds of the first forward + backward of a shape in a new process: with an empty
    Triton cache (compiling and autotuning every kernel), then in a second process that shares
    the cache (binaries and autotuning results come from disk)."""
    import tempfile
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        return [float(subprocess.check_output([sys.executable, "-c", _COLD], env=env,
                                              text=True).split()[-1]) for _ in range(2)]


def host_overhead_us(fn, calls=300):
    """Host microseconds per call at a tiny shape, no CUDA graphs: the GPU work is smaller
    than the launch cost, so the wall time of many back-to-back calls is the host's."""
    q, k, v = _inputs(Shape("overhead", 1, 4, 4, 128, 64, False), torch.bfloat16, False)
    for _ in range(20):
        fn(q, k, v, False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn(q, k, v, False)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def decode_bytes(B, N, HKV=8, D=128, itemsize=2):
    """Bytes of K and V one decoding step must read."""
    return 2 * B * N * HKV * D * itemsize


def cold_ms(fn, reps=100):
    """Median GPU ms of fn, each call after launch.flush_l2 (an L2 left clean: do_bench's
    flush leaves it dirty, and the write-back fell on the timed call, 13% of a 268 MB
    decoding step), the host's time kept out (launch.gpu_time_ms: the GPU sleeps while the
    host queues the calls). Memory-bound rows (decode, copy) are timed this way; per_call_us
    times the host."""
    from flashtriton import launch
    return launch.gpu_time_ms(fn, (0.5,), reps)[0]


def copy_bandwidth_gbps(nbytes=2**31):
    """Device-to-device copy, bytes read plus written per second (the memory ceiling)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / cold_ms(lambda: dst.copy_(src)) * 1e-6


def per_call_us(fn, calls=50, warmup=0, repeats=1):
    """Wall time per call of back-to-back calls (no cache flush between them), the best of
    ``repeats`` loops: the larger of a call's host time and its GPU time (an eager step whose
    loop_us passes its GPU time is host-bound)."""
    import time
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def decode_inputs(B, N, H=32, HKV=8, D=128, page=16):
    """One decoding step's bf16 inputs on the GPU: q (B, 1, H, D); a full contiguous cache
    (B, N, HKV, D); the same keys and values in shuffled pages of ``page`` tokens with their
    block table; cache_seqlens (all N)."""
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(B * N // page, device="cuda").view(B, -1).to(torch.int32)
    kp = torch.empty(B * N // page, page, HKV, D, device="cuda", dtype=torch.bfloat16)
    vp = torch.empty_like(kp)
    kp[table.view(-1).long()] = kc.view(-1, page, HKV, D)
    vp[table.view(-1).long()] = vc.view(-1, page, HKV, D)
    lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
    return q, kc, vc, kp, vp, table, lens


def _graph(fn):
    """fn captured in a CUDA graph (serving engines replay decoding steps this way: the
    replay has no host overhead, so it times the kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def run_decode(batches, lens, meta, copy_gbps):
    import triton
    from flashtriton import launch
    from flashtriton.decode import attention_with_kvcache
    H, HKV, D, page = 32, 8, 128, 16
    rows = []
    for B in batches:
        for N in lens:
            base = dict(meta, suite="decode", B=B, H=H, HKV=HKV, N=N, D=D, causal=False)
            try:
                q, kc, vc, kp, vp, table, lens_t = decode_inputs(B, N, H, HKV, D, page)
                qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
                # out only, as SDPA returns (flash-attn's return_softmax_lse=False)
                fns = {
                    "flashtriton": lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens_t,
                                                                  return_lse=False),
                    "flashtriton_paged16": lambda: attention_with_kvcache(
                        q, kp, vp, cache_seqlens=lens_t, block_table=table, return_lse=False),
                    "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True),
                }
                ref = fns["sdpa"]().transpose(1, 2).float()
                for prov, fn in fns.items():
                    row = dict(base, provider=prov)
                    tuned_before = set(launch._TUNED)
                    err = float((fn()[0] if prov != "sdpa" else ref).float().sub(ref).norm()
                                / ref.norm())
                    if err > 2e-2:
                        row["status"] = f"FAILED check (rel err {err:.2e})"
                    else:
                        nbytes = decode_bytes(B, N, HKV, D)
                        ms = cold_ms(fn)
                        graph = _graph(fn)
                        graph_ms = cold_ms(graph.replay)
                        # do_bench's (dirty) flush, beside the runs before session 26
                        dirty_ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100,
                                                           return_mode="median")
                        # the best of 5 loops: one loop of 50 calls swung with host noise
                        replays = launch.FAST_LAUNCHES
                        row["loop_us"] = per_call_us(fn, calls=100, repeats=5)
                        if prov != "sdpa":  # replayed launches per call (1 or 2; 0: slow path)
                            row["replays_per_call"] = (launch.FAST_LAUNCHES - replays) / 500
                            row["tiles"] = tiles_since(tuned_before)  # a tile tuned for this row
                        row.update(status="ok", decode_ms=ms, decode_GBps=nbytes / ms * 1e-6,
                                   pct_of_copy=100 * nbytes / ms * 1e-6 / copy_gbps,
                                   graph_ms=graph_ms, graph_GBps=nbytes / graph_ms * 1e-6,
                                   graph_pct_of_copy=100 * nbytes / graph_ms * 1e-6 / copy_gbps,
                                   graph_dirty_GBps=nbytes / dirty_ms * 1e-6)
                    rows.append(row)
            except torch.cuda.OutOfMemoryError:
                rows.append(dict(base, provider="all", status="out of memory"))
            torch.cuda.empty_cache()
    return rows


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


def shapes(args):
    out = []
    if "train" in args.suites:
        out += [Shape("train", max(1, args.tokens // N), args.dmodel // D, args.dmodel // D, N, D,
                      bool(c)) for D in args.dims for N in args.seqlens for c in args.causal]
    if "gqa" in args.suites:
        out += [Shape("gqa", 1, 64, 8, N, 128, True) for N in args.gqa_seqlens]
    return out


def tiles_since(before) -> dict:
    """The configs the autotuner chose for flashtriton's kernels since ``before`` (a set of
    keys of ``launch._TUNED``), as {"fwd": "128x64/8w/3s", ...}: which tile won a shape."""
    from flashtriton import launch
    names = {id(launch._fwd): "fwd", id(launch._dkdv): "dkdv", id(launch._dq): "dq",
             id(launch._decode): "decode"}
    out = {}
    for key, cfg in launch._TUNED.items():
        if key not in before and key[0] in names:
            bm, bn, w, st = launch._cfg_tuple(cfg)
            out[names[key[0]]] = f"{bm}x{bn}/{w}w/{st}s"
    return out


def run_shape(shape: Shape, providers, dtype, meta):
    """One row per provider; flashtriton's speed only after its check passes."""
    from flashtriton import launch
    rows = []
    tuned_before = set(launch._TUNED)
    err = _check(shape, dtype) if "flashtriton" in providers else None
    for prov in providers:
        row = dict(meta, provider=prov, dtype=str(dtype).split(".")[-1], **shape._asdict())
        if prov == "flashtriton":
            row["rel_err_vs_sdpa"] = err
        if prov == "flashtriton" and not err < 2e-2:
            row["status"] = f"FAILED check (rel err {err:.2e}); speed not reported"
        else:
            try:
                row.update(_measure(PROVIDERS[prov], shape, dtype), status="ok")
                if prov == "flashtriton":
                    row["tiles"] = tiles_since(tuned_before)
                f = flops_fwd(shape.B, shape.H, shape.N, shape.N, shape.D, shape.causal)
                row.update(fwd_tflops=f / row["fwd_ms"] * 1e-9,
                           bwd_tflops=2.5 * f / row["bwd_ms"] * 1e-9,
                           fwdbwd_tflops=3.5 * f / row["fwdbwd_ms"] * 1e-9)
            except torch.cuda.OutOfMemoryError:
                row["status"] = "out of memory"
            except Exception as e:  # a provider that cannot run this shape
                row["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def _speedups(train, providers):
    """flashtriton's speed over each other provider, forward and backward, per shape group
    (head dim, causal): the range over the shapes both ran (markdown lines)."""
    others = [p for p in providers if p != "flashtriton"]
    ok = {(r["provider"], r["suite"], r["B"], r["H"], r["HKV"], r["D"], r["N"], r["causal"]): r
          for r in train if r.get("status") == "ok"}
    groups = {}
    for (prov, *shape), r in ok.items():
        mine = ok.get(("flashtriton", *shape))
        if prov == "flashtriton" or mine is None:
            continue
        key = (shape[0], shape[4], bool(shape[6]), prov)  # suite, D, causal, provider
        groups.setdefault(key, []).append((mine["fwd_tflops"] / r["fwd_tflops"],
                                           mine["bwd_tflops"] / r["bwd_tflops"]))
    if not groups or "flashtriton" not in providers:
        return []
    lines = ["", "flashtriton's speed-up over each provider (its TFLOP/s over theirs, forward / "
             "backward; the range over the sequence lengths of the table):", "",
             "| suite | D | causal | " + " | ".join(others) + " |",
             "|---|---|---|" + "---|" * len(others)]
    for suite, D, causal in sorted({k[:3] for k in groups}):
        cells = []
        for prov in others:
            ratios = groups.get((suite, D, causal, prov))
            if not ratios:
                cells.append("")
                continue
            f, b = zip(*ratios)
            span = lambda v: "-".join(dict.fromkeys(f"{x:.2f}" for x in (min(v), max(v))))
            cells.append(f"{span(f)}x / {span(b)}x")
        lines.append(f"| {suite} | {D} | {int(causal)} | " + " | ".join(cells) + " |")
    return lines


def markdown(rows, providers, meta):
    head = (f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit "
            f"{meta['commit']}, {meta['date']}. TFLOP/s forward / backward (peak extra MiB)\n\n")
    lines = ["| suite | B | H/HKV | D | N | causal | " + " | ".join(providers) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(providers)]
    train = [r for r in rows if r.get("suite") in ("train", "gqa")]
    keys = sorted({(r["suite"], r["B"], r["H"], r["HKV"], r["D"], r["N"], r["causal"])
                   for r in train})
    for key in keys:
        cells = []
        for prov in providers:
            r = next((r for r in train if r["provider"] == prov and
                      (r["suite"], r["B"], r["H"], r["HKV"], r["D"], r["N"], r["causal"]) == key),
                     None)
            cells.append("" if r is None else
                         f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f} ({r['peak_extra_MiB']:.0f})"
                         if r.get("status") == "ok" else r["status"][:30])
        s, B, H, HKV, D, N, c = key
        lines.append(f"| {s} | {B} | {H}/{HKV} | {D} | {N} | {int(c)} | " + " | ".join(cells) + " |")
    lines += _speedups(train, providers)
    dec = [r for r in rows if r.get("suite") == "decode"]
    if dec:
        dprov = sorted({r["provider"] for r in dec})
        lines += ["", "GB/s of K and V read per decoding step (% of the copy bandwidth): eager "
                  "calls' kernels / the same step replayed from a CUDA graph; GPU time after a "
                  "clean L2 flush (bench.cold_ms).", "",
                  "| decode B | cache | " + " | ".join(f"{p} eager / graph" for p in dprov)
                  + " |", "|---|---|" + "---|" * len(dprov)]
        for B, N in sorted({(r["B"], r["N"]) for r in dec}):
            cells = []
            for prov in dprov:
                r = next((r for r in dec if (r["provider"], r["B"], r["N"]) == (prov, B, N)), None)
                cells.append("" if r is None else
                             f"{r['decode_GBps']:.0f} ({r['pct_of_copy']:.0f}%) / "
                             f"{r['graph_GBps']:.0f} ({r['graph_pct_of_copy']:.0f}%)"
                             if r.get("status") == "ok" else r["status"][:30])
            lines.append(f"| {B} | {N} | " + " | ".join(cells) + " |")
    for r in rows:
        if r.get("suite") == "coldstart" and r.get("status") == "ok":
            lines += ["", f"First forward + backward of a new shape (causal, bf16, D=128) in a new "
                      f"process: {r['empty_cache_s']:.1f} s with an empty Triton cache (compile and "
                      f"autotune), {r['second_process_s']:.1f} s in a second process sharing the "
                      f"cache."]
    over = [r for r in rows if r.get("suite") == "overhead"]
    if over:
        lines += ["", "| host overhead per call (us) | " + " | ".join(r["provider"] for r in over)
                  + " |", "|---|" + "---|" * len(over),
                  "| B=1 H=4 N=128 D=64 bf16 | " + " | ".join(
                      f"{r['host_us']:.1f}" if "host_us" in r else r["status"][:30] for r in over)
                  + " |"]
    return head + "\n".join(lines) + "\n"


def write_csv(rows, path):
    fields = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def plot(rows, out_dir):
    """tflops.png (forward and backward TFLOP/s against seqlen, a panel per (suite, D, causal))
    and memory.png (peak extra memory against seqlen). Needs matplotlib; else nothing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ok = [r for r in rows if r.get("status") == "ok" and r.get("suite") in ("train", "gqa")]
    panels = sorted({(r["suite"], r["D"], r["causal"]) for r in ok})
    if not panels:
        return []
    written = []
    for name, metrics in (("tflops.png", ("fwd_tflops", "bwd_tflops")),
                          ("memory.png", ("peak_extra_MiB",))):
        fig, axes = plt.subplots(len(metrics), len(panels), squeeze=False,
                                 figsize=(4 * len(panels), 3.2 * len(metrics)))
        for j, (suite, D, c) in enumerate(panels):
            for i, metric in enumerate(metrics):
                ax = axes[i][j]
                for prov in sorted({r["provider"] for r in ok}):
                    pts = sorted((r["N"], r[metric]) for r in ok if r["provider"] == prov and
                                 (r["suite"], r["D"], r["causal"]) == (suite, D, c))
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=prov)
                ax.set_xscale("log", base=2)
                if metric == "peak_extra_MiB":
                    ax.set_yscale("log")
                ax.set_title(f"{suite} D={D} {'causal' if c else 'full'}: {metric}", fontsize=9)
                ax.set_xlabel("seqlen")
                ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _progress(items):
    try:
        from tqdm import tqdm
        return tqdm(items, desc="bench", file=sys.stdout)
    except ImportError:
        return items


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--providers", nargs="+", default=["flashtriton", "sdpa_cudnn", "flex",
                                                      "sdpa_flash", "sdpa_efficient",
                                                      "flash_attn", "naive"],
                   choices=list(PROVIDERS))
    p.add_argument("--suites", nargs="+", default=["train", "gqa", "overhead", "coldstart",
                                                   "decode"],
                   choices=["train", "gqa", "overhead", "coldstart", "decode"])
    p.add_argument("--decode-batches", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--decode-lens", nargs="+", type=int, default=[1024, 8192, 65536, 131072])
    p.add_argument("--dims", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384,
                                                                  32768])
    p.add_argument("--gqa-seqlens", nargs="+", type=int, default=[2048, 8192, 32768])
    p.add_argument("--causal", nargs="+", type=int, default=[0, 1])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dmodel", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    p.add_argument("--merge", nargs="+", metavar="JSONL",
                   help="write the table, CSV and plots of saved runs' results.jsonl (no GPU)")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if not torch.cuda.is_available():
        sys.exit("the benchmark needs a CUDA GPU (python -m flashtriton.demo runs on the CPU)")
    dtype = getattr(torch, args.dtype)
    providers = [prov for prov in args.providers if _available(prov)]
    os.makedirs(args.out, exist_ok=True)
    meta = _meta(args.commit)
    rows = []
    with open(os.path.join(args.out, "results.jsonl"), "w") as jsonl:  # row by row
        for shape in _progress(shapes(args)):
            for row in run_shape(shape, providers, dtype, meta):
                rows.append(row)
                jsonl.write(json.dumps(row) + "\n")
                jsonl.flush()
                print(f"{row['provider']:14s} {shape.suite} B={shape.B} H={shape.H}/{shape.HKV} "
                      f"D={shape.D} N={shape.N} causal={int(shape.causal)} "
                      + (f"fwd {row['fwd_tflops']:6.1f} bwd {row['bwd_tflops']:6.1f} TFLOP/s "
                         f"mem {row['peak_extra_MiB']:9.1f} MiB" if row["status"] == "ok"
                         else row["status"])
                      + "".join(f" {k} {v}" for k, v in row.get("tiles", {}).items()),
                      flush=True)
        if "overhead" in args.suites:
            for prov in providers:
                row = dict(meta, provider=prov, suite="overhead")
                try:
                    row.update(host_us=host_overhead_us(PROVIDERS[prov]), status="ok")
                except Exception as e:
                    row["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
                rows.append(row)
                jsonl.write(json.dumps(row) + "\n")
        if "coldstart" in args.suites:
            row = dict(meta, provider="flashtriton", suite="coldstart")
            try:
                first, second = cold_start_s()
                row.update(status="ok", empty_cache_s=first, second_process_s=second)
            except Exception as e:
                row["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            jsonl.write(json.dumps(row) + "\n")
            print(f"coldstart {row}", flush=True)
        if "decode" in args.suites:
            copy = copy_bandwidth_gbps()
            for row in run_decode(args.decode_batches, args.decode_lens, meta, copy):
                row["copy_GBps"] = copy
                rows.append(row)
                jsonl.write(json.dumps(row) + "\n")
                print(f"decode {row['provider']:20s} B={row['B']} N={row['N']} "
                      + (f"{row['decode_GBps']:7.0f} GB/s eager, {row['graph_GBps']:7.0f} GB/s "
                         f"graph ({row['graph_pct_of_copy']:.0f}% of copy), "
                         f"{row['loop_us']:.1f} us per call back to back"
                         if row["status"] == "ok" else row["status"])
                      + "".join(f" {k} {v}" for k, v in row.get("tiles", {}).items()),
                      flush=True)
    report(rows, providers, meta, args.out)


def report(rows, providers, meta, out_dir):
    """results.csv, results.md and the plots of ``rows`` in ``out_dir``; prints the table."""
    write_csv(rows, os.path.join(out_dir, "results.csv"))
    table = markdown(rows, providers, meta)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(table)
    plot(rows, out_dir)
    print(table)


def merge(paths, out_dir):
    """One report of the rows of several runs (their results.jsonl, e.g. one per GPU or per
    call): providers in the order they first appear; the header names every commit and date."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise SystemExit(f"no rows in {' '.join(paths)}")
    providers = list(dict.fromkeys(r["provider"] for r in rows if r.get("suite") != "decode"))
    meta = {k: ", ".join(dict.fromkeys(str(r.get(k)) for r in rows))
            for k in ("gpu", "torch", "triton", "commit", "date")}
    os.makedirs(out_dir, exist_ok=True)
    report(rows, providers, meta, out_dir)


if __name__ == "__main__":
    main()
