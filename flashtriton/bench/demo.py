"""The demo: check flashtriton against float64, then (where it matched) its memory and speed
against naive attention.

    python -m flashtriton.bench.demo

On a CUDA GPU it checks bf16 output and gradients against the float64 reference, then
times flashtriton and naive attention at (batch 2, seqlen 4096, 16 heads, headdim 128,
causal) and measures their peak extra memory. Without one it re-runs itself under
Triton's interpreter (TRITON_INTERPRET=1) and checks float32 at a small size; the
interpreter runs the kernels as NumPy on the CPU, whose time says nothing of the kernels'
speed, so there it times nothing and gives the memory arithmetic of the GPU shape instead.
"""

import os
import sys

import torch

from flashtriton import flash_attention
from flashtriton.bench import common
from flashtriton.reference import attention_reference, causal_mask

GPU_SHAPE = (2, 4096, 16, 128)  # (B, N, H, D), timed on a GPU


def _reexec_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    os.execve(sys.executable, [sys.executable, "-m", "flashtriton.bench.demo", *sys.argv[1:]], env)


def _naive(q, k, v, causal):
    # (B, T, H, D) layout; materialises the (B, H, SQ, SK) scores and probabilities.
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    s = torch.matmul(qt, kt.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vt).transpose(1, 2)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _check(device, dtype, shape, causal):
    B, N, H, D = shape
    q, k, v = (torch.randn(B, N, H, D, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(B, N, H, D, device=device, dtype=dtype)
    out = flash_attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*leaves, causal=causal).out
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    errs = {"out": _rel(out, ref)}
    errs.update({n: _rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    return errs


def _run_once(fn, q, k, v, dout, causal, backward):
    out = fn(q, k, v, causal)
    if backward:
        out.backward(dout)
    return out


def _measure(fn, q, k, v, dout, causal, backward):
    """(median ms, peak extra bytes) of one call on the GPU."""
    import triton
    _run_once(fn, q, k, v, dout, causal, backward)  # warm-up: compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _run_once(fn, q, k, v, dout, causal, backward)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = triton.testing.do_bench(lambda: _run_once(fn, q, k, v, dout, causal, backward),
                                 grad_to_none=[q, k, v], return_mode="median")
    return ms, peak


def _timings(dtype, causal):
    """flashtriton's and naive attention's times and peak memory at GPU_SHAPE."""
    B, N, H, D = GPU_SHAPE
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    ours = lambda q, k, v, c: flash_attention(q, k, v, causal=c)  # noqa: E731
    print(f"\n(B, N, H, D) = {GPU_SHAPE}, {dtype}, causal={causal}")
    print(f"{'':12s} {'forward ms':>11s} {'fwd+bwd ms':>11s} {'peak extra memory':>18s}")
    for name, fn in (("flashtriton", ours), ("naive", _naive)):
        fwd_ms, _ = _measure(fn, q, k, v, dout, causal, False)
        both_ms, peak = _measure(fn, q, k, v, dout, causal, True)
        q.grad = k.grad = v.grad = None
        print(f"{name:12s} {fwd_ms:11.2f} {both_ms:11.2f} {peak / 2**20:14.1f} MiB")


def parser():
    return common.parser("flashtriton.bench.demo", __doc__)


def main(argv=None):
    parser().parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        _reexec_under_interpreter()
    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        dtype, check_shape, tol = torch.bfloat16, (1, 1000, 4, 128), 2e-2
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    else:
        dtype, check_shape, tol = torch.float32, (1, 77, 2, 64), 1e-5
        print("No CUDA GPU: the kernels run through Triton's interpreter on the CPU (for "
              "debugging and CI)")
    causal = True

    ok = True
    for c in (False, True):
        errs = _check(device, dtype, check_shape, c)
        passed = all(e < tol for e in errs.values())
        ok &= passed
        print(f"check vs float64 reference, {dtype}, (B, N, H, D) = {check_shape}, causal={c}: "
              + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
              + f"  -> {'PASS' if passed else 'FAIL'} (relative error < {tol:g})")
    if not ok:  # no speed for a result that does not match the reference
        sys.exit("flashtriton does not match the float64 reference: no timings")
    if on_gpu:
        _timings(dtype, causal)
    else:
        print("\nNo timings: through the interpreter the kernels run as NumPy on the CPU, "
              "and that time is not the kernels' speed (run the demo on a GPU).")
    B, N, H, D = GPU_SHAPE
    print(f"\nAt (B, N, H, D) = {GPU_SHAPE} in bf16, naive attention materialises S and P: "
          f"2 x {B * H * N * N * 2 / 2**20:.1f} MiB; flashtriton keeps per row only LSE and "
          f"delta (float32): {B * H * N * 8 / 2**20:.2f} MiB.")


if __name__ == "__main__":
    main()
