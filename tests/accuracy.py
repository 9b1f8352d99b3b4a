"""flash-attention's accuracy rule, shared by every test module.

Our error against the float64 reference must be within `factor` times the
error of PyTorch computing the same thing in the input dtype, plus a floor:
twice the dtype's rounding error at the outputs' magnitude (flash-attn's
atol), plus an eighth of the dtype's epsilon.

Two cases where torch's own error is ~0 and says nothing about the kernel:
- a reference that is exactly 0 everywhere (dq when seqlen_k == 1: the softmax
  of one key is constant): the kernels compute dp - delta in float32, and the
  cancellation leaves float32 rounding, so the floor is 64 float32 epsilon;
- float32 inputs: the GPU's exp2 is approximate to ~2 ulp, so the floor is
  32 float32 epsilon times max(|ref|, 1) -- 30x under what tf32 would give.
"""

import torch

from flashtriton.reference import attention_reference


def floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    r = ref.detach().to(dtype)
    r = torch.where(torch.isfinite(r), r, 0.0)  # -inf LSE of rows with no key
    eps = torch.finfo(dtype).eps
    eps32 = torch.finfo(torch.float32).eps
    if r.numel() == 0 or not r.any():
        return 64 * eps32
    rounding = 2 * float((r + 0.3 - 0.3 - r).abs().max()) + eps / 8
    if dtype == torch.float32:
        rounding += 32 * eps32 * max(float(r.abs().max()), 1.0)
    return rounding


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    if x.numel() == 0:
        return 0.0
    both_inf = torch.isinf(x) & torch.isinf(ref) & (torch.sign(x) == torch.sign(ref))
    diff = torch.where(both_inf, 0.0, (x - ref).abs())
    return float(diff.max())


def assert_rule(name, ours, ref64, torch_lowp, factor, dtype):
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(ours).any(), f"{name}: NaN in result"
    e_ours, e_pt = max_err(ours, ref64), max_err(torch_lowp, ref64)
    bound = factor * e_pt + floor(ref64, dtype)
    assert e_ours <= bound, (f"{name}: max error {e_ours:.3e} > {factor} x torch's {e_pt:.3e} "
                             f"+ floor = {bound:.3e}")


def make_qkv(B, SQ, SK, H, HKV, D, dtype, device, requires_grad=True):
    q = torch.randn(B, SQ, H, D, dtype=dtype, device=device)
    k = torch.randn(B, SK, HKV, D, dtype=dtype, device=device)
    v = torch.randn(B, SK, HKV, D, dtype=dtype, device=device)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def check_against_reference(fn, q, k, v, causal, softmax_scale=None, check_lse=True,
                            check_grads=True, **options):
    """Run fn(q, k, v) -> (out, lse or None) and check out, lse and all grads.

    ``options`` (window_size, softcap, alibi_slopes) go to the reference."""
    dtype = q.dtype
    out, lse = fn(q, k, v)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*leaves, causal=causal, softmax_scale=softmax_scale, **options)
    lowp = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    pt = attention_reference(*lowp, causal=causal, softmax_scale=softmax_scale, dtype=dtype,
                             **options)
    assert out.dtype == dtype
    assert_rule("out", out, ref.out, pt.out, 2, dtype)
    if check_lse and lse is not None:
        assert lse.dtype == torch.float32
        assert_rule("lse", lse, ref.lse, pt.lse, 2, dtype)
    if not check_grads:
        return
    dout = torch.randn_like(out)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), dout)
    rq, rk, rv = torch.autograd.grad(ref.out, leaves, dout.double())
    pq, pk, pv = torch.autograd.grad(pt.out, lowp, dout)
    for name, g, r, p in (("dq", gq, rq, pq), ("dk", gk, rk, pk), ("dv", gv, rv, pv)):
        assert torch.isfinite(g).all(), f"{name}: non-finite gradient"
        assert_rule(name, g, r, p, 3, dtype)
