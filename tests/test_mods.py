"""User score_mod / mask_mod (@triton.jit) and block masks, against the float64 reference."""

import pytest
import torch
import triton
import triton.language as tl

from accuracy import assert_rule, make_qkv
from conftest import DEVICE, ON_GPU
from flashtriton import flash_attention, flash_attention_with_lse
from flashtriton.block_mask import create_block_mask
from flashtriton.reference import attention_reference


@triton.jit
def causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@triton.jit
def document_mod(b, h, q_idx, kv_idx):
    # Documents of 24 tokens (the same in every batch element and head).
    return (q_idx // 24) == (kv_idx // 24)


@triton.jit
def prefix_lm_mod(b, h, q_idx, kv_idx):
    # The first 20 tokens see each other; the rest is causal.
    return (kv_idx <= q_idx) | (kv_idx < 20)


@triton.jit
def window_mod(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= 9) & (kv_idx <= q_idx)


@triton.jit
def head_mod(b, h, q_idx, kv_idx):
    # A mask that depends on the batch element and head: a different causal shift each.
    return kv_idx <= q_idx + (b * 2 + h) * 7


@triton.jit
def tanh_cap(score, b, h, q_idx, kv_idx):
    e = tl.exp(2.0 * score / 3.0)
    return 3.0 * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def tanh_cap_grad(score, b, h, q_idx, kv_idx):
    e = tl.exp(2.0 * score / 3.0)
    t = 1.0 - 2.0 / (e + 1.0)
    return 1.0 - t * t


@triton.jit
def relpos_bias(score, b, h, q_idx, kv_idx):
    return score - 0.05 * (h + 1) * tl.abs(q_idx - kv_idx).to(tl.float32)


@triton.jit
def relpos_bias_grad(score, b, h, q_idx, kv_idx):
    return score * 0.0 + 1.0


def _torch_mask(name, B, H, SQ, SK):
    i = torch.arange(SQ, device=DEVICE)[:, None]
    j = torch.arange(SK, device=DEVICE)[None, :]
    if name == "head":
        b = torch.arange(B, device=DEVICE)[:, None, None, None]
        h = torch.arange(H, device=DEVICE)[None, :, None, None]
        return j <= i + (b * 2 + h) * 7
    return {"causal": i >= j, "document": i // 24 == j // 24,
            "prefix_lm": (j <= i) | (j < 20), "window": (i - j <= 9) & (j <= i)}[name]


MODS = {"causal": causal_mod, "document": document_mod, "prefix_lm": prefix_lm_mod,
        "window": window_mod, "head": head_mod}
SHAPE = (2, 300, 300, 4, 2, 64) if ON_GPU else (2, 70, 70, 2, 1, 32)
BLOCK = 128 if ON_GPU else 32


def _check(q, k, v, ours, ref_kwargs, score_fn=None):
    dtype = q.dtype
    out, lse = ours(q, k, v)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    lowp = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*leaves, **ref_kwargs)
    pt = attention_reference(*lowp, dtype=dtype, **ref_kwargs)
    assert_rule("out", out, ref.out, pt.out, 2, dtype)
    assert_rule("lse", lse, ref.lse, pt.lse, 2, dtype)
    dout = torch.randn_like(out)
    for name, g, r, p in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout),
                             torch.autograd.grad(ref.out, leaves, dout.double()),
                             torch.autograd.grad(pt.out, lowp, dout)):
        assert_rule(name, g, r, p, 3, dtype)


@pytest.mark.parametrize("name", list(MODS))
def test_mask_mod_with_block_mask(name):
    B, SQ, SK, H, HKV, D = SHAPE
    q, k, v = make_qkv(*SHAPE, torch.bfloat16, DEVICE)
    per_head = name == "head"
    bm = create_block_mask(MODS[name], B if per_head else None, H if per_head else None, SQ, SK,
                           DEVICE, block_size=BLOCK)
    assert 0 < bm.density() <= 1
    _check(q, k, v, lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, block_mask=bm)),
           dict(attn_mask=_torch_mask(name, B, H, SQ, SK)))


def test_block_mask_skips_tiles():
    bm = create_block_mask(document_mod, None, None, 96 * 4, 96 * 4, DEVICE, block_size=32)
    # Documents of 24 tokens in 32-token blocks: each query block touches 1-2 key blocks.
    assert bm.density() < 0.2
    full = bm.kv_blocks[0, 0, :, 1]
    assert (full == 0).all()  # a 32-block never lies inside one 24-token document
    causal = create_block_mask(causal_mod, None, None, 128, 128, DEVICE, block_size=32)
    assert causal.kv_blocks[0, 0, :, 0].tolist() == [1, 1, 1, 1]          # the diagonal
    assert causal.kv_blocks[0, 0, :, 1].tolist() == [0, 1, 2, 3]          # below it


def test_mask_mod_without_block_mask_matches():
    q, k, v = make_qkv(1, 50, 50, 2, 2, 32, torch.float16, DEVICE, requires_grad=False)
    a = flash_attention(q, k, v, mask_mod=causal_mod)
    b = flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(a, b, atol=2e-3, rtol=0)


@pytest.mark.parametrize("mod,grad,ref", [
    pytest.param(tanh_cap, tanh_cap_grad, dict(softcap=3.0), id="softcap-as-score-mod"),
    pytest.param(relpos_bias, relpos_bias_grad, None, id="relative-bias"),
])
def test_score_mod(mod, grad, ref):
    B, SQ, SK, H, HKV, D = SHAPE
    q, k, v = make_qkv(*SHAPE, torch.float16, DEVICE)
    if ref is None:
        i = torch.arange(SQ, device=DEVICE)[:, None]
        j = torch.arange(SK, device=DEVICE)[None, :]
        h = torch.arange(H, device=DEVICE)[:, None, None]
        ref = dict(attn_mask=(-0.05 * (h + 1) * (i - j).abs()).float())
    _check(q, k, v, lambda q, k, v: tuple(flash_attention_with_lse(
        q, k, v, score_mod=mod, score_mod_grad=grad)), ref)


def test_score_mod_and_block_mask_together():
    B, SQ, SK, H, HKV, D = SHAPE
    q, k, v = make_qkv(*SHAPE, torch.float16, DEVICE)
    bm = create_block_mask(window_mod, None, None, SQ, SK, DEVICE, block_size=BLOCK)
    _check(q, k, v, lambda q, k, v: tuple(flash_attention_with_lse(
        q, k, v, score_mod=tanh_cap, score_mod_grad=tanh_cap_grad, block_mask=bm)),
        dict(softcap=3.0, attn_mask=_torch_mask("window", B, H, SQ, SK)))


def test_mod_errors():
    q, k, v = make_qkv(1, 40, 40, 2, 2, 32, torch.float16, DEVICE)
    with pytest.raises(ValueError, match="score_mod_grad"):
        flash_attention(q, k, v, score_mod=tanh_cap)
    with pytest.raises(ValueError, match="causal"):
        flash_attention(q, k, v, mask_mod=causal_mod, causal=True)
    bm = create_block_mask(causal_mod, None, None, 64, 64, DEVICE, block_size=32)
    with pytest.raises(ValueError, match="block_mask was made for"):
        flash_attention(q, k, v, block_mask=bm)
    with pytest.raises(TypeError, match="mask_mod"):
        create_block_mask(lambda b, h, i, j: i >= j, None, None, 8, 8, DEVICE)
