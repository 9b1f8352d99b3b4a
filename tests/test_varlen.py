"""Packed variable-length sequences against a loop over sequences (float64 reference)."""

import pytest
import torch

from accuracy import assert_rule
from conftest import DEVICE, ON_GPU
from flashtriton import flash_attention, flash_attention_varlen, flash_attention_varlen_with_lse
from flashtriton.compat import bert_padding
from flashtriton.compat import flash_attn as fa
from flashtriton.reference import attention_reference

if ON_GPU:
    LENS = [pytest.param(([300, 0, 1, 1024, 77], [500, 13, 0, 1024, 200]), id="ragged")]
else:
    LENS = [pytest.param(([19, 0, 1, 33], [25, 7, 0, 16]), id="ragged"),
            pytest.param(([16, 16], [16, 16]), id="aligned")]


def _cu(lens):
    return torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)


def _check_varlen(lens_q, lens_k, H, HKV, D, dtype, causal, max_as=int, **options):
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, H, D, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(tk, HKV, D, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(tk, HKV, D, device=DEVICE, dtype=dtype, requires_grad=True)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse = flash_attention_varlen_with_lse(q, k, v, cu_q, cu_k, max_as(max(lens_q)),
                                               max_as(max(lens_k)), causal=causal, **options)
    assert out.shape == q.shape and lse.shape == (H, tq)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    slopes = options.pop("alibi_slopes", None)
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            continue
        sl = None if slopes is None else (slopes[b] if slopes.dim() == 2 else slopes)
        leaves = [x.detach()[s].unsqueeze(0) for x, s in ((q, qs), (k, ks), (v, ks))]
        ref_in = [x.double().requires_grad_() for x in leaves]
        pt_in = [x.clone().requires_grad_() for x in leaves]
        ref = attention_reference(*ref_in, causal=causal, alibi_slopes=sl, **options)
        pt = attention_reference(*pt_in, causal=causal, alibi_slopes=sl, dtype=dtype, **options)
        assert_rule(f"out[{b}]", out[qs].unsqueeze(0), ref.out, pt.out, 2, dtype)
        assert_rule(f"lse[{b}]", lse[:, qs].unsqueeze(0), ref.lse, pt.lse, 2, dtype)
        if lens_k[b] == 0:
            continue
        d = dout[qs].unsqueeze(0)
        r = torch.autograd.grad(ref.out, ref_in, d.double())
        p = torch.autograd.grad(pt.out, pt_in, d)
        for name, g, s, rg, pg in zip("qkv", grads, (qs, ks, ks), r, p):
            assert_rule(f"d{name}[{b}]", g[s].unsqueeze(0), rg, pg, 3, dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens", LENS)
def test_varlen_matches_per_sequence_reference(lens, causal, dtype):
    _check_varlen(*lens, 4, 2, 40, dtype, causal)


@pytest.mark.parametrize("lens", LENS)
def test_varlen_variants(lens):
    B = len(lens[0])
    slopes = torch.rand(B, 2, device=DEVICE) * 0.3
    _check_varlen(*lens, 2, 1, 32, torch.bfloat16, True, window_size=(5, 0), softcap=10.0,
                  alibi_slopes=slopes)


def test_varlen_max_seqlen_as_tensor():
    lens_q, lens_k = [9, 21], [9, 21]
    _check_varlen(lens_q, lens_k, 2, 2, 16, torch.float32, True, max_as=torch.tensor)


def test_varlen_equals_dense_on_equal_lengths():
    B, S, H, D = 3, 24, 2, 32
    q, k, v = (torch.randn(B, S, H, D, device=DEVICE, dtype=torch.float16) for _ in range(3))
    cu = _cu([S] * B)
    packed = flash_attention_varlen(q.reshape(B * S, H, D), k.reshape(B * S, H, D),
                                    v.reshape(B * S, H, D), cu, cu, S, S, causal=True)
    dense = flash_attention(q, k, v, causal=True)
    assert torch.equal(packed.reshape(B, S, H, D), dense)


def test_flash_attn_varlen_forms():
    lens = [7, 0, 18]
    cu = _cu(lens)
    qkv = torch.randn(sum(lens), 3, 2, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    out, lse, none = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True,
                                                         return_attn_probs=True)
    ref = flash_attention_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 18, 18, causal=True)
    assert none is None and lse.shape == (2, sum(lens)) and torch.equal(out, ref)
    out.float().sum().backward()
    assert torch.isfinite(qkv.grad).all()
    q, kv = qkv[:, 0].detach(), qkv[:, 1:].detach()
    assert torch.equal(fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 18, 18, causal=True), ref)
    assert torch.equal(fa.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu, 18, 18,
                                                 causal=True), ref)
    with pytest.raises(ValueError, match="pages with block_table"):  # k must be pages
        fa.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu, 18, 18, block_table=cu)


@pytest.mark.parametrize("make,exc,msg", [
    pytest.param(lambda q, cu: (q.unsqueeze(0), cu, cu), ValueError, "3-D", id="4d"),
    pytest.param(lambda q, cu: (q, cu.long(), cu), ValueError, "int32", id="cu-int64"),
    pytest.param(lambda q, cu: (q, cu, cu[:-1]), ValueError, "same length", id="cu-len"),
])
def test_varlen_bad_input(make, exc, msg):
    q = torch.randn(10, 2, 16, device=DEVICE, dtype=torch.float16)
    qq, cu_q, cu_k = make(q, _cu([4, 6]))
    with pytest.raises(exc, match=msg):
        flash_attention_varlen(qq, q, q, cu_q, cu_k, 6, 6)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        flash_attention_varlen(q, q, q, _cu([4, 6]), _cu([4, 6]), 6.0, 6)


def test_unpad_pad_roundtrip_and_attention():
    B, S, H, D = 3, 20, 2, 16
    mask = torch.zeros(B, S, dtype=torch.bool, device=DEVICE)
    for b, n in enumerate([20, 5, 0]):
        mask[b, :n] = True
    x = torch.randn(B, S, H, D, device=DEVICE, dtype=torch.float32, requires_grad=True)
    packed, idx, cu, max_len, used = bert_padding.unpad_input(x, mask)
    assert packed.shape == (25, H, D) and cu.tolist() == [0, 20, 25, 25] and max_len == 20
    assert used.tolist() == [20, 5, 0] and used.dtype == torch.int32
    back = bert_padding.pad_input(packed, idx, B, S)
    assert torch.equal(back[mask], x[mask]) and torch.equal(back[~mask], torch.zeros_like(x[~mask]))
    out = bert_padding.pad_input(flash_attention_varlen(packed, packed, packed, cu, cu, max_len,
                                                        max_len, causal=True), idx, B, S)
    out.sum().backward()
    assert torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask]))
    dense = flash_attention(x[:1].detach(), x[:1].detach(), x[:1].detach(), causal=True)
    torch.testing.assert_close(out[:1], dense, atol=1e-6, rtol=1e-6)
