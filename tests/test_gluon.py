"""The Gluon forward and backward (kernels/gluon/fwd.py and bwd.py, Hopper only) against
the float64 reference (their variants too), the layouts they read, and when
attention_forward / attention_backward choose them (deterministic=True keeps the backward on
the repeatable Triton kernels).
Their compiled sm_90 code (the forward's softmax between the two products' waits, the
backward's dQ reductions) is checked on any machine by tools/compile_check.py, which CI
runs; the layout and eligibility rules and the backward's Triton prep kernel run on the CPU
(their option rules: tests/test_configs.py; their masks: tests/test_mask.py)."""

import math

import pytest
import torch
import triton

from accuracy import check_against_reference, make_qkv
from conftest import DEVICE, ON_GPU
from flashtriton import _env, flash_attention, flash_attention_with_lse, launch
from flashtriton import configs, runtime
from flashtriton.launch import Variant, _token_rows, gluon_misfit

HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
# (B, N, H, HKV, D): ragged ends, one block, GQA, every kernel head dim and two padded ones
SHAPES = [(2, 1000, 3, 3, 128), (1, 2048, 2, 2, 128), (2, 777, 2, 2, 64), (1, 128, 1, 1, 128),
          (1, 100, 2, 2, 64), (2, 600, 8, 2, 128), (2, 777, 4, 2, 256), (1, 100, 2, 2, 256),
          (2, 777, 4, 2, 96), (1, 300, 2, 2, 192), (2, 500, 8, 2, 64)]


def _heads_major(x):
    """x's values in (B, H, N, D) memory, seen as (B, N, H, D) (SDPA's layout)."""
    return x.detach().transpose(1, 2).contiguous().transpose(1, 2)


def _packed(q, k, v):
    """q, k, v as views of one (B, N, 3, H, D) buffer (qkv-packed)."""
    return torch.stack([x.detach() for x in (q, k, v)], dim=2).unbind(2)


