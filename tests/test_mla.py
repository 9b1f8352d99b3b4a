"""A head dim for v of its own (DeepSeek-V3's MLA: q and k 192, v 128): forward and backward
against the float64 reference, dense, packed and paged, through the native API, the flash-attn
and SDPA drop-ins, and bad input."""

import pytest
import torch
import torch.nn.functional as F

from accuracy import assert_rule, check_against_reference
from conftest import DEVICE, ON_GPU
from flashtriton import (flash_attention, flash_attention_varlen,
                         flash_attention_varlen_with_lse, flash_attention_with_lse, launch,
                         scaled_dot_product_attention)
from flashtriton.compat import flash_attn as fa
from flashtriton.decode import attention_with_kvcache
from flashtriton.reference import attention_reference
from flashtriton.sdpa import sdpa_misfit

if ON_GPU:
    # (B, SQ, SK, H, HKV, D, DV)
    SHAPES = [pytest.param((2, 1024, 1024, 8, 8, 192, 128), id="deepseek-192-128"),
              pytest.param((1, 700, 1500, 8, 2, 96, 64), id="gqa-96-64"),
              pytest.param((1, 513, 513, 4, 4, 64, 128), id="64-128"),
              pytest.param((1, 300, 600, 4, 1, 256, 128), id="mqa-256-128")]
    SMALL = (2, 300, 300, 8, 2, 192, 128)
else:
    SHAPES = [pytest.param((1, 37, 45, 4, 2, 24, 16), id="gqa-24-16"),
              pytest.param((2, 29, 29, 2, 2, 16, 40), id="16-40"),
              pytest.param((1, 40, 23, 2, 1, 48, 32), id="sq>sk-48-32")]
    SMALL = (1, 21, 21, 4, 2, 24, 16)


