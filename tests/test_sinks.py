"""Attention sinks (gpt-oss): one logit a query head in every row's softmax denominator,
forward and backward (the sinks' gradient too), against the float64 reference."""

import pytest
import torch

from accuracy import assert_rule, make_qkv
from conftest import DEVICE, ON_GPU
from flashtriton import flash_attention, flash_attention_varlen_with_lse, flash_attention_with_lse
from flashtriton.reference import attention_reference


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())

if ON_GPU:
    # (B, SQ, SK, H, HKV, D)
    SHAPES = [pytest.param((2, 1024, 1024, 8, 2, 64), id="gqa-d64"),
              pytest.param((1, 777, 1500, 4, 4, 128), id="sq<sk-d128"),
              pytest.param((2, 2048, 2048, 8, 1, 128), id="mqa-d128-2k"),
              pytest.param((1, 600, 300, 4, 2, 256), id="sq>sk-d256"),
              pytest.param((1, 1024, 1024, 4, 2, 256), id="gqa-d256")]  # Gluon forward
    WINDOW = (128, 0)
else:
    SHAPES = [pytest.param((1, 40, 40, 4, 2, 32), id="gqa"),
              pytest.param((1, 23, 57, 2, 2, 24), id="sq<sk"),
              pytest.param((2, 57, 23, 2, 1, 40), id="sq>sk")]
    WINDOW = (8, 0)


def _sinks(H, dtype=torch.float32, scale=1.0):
    return (torch.randn(H, device=DEVICE) * scale).to(dtype).requires_grad_()


def check_sinks(fn, q, k, v, sinks, **options):
    """fn(q, k, v, sinks) -> (out, lse) against the reference: out, lse, dq, dk, dv, dsinks."""
    dtype = q.dtype
    out, lse = fn(q, k, v, sinks)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    lowp = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    ref = attention_reference(*leaves[:3], sinks=leaves[3], **options)
    pt = attention_reference(*lowp[:3], sinks=lowp[3], dtype=dtype, **options)
    assert_rule("out", out, ref.out, pt.out, 2, dtype)
    assert_rule("lse", lse, ref.lse, pt.lse, 2, dtype)
    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v, sinks), dout)
    refs = torch.autograd.grad(ref.out, leaves, dout.double())
    pts = torch.autograd.grad(pt.out, lowp, dout)
    coarser = max(dtype, sinks.dtype, key=lambda d: torch.finfo(d).eps)
    for name, g, r, p in zip(("dq", "dk", "dv", "dsinks"), ours, refs, pts):
        assert torch.isfinite(g).all(), f"{name}: non-finite gradient"
        assert_rule(name, g, r, p, 3, coarser if name == "dsinks" else dtype)
    assert ours[3].dtype == sinks.dtype and ours[3].shape == sinks.shape


def _dense(**options):
    return lambda q, k, v, s: tuple(flash_attention_with_lse(q, k, v, sinks=s, **options))


