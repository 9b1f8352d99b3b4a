"""Native API against the float64 reference: the shape x causal x dtype matrix."""

import pytest
import torch

from accuracy import check_against_reference, make_qkv
from conftest import DEVICE, ON_GPU
from flashtriton import flash_attention, flash_attention_with_lse
from flashtriton import runtime

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# (B, SQ, SK, H, HKV, D, id). CPU shapes are tiny (the interpreter is slow)
# but span several 16 x 16 tiles; GPU shapes span several real tiles.
if ON_GPU:
    SHAPES = [
        (2, 512, 512, 4, 4, 64, "aligned-d64"),
        (2, 1024, 1024, 8, 2, 128, "aligned-d128-gqa4"),
        (1, 1000, 777, 4, 4, 80, "unaligned-d80"),
        (2, 1, 1, 4, 4, 128, "seqlen1"),
        (2, 1, 2048, 8, 2, 128, "sq1-gqa4"),  # one query token: the GQA loop alone in dK/dV
        (2, 3, 3000, 8, 1, 128, "sq<sk-mqa"),
        (1, 1537, 300, 6, 3, 96, "sq>sk-d96-gqa2"),
        (1, 333, 333, 2, 2, 40, "d40"),
        (1, 300, 500, 2, 2, 72, "d72"),
        (1, 257, 257, 2, 1, 192, "d192-mqa"),
        (1, 700, 700, 2, 2, 256, "d256"),
        (1, 129, 129, 2, 2, 1, "d1"),
        (1, 200, 200, 4, 4, 8, "d8"),
    ]
else:
    SHAPES = [
        (2, 32, 32, 2, 2, 32, "aligned-d32"),
        (1, 37, 53, 2, 2, 40, "unaligned-d40"),
        (2, 1, 1, 2, 2, 16, "seqlen1"),
        (1, 1, 40, 4, 2, 32, "sq1-gqa2"),
        (1, 3, 45, 4, 1, 64, "sq<sk-mqa"),
        (1, 50, 19, 4, 2, 24, "sq>sk-gqa2"),
        (1, 21, 21, 1, 1, 1, "d1"),
        (1, 18, 27, 2, 2, 72, "d72"),
        (1, 17, 17, 2, 1, 256, "d256-mqa"),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [pytest.param(s[:6], id=s[6]) for s in SHAPES])
def test_matches_reference(shape, causal, dtype):
    q, k, v = make_qkv(*shape, dtype, DEVICE)
    check_against_reference(
        lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, causal=causal)), q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", [0.0, 0.05, 1.7, -0.4])
def test_softmax_scale(scale, causal):
    # A negative scale is legal (flash-attn accepts it): the row maximum of the scaled scores
    # is then the scale times the row minimum of q k^T.
    q, k, v = make_qkv(1, 24, 40, 2, 2, 32, torch.float16, DEVICE)
    check_against_reference(
        lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, causal=causal,
                                                       softmax_scale=scale)),
        q, k, v, causal, softmax_scale=scale)


@pytest.mark.parametrize("D", [16, 256], ids=["d16", "d256"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_running_max_that_grows_along_the_keys(dtype, D):
    # Scores rise along the keys (quadratically) at a rate that differs per row: in some key
    # blocks the row maxima grow a little, in others by far more, and rows disagree: the
    # online softmax's rescaling of the accumulator must follow every row (also at D=256,
    # the forward's one-block head dim).
    B, S, H = 1, 70, 2
    e = torch.zeros(D, dtype=torch.float64)
    e[0] = 1.0
    rate = torch.linspace(0.2, 1.0, S, dtype=torch.float64)[None, :, None, None]
    q = (e * rate + 0.05 * torch.randn(B, S, H, D, dtype=torch.float64)).to(dtype)
    j = torch.arange(S, dtype=torch.float64)[None, :, None, None]
    k = (e * 0.03 * j ** 2 + 0.05 * torch.randn(B, S, H, D, dtype=torch.float64)).to(dtype)
    v = torch.randn(B, S, H, D, dtype=torch.float64).to(dtype)
    q, k, v = (x.to(DEVICE).requires_grad_() for x in (q, k, v))
    # Forward only (out and LSE): with logits past ~100 the float32 backward's exp2 argument
    # loses ~1e-5 to rounding, a few times torch's float32 error on dV (not this test's topic).
    check_against_reference(
        lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, softmax_scale=1.0)), q, k, v,
        False, softmax_scale=1.0, check_grads=False)