def _qkv(B, SQ, SK, H, HKV, D, DV, dtype=torch.bfloat16, requires_grad=True):
    q = torch.randn(B, SQ, H, D, device=DEVICE, dtype=dtype)
    k = torch.randn(B, SK, HKV, D, device=DEVICE, dtype=dtype)
    v = torch.randn(B, SK, HKV, DV, device=DEVICE, dtype=dtype)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def _lse(**options):
    return lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, **options))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_backward(shape, causal):
    q, k, v = _qkv(*shape)
    check_against_reference(_lse(causal=causal), q, k, v, causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dtypes(dtype):
    q, k, v = _qkv(*SMALL, dtype=dtype)
    check_against_reference(_lse(causal=True), q, k, v, True)


@pytest.mark.parametrize("option", [dict(window_size=(7, 0)), dict(softcap=3.0),
                                    dict(alibi_slopes="slopes")],
                         ids=["window", "softcap", "alibi"])
def test_variants(option):
    q, k, v = _qkv(*SMALL)
    if "alibi_slopes" in option:
        option = dict(alibi_slopes=torch.rand(q.shape[2], device=DEVICE))
    check_against_reference(_lse(causal=True, **option), q, k, v, True, **option)


def test_sinks_forward_and_backward():
    q, k, v = _qkv(*SMALL)
    sinks = torch.randn(q.shape[2], device=DEVICE, requires_grad=True)
    out, lse = flash_attention_with_lse(q, k, v, causal=True, sinks=sinks)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    lowp = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    ref = attention_reference(*leaves[:3], causal=True, sinks=leaves[3])
    pt = attention_reference(*lowp[:3], causal=True, sinks=lowp[3], dtype=q.dtype)
    assert_rule("out", out, ref.out, pt.out, 2, q.dtype)
    assert_rule("lse", lse, ref.lse, pt.lse, 2, q.dtype)
    dout = torch.randn_like(out)
    for name, g, r, p in zip(("dq", "dk", "dv", "dsinks"),
                             torch.autograd.grad(out, (q, k, v, sinks), dout),
                             torch.autograd.grad(ref.out, leaves, dout.double()),
                             torch.autograd.grad(pt.out, lowp, dout)):
        assert_rule(name, g, r, p, 3, q.dtype)


def test_output_layout_follows_q():
    """out (and dq, dk, dv) keep their inputs' layouts: heads-major q gives a heads-major out
    with v's head dim."""
    B, SQ, SK, H, HKV, D, DV = SMALL
    q = torch.randn(B, H, SQ, D, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, HKV, SK, D, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, HKV, SK, DV, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    out = flash_attention(q, k, v, causal=True)
    assert out.shape == (B, SQ, H, DV) and out.transpose(1, 2).is_contiguous()
    ref = attention_reference(q, k, v, causal=True)
    lowp = attention_reference(q, k, v, causal=True, dtype=q.dtype)
    assert_rule("out", out, ref.out, lowp.out, 2, q.dtype)


def _check_rule(out, ref, low, inputs, leaves, lowp):
    """out and the gradients of ``inputs`` under the accuracy rule: ref (float64, from
    ``leaves``) and low (torch in the inputs' dtype, from ``lowp``)."""
    dtype = inputs[0].dtype
    assert_rule("out", out, ref, low, 2, dtype)
    dout = torch.randn_like(out)
    for name, g, r, p in zip(("dq", "dk", "dv"), torch.autograd.grad(out, inputs, dout),
                             torch.autograd.grad(ref, leaves, dout.double()),
                             torch.autograd.grad(low, lowp, dout)):
        assert_rule(name, g, r, p, 3, dtype)


def _packed(lens_q, lens_k, H, HKV, D, DV, dtype=torch.bfloat16):
    q = torch.randn(sum(lens_q), H, D, device=DEVICE, dtype=dtype)
    k = torch.randn(sum(lens_k), HKV, D, device=DEVICE, dtype=dtype)
    v = torch.randn(sum(lens_k), HKV, DV, device=DEVICE, dtype=dtype)
    return q, k, v


def _cu(lens):
    return torch.tensor([0] + list(lens), device=DEVICE).cumsum(0).to(torch.int32)


def _per_sequence(q, k, v, lens_q, lens_k, causal):
    """The float64 and low-precision references, sequence by sequence, concatenated."""
    refs, lows = [], []
    cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    for b in range(len(lens_q)):
        qs, ks, vs = (x[None, c[b]:c[b + 1]] for x, c in ((q, cq), (k, ck), (v, ck)))
        refs.append(attention_reference(qs, ks, vs, causal=causal).out[0])
        lows.append(attention_reference(qs, ks, vs, causal=causal, dtype=q.dtype).out[0])
    return torch.cat(refs), torch.cat(lows)


LENS = ([300, 1, 0, 1024], [900, 300, 13, 1024]) if ON_GPU else ([9, 1, 0, 17], [20, 6, 5, 17])


def test_varlen_forward_and_backward():
    lens_q, lens_k = LENS
    H, HKV, D, DV = SMALL[3:]
    q, k, v = (x.requires_grad_() for x in _packed(lens_q, lens_k, H, HKV, D, DV))
    out = flash_attention_varlen(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k),
                                 causal=True)
    assert out.shape == (sum(lens_q), H, DV)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    lowp = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref, _ = _per_sequence(*leaves, lens_q, lens_k, True)
    _, low = _per_sequence(*lowp, lens_q, lens_k, True)  # torch in q's dtype
    _check_rule(out, ref, low, (q, k, v), leaves, lowp)


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode-only"])
def test_paged_varlen(decode):
    """Pages of k (192) and v (128) rows: against the reference over each sequence's keys;
    a decode-only batch (which with equal head dims takes the KV-cache split kernel) runs the
    forward and is right too; out= is written."""
    lens_q, lens_k = ([1, 1, 1, 1], LENS[1]) if decode else LENS
    H, HKV, D, DV = SMALL[3:]
    page = 16
    q, k, v = _packed(lens_q, lens_k, H, HKV, D, DV)
    per_seq = [-(-n // page) for n in lens_k]
    order = torch.randperm(sum(per_seq) + 2)
    pool_k = torch.randn(len(order), page, HKV, D, device=DEVICE, dtype=q.dtype)
    pool_v = torch.randn(len(order), page, HKV, DV, device=DEVICE, dtype=q.dtype)
    table = torch.zeros(len(lens_k), max(per_seq), dtype=torch.int32)
    at = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = order[at:at + n].to(torch.int32)
        at += n
    table = table.to(DEVICE)
    out = torch.full((sum(lens_q), H, DV), float("nan"), device=DEVICE, dtype=q.dtype)
    res, lse = flash_attention_varlen_with_lse(
        q, pool_k, pool_v, _cu(lens_q), None, max(lens_q), max(lens_k), causal=True,
        block_table=table, seqused_k=torch.tensor(lens_k, dtype=torch.int32, device=DEVICE),
        out=out)
    assert res.data_ptr() == out.data_ptr() and lse.shape == (H, sum(lens_q))
    ks = torch.cat([pool_k[table[b, :n].long()].flatten(0, 1)[:lens_k[b]]
                    for b, n in enumerate(per_seq)])
    vs = torch.cat([pool_v[table[b, :n].long()].flatten(0, 1)[:lens_k[b]]
                    for b, n in enumerate(per_seq)])
    ref, low = _per_sequence(q, ks, vs, lens_q, lens_k, True)
    assert_rule("out", out, ref, low, 2, q.dtype)


def test_flash_attn_drop_in():
    """flash_attn_func / flash_attn_varlen_func take v's own head dim (FA3's headdim_v)."""
    q, k, v = _qkv(*SMALL)
    check_against_reference(
        lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2],
        q, k, v, True)
    lens_q, lens_k = LENS
    H, HKV, D, DV = SMALL[3:]
    q, k, v = _packed(lens_q, lens_k, H, HKV, D, DV)
    out = fa.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k),
                                    causal=True)
    ref, low = _per_sequence(q, k, v, lens_q, lens_k, True)
    assert_rule("out", out, ref, low, 2, q.dtype)


