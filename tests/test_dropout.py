"""Dropout: the kept fraction, one mask for forward and backward, reproducibility."""

import pytest
import torch

from accuracy import check_against_reference, make_qkv
from conftest import DEVICE, ON_GPU
from flashtriton import flash_attention, flash_attention_varlen
from flashtriton.compat import flash_attn as fa

SEED = 1234


def _recover_mask(B, SQ, SK, H, p, causal=False):
    """The kept (query, key) pairs of the call made right after torch.manual_seed(SEED):
    with q = 0 every visible key gets weight 1/n, and one-hot values read the weights out."""
    D = max(16, SK)
    q = torch.zeros(B, SQ, H, D, device=DEVICE)
    k = torch.randn(B, SK, H, D, device=DEVICE)
    v = torch.eye(SK, D, device=DEVICE)[None, :, None, :].expand(B, SK, H, D).contiguous()
    torch.manual_seed(SEED)
    out = flash_attention(q, k, v, causal=causal, dropout_p=p)       # (B, SQ, H, D)
    n = torch.arange(SQ, device=DEVICE)[:, None] + (SK - SQ) + 1 if causal else SK
    w = out[..., :SK].permute(0, 2, 1, 3) * (1 - p)                  # (B, H, SQ, SK)
    w = w * (torch.as_tensor(n, device=DEVICE).clamp(min=1) if causal else n)
    return w > 0.5


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_kept_fraction(p):
    B, SQ, SK, H = (2, 256, 256, 4) if ON_GPU else (1, 48, 64, 2)
    mask = _recover_mask(B, SQ, SK, H, p)
    n = mask.numel()
    kept = mask.float().mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(kept - (1 - p)) < 5 * sigma, (kept, 1 - p, sigma)
    # Rows and heads draw different masks.
    assert not torch.equal(mask[0, 0, 0], mask[0, 0, 1])
    assert not torch.equal(mask[0, 0], mask[0, 1])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_forward_and_backward_use_one_mask(causal, dtype):
    B, SQ, SK, H, D = (2, 200, 256, 2, 64) if ON_GPU else (1, 37, 45, 2, 32)
    p = 0.3
    mask = _recover_mask(B, SQ, SK, H, p, causal)
    q, k, v = make_qkv(B, SQ, SK, H, H, D, dtype, DEVICE)

    def ours(q, k, v):
        torch.manual_seed(SEED)
        return flash_attention(q, k, v, causal=causal, dropout_p=p), None

    check_against_reference(ours, q, k, v, causal, dropout_mask=mask, dropout_p=p)


def test_same_seed_same_result_other_seed_differs():
    q, k, v = make_qkv(1, 40, 40, 2, 1, 32, torch.bfloat16, DEVICE)
    dout = torch.randn_like(q)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        out = flash_attention(q, k, v, dropout_p=0.4)
        runs.append((out,) + torch.autograd.grad(out, (q, k, v), dout))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])


def test_dropout_everywhere_it_is_offered():
    q, k, v = make_qkv(2, 20, 20, 2, 2, 16, torch.float16, DEVICE, requires_grad=False)
    torch.manual_seed(3)
    a = fa.flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    b = flash_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, flash_attention(q, k, v))
    cu = torch.tensor([0, 20, 40], dtype=torch.int32, device=DEVICE)
    torch.manual_seed(3)
    c = flash_attention_varlen(q.reshape(40, 2, 16), k.reshape(40, 2, 16), v.reshape(40, 2, 16),
                               cu, cu, 20, 20, dropout_p=0.5)
    assert torch.equal(c.reshape(2, 20, 2, 16), b)  # same (batch, head, row, col) counters
    from flashtriton import scaled_dot_product_attention as sdpa
    torch.manual_seed(3)
    d = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.5)
    assert torch.equal(d.transpose(1, 2), b)  # routed to the kernels, same mask
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attention(q, k, v, dropout_p=1.0)