def test_token_rows_reads_both_layouts_and_rejects_the_rest():
    B, N, H, D = 2, 100, 4, 128
    q = torch.randn(B, N, H, D, dtype=torch.bfloat16, device=DEVICE)
    assert _token_rows(q) == (N, 0, D, B * N, H * D)
    assert _token_rows(_heads_major(q)) == (H * N, N, 0, B * H * N, D)
    packed = _packed(q, q, q)
    assert _token_rows(packed[1]) == (N, 0, D, B * N, H * D)
    assert packed[1].stride(1) == 3 * H * D  # the descriptor's row stride
    assert _token_rows(q[..., :64]) is None  # heads 128 apart, 64 wide
    assert _token_rows(q[:, :, :2]) == (N, 0, D, B * N, 2 * D)  # two heads of each row
    assert _token_rows(q[:, ::2]) == (N // 2, 0, D, B * N // 2, H * D)  # every other token
    assert _token_rows(q[:, :50]) is None  # batches not 50 rows apart
    assert _token_rows(q.view(-1)[1:1 + D].view(1, 1, 1, D)) is None  # 2-byte aligned
    assert _token_rows(q.as_strided((B, N, H, D), (0, H * D, D, 1))) is None  # batch repeated


def test_gluon_misfit_names_what_it_does_not_take():
    q, k, v = make_qkv(1, 64, 64, 2, 2, 128, torch.bfloat16, DEVICE, requires_grad=False)
    plain = Variant(0.1)
    reason = gluon_misfit(q, k, v, plain)
    if HOPPER:
        assert reason is None
    else:
        assert "Hopper" in reason
    assert gluon_misfit(q, k, v, Variant(0.1, causal=True, window_right=0)) == reason
    assert "bf16 or fp16" in gluon_misfit(q.float(), k.float(), v.float(), plain)
    assert "as many queries" in gluon_misfit(q[:, :32], k, v, plain)
    assert "head dims" in gluon_misfit(q[..., :32], k[..., :32], v[..., :32], plain)
    for variant in (Variant(0.1, window_left=8), Variant(0.1, window_right=8),
                    Variant(0.1, softcap=30.0), Variant(0.1, dropout_p=0.1),
                    Variant(0.1, alibi_slopes=torch.ones(2)), Variant(-0.1),
                    Variant(0.1, causal=True, diag_offset=1)):
        assert "plain or causal" in gluon_misfit(q, k, v, variant), variant
    for variant in (Variant(0.1, window_left=8), Variant(0.1, window_right=8),
                    Variant(0.1, softcap=30.0), Variant(0.1, alibi_slopes=torch.ones(2))):
        assert gluon_misfit(q, k, v, variant, variants=True) == reason, variant
    blocks = torch.zeros(1, 1, 1, 4, dtype=torch.int32)
    listed = Variant(0.1, mask_mod=_doc_mod, kv_blocks=blocks)
    assert gluon_misfit(q, k, v, listed, variants=True) == reason
    assert "plain or causal" in gluon_misfit(q, k, v, listed)
    for variant in (Variant(0.1, dropout_p=0.1), Variant(-0.1),
                    Variant(0.1, causal=True, diag_offset=1),
                    listed._replace(block_size=64), listed._replace(causal=True),
                    listed._replace(kv_blocks=None)):
        assert "block masks of 128" in gluon_misfit(q, k, v, variant, variants=True), variant
    wide = make_qkv(1, 64, 64, 2, 2, 256, torch.bfloat16, DEVICE, requires_grad=False)
    assert gluon_misfit(*wide, plain) == reason  # head dim 256: key blocks of 64, no masks
    assert "block masks of 128" in gluon_misfit(*wide, listed, variants=True)
    # the backward too (64-key programs, the head dim split between its consumers)
    assert launch.gluon_backward_misfit(None, *wide, plain) == reason
    assert "block masks of 128" in launch.gluon_backward_misfit(None, *wide, listed)
    assert "tokens-major" in gluon_misfit(q, k, _heads_major(v), plain)  # k and v differ
    assert "tokens-major" in gluon_misfit(q[..., :64], k[..., :64], v[..., :64], plain)
    # head dims under the tiles' width: the same layouts (TMA reads the tensors themselves)
    narrow = [x[..., :96].contiguous() for x in (q, k, v)]
    assert gluon_misfit(*narrow, plain) == reason
    assert launch.gluon_backward_misfit(narrow[0], *narrow, plain) == reason
    heads_major = [_heads_major(x) for x in narrow]
    assert gluon_misfit(*heads_major, plain) == reason
    assert "tokens-major" in gluon_misfit(*(x[..., :96] for x in (q, k, v)), plain)
    assert "head dims" in gluon_misfit(*(x[..., :72] for x in (q, k, v)), plain)


@pytest.mark.parametrize("D,width", [(80, 128), (96, 128), (112, 128), (192, 256)])
@pytest.mark.parametrize("layout", ["tokens-major", "heads-major", "packed"])
def test_head_dims_under_the_width_are_read_in_place(D, width, layout):
    """At a head dim under the tiles' width (configs.GLUON_PADDED_HEAD_DIMS) the descriptors
    view the tensors themselves, 3-D (token rows, heads a row, D) in blocks of (rows, 1,
    width), so that TMA fills the columns past D with zeros: no copies. ch counts heads (1
    tokens-major, 0 heads-major), the kernels' column coordinate there; the fp32 dQ buffer
    is read the same way in blocks half the width."""
    from flashtriton.launch import gluon_attn
    assert configs.gluon_head_dim(D) == width
    x = torch.randn(2, 40, 3, D, dtype=torch.bfloat16, device=DEVICE)
    x = {"tokens-major": x, "heads-major": _heads_major(x), "packed": _packed(x, x, x)[1]}[layout]
    rb, rh, ch, rows, columns = _token_rows(x)
    desc, coords = gluon_attn._gluon_descriptor(x, [64, width], width)
    assert desc.base is x and desc.block_shape == [64, 1, width]
    assert desc.shape == [rows, columns // D, D] and desc.strides == [x.stride(1), D, 1]
    assert coords == (rb, rh, 0 if layout == "heads-major" else 1)
    if layout == "heads-major":
        assert desc.shape[1] == 1
    else:  # head h of token row r: element r * stride(1) + h * D, as the tensor has it
        assert x.stride(2) == D and desc.shape[1] * D <= x.stride(1)
    dq = gluon_attn._dq_buffer(x)
    assert dq.shape == x.shape and dq.dtype == torch.float32
    dq_desc, _ = gluon_attn._gluon_descriptor(dq, [64, width // 2], width)
    assert dq_desc.block_shape == [64, 1, width // 2] and dq_desc.shape[2] == D
    # at the kernels' own head dims: the 2-D view, columns h * ch
    wide = torch.randn(2, 40, 3, width, dtype=torch.bfloat16, device=DEVICE)
    desc, coords = gluon_attn._gluon_descriptor(wide, [64, width], width)
    assert desc.block_shape == [64, width] and desc.shape == [80, 3 * width]
    assert coords == (40, 0, width)


@needs_hopper
@pytest.mark.parametrize("B,N,H,HKV,D", SHAPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_forward_matches_reference(B, N, H, HKV, D, causal, dtype):
    q, k, v = make_qkv(B, N, N, H, HKV, D, dtype, "cuda", requires_grad=False)
    check_against_reference(
        lambda q, k, v: launch.attention_forward_gluon(q, k, v, causal), q, k, v, causal,
        check_grads=False)


@needs_hopper
@pytest.mark.parametrize("heavy_first", [False, True])
@pytest.mark.parametrize("order", [0, 1, 3])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, 50)),
                                           (True, (100, 0))],
                         ids=["causal", "upper-bound", "causal-window"])
def test_gluon_forward_query_block_order(heavy_first, order, causal, window, monkeypatch):
    """configs.GLUON_FWD_OPTIONS["HEAVY_FIRST"] both ways (a walk with an upper bound and no
    lower one takes each head's query blocks last first; a window with both bounds keeps the
    order) and ORDER 0, 1 and 3 (grid_order: the grid's order, whole windows first, groups of
    3 heads: the last group of 8 is 2) against the float64 reference: ragged, GQA, several
    heads."""
    monkeypatch.setitem(configs.GLUON_FWD_OPTIONS, "HEAVY_FIRST", heavy_first)
    monkeypatch.setitem(configs.GLUON_FWD_OPTIONS, "ORDER", order)
    q, k, v = make_qkv(2, 700, 700, 4, 2, 128, torch.bfloat16, "cuda", requires_grad=False)
    check_against_reference(
        lambda q, k, v: launch.attention_forward_gluon(q, k, v, causal, window_size=window),
        q, k, v, causal, window_size=window, check_grads=False)


@needs_hopper
@pytest.mark.parametrize("layout", ["heads-major", "packed"])
def test_gluon_forward_reads_strided_layouts(layout):
    q, k, v = make_qkv(2, 333, 333, 4, 4, 128, torch.bfloat16, "cuda", requires_grad=False)
    q, k, v = (_heads_major(x) for x in (q, k, v)) if layout == "heads-major" else _packed(q, k, v)
    for causal in (False, True):
        check_against_reference(
            lambda q, k, v: launch.attention_forward_gluon(q, k, v, causal), q, k, v, causal,
            check_grads=False)


# (causal, window_size, softcap, alibi): windows on each side, both, with causal; softcap
# with large logits; ALiBi per head and per batch and head; and together.
VARIANTS = [(False, (100, -1), 0.0, None), (False, (-1, 37), 0.0, None),
            (False, (300, 0), 0.0, None), (False, (5, 130), 0.0, None),
            (True, (200, -1), 0.0, None), (True, (0, -1), 0.0, None),
            (False, (-1, -1), 5.0, None), (True, (-1, -1), 5.0, None),
            (False, (-1, -1), 0.0, "head"), (True, (-1, -1), 0.0, "batch"),
            (True, (150, -1), 30.0, "head"), (False, (64, 64), 0.0, "batch")]


@needs_hopper
@pytest.mark.parametrize("causal,window,softcap,alibi", VARIANTS)
@pytest.mark.parametrize("B,N,H,HKV,D", [(2, 1000, 4, 2, 128), (1, 333, 2, 2, 64),
                                         (1, 333, 2, 2, 256)])
def test_gluon_forward_variants_match_reference(B, N, H, HKV, D, causal, window, softcap,
                                                alibi):
    """The Gluon forward's windows, softcap and ALiBi (launch.attention_forward_gluon)
    against the float64 reference."""
    q, k, v = make_qkv(B, N, N, H, HKV, D, torch.bfloat16, "cuda", requires_grad=False)
    if softcap:
        q = q * 4  # large logits: the cap matters
    slopes = None
    if alibi is not None:
        shape = (H,) if alibi == "head" else (B, H)
        slopes = torch.rand(shape, device="cuda", dtype=torch.float32) * 0.3
    check_against_reference(
        lambda q, k, v: launch.attention_forward_gluon(q, k, v, causal, window_size=window,
                                                       softcap=softcap, alibi_slopes=slopes),
        q, k, v, causal, check_grads=False, window_size=window, softcap=softcap,
        alibi_slopes=slopes)


@needs_hopper
@pytest.mark.parametrize("D", (64, *configs.GLUON_FWD_HEAD_DIMS), ids=lambda d: f"d{d}")
def test_attention_forward_runs_gluon_where_it_fits(monkeypatch, D):
    """flash_attention on Hopper at the head dims of configs.GLUON_FWD_HEAD_DIMS (and head dim
    64 from its GLUON_FWD_MIN_SEQLEN, lowered here: 192-row programs) runs the Gluon forward
    (its replay on the second call), the backward on its output and LSE; FLASHTRITON_GLUON=0
    or a variant runs the Triton forward; both against the float64 reference, gradients
    included."""
    monkeypatch.setattr(runtime, "_CALLS", {})  # no replay of another test's calls
    if D in configs.GLUON_FWD_MIN_SEQLEN:
        monkeypatch.setitem(configs.GLUON_FWD_MIN_SEQLEN, D, 512)
    calls = []
    real = launch._gluon_forward
    monkeypatch.setattr(launch, "_gluon_forward", lambda *a: calls.append(1) or real(*a))
    q, k, v = make_qkv(2, 513, 513, 4, 2, D, torch.bfloat16, "cuda")
    for causal in (False, True):
        check_against_reference(
            lambda q, k, v: flash_attention_with_lse(q, k, v, causal=causal),
            q, k, v, causal)
    assert len(calls) == 2
    replays = runtime.FAST_LAUNCHES
    flash_attention(q, k, v, causal=True)
    assert len(calls) == 2 and runtime.FAST_LAUNCHES == replays + 1  # replayed
    monkeypatch.setattr(configs, "GLUON_VARIANTS", False)
    flash_attention(q, k, v, causal=True, window_size=(64, 0))
    monkeypatch.setattr(_env, "GLUON", False)
    flash_attention(q, k, v)
    assert len(calls) == 2


@needs_hopper
@pytest.mark.parametrize("site,switch,counts", [
    ("_gluon_forward", "GLUON_VARIANTS", (0, 4)),
    ("_gluon_backward", "GLUON_BWD_VARIANTS", (1, 5))], ids=["forward", "backward"])
def test_variants_run_on_gluon_as_switched(monkeypatch, site, switch, counts):
    """flash_attention runs a window, softcap, ALiBi and a block mask on the Gluon kernels as
    configs' switches say (against the float64 reference, gradients included): the forwards
    with GLUON_VARIANTS, the backwards with GLUON_BWD_VARIANTS (both on by default; a block
    mask's backward runs on Gluon either way; GLUON_BWD_MIN_SEQLEN lowered to reach it at test
    size); switched off, the Triton kernels."""
    monkeypatch.setattr(runtime, "_CALLS", {})  # no replay of another test's calls
    calls = []
    real = getattr(launch, site)
    monkeypatch.setattr(launch, site, lambda *a: calls.append(1) or real(*a))
    if site == "_gluon_backward":
        monkeypatch.setattr(configs, "GLUON_BWD_MIN_SEQLEN", 512)
    from flashtriton.block_mask import create_block_mask
    q, k, v = make_qkv(2, 700, 700, 4, 2, 128, torch.bfloat16, "cuda")
    slopes = torch.rand(4, device="cuda") * 0.3
    bm = create_block_mask(_doc_mod, None, None, 700, 700, "cuda")
    i = torch.arange(700, device="cuda")
    doc = _doc_mod.fn(0, 0, i[:, None], i[None, :])[None, None].expand(2, 4, 700, 700)
    cases = [(dict(causal=True, window_size=(256, 0)), {}),
             (dict(causal=True, softcap=20.0), {}), (dict(alibi_slopes=slopes), {}),
             (dict(block_mask=bm), dict(attn_mask=doc))]
    for on, count in zip((False, True), counts):
        monkeypatch.setattr(configs, switch, on)
        for opts, ref in cases:
            check_against_reference(lambda q, k, v: flash_attention_with_lse(q, k, v, **opts),
                                    q, k, v, opts.get("causal", False),
                                    **{**ref, **{n: x for n, x in opts.items()
                                                 if n not in ("causal", "block_mask")}})
        assert len(calls) == count


@needs_hopper
def test_gluon_forward_rejects_what_it_does_not_take():
    q, k, v = make_qkv(1, 64, 64, 2, 2, 128, torch.bfloat16, "cuda", requires_grad=False)
    with pytest.raises(ValueError, match="as many queries"):
        launch.attention_forward_gluon(q, k[:, :32], v[:, :32])
    with pytest.raises(ValueError, match="bf16 or fp16"):
        launch.attention_forward_gluon(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="softmax_scale > 0"):
        launch.attention_forward_gluon(q, k, v, softmax_scale=-0.1)
    with pytest.raises(ValueError, match="tokens-major"):
        launch.attention_forward_gluon(q, k, _heads_major(v))


def test_gluon_forward_raises_off_hopper():
    if HOPPER:
        pytest.skip("this machine has a Hopper GPU (the tests above run the kernel)")
    q, k, v = make_qkv(1, 64, 64, 2, 2, 128, torch.bfloat16, DEVICE, requires_grad=False)
    with pytest.raises(ValueError, match="Hopper"):
        launch.attention_forward_gluon(q, k, v)


@pytest.mark.parametrize("D", [64, 80])
@pytest.mark.parametrize("dq_layout", ["tokens-major", "heads-major"])
def test_backward_prep_kernel_gives_padded_stats_and_a_zeroed_dq_buffer(dq_layout, D):
    """kernels.attn_bwd._attn_bwd_prep_kernel (the Gluon backward's first launch, a Triton
    kernel: runs in the interpreter): the log2 LSE (+inf where it is -inf) and delta =
    rowsum(dO * O) of each head's rows, padded to 128 rows (N = 70: not a multiple of 4, so
    unpadded rows would start off the 16-byte alignment TMA needs) with +inf and 0, and the
    fp32 dQ buffer zeroed in q's layout (launch.gluon_attn._dq_buffer: tokens-major or heads-major; the
    kernel goes by its strides and writes nothing else), from O and dO in any strided (B, N,
    H, D) layout; at a head dim under its tile's width (80 in 128) it reads and writes D
    columns."""
    from flashtriton.kernels.attn_bwd import _attn_bwd_prep_kernel
    B, N, H = 2, 70, 3
    out = torch.randn(B, H, N, D, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)
    dout = torch.randn(B, N, H, D, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.randn(B, H, N, device=DEVICE)
    lse[0, 1, 5] = -float("inf")  # a row that sees no key
    lse2, delta = torch.full((2, B, H, 128), float("nan"), device=DEVICE)
    q = out if dq_layout == "heads-major" else dout
    buffer = launch.gluon_attn._dq_buffer(q)
    assert buffer.shape == (B, N, H, D) and buffer.stride() == q.stride()
    # the kernel zeroes by the strides it is given: here a buffer with a spare head between
    # batches, which it must leave alone
    if dq_layout == "heads-major":
        memory = torch.full((B, H + 1, N, D), 7.0, device=DEVICE)
        dq, spare = memory[:, :H].transpose(1, 2), memory[:, H]
    else:
        memory = torch.full((B, N, H + 1, D), 7.0, device=DEVICE)
        dq, spare = memory[:, :, :H], memory[:, :, H]
    _attn_bwd_prep_kernel[(2, B * H)](out, dout, lse, lse2, delta, dq, *out.stride()[:3],
                                      *dout.stride()[:3], *lse.stride()[:2], *dq.stride()[:3],
                                      H, N, 128, HEAD_DIM=triton.next_power_of_2(D),
                                      BLOCK_M=64, DIM=D)
    expect = (out.double() * dout.double()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(delta[..., :N].double(), expect, rtol=1e-5, atol=1e-5)
    expect = torch.where(lse == -float("inf"), float("inf"), lse * math.log2(math.e))
    torch.testing.assert_close(lse2[..., :N], expect)
    assert lse2[0, 1, 5] == float("inf")
    assert bool((lse2[..., N:] == float("inf")).all()) and bool((delta[..., N:] == 0).all())
    assert bool((dq == 0).all()) and bool((spare == 7).all())


@triton.jit
def _doc_mod(b, h, q_idx, kv_idx):
    """Documents of 300 tokens (block-mask tiles of 128: full, partial and empty ones)."""
    return (q_idx // 300) == (kv_idx // 300)


@triton.jit
def _prefix_mod(b, h, q_idx, kv_idx):
    """A 200-token bidirectional prefix, causal after it."""
    return (kv_idx < 200) | (q_idx >= kv_idx)


@needs_hopper
@pytest.mark.parametrize("mask_mod", [_doc_mod, _prefix_mod], ids=["document", "prefix-lm"])
@pytest.mark.parametrize("N", [1024, 1000])
def test_gluon_forward_block_masks_match_reference(mask_mod, N):
    """The Gluon forward over a block mask's lists (full blocks unmasked but at a ragged end,
    mask_mod on the partial ones) against the float64 reference of the same mask."""
    from flashtriton.block_mask import create_block_mask
    B, H, HKV, D = 2, 4, 2, 128
    q, k, v = make_qkv(B, N, N, H, HKV, D, torch.bfloat16, "cuda", requires_grad=False)
    bm = create_block_mask(mask_mod, None, None, N, N, "cuda")
    i = torch.arange(N, device="cuda")
    keep = mask_mod.fn(0, 0, i[:, None], i[None, :])
    check_against_reference(
        lambda q, k, v: launch.attention_forward_gluon(q, k, v, block_mask=bm), q, k, v, False,
        check_grads=False, attn_mask=keep[None, None].expand(B, H, N, N))


class _GluonBackward(torch.autograd.Function):
    """flashtriton's forward, then the Gluon backward for the gradients (the options as
    attention_backward_gluon's)."""

    @staticmethod
    def forward(ctx, q, k, v, opts):
        out, lse = launch.attention_forward_gluon(q, k, v, **opts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts = opts
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse = ctx.saved_tensors
        return (*launch.attention_backward_gluon(dout, q, k, v, out, lse, **ctx.opts), None)


def _gluon_backward(**opts):
    return lambda q, k, v: _GluonBackward.apply(q, k, v, opts)


@pytest.fixture(params=[dict(EARLY_S=False), dict(EARLY_S=True), dict(ONE_LOOP=True),
                        dict(ONE_LOOP=False), dict(SKIP_EMPTY=True),
                        dict(SKIP_EMPTY=True, ONE_LOOP=True), dict(SKIP_EMPTY=False, ORDER=0),
                        dict(ORDER=1), dict(ORDER=3)],
                ids=["s0", "s1", "one", "split", "skip", "skipone", "plain", "order1", "order3"])
def bwd_options(request, monkeypatch):
    """The Gluon backward's forms (configs.GLUON_BWD_OPTIONS): EARLY_S both ways (the next
    step's S^T issued before dQ's staging), ONE_LOOP both ways (the walk in one loop, every
    step masked, or masked, unmasked and masked loops), SKIP_EMPTY (in a walk in one loop,
    a group's steps that see none of its keys run without its products) with the default
    walks and with every walk in one loop, and off with ORDER 0 (the window's walks as they
    were before gluon_bwd_options chose both for them), ORDER 1 and 3 (the programs' order
    over the grid: whole walks first; groups of 3 heads, which leave a last group of 1 or 2)."""
    for name, value in request.param.items():
        monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, name, value)


@needs_hopper
@pytest.mark.parametrize("B,N,H,HKV,D", [s for s in SHAPES
                                         if configs.gluon_head_dim(s[-1])
                                         in configs.GLUON_BWD_KERNEL_HEAD_DIMS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_backward_matches_reference(B, N, H, HKV, D, causal, dtype, bwd_options):
    q, k, v = make_qkv(B, N, N, H, HKV, D, dtype, "cuda")
    check_against_reference(_gluon_backward(causal=causal), q, k, v, causal)


@needs_hopper
@pytest.mark.parametrize("causal,window,softcap,alibi", VARIANTS)
@pytest.mark.parametrize("B,N,H,HKV,D", [(2, 1000, 4, 2, 128), (1, 333, 2, 2, 128),
                                         (2, 1000, 4, 2, 64), (2, 1000, 4, 2, 256)])
def test_gluon_backward_variants_match_reference(B, N, H, HKV, D, causal, window, softcap,
                                                 alibi, bwd_options):
    """The Gluon backward with windows (one- and two-sided, with causal, narrower than a block),
    softcap and ALiBi (per head and per batch and head), gradients against the float64
    reference, at each of its head dims."""
    q, k, v = make_qkv(B, N, N, H, HKV, D, torch.bfloat16, "cuda", requires_grad=False)
    if softcap:
        q = q * 4  # large logits: the cap matters
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    slopes = None
    if alibi is not None:
        shape = (H,) if alibi == "head" else (B, H)
        slopes = torch.rand(shape, device="cuda", dtype=torch.float32) * 0.3
    check_against_reference(
        _gluon_backward(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes),
        q, k, v, causal, window_size=window, softcap=softcap, alibi_slopes=slopes)


@needs_hopper
@pytest.mark.parametrize("mask_mod", [_doc_mod, _prefix_mod], ids=["document", "prefix-lm"])
@pytest.mark.parametrize("N,H,HKV,D", [(1024, 4, 2, 128), (1000, 2, 2, 128), (700, 2, 2, 128),
                                       (700, 2, 2, 64)])
def test_gluon_backward_block_masks_match_reference(mask_mod, N, H, HKV, D, bwd_options):
    """The Gluon backward over a block mask's transposed lists (GQA with a shared mask, ragged
    ends; N = 700: the last 128-row query block's second half is all padding), gradients
    against the float64 reference of the same mask."""
    from flashtriton.block_mask import create_block_mask
    q, k, v = make_qkv(2, N, N, H, HKV, D, torch.bfloat16, "cuda")
    bm = create_block_mask(mask_mod, None, None, N, N, "cuda")
    i = torch.arange(N, device="cuda")
    keep = mask_mod.fn(0, 0, i[:, None], i[None, :])
    check_against_reference(_gluon_backward(block_mask=bm), q, k, v, False,
                            attn_mask=keep[None, None].expand(2, H, N, N))


@needs_hopper
@pytest.mark.parametrize("layout", ["heads-major", "packed"])
@pytest.mark.parametrize("D", [128, 256])
def test_gluon_backward_reads_strided_layouts(layout, D):
    q, k, v = make_qkv(2, 333, 333, 4, 4, D, torch.bfloat16, "cuda", requires_grad=False)
    q, k, v = (_heads_major(x) for x in (q, k, v)) if layout == "heads-major" else _packed(q, k, v)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    for causal in (False, True):
        check_against_reference(_gluon_backward(causal=causal), q, k, v, causal)


@needs_hopper
def test_gluon_backward_rejects_what_it_does_not_take():
    q, k, v = make_qkv(1, 64, 64, 2, 2, 128, torch.bfloat16, "cuda", requires_grad=False)
    out, lse = launch.attention_forward_gluon(q, k, v)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        launch.attention_backward_gluon(out.float(), q.float(), k.float(), v.float(), out, lse)
    with pytest.raises(ValueError, match="dout in q's dtype"):
        strided = torch.randn(1, 64, 2, 256, dtype=q.dtype, device="cuda")[..., ::2]
        launch.attention_backward_gluon(strided, q, k, v, out, lse)
    with pytest.raises(ValueError, match="_dq_mode 2 or 1"):
        launch.attention_backward_gluon(out, q, k, v, out, lse, _dq_mode=0)
    with pytest.raises(ValueError, match="head dims"):
        launch.attention_backward_gluon(out[..., :32], q[..., :32], k[..., :32], v[..., :32],
                                        out, lse)


def test_gluon_backward_timeline_rows_and_step_parts():
    """attention_backward_gluon's _timeline (timing only) must be programs x TL_ROW int64 (a
    ValueError otherwise, before the kernel's other checks), and tools/timeline.py's step_parts
    reads a consumer's step marks, one a warp: the mean cycles of each part over the steps
    that are neither a walk's first nor its last, a column a warp, and the SM's cycles a
    ns."""
    from flashtriton.kernels.gluon import bwd
    from tools import timeline as probe
    q = torch.zeros(2, 300, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 300, 2, 128, dtype=torch.bfloat16)
    row = bwd.TL_ROW.value
    for bad in (torch.zeros(12, 8, dtype=torch.int64), torch.zeros(13, row, dtype=torch.int64),
                torch.zeros(12, row, dtype=torch.int32), torch.zeros(row, 12).long().t()):
        with pytest.raises(ValueError, match="_timeline must be"):
            launch.attention_backward_gluon(q, q, k, k, q, None, _timeline=bad)
    steps, n = bwd.TL_STEPS.value, bwd.TL_MARKS.value
    warps = bwd.TL_WARPS.value
    assert len(probe.STEP_PARTS) == n - 1  # a name for each part between two marks
    assert row == 8 + 2 * steps * n * warps
    tl = torch.zeros(2, row, dtype=torch.int64)
    tl[:, 2], tl[:, 3] = 1000, 1000 + 5 * 100  # K / V landed, walk done (ns)
    k_ = torch.arange(n)
    for p_, walk in enumerate((5, steps + 3)):  # the second walk is longer than TL_STEPS
        for t in range(min(walk, steps)):
            for w in range(2):
                for u in range(warps):
                    at = 8 + (t * 2 + w) * n * warps + u + k_ * warps
                    # step t starts at 200 t; warp u's parts take 1 + u, 2 + u, .., n - 1 + u
                    # cycles (the part's number times 1 + w)
                    tl[p_, at] = 200 * t + 10 + k_ * (k_ + 1) // 2 * (1 + w) + u * k_
    tl[:, 8 + ((3 * 2 + 1) * n + n - 1) * warps + 2] += 40  # consumer 1's step 3, warp 2
    parts, counted, rate = probe.step_parts(tl)
    assert len(parts) == 2 * warps
    assert counted == 3 + steps - 2  # steps 1-3 of the first walk, 1 .. steps - 2 of the other
    for w in range(2):
        for u in range(warps):
            col = parts[w * warps + u]
            longer = 2 * 40 / counted if (w, u) == (1, 2) else 0  # its last part, both walks
            assert col[:n - 2].tolist() == [(i + 1) * (1 + w) + u for i in range(n - 2)]
            assert float(col[n - 2]) == pytest.approx((n - 1) * (1 + w) + u + longer)
            assert col[n - 1] == 200
    # the first walk: 5 steps from cycle 10 to step 4's last mark (800 + 10 + (n - 1) n / 2)
    # over 500 ns
    assert rate == pytest.approx((4 * 200 + (n - 1) * n // 2) / 500)


def test_bench_gluon_ab_settings(monkeypatch):
    """bench_gluon --ab NAME[=A,B]: a boolean option (or one left None for configs'
    gluon_*_options to choose) off and on (a None one's other values integers: ORDER=0,2),
    an integer option at A and B (CONSUMER_REGS=232,240), several joined by + together,
    fwd. / bwd. naming one kernel's (left out of the other kernel's A/B, an error where
    nothing is left), bench.variants.ab_side's items for either side, and an error for an
    unknown name or a third value."""
    from tools import bench_gluon as bench
    fwd, bwd = configs.GLUON_FWD_OPTIONS, configs.GLUON_BWD_OPTIONS
    regs = bench.ab_settings("CONSUMER_REGS=232,240", fwd)
    assert regs == [{"CONSUMER_REGS": 232}, {"CONSUMER_REGS": 240}]
    assert all(type(st["CONSUMER_REGS"]) is int for st in regs)
    assert bench.ab_settings("EARLY_S", bwd) == [{"EARLY_S": False}, {"EARLY_S": True}]
    assert bench.ab_settings("ONE_LOOP=1,0", bwd) == [{"ONE_LOOP": True}, {"ONE_LOOP": False}]
    monkeypatch.setitem(bwd, "ORDER", None)  # (gluon_bwd_options chooses; 2: groups)
    order = bench.ab_settings("ORDER=0,2", bwd)
    assert order == [{"ORDER": False}, {"ORDER": 2}] and type(order[1]["ORDER"]) is int
    both = "fwd.CONSUMER_REGS=232,240+fwd.PRODUCER_REGS=40,24"
    assert bench.ab_settings(both, fwd) == [
        {"CONSUMER_REGS": 232, "PRODUCER_REGS": 40}, {"CONSUMER_REGS": 240, "PRODUCER_REGS": 24}]
    assert bench.ab_labels(bench.ab_settings(both, fwd))[1] == \
        "CONSUMER_REGS=240,PRODUCER_REGS=24"
    assert bench.ab_settings(both + "+ONE_LOOP", bwd) == [{"ONE_LOOP": False},
                                                          {"ONE_LOOP": True}]
    from flashtriton.bench.variants import ab_side
    assert ab_side(both + "+ONE_LOOP", 1) == \
        ["fwd.CONSUMER_REGS=240", "fwd.PRODUCER_REGS=24", "ONE_LOOP=1"]
    assert ab_side("HEAVY_FIRST", 0) == ["HEAVY_FIRST=0"]
    for bad, table in (("NO_SUCH", fwd), ("CONSUMER_REGS=1,2,3", fwd),
                       ("bwd.HEAVY_FIRST", fwd), (both, bwd)):
        with pytest.raises(SystemExit):
            bench.ab_settings(bad, table)


@needs_hopper
def test_gluon_forward_replays_alibi_and_block_masks(monkeypatch):
    """A Gluon forward with ALiBi or a block mask whose signature was seen replays over new
    tensors, new slopes and a new block mask of the same shapes included (their pointers
    handed over: the second slopes differ, and the output follows them; against the float64
    reference each time): _gluon_forward runs once a variant."""
    monkeypatch.setattr(runtime, "_CALLS", {})  # no replay of another test's calls
    from flashtriton.block_mask import create_block_mask
    calls = []
    real = launch._gluon_forward
    monkeypatch.setattr(launch, "_gluon_forward", lambda *a: calls.append(1) or real(*a))
    cases = [lambda: dict(causal=True, alibi_slopes=torch.rand(4, device="cuda") * 0.3),
             lambda: dict(block_mask=create_block_mask(_doc_mod, None, None, 700, 700, "cuda"))]
    i = torch.arange(700, device="cuda")
    doc = _doc_mod.fn(0, 0, i[:, None], i[None, :])[None, None].expand(2, 4, 700, 700)
    for n, case in enumerate(cases):
        for trial in range(2):
            opts = case()
            ref = dict(attn_mask=doc) if "block_mask" in opts else dict(opts)
            ref.pop("causal", None)
            q, k, v = make_qkv(2, 700, 700, 4, 2, 128, torch.bfloat16, "cuda")
            check_against_reference(lambda q, k, v: flash_attention_with_lse(q, k, v, **opts),
                                    q, k, v, opts.get("causal", False), check_grads=False,
                                    **ref)
            assert len(calls) == n + 1, (n, trial)


@needs_hopper
def test_gluon_backward_replays(monkeypatch):
    """A Gluon backward whose signature was seen replays its prep kernel and kernel over new
    tensors (a window, ALiBi and a block mask; gradients against the float64 reference both
    times): _gluon_bwd_launch runs once a variant, and again after a change of
    configs.GLUON_BWD_OPTIONS (part of the signature)."""
    monkeypatch.setattr(runtime, "_CALLS", {})  # no replay of another test's calls
    from flashtriton.block_mask import create_block_mask
    monkeypatch.setattr(configs, "GLUON_BWD_MIN_SEQLEN", 512)
    calls = []
    real = launch.gluon_attn._gluon_bwd_launch
    monkeypatch.setattr(launch.gluon_attn, "_gluon_bwd_launch", lambda *a: calls.append(1) or real(*a))
    bm = create_block_mask(_doc_mod, None, None, 700, 700, "cuda")
    i = torch.arange(700, device="cuda")
    doc = _doc_mod.fn(0, 0, i[:, None], i[None, :])[None, None].expand(2, 4, 700, 700)
    slopes = torch.rand(4, device="cuda") * 0.3
    cases = [(dict(causal=True, window_size=(256, 0)), {}),
             (dict(causal=True, alibi_slopes=slopes), {}),
             (dict(block_mask=bm), dict(attn_mask=doc))]
    for n, (opts, ref) in enumerate(cases):
        for trial in range(2):
            q, k, v = make_qkv(2, 700, 700, 4, 2, 128, torch.bfloat16, "cuda")
            check_against_reference(lambda q, k, v: flash_attention_with_lse(q, k, v, **opts),
                                    q, k, v, opts.get("causal", False),
                                    **{**ref, **{n: x for n, x in opts.items()
                                                 if n not in ("causal", "block_mask")}})
            assert len(calls) == n + 1, (opts, trial)
    monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, "EARLY_S", True)
    q, k, v = make_qkv(2, 700, 700, 4, 2, 128, torch.bfloat16, "cuda")
    check_against_reference(lambda q, k, v: flash_attention_with_lse(q, k, v, **cases[0][0]),
                            q, k, v, True, window_size=(256, 0))
    assert len(calls) == 4


@needs_hopper
@pytest.mark.parametrize("D", configs.GLUON_BWD_HEAD_DIMS, ids=lambda d: f"d{d}")
def test_attention_backward_runs_gluon_where_it_fits(monkeypatch, D):
    """flash_attention's backward on Hopper at the head dims of configs.GLUON_BWD_HEAD_DIMS
    runs the warp-specialized Gluon backward from GLUON_BWD_MIN_SEQLEN tokens (lowered here to
    reach it at test size), GQA and an expanded dout included (against the float64
    reference); deterministic=True and torch.use_deterministic_algorithms (up to head dim
    128), FLASHTRITON_GLUON=0, a window, head dim 72 and shorter sequences run the Triton
    backward."""
    calls = []
    real = launch._gluon_backward
    monkeypatch.setattr(launch, "_gluon_backward", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(configs, "GLUON_BWD_MIN_SEQLEN", 512)
    monkeypatch.setattr(configs, "GLUON_BWD_VARIANTS", False)
    q, k, v = make_qkv(2, 513, 513, 4, 2, D, torch.bfloat16, "cuda")
    for causal in (False, True):
        check_against_reference(
            lambda q, k, v: flash_attention_with_lse(q, k, v, causal=causal), q, k, v, causal)
    assert len(calls) == 2
    flash_attention(q, k, v).sum().backward()  # dout: an expanded scalar, copied
    assert len(calls) == 3

    def grads(**opts):
        return torch.autograd.grad(flash_attention(q, k, v, **opts), (q, k, v),
                                   torch.ones_like(q))
    grads(deterministic=True)
    grads(window_size=(64, 64))
    torch.use_deterministic_algorithms(True)
    try:
        grads()
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setattr(_env, "GLUON", False)
    grads()
    monkeypatch.setattr(_env, "GLUON", True)
    q72, k72, v72 = make_qkv(1, 600, 600, 2, 2, 72, torch.bfloat16, "cuda")
    torch.autograd.grad(flash_attention(q72, k72, v72), (q72, k72, v72), torch.ones_like(q72))
    grads(causal=True)  # reaches the Gluon backward: the calls above did not
    # (over head dim 128 the deterministic calls take it: dQ from the Triton dQ kernel)
    seen = 4 + 2 * configs.gluon_bwd_split(D)
    assert len(calls) == seen
    monkeypatch.setattr(configs, "GLUON_BWD_MIN_SEQLEN", 1024)
    grads()
    assert len(calls) == seen


@needs_hopper
@pytest.mark.parametrize("D", configs.GLUON_PADDED_HEAD_DIMS, ids=lambda d: f"d{d}")
def test_padded_head_dims_run_gluon(monkeypatch, D):
    """flash_attention at the padded head dims (configs.GLUON_PADDED_HEAD_DIMS) runs the Gluon
    forward and backward from their GLUON_PADDED_*_MIN_SEQLEN (lowered here), against the
    float64 reference, gradients included, in SDPA's heads-major layout and qkv-packed too,
    with no copies of the inputs: the forward's peak memory is its output and LSE."""
    monkeypatch.setattr(runtime, "_CALLS", {})
    monkeypatch.setattr(configs, "GLUON_BWD_MIN_SEQLEN", 512)
    monkeypatch.setitem(configs.GLUON_FWD_MIN_SEQLEN, D, 512)
    monkeypatch.setitem(configs.GLUON_PADDED_BWD_MIN_SEQLEN, D, 512)
    calls = []
    for name in ("_gluon_forward", "_gluon_backward"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name,
                            lambda *a, real=real, name=name: calls.append(name) or real(*a))
    q, k, v = make_qkv(2, 700, 700, 4, 2, D, torch.bfloat16, "cuda")
    for causal in (False, True):
        check_against_reference(
            lambda q, k, v: flash_attention_with_lse(q, k, v, causal=causal), q, k, v, causal)
    for shaped in (_heads_major, lambda x: x):
        q2, k2, v2 = (shaped(x).requires_grad_() for x in (q, k, v))
        if shaped is not _heads_major:  # qkv-packed, MHA
            q2, k2, v2 = (x.requires_grad_() for x in _packed(q, q, q))
        check_against_reference(
            lambda q, k, v: flash_attention_with_lse(q, k, v, causal=True), q2, k2, v2, True)
    assert calls == ["_gluon_forward", "_gluon_backward"] * 4
    with torch.no_grad():
        flash_attention(q, k, v)  # (compiled)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = flash_attention(q, k, v)
        extra = torch.cuda.max_memory_allocated() - base
    lse_bytes = 4 * q.shape[0] * q.shape[2] * q.shape[1]
    assert extra <= out.numel() * out.element_size() + lse_bytes + (1 << 20), extra


@needs_hopper
@pytest.mark.parametrize("D", [128, 192, 256], ids=lambda d: f"d{d}")
def test_deterministic_backward_is_bitwise_repeatable(monkeypatch, D):
    """deterministic=True gives bitwise the same gradients run after run: on the Triton
    backward where the default would run the Gluon backward (whose dQ sums vary in order), on
    the Gluon backward over head dim 128 (dK and dV from its programs' own sums, dQ from the
    Triton dQ kernel)."""
    monkeypatch.setattr(configs, "GLUON_BWD_MIN_SEQLEN", 512)
    monkeypatch.setitem(configs.GLUON_PADDED_BWD_MIN_SEQLEN, 192, 512)
    calls = []
    real = launch._gluon_backward
    monkeypatch.setattr(launch, "_gluon_backward", lambda *a: calls.append(1) or real(*a))
    q, k, v = make_qkv(2, 1024, 1024, 4, 2, D, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    runs = [torch.autograd.grad(flash_attention(q, k, v, causal=True, deterministic=True),
                                (q, k, v), dout) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    assert len(calls) == (3 if D > 128 else 0)



@needs_hopper
@pytest.mark.parametrize("one_sided", [True, False])
@pytest.mark.parametrize("window,softcap,alibi", [((-1, -1), 0.0, "head"),
                                                  ((-1, -1), 0.0, "batch"),
                                                  ((150, -1), 0.0, "batch"),
                                                  ((150, -1), 30.0, "head")])
def test_gluon_causal_alibi_forms_match_reference(monkeypatch, window, softcap, alibi,
                                                  one_sided):
    """Causal ALiBi in the Gluon forward and backward, in the one-sided form (the keys' part
    in the scores, the rows' part in the LSE; configs.GLUON_ALIBI_ONE_SIDED, the default),
    and the general one: output, LSE and gradients against the float64 reference, GQA,
    ragged N."""
    monkeypatch.setattr(configs, "GLUON_ALIBI_ONE_SIDED", one_sided)
    B, N, H, HKV = 2, 1000, 4, 2
    q, k, v = make_qkv(B, N, N, H, HKV, 128, torch.bfloat16, "cuda")
    slopes = torch.rand((H,) if alibi == "head" else (B, H), device="cuda") * 0.3
    check_against_reference(
        _gluon_backward(causal=True, window_size=window, softcap=softcap, alibi_slopes=slopes),
        q, k, v, True, window_size=window, softcap=softcap, alibi_slopes=slopes)


def test_gluon_alibi_form_follows_the_switch_and_the_mask(monkeypatch):
    """launch.gluon_attn._gluon_alibi: no slopes 0; the general form 1; the one-sided form 2 only with
    GLUON_ALIBI_ONE_SIDED and every visible key at or left of the diagonal (causal, or a
    window whose right side is 0)."""
    slopes = torch.ones(2)
    q = torch.empty(1, 64, 2, 128)

    def form(**opts):
        variant = Variant(0.1, alibi_slopes=slopes, **opts)
        return launch.gluon_attn._gluon_alibi(launch.calls._common(q, None, 64, 64, variant)[0], slopes)
    assert launch.gluon_attn._gluon_alibi({}, None) == 0
    monkeypatch.setattr(configs, "GLUON_ALIBI_ONE_SIDED", False)
    assert form(causal=True) == 1
    monkeypatch.setattr(configs, "GLUON_ALIBI_ONE_SIDED", True)
    assert form(causal=True) == 2 and form(window_left=30, window_right=0) == 2
    assert form() == 1 and form(window_left=30, window_right=5) == 1


def test_backward_ahead_compiles_on_meta_tensors_and_launches_nothing(monkeypatch):
    """gluon_backward_ahead hands both backward kernels (the prep kernel and the Gluon
    kernel) to Triton's warmup, never to a launch, with meta tensors for everything but the
    variant's: no allocation, no device work (it runs beside the forward's compile); dQ's
    buffer in q's layout (tokens-major here, heads-major for SDPA's layout)."""
    from flashtriton.kernels.attn_bwd import _attn_bwd_prep_kernel
    from flashtriton.kernels.gluon import bwd
    warmed = []
    for kernel, name in ((_attn_bwd_prep_kernel, "prep"), (bwd._attn_bwd_gluon_kernel, "bwd")):
        monkeypatch.setattr(kernel, "warmup",
                            lambda *a, name=name, **kw: warmed.append((name, a, kw)))
        monkeypatch.setattr(kernel, "run", lambda *a, **kw: pytest.fail("launched"))
    for layout in ("tokens", "heads"):
        warmed.clear()
        strides = ((256 * 512, 512, 128, 1) if layout == "tokens"
                   else (4 * 256 * 128, 128, 256 * 128, 1))
        q, k, v = (torch.empty_strided((2, 256, 4, 128), strides, dtype=torch.bfloat16,
                                       device="meta") for _ in range(3))
        variant = Variant(0.1, True, -1, -1, 0.0, None)
        launch.gluon_attn.gluon_backward_ahead(q, k, v, variant)
        assert [w[0] for w in warmed] == ["prep", "bwd"]
        tensors = [a for _, args, _ in warmed for a in args if isinstance(a, torch.Tensor)]
        assert tensors and all(t.device.type == "meta" for t in tensors)
        dq_acc = warmed[0][1][5]
        assert dq_acc.dtype == torch.float32 and dq_acc.shape == q.shape
        assert (_token_rows(dq_acc)[1] == 0) == (layout == "tokens")
        descs = warmed[1][1][:7]
        assert [list(d.block_shape) for d in descs[:4]] == [[64, 128], [128, 128], [128, 128],
                                                             [64, 128]]


def test_backward_ahead_starts_no_thread_where_it_does_not_apply(monkeypatch):
    """launch.backward_ahead: nothing under the interpreter, with FLASHTRITON_COMPILE_AHEAD=0,
    on CPU tensors, or for a signature it has seen."""
    started = []
    monkeypatch.setattr(launch.threading.Thread, "start", lambda self: started.append(self))
    monkeypatch.setattr(launch, "_AHEAD", set())
    q = torch.randn(1, 16, 2, 64)
    variant = Variant(0.1, True, -1, -1, 0.0, None)
    launch.backward_ahead(q, q, q, variant)  # CPU tensors (and the interpreter here)
    monkeypatch.setattr(_env, "COMPILE_AHEAD", False)
    launch.backward_ahead(q, q, q, variant)
    assert started == [] and launch._PENDING == []


@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_backward_compiled_ahead_is_the_one_the_backward_runs(monkeypatch, D):
    """The first forward of a training call compiles its Gluon backward in a thread
    (backward_ahead): with Triton's in-memory caches of both backward kernels emptied, after
    the forward (and join_ahead) they hold the kernels, and the backward (gradients against
    the float64 reference) compiles none more."""
    from flashtriton.kernels.attn_bwd import _attn_bwd_prep_kernel
    from flashtriton.kernels.gluon import bwd
    monkeypatch.setattr(runtime, "_CALLS", {})
    monkeypatch.setattr(runtime, "_COMPILED", {})
    monkeypatch.setattr(launch, "_AHEAD", set())
    monkeypatch.setattr(configs, "GLUON_BWD_MIN_SEQLEN", 512)
    kernels = (_attn_bwd_prep_kernel, bwd._attn_bwd_gluon_kernel)
    dev = torch.cuda.current_device()
    for kernel in kernels:
        kernel.device_caches[dev][0].clear()
    q, k, v = make_qkv(2, 700, 700, 4, 2, D, torch.bfloat16, "cuda")
    seen = []

    def fn(q, k, v):
        res = flash_attention_with_lse(q, k, v, causal=True)
        launch.join_ahead()
        seen.append([set(kernel.device_caches[dev][0]) for kernel in kernels])
        return res
    check_against_reference(fn, q, k, v, True)
    assert all(seen[0]), "nothing compiled ahead"
    assert [set(kernel.device_caches[dev][0]) for kernel in kernels] == seen[0]
