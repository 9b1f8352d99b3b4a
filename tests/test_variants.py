"""Sliding window, softcap and ALiBi against the float64 reference, forward and backward."""

import pytest
import torch

from accuracy import check_against_reference, make_qkv
from conftest import DEVICE, ON_GPU
from flashtriton import flash_attention_with_lse
from flashtriton.compat import flash_attn as fa

if ON_GPU:
    # (B, SQ, SK, H, HKV, D)
    SHAPES = [pytest.param((2, 1000, 1000, 4, 2, 128), id="square-d128"),
              pytest.param((1, 700, 1500, 4, 4, 64), id="sq<sk-d64"),
              pytest.param((1, 1500, 600, 4, 1, 80), id="sq>sk-d80")]
    WINDOWS = [(256, 0), (100, 300), (0, 0), (-1, 200), (600, -1), (5000, 3)]
else:
    SHAPES = [pytest.param((1, 40, 40, 2, 2, 32), id="square"),
              pytest.param((1, 23, 57, 2, 1, 24), id="sq<sk"),
              pytest.param((1, 57, 23, 2, 2, 40), id="sq>sk")]
    # Edges: width 0 (the diagonal only), one side unbounded, wider than the sequence.
    WINDOWS = [(8, 0), (5, 17), (0, 0), (-1, 11), (19, -1), (100, 3)]


def _run(options, causal=False):
    return lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, causal=causal, **options))


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("shape", SHAPES)
def test_sliding_window(shape, window):
    q, k, v = make_qkv(*shape, torch.bfloat16, DEVICE)
    check_against_reference(_run(dict(window_size=window)), q, k, v, False, window_size=window)


@pytest.mark.parametrize("shape", SHAPES)
def test_causal_plus_window(shape):
    q, k, v = make_qkv(*shape, torch.float16, DEVICE)
    w = (9, 5)  # right is ignored under causal, as in flash-attn
    check_against_reference(_run(dict(window_size=w), causal=True), q, k, v, True, window_size=w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_softcap_large_logits(shape, causal, dtype):
    q, k, v = make_qkv(*shape, dtype, DEVICE, requires_grad=False)
    q = (q * 4).requires_grad_()  # logits well into tanh's saturation
    k.requires_grad_()
    v.requires_grad_()
    check_against_reference(_run(dict(softcap=5.0), causal), q, k, v, causal, softcap=5.0)


@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes-h", "slopes-bh"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_alibi(shape, causal, per_batch):
    B, H = shape[0], shape[3]
    q, k, v = make_qkv(*shape, torch.bfloat16, DEVICE)
    size = (B, H) if per_batch else (H,)
    slopes = torch.rand(size, device=DEVICE, dtype=torch.float32) * 0.3
    check_against_reference(_run(dict(alibi_slopes=slopes), causal), q, k, v, causal,
                            alibi_slopes=slopes)


@pytest.mark.parametrize("window,causal,form", [((-1, -1), True, 2), ((9, 0), False, 2),
                                                ((9, 3), False, 1), ((-1, -1), False, 1)],
                         ids=["causal", "window-left", "window-both", "full"])
def test_alibi_forms_fp32(window, causal, form):
    # Causal ALiBi and windows that end at the diagonal take the one-sided form (the rows'
    # part of the bias moved into the LSE, kernels.common.alibi_part), the others the
    # general one; both match the reference in fp32, LSE included, with steep slopes.
    from flashtriton import launch
    q, k, v = make_qkv(2, 37, 53, 3, 3, 32, torch.float32, DEVICE)
    slopes = torch.tensor([1.0, 0.25, 0.0625], device=DEVICE)
    variant = launch.Variant(0.125, causal=causal, window_left=window[0],
                             window_right=window[1], alibi_slopes=slopes)
    assert launch.calls._common(q, None, 37, 53, variant)[0]["HAS_ALIBI"] == form
    opts = dict(window_size=window, alibi_slopes=slopes)
    check_against_reference(_run(opts, causal), q, k, v, causal, **opts)


@pytest.mark.parametrize("shape", SHAPES)
def test_all_variants_together(shape):
    H = shape[3]
    q, k, v = make_qkv(*shape, torch.float16, DEVICE)
    opts = dict(window_size=(13, 4), softcap=8.0,
                alibi_slopes=torch.rand(H, device=DEVICE, dtype=torch.float32) * 0.2)
    check_against_reference(_run(opts, causal=True), q, k, v, True, **opts)


def test_flash_attn_func_variants():
    q, k, v = make_qkv(2, 31, 31, 4, 2, 32, torch.bfloat16, DEVICE)
    slopes = torch.rand(2, 4, device=DEVICE, dtype=torch.float32) * 0.3
    opts = dict(window_size=(6, 2), softcap=20.0, alibi_slopes=slopes)
    check_against_reference(
        lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                           **opts)[:2], q, k, v, True, **opts)


def test_window_rows_with_no_key():
    # A window that lies wholly before the keys leaves rows empty: output 0, finite grads.
    q, k, v = make_qkv(1, 40, 10, 2, 2, 16, torch.float32, DEVICE)
    out, lse = flash_attention_with_lse(q, k, v, window_size=(3, 0))
    empty = torch.isneginf(lse[0, 0])
    assert empty.any() and not empty.all()
    assert torch.equal(out[0, empty], torch.zeros_like(out[0, empty]))
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


# SDPA attn_mask ----------------------------------------------------------------

def _sdpa_masks(B, H, L, S):
    g = torch.Generator(device="cpu").manual_seed(3)
    rand = lambda *shape: torch.rand(*shape, generator=g).to(DEVICE)  # noqa: E731
    rows_empty = rand(B, 1, L, S) > 0.4
    rows_empty[:, :, :3] = False                         # whole rows masked out
    tiles_empty = rand(L, S) > 0.2
    tiles_empty[: L // 2, : S // 2] = False               # whole tiles masked out
    return {
        "bool-LS": tiles_empty,
        "bool-B1LS-empty-rows": rows_empty,
        "float-1HLS": rand(1, H, L, S) * 4 - 2,
        "float-BHLS-neginf": torch.where(rand(B, H, L, S) > 0.3, 0.0, float("-inf")),
    }


@pytest.mark.parametrize("name", ["bool-LS", "bool-B1LS-empty-rows", "float-1HLS",
                                  "float-BHLS-neginf"])
def test_sdpa_attn_mask(name, monkeypatch):
    import flashtriton.sdpa as sdpa_mod
    from flashtriton import scaled_dot_product_attention as sdpa
    B, SQ, SK, H, HKV, D = (2, 300, 400, 4, 2, 64) if ON_GPU else (2, 37, 45, 2, 1, 32)
    mask = _sdpa_masks(B, H, SQ, SK)[name]
    dtype = torch.float16
    if mask.dtype != torch.bool:
        mask = mask.to(dtype)
    q, k, v = make_qkv(B, SQ, SK, H, HKV, D, dtype, DEVICE)
    calls = []
    monkeypatch.setattr(sdpa_mod, "_TORCH_SDPA", lambda *a, **kw: calls.append(1))

    def ours(q, k, v):
        out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                   enable_gqa=True)
        return out.transpose(1, 2), None

    check_against_reference(ours, q, k, v, False, attn_mask=mask)
    assert not calls  # the kernels ran, not torch's fallback