def test_sdpa_drop_in_runs_the_kernels():
    """torch's SDPA takes value's own head dim Ev; the drop-in runs it in the kernels (no
    fallback) and matches torch's result, forward and backward."""
    B, SQ, SK, H, HKV, D, DV = SMALL
    q, k, v = (x.detach().transpose(1, 2).requires_grad_() for x in _qkv(B, SQ, SK, H, H, D, DV))
    assert sdpa_misfit(q, k, v, is_causal=True) is None
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == (B, H, SQ, DV)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True)
    lowp = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    low = F.scaled_dot_product_attention(*lowp, is_causal=True)
    _check_rule(out, ref, low, (q, k, v), leaves, lowp)


def test_kernel_families():
    """The Gluon kernels take v's head dim equal to q's: MLA shapes run the Triton forward and
    backward."""
    q, k, v = _qkv(1, 4096, 4096, 2, 2, 128, 64, requires_grad=False)
    variant = launch.Variant(0.1, causal=True)
    assert launch.forward_route(q, k, v, variant)[0] == "triton"
    assert launch.backward_route(q, k, v, variant)[0] == "triton"


def _bad(q, k, v):
    return flash_attention(q, k, v)


@pytest.mark.parametrize("edit, match", [
    (lambda q, k, v: (q, k, torch.randn(*v.shape[:3], 300, device=DEVICE, dtype=v.dtype)),
     r"v's headdim must be in 1\.\.256"),
    (lambda q, k, v: (q, k, v[:, :-1]), "same shape but for the head dim"),
    (lambda q, k, v: (q, k, v[:, :, :1]), "same shape but for the head dim"),
    (lambda q, k, v: (q[..., :8], k, v), "headdim mismatch"),
])
def test_bad_input_raises_naming_it(edit, match):
    q, k, v = _qkv(*SMALL, requires_grad=False)
    with pytest.raises(ValueError, match=match):
        flash_attention(*edit(q, k, v))


def test_kv_cache_refuses_its_own_v_head_dim():
    """The KV cache keeps one head dim: a v_cache of another raises, naming it."""
    q = torch.randn(1, 1, 4, 32, device=DEVICE, dtype=torch.bfloat16)
    k_cache = torch.randn(1, 64, 2, 32, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn(1, 64, 2, 16, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="v_cache.*head dim of its own"):
        attention_with_kvcache(q, k_cache, v_cache,
                               cache_seqlens=torch.tensor([10], dtype=torch.int32, device=DEVICE))


def test_out_buffer_must_have_v_head_dim():
    lens_q, lens_k = LENS
    H, HKV, D, DV = SMALL[3:]
    q, k, v = _packed(lens_q, lens_k, H, HKV, D, DV)
    wrong = torch.empty(sum(lens_q), H, D, device=DEVICE, dtype=q.dtype)
    with pytest.raises(ValueError, match="out must have shape"):
        flash_attention_varlen(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k),
                               out=wrong)