@pytest.mark.parametrize("window", [None, "window"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_sinks_dense(shape, causal, window):
    q, k, v = make_qkv(*shape, torch.bfloat16, DEVICE)
    sinks = _sinks(shape[3])
    options = dict(causal=causal, window_size=WINDOW if window else (-1, -1))
    check_sinks(_dense(**options), q, k, v, sinks, **options)


@pytest.mark.parametrize("scale", [0.0, 6.0], ids=["sinks-0", "sinks-large"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32],
                         ids=lambda d: str(d).split(".")[-1])
def test_sinks_dtypes_and_magnitudes(dtype, scale):
    """fp16 / fp32 inputs; sinks 0 and sinks that dominate some rows (|sink| up to ~15, scores
    ~1): the sink's exp must not overflow the row state."""
    shape = SHAPES[0].values[0]
    q, k, v = make_qkv(*shape, dtype, DEVICE)
    sinks = _sinks(shape[3], torch.bfloat16, scale)
    check_sinks(_dense(causal=True), q, k, v, sinks, causal=True)


def test_rows_without_keys_see_only_the_sink():
    """seqlen_q > seqlen_k under causal: the first rows see no key, so their softmax is the
    sink's alone: out 0, lse = the sink, finite gradients (none into the sink)."""
    B, SQ, SK, H = 1, 30, 10, 2
    q, k, v = make_qkv(B, SQ, SK, H, H, 16, torch.bfloat16, DEVICE)
    sinks = torch.tensor([0.5, -1.25], device=DEVICE, requires_grad=True)
    out, lse = flash_attention_with_lse(q, k, v, causal=True, sinks=sinks)
    empty = SQ - SK
    assert (out[:, :empty] == 0).all()
    torch.testing.assert_close(lse[0, :, :empty], sinks.detach()[:, None].expand(H, empty))
    check_sinks(_dense(causal=True), q, k, v, sinks, causal=True)


def test_sinks_change_the_result_and_no_grad_path():
    """A sink changes out (the test could fail); under no_grad the forward alone runs and
    matches the differentiable call."""
    q, k, v = make_qkv(1, 32, 32, 2, 2, 16, torch.float32, DEVICE, requires_grad=False)
    sinks = torch.full((2,), 1.0, device=DEVICE)
    plain = flash_attention(q, k, v)
    with torch.no_grad():
        sunk = flash_attention(q, k, v, sinks=sinks)
    assert (plain - sunk).abs().max() > 1e-3
    ref = attention_reference(q, k, v, sinks=sinks)
    torch.testing.assert_close(sunk.double(), ref.out, atol=1e-5, rtol=0)
    assert torch.equal(sunk, flash_attention(q, k, v, sinks=sinks.clone().requires_grad_()))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks_varlen(causal):
    """Packed sequences of different lengths (one empty): each against the reference over its
    own keys, out, lse and every gradient."""
    lens_q, lens_k = [9, 0, 17, 5], [12, 3, 17, 2]
    H, HKV, D = 4, 2, 32
    cu_q = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), H, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), HKV, D, device=DEVICE, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    sinks = _sinks(H)
    out, lse = flash_attention_varlen_with_lse(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                               causal=causal, sinks=sinks)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    ref_ds = torch.zeros(H, dtype=torch.float64, device=DEVICE)
    for b in range(len(lens_q)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        leaves = [x.detach()[None, s].double().requires_grad_() for x, s in
                  ((q, qs), (k, ks), (v, ks))] + [sinks.detach().double().requires_grad_()]
        ref = attention_reference(*leaves[:3], causal=causal, sinks=leaves[3])
        torch.testing.assert_close(out[qs].double(), ref.out[0], atol=2e-2, rtol=0)
        torch.testing.assert_close(lse[:, qs].double(), ref.lse[0], atol=1e-2, rtol=0)
        if lens_q[b]:
            g = torch.autograd.grad(ref.out, leaves, dout[None, qs].double())
            torch.testing.assert_close(grads[0][qs].double(), g[0][0], atol=3e-2, rtol=0)
            torch.testing.assert_close(grads[1][ks].double(), g[1][0], atol=3e-2, rtol=0)
            torch.testing.assert_close(grads[2][ks].double(), g[2][0], atol=3e-2, rtol=0)
            ref_ds += g[3]
    torch.testing.assert_close(grads[3].double(), ref_ds, atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("bad, error, words", [
    (lambda H: torch.zeros(H + 1), ValueError, "shape (nheads,)"),
    (lambda H: torch.zeros(1, H), ValueError, "shape (nheads,)"),
    (lambda H: torch.zeros(H, dtype=torch.int32), TypeError, "float16, bfloat16 or float32"),
    (lambda H: torch.zeros(H, dtype=torch.float64), TypeError, "float16, bfloat16 or float32"),
    (lambda H: [0.0] * H, TypeError, "torch.Tensor"),
])
def test_bad_sinks_are_named(bad, error, words):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float16, DEVICE)
    sinks = bad(2)
    if isinstance(sinks, torch.Tensor):
        sinks = sinks.to(DEVICE)
    with pytest.raises(error, match="sinks") as info:
        flash_attention(q, k, v, sinks=sinks)
    assert words in str(info.value)


def test_sinks_on_another_device():
    if not ON_GPU:
        pytest.skip("needs a GPU (sinks on the CPU beside q on the GPU)")
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float16, DEVICE)
    with pytest.raises(ValueError, match="sinks must be on q's device"):
        flash_attention(q, k, v, sinks=torch.zeros(2))


