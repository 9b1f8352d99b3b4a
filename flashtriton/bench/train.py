"""The training suites (train, gqa: forward and backward of each provider at each shape), the
host overhead per call and the cold start.

For every shape, every provider's out, dq, dk and dv are checked against flashtriton.reference
(common.expected, float32) before its speed is measured: median times (do_bench) of forward,
backward and forward + backward, TFLOP/s (forward 4 * B * H * SQ * SK * D, halved when
causal; backward 2.5x that) and the peak extra memory of forward + backward. A provider whose
check fails, that runs out of memory or cannot run the shape is a row that says so.
"""

import os
import subprocess
import sys
import time

import torch

from . import OVERHEAD_SHAPE, PROVIDERS, Shape, flops_fwd
from .common import (check, expected, failed, measure, median_run, rotated, tiles_mark,
                     tiles_since)


def inputs(shape: Shape, dtype, requires_grad=True, device="cuda"):
    """q (B, H, N, D) and k, v (B, HKV, N, D), normal."""
    def t(heads):
        return torch.randn(shape.B, heads, shape.N, shape.D, device=device, dtype=dtype,
                           requires_grad=requires_grad)
    return t(shape.H), t(shape.HKV), t(shape.HKV)


def reference(q, k, v, dout, causal):
    """expected's out, dq, dk, dv for (B, H, N, D) tensors, in that layout."""
    t = [x.transpose(1, 2) for x in (q, k, v, dout)]
    return [x.transpose(1, 2) for x in expected(*t, causal=causal)]


def run_shape(shape: Shape, providers, dtype, meta, device="cuda", timed=True, rounds=3):
    """One row per provider: its check against the reference, then (timed) its speed only
    where the check passed, measured ``rounds`` times with the providers' order rotated each
    round (a provider timed after others runs on a hotter card) and the median of each figure
    kept. timed=False: the checks alone (no GPU needed)."""
    torch.manual_seed(0)
    q, k, v = inputs(shape, dtype, device=device)
    dout = torch.randn_like(q)
    try:
        ref = reference(q, k, v, dout, shape.causal)
    except torch.cuda.OutOfMemoryError:
        ref = None
    rows, mark = {}, tiles_mark() if timed else 0  # the checks' first calls tune the tiles
    for prov in providers:
        row = rows[prov] = dict(meta, provider=prov, dtype=str(dtype).split(".")[-1],
                                **shape._asdict())
        if ref is None:
            row["status"] = "out of memory (the reference)"
            continue
        try:
            row["rel_err"] = err = check(PROVIDERS[prov], q, k, v, dout, ref, shape.causal)
            row["status"] = failed(err) or ("ok" if timed else "checked")
        except torch.cuda.OutOfMemoryError:
            row["status"] = "out of memory"
        except Exception as e:  # a provider that cannot run this shape
            row["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
        q.grad = k.grad = v.grad = None
    del ref
    timing = [prov for prov in providers if rows[prov]["status"] == "ok"]
    runs = {prov: [] for prov in timing}
    for r in range(rounds if timing else 0):
        for prov in rotated(timing, r):
            if rows[prov]["status"] != "ok":  # failed in an earlier round
                continue
            try:
                runs[prov].append(measure(PROVIDERS[prov], q, k, v, shape.causal, dout))
            except torch.cuda.OutOfMemoryError:
                rows[prov]["status"] = "out of memory"
            except Exception as e:
                rows[prov]["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
            q.grad = k.grad = v.grad = None
            if device == "cuda":
                torch.cuda.empty_cache()
    f = flops_fwd(shape.B, shape.H, shape.N, shape.N, shape.D, shape.causal)
    for prov in timing:
        row = rows[prov]
        if row["status"] != "ok":
            continue
        row.update(median_run(runs[prov]), rounds=rounds)
        row.update(fwd_tflops=f / row["fwd_ms"] * 1e-9, bwd_tflops=2.5 * f / row["bwd_ms"] * 1e-9,
                   fwdbwd_tflops=3.5 * f / row["fwdbwd_ms"] * 1e-9)
        if prov == "flashtriton":
            row["tiles"] = tiles_since(mark)
    return list(rows.values())


_COLD = """
import sys, time, torch
from flashtriton import flash_attention
D, N = int(sys.argv[1]), int(sys.argv[2])
H = 2048 // D

def step(n, B=2):
    q, k, v = (torch.randn(B, n, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    torch.cuda.synchronize()
    t = time.perf_counter()
    flash_attention(q, k, v, causal=True).sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t

first = step(N)
bucket = step(2 * N + 100)  # another length bucket of the same shape family
k, v = (torch.randn(1, N + 64, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
slowest = 0.0
for n in range(N - 64, N + 64):  # one-token steps over a cache that crosses a bucket
    q = torch.randn(1, 1, H, D, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t = time.perf_counter()
    flash_attention(q, k[:, :n], v[:, :n], causal=True)
    torch.cuda.synchronize()
    slowest = max(slowest, time.perf_counter() - t)
print(first, bucket, slowest)
"""
COLD_SHAPE_TOKENS = 4096  # the cold start's first length, a bucket's last


def cold_start_s(head_dim: int = 128, seqlen: int = COLD_SHAPE_TOKENS) -> list:
    """Seconds of a new shape family's first calls in a new process, with an empty Triton
    cache (compiling every kernel), then in a second process that shares the cache: for each,
    [the first causal forward + backward (batch 2, ``seqlen``, 2048 / head_dim heads), the
    first at another length bucket, the slowest of 128 one-token forwards over a cache of
    seqlen -/+ 64 keys (a generation that crosses a bucket)]."""
    import tempfile
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        return [[float(x) for x in subprocess.check_output(
                    [sys.executable, "-c", _COLD, str(head_dim), str(seqlen)], env=env,
                    text=True).split()[-3:]] for _ in range(2)]


def host_overhead_us(fn, calls=300):
    """Host microseconds per call at a tiny shape, no CUDA graphs: the GPU work is smaller
    than the launch cost, so the wall time of many back-to-back calls is the host's. The
    provider's result at that shape is checked first (ValueError where it fails)."""
    torch.manual_seed(0)
    q, k, v = inputs(OVERHEAD_SHAPE, torch.bfloat16)
    dout = torch.randn_like(q)
    status = failed(check(fn, q, k, v, dout, reference(q, k, v, dout, False), False))
    if status:
        raise ValueError(status)
    q, k, v = (x.detach() for x in (q, k, v))
    for _ in range(20):
        fn(q, k, v, False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn(q, k, v, False)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6