def test_rows_without_keys_are_zero_with_finite_grads():
    q, k, v = make_qkv(1, 40, 8, 2, 2, 32, torch.bfloat16, DEVICE)
    out, lse = flash_attention_with_lse(q, k, v, causal=True)
    empty = 40 - 8  # bottom-right alignment: the first SQ - SK rows see no key
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all()
    assert torch.isfinite(lse[:, :, empty:]).all()
    out.float().pow(2).sum().backward()
    assert torch.equal(q.grad[:, :empty], torch.zeros_like(q.grad[:, :empty]))
    assert all(torch.isfinite(g).all() for g in (q.grad, k.grad, v.grad))


def _packed(B, S, H, D, dtype):
    qkv = torch.randn(B, S, 3, H, D, dtype=dtype, device=DEVICE, requires_grad=True)
    return qkv, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_views(causal):
    # Views of a packed qkv tensor, a (B, H, T, D) transpose and a batch slice.
    _, q, k, v = _packed(2, 29, 2, 48, torch.float16)
    check_against_reference(lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, causal=causal)),
                            q, k, v, causal)
    base = torch.randn(4, 2, 31, 32, dtype=torch.bfloat16, device=DEVICE)
    q = base[::2].transpose(1, 2).detach().requires_grad_()  # (2, 31, 2, 32), strided
    kv = torch.randn(2, 2, 2, 23, 32, dtype=torch.bfloat16, device=DEVICE)
    k = kv[0].transpose(1, 2).requires_grad_()
    v = kv[1].transpose(1, 2).requires_grad_()
    assert not (q.is_contiguous() or k.is_contiguous())
    check_against_reference(lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, causal=causal)),
                            q, k, v, causal)


def test_outputs_and_grads_keep_the_input_layout():
    # SDPA's (B, H, T, D) tensors seen as (B, T, H, D): out, dq, dk, dv come back in that
    # memory layout (else autograd copies every gradient into the leaf's layout).
    q, k, v = (torch.randn(2, 3, 19, 32, dtype=torch.float16, device=DEVICE).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    out = flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert out.stride() == q.stride()
    assert [g.stride() for g in grads] == [x.stride() for x in (q, k, v)]
    check_against_reference(lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, causal=True)),
                            q, k, v, True)
    # A packed view (not dense) gets contiguous outputs.
    _, q, k, v = _packed(1, 9, 2, 16, torch.float16)
    assert flash_attention(q, k, v).is_contiguous()


def test_packed_qkv_grad_lands_in_the_pack():
    qkv, q, k, v = _packed(1, 20, 2, 32, torch.float32)
    out = flash_attention(q, k, v)
    out.sum().backward()
    ref_leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    flash_attention(*ref_leaves).sum().backward()
    for i, leaf in enumerate(ref_leaves):
        assert torch.equal(qkv.grad[:, :, i], leaf.grad)


def test_non_unit_last_stride_is_copied():
    q, k, v = make_qkv(1, 20, 20, 2, 2, 64, torch.float16, DEVICE, requires_grad=False)
    q2 = torch.randn(1, 20, 2, 128, dtype=torch.float16, device=DEVICE)[..., ::2]
    assert q2.stride(-1) == 2
    out = flash_attention(q2, k, v)
    assert torch.equal(out, flash_attention(q2.contiguous(), k, v))