def test_flash_attn_learnable_sink():
    """The flash-attn drop-in's learnable_sink (FlashAttention-4's name): the native result,
    its gradient, and errors under its own name."""
    from flashtriton.compat import flash_attn as fa
    q, k, v = make_qkv(2, 24, 24, 4, 2, 16, torch.bfloat16, DEVICE)
    sinks = _sinks(4)
    out = fa.flash_attn_func(q, k, v, causal=True, learnable_sink=sinks)
    assert torch.equal(out, flash_attention(q, k, v, causal=True, sinks=sinks))
    (g,) = torch.autograd.grad(out.float().sum(), (sinks,))
    assert g.abs().max() > 0
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=DEVICE)
    packed = fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 14, 14, causal=True,
                                       learnable_sink=sinks)
    ref = torch.cat([flash_attention(q[:1, a:b], k[:1, a:b], v[:1, a:b], causal=True,
                                     sinks=sinks)[0] for a, b in ((0, 10), (10, 24))])
    torch.testing.assert_close(packed, ref, atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="learnable_sink must have shape"):
        fa.flash_attn_func(q, k, v, learnable_sink=torch.zeros(3, device=DEVICE))
    # flash_attn_with_kvcache: the last query over the whole cache is the last row of the
    # causal attention above
    with torch.no_grad():
        step = fa.flash_attn_with_kvcache(q[:, -1:].detach(), k.detach(), v.detach(),
                                          causal=True, learnable_sink=sinks.detach())
    torch.testing.assert_close(step, out[:, -1:].detach(), atol=1e-2, rtol=0)


def test_sinks_take_the_gluon_forward():
    """On Hopper, D=128 causal attention with sinks runs the Gluon forward (its epilogue adds
    the sink), and meets the rule there."""
    if not ON_GPU or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward runs on Hopper")
    from flashtriton import launch
    q, k, v = make_qkv(2, 2048, 2048, 8, 2, 128, torch.bfloat16, DEVICE)
    sinks = _sinks(8, torch.bfloat16, 2.0)
    variant = launch.Variant(128 ** -0.5, causal=True, sinks=sinks)
    assert launch.forward_route(q, k, v, variant)[0] == "gluon"
    check_sinks(_dense(causal=True), q, k, v, sinks, causal=True)
    with torch.no_grad():  # a remembered call replays on the new sinks' pointer
        for _ in range(2):
            other = torch.randn(8, device=DEVICE) * 3
            out = flash_attention(q, k, v, causal=True, sinks=other)
            ref = attention_reference(q, k, v, causal=True, sinks=other, dtype=torch.float32)
            assert rel_err(out, ref.out) < 1e-2


def test_strided_sinks():
    """Sinks as a strided view (every other logit of a parameter): the kernels read a unit
    stride copy, and the gradient reaches the parameter's elements of the view."""
    q, k, v = make_qkv(1, 16, 16, 2, 2, 16, torch.float32, DEVICE)
    param = torch.randn(4, device=DEVICE, requires_grad=True)
    view = param[::2]
    out = flash_attention(q, k, v, causal=True, sinks=view)
    ref = attention_reference(q, k, v, causal=True, sinks=view)
    torch.testing.assert_close(out.double(), ref.out, atol=1e-5, rtol=0)
    (g,) = torch.autograd.grad(out.sum(), (param,))
    (r,) = torch.autograd.grad(ref.out.sum(), (param,))
    torch.testing.assert_close(g.double(), r.double(), atol=1e-4, rtol=1e-4)
    assert (g[1::2] == 0).all() and (g[::2] != 0).all()


def test_no_keys_at_all():
    """seqlen_k = 0 (no launch): out 0, lse = the sink (dense and packed), zero gradients."""
    q = torch.randn(1, 5, 2, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 0, 2, 16, device=DEVICE, requires_grad=True)
    sinks = torch.tensor([0.5, -2.0], device=DEVICE, requires_grad=True)
    out, lse = flash_attention_with_lse(q, k, k, sinks=sinks)
    assert (out == 0).all()
    torch.testing.assert_close(lse[0], sinks.detach()[:, None].expand(2, 5))
    ds = torch.autograd.grad(out.sum(), (sinks,))[0]
    assert (ds == 0).all()
    cu_q = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    out, lse = flash_attention_varlen_with_lse(q[0].detach(), k[0].detach(), k[0].detach(),
                                               cu_q, cu_k, 5, 0, sinks=sinks.detach())
    assert (out == 0).all()
    torch.testing.assert_close(lse, sinks.detach()[:, None].expand(2, 5))


