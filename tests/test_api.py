"""Input validation, the flash-attn and SDPA drop-ins, custom ops and torch.compile."""

import re

import pytest
import torch
import torch.nn.functional as F

from accuracy import check_against_reference, make_qkv
from conftest import DEVICE
from flashtriton import (AttentionOutput, flash_attention, flash_attention_with_lse,
                         scaled_dot_product_attention)
from flashtriton.compat import flash_attn as fa


def _t(*shape, dtype=torch.float16, device=DEVICE):
    return torch.randn(*shape, dtype=dtype, device=device)


BAD = [
    pytest.param(lambda: (_t(2, 8, 2, 16)[0], _t(2, 8, 2, 16), _t(2, 8, 2, 16)), ValueError, "q must be 4-D", id="q-3d"),
    pytest.param(lambda: (_t(2, 8, 2, 16), _t(2, 8, 2, 16), _t(2, 9, 2, 16)), ValueError, "same shape", id="kv-shape"),
    pytest.param(lambda: (_t(2, 8, 2, 16), _t(3, 8, 2, 16), _t(3, 8, 2, 16)), ValueError, "batch mismatch", id="batch"),
    pytest.param(lambda: (_t(2, 8, 2, 16), _t(2, 8, 2, 32), _t(2, 8, 2, 32)), ValueError, "headdim mismatch", id="headdim"),
    pytest.param(lambda: (_t(2, 8, 3, 16), _t(2, 8, 2, 16), _t(2, 8, 2, 16)), ValueError, "multiple of nheads", id="heads"),
    pytest.param(lambda: (_t(1, 8, 1, 272), _t(1, 8, 1, 272), _t(1, 8, 1, 272)), ValueError, "1..256", id="d272"),
    pytest.param(lambda: (_t(1, 8, 1, 16), _t(1, 8, 1, 16, dtype=torch.bfloat16), _t(1, 8, 1, 16)), TypeError, "share one dtype", id="mixed-dtype"),
    pytest.param(lambda: tuple(_t(1, 8, 1, 16, dtype=torch.float64) for _ in range(3)), TypeError, "unsupported dtype", id="fp64"),
    pytest.param(lambda: tuple(torch.ones(1, 8, 1, 16, dtype=torch.int32, device=DEVICE) for _ in range(3)), TypeError, "unsupported dtype", id="int"),
    pytest.param(lambda: (_t(1, 8, 1, 16).tolist(), _t(1, 8, 1, 16), _t(1, 8, 1, 16)), TypeError, "must be a torch.Tensor", id="not-tensor"),
    pytest.param(lambda: (_t(1, 8, 1, 16), _t(1, 8, 1, 16, device="meta"), _t(1, 8, 1, 16)), ValueError, "one device", id="devices"),
]


@pytest.mark.parametrize("make,exc,msg", BAD)
def test_bad_input_raises_before_launch(make, exc, msg):
    q, k, v = make()
    with pytest.raises(exc, match=msg) as info:
        flash_attention(q, k, v)
    if isinstance(q, torch.Tensor) and msg != "one device":
        assert "shape" in str(info.value) or "dtype" in str(info.value) or "nheads" in str(info.value)


def test_bad_scale_type():
    q, k, v = make_qkv(1, 8, 8, 1, 1, 16, torch.float16, DEVICE, requires_grad=False)
    with pytest.raises(TypeError, match="softmax_scale"):
        flash_attention(q, k, v, softmax_scale="0.1")


def test_cpu_tensor_without_interpreter_names_the_fix(monkeypatch):
    from flashtriton import _env
    monkeypatch.setattr(_env, "INTERPRET", False)
    q = torch.randn(1, 8, 1, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        flash_attention(q, q, q)


def test_return_types():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float16, DEVICE, requires_grad=False)
    r = flash_attention_with_lse(q, k, v)
    assert isinstance(r, AttentionOutput) and r.out.shape == q.shape and r.lse.shape == (1, 2, 8)
    assert isinstance(flash_attention(q, k, v), torch.Tensor)


# flash-attn drop-in -------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func_matches_reference(causal):
    q, k, v = make_qkv(2, 19, 30, 4, 2, 32, torch.bfloat16, DEVICE)
    check_against_reference(
        lambda q, k, v: fa.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[:2],
        q, k, v, causal)


def test_flash_attn_packed_forms():
    qkv = _t(2, 21, 3, 2, 32).requires_grad_()
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    ref = flash_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert torch.equal(out, ref)
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()
    q, kv = _t(2, 9, 4, 32), _t(2, 21, 2, 2, 32)
    out = fa.flash_attn_kvpacked_func(q, kv, softmax_scale=0.3)
    assert torch.equal(out, flash_attention(q, kv[:, :, 0], kv[:, :, 1], softmax_scale=0.3))


