"""What every benchmark shares: the reference check that comes before any timing, the timers
(do_bench medians, GPU time after a clean L2 flush, back-to-back host time, CUDA graphs), the
run's metadata and the autotuner's chosen tiles."""

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

import torch

from flashtriton.reference import attention_reference

TOLERANCE = 2e-2  # largest relative error (norm) of out, dq, dk, dv in bf16 / fp16
_BUDGET = 2 ** 28  # float32 elements of one reference call's scores (1 GB)


def expected(q, k, v, dout=None, **kw):
    """flashtriton.reference's out (and, given dout, dq, dk, dv) in float32 for (B, T, H, D)
    q, k, v: per batch element and KV head (its group of query heads) and per block of query
    rows where one call's scores would pass 1 GB, so that long sequences fit. kw: the
    reference's options (causal, window_size, softcap, alibi_slopes of shape (H,), attn_mask
    of shape (SQ, SK) or broadcastable to it)."""
    B, SQ, H, D = q.shape
    SK, HKV = k.shape[1], k.shape[2]
    G = H // HKV
    grads = dout is not None
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dq, dk, dv = ((torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in (q, k, v))
                  if grads else (None, None, None))
    mask, slopes = kw.pop("attn_mask", None), kw.pop("alibi_slopes", None)
    if B * H * SQ * SK + 2 * B * H * SK * D <= _BUDGET:
        units, rows = [(slice(None), slice(None), slice(None))], SQ
    else:
        units = [(slice(b, b + 1), slice(g * G, (g + 1) * G), slice(g, g + 1))
                 for b in range(B) for g in range(HKV)]
        # a block of rows at a time: causal (keys [:end], where the reference's bottom-right
        # alignment puts the block's rows where they are), or where nothing depends on the
        # rows' place but the mask, sliced with them
        blocks = kw.get("causal") or (slopes is None and
                                      tuple(kw.get("window_size", (-1, -1))) == (-1, -1))
        rows = min(SQ, max(1, _BUDGET // (G * (SK + 2 * D)))) if blocks else SQ
    for b, h, g in units:
        for start in range(0, SQ, rows):
            end = min(SQ, start + rows)
            # causal: the rows see keys [:end + SK - SQ] only, and the reference aligns the
            # block's last row with that key (bottom right)
            keys = slice(0, max(0, end + SK - SQ)) if kw.get("causal") and rows < SQ else slice(None)
            leaves = [x[b, r, hh].detach().float().requires_grad_(grads)
                      for x, r, hh in ((q, slice(start, end), h), (k, keys, g), (v, keys, g))]
            m = None
            if mask is not None:
                m = mask
                if m.dim() >= 2 and m.shape[-2] == SQ and rows < SQ:
                    m = m[..., start:end, :]
                if m.dim() >= 1 and m.shape[-1] == SK:
                    m = m[..., keys]
                if m.dim() >= 3 and m.shape[-3] == H:
                    m = m[..., h, :, :]
            sl = None if slopes is None else slopes[h].float()
            with torch.enable_grad():
                o = attention_reference(*leaves, attn_mask=m, alibi_slopes=sl,
                                        dtype=torch.float32, **kw).out
                if grads:
                    o.backward(dout[b, start:end, h].float())
            out[b, start:end, h] = o.detach()
            if grads:
                dq[b, start:end, h] = leaves[0].grad
                dk[b, keys, g] += leaves[1].grad
                dv[b, keys, g] += leaves[2].grad
    return (out, dq, dk, dv) if grads else out


def rel_err(a, b) -> float:
    """Relative error (norm) of a against b."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(fn, q, k, v, dout, ref, causal=None) -> float:
    """Largest relative error of fn(q, k, v, causal)'s out and gradients against ``ref``
    (expected's, in the same (B, T, H, D) or (B, H, T, D) layout as q); q, k, v require
    grad."""
    out = fn(q, k, v, causal)
    got = [out] + list(torch.autograd.grad(out, (q, k, v), dout))
    err = max(rel_err(a, b) for a, b in zip(got, ref))
    return err if err == err else float("inf")  # NaN: a failure too


def failed(err: float, tol: float = TOLERANCE) -> str:
    """The status of a row whose check gave ``err``, or "" where it passed."""
    return "" if err < tol else f"FAILED check (rel err {err:.2e} vs reference); speed not reported"


def measure(fn, q, k, v, causal, dout=None):
    """Median ms of forward, backward, forward + backward of fn(q, k, v, causal) and its peak
    extra MiB (do_bench, 50 warm-up and 200 timed ms)."""
    import triton

    dout = torch.randn_like(q) if dout is None else dout
    c = causal
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
    q.grad = k.grad = v.grad = None
    return dict(fwd_ms=fwd, bwd_ms=bwd, fwdbwd_ms=both, peak_extra_MiB=peak)


def cold_ms(fn, reps=100):
    """Median GPU ms of fn, each call after runtime.flush_l2 (an L2 left clean: do_bench's
    flush leaves it dirty, and the write-back falls on the timed call), the host's time kept
    out (runtime.gpu_time_ms: the GPU sleeps while the host queues the calls). Memory-bound
    rows (decode, copy) are timed this way; per_call_us times the host."""
    from flashtriton import runtime
    return runtime.gpu_time_ms(fn, (0.5,), reps)[0]


def per_call_us(fn, calls=50, warmup=0, repeats=1):
    """Wall time per call of back-to-back calls (no cache flush between them), the best of
    ``repeats`` loops: the larger of a call's host time and its GPU time (an eager step whose
    loop_us passes its GPU time is host-bound)."""
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


def cuda_graph(fn):
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


def git_commit():
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"],
                                       cwd=os.path.dirname(__file__), text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def meta(commit=None):
    """The GPU, versions, commit and date recorded in every row."""
    import triton
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "commit": commit or git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


_KERNELS = {"_attn_fwd_kernel": "fwd", "_attn_bwd_dkdv_kernel": "dkdv",
            "_attn_bwd_dq_kernel": "dq", "_attn_decode_kernel": "decode"}


def tiles_mark() -> int:
    """How many tiles the autotuner has chosen so far (tiles_since's argument)."""
    from flashtriton import runtime
    return len(runtime.tuned_tiles())


def tiles_since(mark: int) -> dict:
    """The tiles the autotuner chose for flashtriton's kernels after ``mark`` (tiles_mark's),
    as {"fwd": "128x64/8w/3s", ...}: which tile won a shape (the last, where one kernel was
    tuned twice)."""
    from flashtriton import runtime
    out = {}
    for name, _key, (bm, bn, w, st) in runtime.tuned_tiles()[mark:]:
        if name in _KERNELS:
            out[_KERNELS[name]] = f"{bm}x{bn}/{w}w/{st}s"
    return out


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The command line of ``python -m module``: that usage line, and ``doc`` (the module's
    docstring) as its description."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_out(p: argparse.ArgumentParser, what: str) -> None:
    """--out DIR, the folder ``what`` is written to (made only once the run can start)."""
    p.add_argument("--out", default="bench_out", metavar="DIR",
                   help=f"folder for {what} (default: bench_out)")


def add_commit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--commit", default=None,
                   help="commit to record in every row (default: git rev-parse HEAD)")


def need_gpus(prog: str, count: int = 1) -> None:
    """Exits with one line on stderr where this machine has fewer than ``count`` CUDA GPUs
    (before anything is written); ``prog`` names the command."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < count:
        want = "a CUDA GPU" if count == 1 else f"{count} or more CUDA GPUs"
        sys.exit(f"{prog} needs {want}; this machine has {have} "
                 f"(python -m flashtriton.bench.demo runs on the CPU)")


def script_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """A one-GPU bench script's arguments, its --out folder made once a GPU was found."""
    args = p.parse_args(argv)
    need_gpus(p.prog)
    os.makedirs(args.out, exist_ok=True)
    return args


def alternated(time, sides, rounds=3) -> dict:
    """{side: medians} of time(side) -> a tuple of ms for each of ``sides``, the sides taken in
    turn over ``rounds`` rounds (in order in even rounds, reversed in odd ones)."""
    runs = {side: [] for side in sides}
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            runs[side].append(time(side))
    return {side: [statistics.median(t[i] for t in got) for i in range(len(got[0]))]
            for side, got in runs.items()}


def rotated(providers: list, r: int) -> list:
    """Round r's order: the providers rotated by r, so that over len(providers) rounds each
    runs in every place once (a provider measured just after FlexAttention runs slower than in
    the next place: the order is part of the measurement)."""
    r %= len(providers)
    return providers[r:] + providers[:r]


def median_run(runs: list) -> dict:
    """Each of common.measure's figures: its median over the rounds, and every round's ms."""
    out = {}
    for key in runs[0]:
        out[key] = statistics.median(r[key] for r in runs)
        if key.endswith("_ms"):
            out[key + "_rounds"] = [r[key] for r in runs]
    return out