def test_learnable_sink_after_the_rank_of_q():
    """A q of the wrong rank beside learnable_sink is named (q), not the sink checked against
    the wrong axis."""
    from flashtriton.compat import flash_attn as fa
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float16, DEVICE, requires_grad=False)
    sink = torch.zeros(2, device=DEVICE)
    for bad in (q[0], q[:, None]):  # 3-D; 5-D with 8 on the heads axis
        with pytest.raises(ValueError, match="^q must be 4-D"):
            fa.flash_attn_func(bad, k, v, learnable_sink=sink)
        with pytest.raises(ValueError, match="^q must be a 4-D"):
            fa.flash_attn_with_kvcache(bad, k, v, cache_seqlens=8, learnable_sink=sink)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="^q must be 3-D"):
        fa.flash_attn_varlen_func(q, k[0], v[0], cu, cu, 8, 8, learnable_sink=sink)


def test_rows_without_keys_get_the_sinks_logit_in_every_api():
    """A row that sees no key: output 0 and LSE the sink's logit (log(exp(sink))) in each API
    with sinks; without sinks -inf natively and from flash_attn_with_kvcache, +inf from
    flash_attn_func / flash_attn_varlen_func (flash-attn's), as their docstrings say."""
    from flashtriton.compat import flash_attn as fa
    from flashtriton.decode import attention_with_kvcache
    q, k, v = make_qkv(1, 4, 2, 2, 2, 16, torch.float32, DEVICE, requires_grad=False)
    sinks = torch.tensor([0.5, -1.25], device=DEVICE)
    empty = sinks.view(2, 1).expand(2, 2)  # the first two (causal) rows of each head
    inf = torch.full((2, 2), float("inf"), device=DEVICE)
    for with_lse, no_sink in ((lambda **o: flash_attention_with_lse(q, k, v, causal=True, **o),
                               -inf),
                              (lambda **o: fa.flash_attn_func(
                                  q, k, v, causal=True, return_attn_probs=True,
                                  **({"learnable_sink": o["sinks"]} if o else {}))[:2], inf)):
        out, lse = with_lse(sinks=sinks)
        assert torch.equal(lse[0, :, :2], empty) and not out[0, :2].any()
        assert torch.equal(with_lse()[1][0, :, :2], no_sink)
    cu_q = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 0, 2], dtype=torch.int32, device=DEVICE)  # sequence 0: no key
    out, lse = flash_attention_varlen_with_lse(q[0, :3], k[0], v[0], cu_q, cu_k, 2, 2,
                                               sinks=sinks)
    assert torch.equal(lse[:, 0], sinks) and not out[0].any()
    lse = fa.flash_attn_varlen_func(q[0, :3], k[0], v[0], cu_q, cu_k, 2, 2,
                                    learnable_sink=sinks, return_attn_probs=True)[1]
    assert torch.equal(lse[:, 0], sinks)
    lse = fa.flash_attn_varlen_func(q[0, :3], k[0], v[0], cu_q, cu_k, 2, 2,
                                    return_attn_probs=True)[1]
    assert torch.equal(lse[:, 0], inf[:, 0])
    cache = torch.randn(1, 8, 2, 16, device=DEVICE)
    for opts, want in ((dict(sinks=sinks), sinks), ({}, -inf[:, 0])):
        out, lse = attention_with_kvcache(q[:, :1], cache, cache, cache_seqlens=0, **opts)
        assert torch.equal(lse[0, :, 0], want) and not out.any()
        fa_opts = {"learnable_sink": opts["sinks"]} if opts else {}
        lse = fa.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=0,
                                         return_softmax_lse=True, **fa_opts)[1]
        assert torch.equal(lse[0, :, 0], want)
    for fn in (flash_attention_with_lse, flash_attention_varlen_with_lse, attention_with_kvcache,
               fa.flash_attn_func, fa.flash_attn_varlen_func, fa.flash_attn_with_kvcache):
        assert "the sink's logit" in " ".join(fn.__doc__.split()), fn.__name__