def test_flash_attn_return_attn_probs():
    q, k, v = _t(1, 20, 2, 16), _t(1, 6, 2, 16), _t(1, 6, 2, 16)
    res = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3 and res[2] is None
    out, lse, _ = res
    assert lse.shape == (1, 2, 20) and lse.dtype == torch.float32
    # flash-attn's convention: +inf for rows that see no key (here the first 14).
    assert torch.isposinf(lse[:, :, :14]).all() and torch.isfinite(lse[:, :, 14:]).all()
    assert isinstance(fa.flash_attn_func(q, k, v), torch.Tensor)


BAD_OPTIONS = [
    pytest.param(dict(window_size=(4,)), TypeError, "window_size", id="window-len"),
    pytest.param(dict(window_size=(2.0, 1)), TypeError, "window_size", id="window-float"),
    pytest.param(dict(window_size=(-2, 1)), ValueError, "window_size", id="window-neg"),
    pytest.param(dict(softcap=-1.0), ValueError, "softcap", id="softcap-neg"),
    pytest.param(dict(softcap="30"), TypeError, "softcap", id="softcap-str"),
    pytest.param(dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes", id="alibi-shape"),
    pytest.param(dict(alibi_slopes=torch.ones(2, dtype=torch.float16)), TypeError, "float32",
                 id="alibi-dtype"),
]


@pytest.mark.parametrize("kwargs,exc,msg", BAD_OPTIONS)
def test_bad_options_raise(kwargs, exc, msg):
    q = _t(1, 8, 2, 16)
    if "alibi_slopes" in kwargs:
        kwargs = dict(alibi_slopes=kwargs["alibi_slopes"].to(DEVICE))
    with pytest.raises(exc, match=msg):
        flash_attention(q, q, q, **kwargs)


def test_flash_attn_packed_bad_shapes():
    with pytest.raises(ValueError, match="qkv"):
        fa.flash_attn_qkvpacked_func(_t(1, 8, 2, 2, 16))
    with pytest.raises(ValueError, match="kv"):
        fa.flash_attn_kvpacked_func(_t(1, 8, 2, 16), _t(1, 8, 3, 2, 16))


# SDPA drop-in -------------------------------------------------------------

@pytest.mark.parametrize("causal,L,S", [(False, 23, 23), (True, 23, 23), (True, 9, 23),
                                        (True, 23, 9)],
                         ids=["full", "causal", "causal-top-left-short-q", "causal-top-left-long-q"])
def test_sdpa_routes_to_kernels(causal, L, S, monkeypatch):
    """Including non-square is_causal: torch's top-left alignment, from the kernels."""
    import flashtriton.sdpa as sdpa_mod
    calls = []
    monkeypatch.setattr(sdpa_mod, "_TORCH_SDPA", lambda *a, **k: calls.append(1))
    q = _t(2, 4, L, 32, dtype=torch.float32).requires_grad_()
    k = _t(2, 2, S, 32, dtype=torch.float32).requires_grad_()
    v = _t(2, 2, S, 32, dtype=torch.float32).requires_grad_()
    out = sdpa_mod.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.2,
                                                enable_gqa=True)
    assert not calls and out.shape == (2, 4, L, 32)
    monkeypatch.undo()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    gr = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g, gr):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["mask-with-causal", "mask-requires-grad", "gqa-without-flag"])
def test_sdpa_falls_back_to_torch(case):
    q, k, v = _t(1, 2, 5, 16, dtype=torch.float32), _t(1, 2, 7, 16, dtype=torch.float32), _t(1, 2, 7, 16, dtype=torch.float32)
    kwargs = {}
    if case == "mask-with-causal":  # whatever torch does (an error on some backends), we do
        q = _t(1, 2, 7, 16, dtype=torch.float32)
        kwargs.update(is_causal=True, attn_mask=torch.rand(7, 7, device=DEVICE) > 0.5)
    if case == "mask-requires-grad":
        kwargs["attn_mask"] = torch.randn(5, 7, device=DEVICE, requires_grad=True)
    elif case == "gqa-without-flag":
        q = _t(1, 4, 5, 16, dtype=torch.float32)
        with pytest.raises(RuntimeError):
            scaled_dot_product_attention(q, k, v)
        return
    try:
        ref = F.scaled_dot_product_attention(q, k, v, **kwargs)
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=re.escape(str(e)[:40])):
            scaled_dot_product_attention(q, k, v, **kwargs)
        return
    assert torch.equal(scaled_dot_product_attention(q, k, v, **kwargs), ref)


# torch.library / torch.compile ----------------------------------------------