def test_expanded_inputs():
    # A stride-0 batch dim (expand) is read in place.
    q, k, v = make_qkv(1, 20, 20, 2, 2, 32, torch.float16, DEVICE, requires_grad=False)
    out = flash_attention(q.expand(3, -1, -1, -1), k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1))
    ref = flash_attention(q, k, v)
    for b in range(3):
        assert torch.equal(out[b:b + 1], ref)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_repeatable_bitwise(causal):
    q, k, v = make_qkv(2, 45, 38, 4, 2, 40, torch.bfloat16, DEVICE)
    dout = torch.randn(2, 45, 4, 40, dtype=torch.bfloat16, device=DEVICE)
    runs = []
    for _ in range(3):
        out, lse = flash_attention_with_lse(q, k, v, causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        runs.append((out, lse) + grads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [
    pytest.param((0, 16, 16, 2, 2, 32), id="batch0"),
    pytest.param((2, 0, 16, 2, 2, 32), id="seqlen_q0"),
    pytest.param((2, 16, 0, 2, 2, 32), id="seqlen_k0"),
    pytest.param((2, 0, 0, 2, 2, 32), id="both0"),
])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zero_sizes(shape, causal):
    B, SQ, SK, H, HKV, D = shape
    q, k, v = make_qkv(*shape, torch.float16, DEVICE)
    out, lse = flash_attention_with_lse(q, k, v, causal=causal)
    assert out.shape == (B, SQ, H, D) and lse.shape == (B, H, SQ)
    # No key at all: output 0, lse -inf (the limit of an empty softmax).
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    out.float().sum().backward()
    for x in (q, k, v):
        assert x.grad.shape == x.shape and torch.equal(x.grad, torch.zeros_like(x.grad))


def test_no_heads_give_empty_results():
    """nheads = 0 in q and k (the README's zero-size inputs): empty outputs, LSEs and gradients
    from the native API and the drop-ins, no launch; 0 KV heads for query heads is refused
    naming k."""
    from flashtriton import flash_attention_varlen_with_lse, scaled_dot_product_attention
    from flashtriton.compat import flash_attn as fa
    from flashtriton.decode import attention_with_kvcache
    q, k, v = make_qkv(2, 4, 5, 0, 0, 16, torch.float16, DEVICE)
    out, lse = flash_attention_with_lse(q, k, v, causal=True)
    assert out.shape == (2, 4, 0, 16) and lse.shape == (2, 0, 4)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    res = fa.flash_attn_func(q, k, v, return_attn_probs=True)
    assert res[0].shape == q.shape and res[1].shape == (2, 0, 4)
    assert fa.flash_attn_qkvpacked_func(torch.stack((q, k[:, :4], v[:, :4]), 2)).shape == q.shape
    sdpa = scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
    assert sdpa.shape == (2, 0, 4, 16)
    assert torch.autograd.grad(sdpa.sum(), q)[0].shape == q.shape
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    qv, kv = (torch.randn(8, 0, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
              for _ in range(2))
    out, lse = flash_attention_varlen_with_lse(qv, kv, kv, cu, cu, 5, 5, causal=True)
    assert out.shape == qv.shape and lse.shape == (0, 8)
    assert torch.autograd.grad(out.sum(), kv)[0].shape == kv.shape
    assert fa.flash_attn_varlen_func(qv, kv, kv, cu, cu, 5, 5).shape == qv.shape
    with torch.no_grad():
        cache = torch.randn(2, 8, 0, 16, dtype=torch.float16, device=DEVICE)
        pages = torch.randn(4, 8, 0, 16, dtype=torch.float16, device=DEVICE)
        table = torch.tensor([[1], [2]], dtype=torch.int32, device=DEVICE)
        one = q[:, :1].detach()
        for kw in (dict(k_cache=cache, v_cache=cache, k=one, v=one),
                   dict(k_cache=cache, v_cache=cache, batch_invariant=True),
                   dict(k_cache=pages, v_cache=pages, block_table=table)):
            out, lse = attention_with_kvcache(one, cache_seqlens=3, **kw)
            assert out.shape == one.shape and lse.shape == (2, 0, 1), kw
        assert fa.flash_attn_with_kvcache(one, cache, cache, cache_seqlens=3).shape == one.shape
        ones = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
        out, lse = flash_attention_varlen_with_lse(
            qv[:2], pages, pages, ones, None, 1, 8, block_table=table, seqused_k=ones[1:])
        assert out.shape == (2, 0, 16) and lse.shape == (0, 2)
    q4 = torch.randn(2, 4, 2, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="^k has no heads .* for the 2 heads of q"):
        flash_attention(q4, k, v)
    with pytest.raises(ValueError, match="^k_cache has no heads"):
        attention_with_kvcache(q4[:, :1], cache, cache, cache_seqlens=3)


@pytest.fixture
def tma(monkeypatch):
    """The tensor-descriptor (TMA) kernels on any device: the interpreter runs descriptor
    loads too (with TMA's zero fill past the tensor's end). Returns the list of what each
    forward and backward call chose."""
    import flashtriton._env as env
    chosen, real = [], runtime._use_tma
    monkeypatch.setattr(env, "TMA", True)
    monkeypatch.setattr(runtime, "_tma_capable", lambda device: True)

    def spy(*tensors):
        chosen.append(real(*tensors))
        return chosen[-1]

    monkeypatch.setattr(runtime, "_use_tma", spy)
    return chosen


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [pytest.param((2, 40, 70, 4, 2, 64), id="gqa2-ragged"),
                                   pytest.param((1, 37, 21, 2, 2, 40), id="d40-sq>sk")])
def test_tma_matches_reference(tma, shape, causal, dtype):
    q, k, v = make_qkv(*shape, dtype, DEVICE)
    check_against_reference(
        lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, causal=causal)), q, k, v, causal)
    assert tma and all(tma)