def test_custom_ops_opcheck():
    q, k, v = make_qkv(1, 20, 24, 2, 1, 32, torch.float32, DEVICE, requires_grad=False)
    slopes = torch.rand(2, device=DEVICE)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 11, 24], dtype=torch.int32, device=DEVICE)
    mask = (torch.rand(20, 24, device=DEVICE) > 0.3).expand(1, 2, 20, 24)
    seed = torch.tensor(5, dtype=torch.int64)
    sinks = torch.randn(2, device=DEVICE)
    cases = [
        ((q, k, v, None, None, 0, 0, None, None), (0.2, True, -1, -1, 0.0, 0.0, None), None),
        ((q, k, v, None, None, 0, 0, slopes, None), (0.2, False, 5, 3, 10.0, 0.0, None), sinks),
        ((q, k, v, None, None, 0, 0, None, mask), (0.2, False, -1, -1, 0.0, 0.3, seed), None),
        ((q[0], k[0], v[0], cu, cu_k, 13, 13, None, None), (0.3, True, 4, -1, 0.0, 0.0, None),
         sinks),
    ]
    for (args, opts, sink), invariant in zip(cases, (False, True, False, True)):
        # no block mask, no mods, default backward, batch_invariant, the sinks
        opts = opts + (None, None, 128, 0, False, invariant, sink)
        torch.library.opcheck(torch.ops.flashtriton.attn_fwd.default, args + opts)
        out, lse = torch.ops.flashtriton.attn_fwd(*args, *opts)
        dout = torch.randn_like(out)
        torch.library.opcheck(torch.ops.flashtriton.attn_bwd.default,
                              (dout,) + args[:3] + (out, lse) + args[3:] + opts)


def test_compile_fullgraph_aot_eager():
    q, k, v = make_qkv(2, 20, 20, 2, 2, 32, torch.float32, DEVICE)

    def f(q, k, v):
        return flash_attention(q * 2, k, v, causal=True).sin()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = f(q, k, v)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)


def test_eager_shortcut_matches_the_custom_ops(monkeypatch):
    """Plain eager calls skip the torch.library dispatch; under a dispatch mode the same call
    goes through the ops. Both must give bitwise the same output and gradients, and the
    shortcut must really be taken in plain eager mode (and not under a mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import flashtriton.autograd as ag

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    calls = []
    real_fwd, real_bwd = ag._attn_fwd, ag._attn_bwd
    monkeypatch.setattr(ag, "_attn_fwd", lambda *a: calls.append("fwd") or real_fwd(*a))
    monkeypatch.setattr(ag, "_attn_bwd", lambda *a: calls.append("bwd") or real_bwd(*a))
    q, k, v = make_qkv(1, 40, 40, 2, 1, 16, torch.float32, DEVICE)
    dout = torch.randn(1, 40, 2, 16, device=DEVICE)
    results = []
    for mode in (None, PassThrough()):
        calls.clear()
        if mode is None:
            out = flash_attention(q, k, v, causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        else:
            with mode:
                out = flash_attention(q, k, v, causal=True)
                grads = torch.autograd.grad(out, (q, k, v), dout)
        results.append((out, *grads))
        assert calls == (["fwd", "bwd"] if mode is None else []), calls
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_inference_calls_skip_autograd_with_the_same_result():
    q, k, v = make_qkv(1, 20, 20, 2, 2, 32, torch.float16, DEVICE)
    with torch.no_grad():
        a = flash_attention(q, k, v, causal=True)
    assert a.grad_fn is None and not a.requires_grad
    b = flash_attention(q, k, v, causal=True)
    assert b.grad_fn is not None
    c = flash_attention(q.detach(), k.detach(), v.detach(), causal=True)
    assert c.grad_fn is None
    assert torch.equal(a, b.detach()) and torch.equal(a, c)


def test_deterministic_reaches_the_backward(monkeypatch):
    """deterministic=True (the native API, flash-attn's drop-in, the packed form) and
    torch.use_deterministic_algorithms(True) reach the backward as Variant.deterministic (where
    it keeps the repeatable Triton kernels); by default the backward is free to run the Gluon
    one."""
    from flashtriton import flash_attention_varlen, launch
    seen = []
    real = launch.attention_backward

    def spy(dout, q, k, v, out, lse, variant, varlen=None):
        seen.append(variant.deterministic)
        return real(dout, q, k, v, out, lse, variant, varlen)
    monkeypatch.setattr(launch, "attention_backward", spy)
    q, k, v = make_qkv(1, 16, 16, 2, 2, 16, torch.float32, DEVICE)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)

    def run(fn, *args, **opts):
        out = fn(*args, **opts)
        torch.autograd.grad(out, args[:3], torch.ones_like(out))
    run(flash_attention, q, k, v)
    run(flash_attention, q, k, v, deterministic=True)
    run(fa.flash_attn_func, q, k, v, deterministic=True)
    run(fa.flash_attn_func, q, k, v)
    run(flash_attention_varlen, q[0], k[0], v[0], cu, cu, 16, 16, deterministic=True)
    torch.use_deterministic_algorithms(True)
    try:
        run(flash_attention, q, k, v)
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == [False, True, True, False, True, True]