@pytest.mark.parametrize("sq,expect", [(40, True), (37, False)], ids=["sq40", "sq37"])
def test_tma_row_stats_where_aligned(tma, monkeypatch, sq, expect):
    # The dK/dV kernel reads LSE and delta by 1-D descriptors where each head's rows start
    # 16-byte aligned (SQ a multiple of 4), by pointers otherwise; both give the reference.
    import flashtriton.launch as launch
    chose, real = [], runtime._launch

    def spy(kernel, *args, **kw):
        if kernel is launch.triton_attn._dkdv:
            chose.append(kw["STATS_TMA"])
        return real(kernel, *args, **kw)

    monkeypatch.setattr(runtime, "_launch", spy)
    q, k, v = make_qkv(1, sq, 50, 2, 1, 32, torch.bfloat16, DEVICE)
    check_against_reference(
        lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, causal=True)), q, k, v, True)
    assert chose == [expect] and all(tma)


def test_tma_varlen(tma):
    from test_varlen import _check_varlen
    _check_varlen([19, 0, 1, 33], [25, 7, 0, 16], 4, 2, 40, torch.bfloat16, True,
                  window_size=(9, 0))
    assert tma and all(tma)


def test_tma_declines_unaligned_views(tma):
    # K and V one element past a 16-byte boundary: TMA cannot read them; pointer loads do.
    q, k, v = make_qkv(1, 24, 30, 2, 2, 32, torch.float16, DEVICE)
    kv = torch.randn(2 * 1 * 30 * 2 * 32 + 1, dtype=torch.float16, device=DEVICE)[1:]
    k2, v2 = (t.view(1, 30, 2, 32).requires_grad_() for t in kv.view(2, -1))
    check_against_reference(lambda q, k, v: tuple(flash_attention_with_lse(q, k, v)), q, k2, v2,
                            False)
    assert tma and not any(tma)


def test_tma_rules(tma):
    x = torch.empty(2, 8, 2, 32, dtype=torch.float16, device=DEVICE)
    assert runtime._use_tma(x)
    # The token stride is the descriptor's row stride: a 16-byte multiple even for one token.
    assert not runtime._use_tma(torch.empty(1, 1, 1, 20, dtype=torch.float16, device=DEVICE))
    assert not runtime._use_tma(torch.empty(2, 8, 3, 20, dtype=torch.float16, device=DEVICE))
    assert runtime._use_tma(x[:1, :, :1])  # size-1 batch and head: their strides move nothing
