"""The Gluon family's launchers (Hopper, Triton 3.6): the warp-specialized forward
(kernels/gluon/fwd.py) and backward (kernels/gluon/bwd.py), what each cannot run (the misfit
functions, whose reasons flashtriton.explain reports), TMA descriptors over token rows and
the replays of both. Their tiles and launch constants are configs' (GLUON_FWD_BLOCK_M ..,
gluon_fwd_options, gluon_bwd_options)."""

import functools
from typing import NamedTuple, Optional, Tuple

import torch
import triton

from .. import _env, configs, runtime
from ..kernels.attn_bwd import _attn_bwd_prep_kernel
from ..runtime import Replay, call_signature, launch_jit, on_device_of, pointers, recall, remember
from .calls import (Variant, Varlen, _alibi_args, _block_args, _common, _lse_buffer, _windowed)
from .triton_attn import triton_backward


class _Addr(int):
    """A data pointer where Triton's launcher reads a descriptor's base (it calls data_ptr())."""

    def data_ptr(self) -> int:
        return int(self)


class _TmaView(NamedTuple):
    """What Triton's launcher reads of a host TensorDescriptor (make_tensordesc_arg in its
    NVIDIA driver): a replay builds these instead (no validation: the call that compiled
    validated the same shapes and strides)."""
    base: object
    shape: list
    strides: list
    padding: str = "zero"


class GluonReplay(NamedTuple):
    """A compiled Gluon forward and its launch: called with the data pointers of q, k, v, out,
    lse and (where the call has them) ALiBi's slopes, the block mask's lists and the sinks
    (as a Replay), it builds q's, k's and v's descriptors over the new pointers."""
    replay: Replay
    views: tuple  # (shape, strides) of q's, k's and v's 2-D views

    def __call__(self, q, k, v, out, lse, alibi=None, bmask=None, sinks=None) -> None:
        self.replay(*[_TmaView(_Addr(p), *view) for p, view in zip((q, k, v), self.views)],
                    out, lse, alibi, bmask, sinks)


def _gluon_signature(site: str, variant: Variant, blocks, *tensors) -> Optional[tuple]:
    """The signature (call_signature) of a Gluon kernel's call, ALiBi, block masks and sinks
    included: its replay takes the slopes, the lists (blocks: the forward's kv_blocks, the
    backward's q_blocks) and the sinks by pointer, so the signature holds their shapes,
    strides and dtypes as the tensors'; None for what the Gluon kernels do not run (an SDPA
    mask, dropout, a score_mod)."""
    if variant.attn_mask is not None or variant.dropout_p or variant.score_mod is not None:
        return None
    scalars = variant._replace(alibi_slopes=None, kv_blocks=None, q_blocks=None, sinks=None)
    return call_signature(site, scalars, *tensors, variant.alibi_slopes, blocks, variant.sinks)


def _token_rows(t: torch.Tensor):
    """A (B, N, Ht, D) tensor as TMA's 2-D view of its token rows: (rb, rh, ch, rows, width),
    head h of batch b starting at row b * rb + h * rh, column h * ch; None where the layout
    is neither tokens-major (heads side by side in a row) nor heads-major (a head's rows
    together), or where TMA cannot address it (16-byte aligned base and row stride)."""
    B, N, Ht, D = t.shape
    sb, st, sh, sd = t.stride()
    if sd != 1 or t.data_ptr() % 16 or st * t.element_size() % 16:
        return None
    if (Ht == 1 or sh == D) and st >= Ht * D and (B == 1 or sb == N * st):
        return N, 0, D, B * N, Ht * D
    if st == D and (Ht == 1 or sh == N * D) and (B == 1 or sb == Ht * N * D):
        return Ht * N, N, 0, B * Ht * N, D
    return None



def gluon_misfit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant,
                 varlen: Optional[Varlen] = None, head_dims=None,
                 variants: bool = False) -> Optional[str]:
    """Why the Gluon forward (kernels/gluon/fwd.py) cannot run this call, or None: it takes a
    Hopper GPU, bf16 / fp16, dense batches with SQ == SK, head dims head_dims (None:
    configs.GLUON_FWD_KERNEL_HEAD_DIMS) or configs.GLUON_PADDED_HEAD_DIMS (the tiles of the
    next of them: _gluon_descriptor), plain or causal attention with a positive scale
    (variants: also windows, softcap, ALiBi and block masks of configs.GLUON_FWD_BLOCK_N),
    and q, k, v in a layout of _token_rows (k and v alike)."""
    if head_dims is None:
        head_dims = configs.GLUON_FWD_KERNEL_HEAD_DIMS
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype:
        return f"the Gluon forward takes bf16 or fp16, got {q.dtype}, {k.dtype}, {v.dtype}"
    if varlen is not None or q.dim() != 4 or q.shape[1] != k.shape[1]:
        return "the Gluon forward takes dense batches with as many queries as keys"
    width = configs.gluon_head_dim(q.shape[-1])
    if width not in head_dims or v.shape[-1] != q.shape[-1]:
        return (f"the Gluon forward takes head dims {head_dims} (v's as q's) and "
                f"{configs.GLUON_PADDED_HEAD_DIMS} padded, got {q.shape[-1]} "
                f"(v {v.shape[-1]})")
    w = variant
    windowed = _windowed(w)
    listed = (w.kv_blocks is not None and w.block_size == configs.GLUON_FWD_BLOCK_N
              == configs.gluon_fwd_block_n(width)
              and w.mask_mod is not None and not w.causal and not windowed)
    if (w.attn_mask is not None or w.dropout_p or w.score_mod is not None
            or (w.mask_mod is not None or w.kv_blocks is not None) and not listed
            or w.diag_offset or not w.softmax_scale > 0
            or (not variants and (windowed or w.softcap or w.alibi_slopes is not None
                                  or listed))):
        return ("the Gluon forward takes plain or causal attention with softmax_scale > 0"
                + (", windows, softcap, ALiBi and block masks of %d" % configs.GLUON_FWD_BLOCK_N
                   if variants else ""))
    if k.stride() != v.stride() or _token_rows(q) is None or _token_rows(k) is None:
        return ("the Gluon forward takes q, k, v tokens-major or heads-major, 16-byte "
                "aligned, k and v alike")
    if _env.INTERPRET or not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the Gluon forward needs a Hopper GPU (sm_90)"
    return gluon_triton_misfit()


@functools.lru_cache(maxsize=None)
def gluon_triton_misfit() -> Optional[str]:
    """Why this Triton cannot run the Gluon kernels, or None."""
    release = tuple(int(x) for x in triton.__version__.split(".")[:2])
    if release not in configs.GLUON_TRITONS:
        return (f"the Gluon kernels are written for Triton "
                f"{', '.join('%d.%d' % r for r in configs.GLUON_TRITONS)}; this is Triton "
                f"{triton.__version__}")
    return None




def _gluon_alibi(common, alibi) -> int:
    """The Gluon kernels' HAS_ALIBI: 0 none, 1 the general form, 2 one-sided."""
    if alibi is None:
        return 0
    return 2 if configs.GLUON_ALIBI_ONE_SIDED and common["HAS_ALIBI"] == 2 else 1


def _gluon_forward(q, k, v, out, lse, variant: Variant) -> GluonReplay:
    """Launch kernels/gluon/fwd.py on tensors that gluon_misfit passed, in tiles of
    configs.gluon_head_dim's width (_gluon_descriptor). The variant's window, softcap and
    ALiBi arguments come from _common (the Triton kernels' definitions)."""
    from ..kernels.gluon import fwd
    B, N, H, D = q.shape
    width = configs.gluon_head_dim(D)
    listed = variant.kv_blocks is not None
    bm = configs.gluon_fwd_block_m(width, listed)
    bn = configs.gluon_fwd_block_n(width, bm)
    descs, rows = zip(*(_gluon_descriptor(t, [b, width], width) for t, b in
                        ((q, configs.gluon_fwd_q_block(bm)), (k, bn), (v, bn))))
    views = tuple((list(d.shape), list(d.strides)) for d in descs)
    common, _ = _common(q, None, N, N, variant)
    alibi, stride_ab, stride_ah = _alibi_args(variant)
    # Causal attention without a window keeps its own constexpr path (IS_CAUSAL); with a
    # window the causal bound is the window's upper bound (UPPER 0).
    windowed = _windowed(variant)
    bmask, *bmask_args = _block_args(variant.kv_blocks)
    args = (out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            stride_ab, stride_ah, *bmask_args, H, H // k.shape[2], N, *rows[0], *rows[1],
            common["qk_scale"], common["cap2"], -common["WIN_LEFT"],
            common["WIN_RIGHT"])
    consts = dict(IS_CAUSAL=bool(variant.causal) and not windowed,
                  NUM_STAGES=configs.GLUON_FWD_STAGES,
                  HAS_LOWER=common["HAS_LOWER"], HAS_UPPER=windowed and common["HAS_UPPER"],
                  HAS_SOFTCAP=common["HAS_SOFTCAP"], HAS_ALIBI=_gluon_alibi(common, alibi),
                  LISTED=bmask is not None, MASK_MOD=variant.mask_mod,
                  HAS_SINK=variant.sinks is not None, CONSUMERS=bm // 64, DIM=D,
                  **configs.gluon_fwd_options(common["HAS_LOWER"], bm))
    grid = (configs.cdiv(N, bm), B * H, 1)
    kernel = fwd._attn_fwd_gluon_kernel
    compiled = kernel[grid](*descs, out, lse, alibi, bmask, variant.sinks, *args, **consts)
    tail = (*args, *[consts[n] for n in kernel.arg_names[8 + len(args):]])
    replay = Replay(compiled, grid, 8, tail, q.get_device(),
                    compiled.metadata.global_scratch_size > 0)
    return GluonReplay(replay, views)


def _gluon_variant(q, causal, softmax_scale, window_size, softcap, alibi_slopes, block_mask):
    """The Variant of attention_forward_gluon's and attention_backward_gluon's options."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    variant = Variant(scale, causal, window_size[0], window_size[1], softcap, alibi_slopes)
    if block_mask is not None:
        variant = variant.with_block_mask(block_mask)
    return variant


@on_device_of
def attention_forward_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            causal: bool = False, softmax_scale: Optional[float] = None,
                            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            alibi_slopes: Optional[torch.Tensor] = None, block_mask=None
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The Gluon forward alone (tests and benchmarks; attention_forward chooses it where it
    fits at configs.GLUON_FWD_HEAD_DIMS and, from their GLUON_FWD_MIN_SEQLEN, head dim 64 and
    the padded ones, its variants while GLUON_VARIANTS is on): O in q's
    layout and the natural-log LSE (B, H, N); head dims configs.GLUON_FWD_KERNEL_HEAD_DIMS
    and configs.GLUON_PADDED_HEAD_DIMS;
    flash-attn's window_size, softcap and alibi_slopes, or a block_mask of 128-blocks
    (flashtriton.block_mask; not at head dim 256). Raises ValueError
    where gluon_misfit names a reason."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"attention_forward_gluon takes (B, N, H, D) q, k, v, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    variant = _gluon_variant(q, causal, softmax_scale, window_size, softcap, alibi_slopes,
                             block_mask)
    reason = gluon_misfit(q, k, v, variant, variants=True)
    if reason is not None:
        raise ValueError(reason)
    out = runtime._empty_like(q)
    lse, _, _ = _lse_buffer(q, None)
    _gluon_forward(q, k, v, out, lse, variant)
    return out, lse


def _gluon_descriptor(t: torch.Tensor, block, width: int):
    """A host TensorDescriptor over t's token rows (_token_rows) in blocks of block = (rows,
    columns) for a kernel of tiles width wide, and the rows' (rb, rh, ch). Where t's head dim
    is under the width, the view is 3-D (rows, heads a row, head dim) in blocks of (rows, 1,
    columns): TMA fills the columns past the head dim with zeros and drops them from a
    reduction (kernels/gluon/common.load_rows), and ch counts heads (1 tokens-major, 0
    heads-major)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    el = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
    rb, rh, ch, rows, columns = _token_rows(t)
    D = t.shape[-1]
    if D == width:
        layout = gl.NVMMASharedLayout.get_default_for(block, el[t.dtype])
        return (TensorDescriptor(t, [rows, columns], [t.stride(1), 1], block, layout),
                (rb, rh, ch))
    block = [block[0], 1, block[1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, el[t.dtype])
    return (TensorDescriptor(t, [rows, columns // D, D], [t.stride(1), D, 1], block, layout),
            (rb, rh, 1 if ch else 0))


def _gluon_flat_descriptor(t: torch.Tensor, block: int):
    """A host TensorDescriptor over a fresh (contiguous, aligned) fp32 buffer t as one row of
    t.numel() values, `block` at a time (the Gluon backward's LSE and delta tiles)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor(t, [t.numel()], [1], [block],
                            gl.NVMMASharedLayout.get_default_for([block], gl.float32))


def gluon_backward_misfit(dout: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, variant: Variant, dq_mode: int = 2) -> Optional[str]:
    """Why the Gluon backward (kernels/gluon/bwd.py) cannot run this call, or None: what
    gluon_misfit asks of the forward with its variants (block masks of GLUON_FWD_BLOCK_N, the
    backward's GLUON_BWD_BLOCK_N too), head dims configs.GLUON_BWD_KERNEL_HEAD_DIMS, a block
    mask shared by the query heads of a KV head, dout (unless None) in q's dtype and in a
    layout of _token_rows, dq_mode 2 or 1."""
    reason = gluon_misfit(q, k, v, variant, head_dims=configs.GLUON_BWD_KERNEL_HEAD_DIMS,
                          variants=True)
    blocks = variant.q_blocks
    if reason is None and blocks is not None and blocks.shape[1] > 1 and q.shape[2] > k.shape[2]:
        reason = "the Gluon backward takes GQA with a block mask shared by the heads (H=None)"
    if reason is None and dout is not None and (
            dout.shape != q.shape or dout.dtype != q.dtype
            or _token_rows(dout) is None):
        reason = "the Gluon backward takes dout in q's dtype, tokens-major or heads-major"
    if reason is None and dq_mode not in (1, 2):
        reason = f"the Gluon backward takes _dq_mode 2 or 1, got {dq_mode}"
    return reason


class GluonBwdReplay(NamedTuple):
    """A Gluon backward's two launches, the prep kernel's and the kernel's (Replays): called
    with the data pointers of out, dout, lse, the prep kernel's outputs (log2 LSE, delta, the
    fp32 dQ buffer), q, k, v, dk, dv, ALiBi's slopes and the block mask, it builds the
    kernel's descriptors over the new pointers (as GluonReplay)."""
    prep: Replay
    kernel: Replay
    views: tuple  # (shape, strides) of the descriptors of q, k, v, dout, dQ's buffer (None
    # at head dim 256), lse2, delta

    def __call__(self, out, dout, lse, lse2, delta, dq_acc, q, k, v, dk, dv, alibi,
                 bmask) -> None:
        self.prep(out, dout, lse, lse2, delta, dq_acc)
        bases = (q, k, v, dout, dq_acc, lse2, delta)
        self.kernel(*[None if view is None else _TmaView(_Addr(p), *view)
                      for p, view in zip(bases, self.views)], dk, dv, alibi, bmask)


def _gluon_backward(dout, q, k, v, out, lse, variant: Variant, dq_mode: int = 2,
                    timeline=None):
    """dQ, dK, dV and delta from kernels/gluon/bwd.py on tensors that gluon_backward_misfit
    passed, in tiles of configs.gluon_head_dim's width (_gluon_descriptor): the prep
    kernel (the log2 LSE and delta, each head's rows padded to a multiple of
    configs.GLUON_BWD_BLOCK_N, and a zeroed fp32 dQ buffer), the backward, and dQ's copy
    into q's layout; a call whose signature (_gluon_signature; none for timing runs) was
    seen replays the first two (GluonBwdReplay). Where configs.gluon_bwd_split (head dim
    256) the Gluon kernel computes dK and dV only, and dQ comes from the Triton dQ kernel
    (triton_backward's, which recomputes S and dP; no fp32 buffer): dQ by atomics from the
    Gluon kernel's registers ran at half its rate (docs/perf.md). The variant's window,
    softcap and ALiBi arguments come from _common (as the forward's). timeline: None, or
    (timing only) an int64 tensor of gluon/bwd.TL_ROW per program (gluon/bwd._mark,
    _mark_step)."""
    B, N, H, D = q.shape
    signature = None
    if timeline is None and dq_mode == 2:
        signature = _gluon_signature("gluon_bwd", variant, variant.q_blocks, dout, q, k, v, out,
                                     lse)
    replays = recall(signature)
    split = configs.gluon_bwd_split(configs.gluon_head_dim(D))
    dq_acc = None
    if not split:
        dq_acc = _dq_buffer(q)
    elif dq_mode == 2:
        dq = triton_backward(dout, q, k, v, out, lse, variant, dkdv=False)[0]
    else:  # (timing only: dQ not computed)
        dq = torch.zeros_like(q)
    dk, dv = runtime._empty_like(k), runtime._empty_like(v)
    # (a block mask's walk reads both 64-row halves of its last 128-row query block)
    pad = configs.cdiv(N, configs.GLUON_BWD_BLOCK_N) * configs.GLUON_BWD_BLOCK_N
    lse2, delta = runtime._empty((2, B * H * pad), torch.float32, q.device)
    lse = lse.contiguous()
    alibi, bmask = variant.alibi_slopes, variant.q_blocks
    tensors = (out, dout, lse, lse2, delta, dq_acc, q, k, v, dk, dv, alibi, bmask)
    ptrs = pointers(*tensors) if replays is not None else None
    if ptrs is not None:
        replays[0](*ptrs)
    else:
        replay = _gluon_bwd_launch(*tensors, variant, dq_mode, timeline)
        if pointers(*tensors) is not None:  # as a replay's tensors must be
            remember(signature, replay)
    if not split:
        dq = runtime._empty_like(q)
        dq.copy_(dq_acc)
    return dq, dk, dv, delta.view(B, H, pad)[:, :, :N]


def gluon_backward_ahead(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         variant: Variant) -> None:
    """Compile (launch nothing) the Gluon backward's kernels for a call of these q, k, v and
    variant, its other tensors as meta tensors in the layouts the backward gives them
    (out and dout in q's, dK and dV in k's and v's, the stats flat): no allocation and no
    device work, so it may run in a thread while the forward's kernels compile (Triton's
    compiler releases the GIL: launch.backward_ahead). Only the head dims the kernel runs
    dQ's Triton kernel at a split head dim is left to the backward."""
    B, N, H, D = q.shape

    def meta(like: torch.Tensor, dtype=None) -> torch.Tensor:
        return torch.empty_strided(like.shape, like.stride(), dtype=dtype or like.dtype,
                                   device="meta")
    out = meta(q)
    pad = configs.cdiv(N, configs.GLUON_BWD_BLOCK_N) * configs.GLUON_BWD_BLOCK_N
    stats = torch.empty((B * H * pad,), dtype=torch.float32, device="meta")
    lse = torch.empty((B, H, N), dtype=torch.float32, device="meta")
    dq_acc = None
    if not configs.gluon_bwd_split(configs.gluon_head_dim(D)):
        heads_major = _token_rows(q)[1] != 0
        dq_acc = (torch.empty((B, H, N, D), dtype=torch.float32, device="meta").transpose(1, 2)
                  if heads_major else torch.empty((B, N, H, D), dtype=torch.float32,
                                                  device="meta"))
    _gluon_bwd_launch(out, out, lse, stats, stats, dq_acc, q, k, v, meta(k), meta(v),
                      variant.alibi_slopes, variant.q_blocks, variant, 2, None,
                      compile_only=True)


def _dq_buffer(q: torch.Tensor) -> torch.Tensor:
    """The Gluon backward's fp32 dQ buffer, (B, N, H, D) in q's layout (_token_rows: its
    rows and columns are q's, so the kernel's reductions use q's coordinates): tokens-major
    or heads-major memory, dense. dQ's copy out of it into a gradient of q's layout then
    keeps the order of memory (a transposing copy is slower: docs/journal/perf-journal.md)."""
    B, N, H, D = q.shape
    if _token_rows(q)[1] == 0:  # tokens-major (rh 0)
        return runtime._empty((B, N, H, D), torch.float32, q.device)
    return runtime._empty((B, H, N, D), torch.float32, q.device).transpose(1, 2)


def _gluon_bwd_launch(out, dout, lse, lse2, delta, dq_acc, q, k, v, dk, dv, alibi, bmask,
                      variant: Variant, dq_mode, timeline,
                      compile_only: bool = False) -> Optional[GluonBwdReplay]:
    """_gluon_backward's launches through Triton's launchers; their GluonBwdReplay where both
    can be replayed. compile_only: compile both kernels for these arguments (Triton's
    warmup; tensors may be meta tensors, whose data pointer 0 is aligned), launch nothing."""
    from ..kernels.gluon import bwd
    B, N, H, D = q.shape
    width = configs.gluon_head_dim(D)
    bm, bn = configs.GLUON_BWD_BLOCK_M, configs.gluon_bwd_block_n(width)
    common, _ = _common(q, None, N, N, variant)
    _, stride_ab, stride_ah = _alibi_args(variant)  # (alibi, bmask: the variant's, given)
    _, *bmask_args = _block_args(variant.q_blocks)
    pad = lse2.numel() // (B * H)
    dq_strides = (0, 0, 0) if dq_acc is None else dq_acc.stride()[:3]
    prep_args = (out, dout, lse, lse2, delta, dq_acc, out.stride(0), out.stride(1),
                 out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2), lse.stride(0),
                 lse.stride(1), *dq_strides, H, N, pad)
    prep_consts = dict(HEAD_DIM=width, BLOCK_M=bm, DIM=D, num_warps=4)
    prep_grid = (pad // bm, B * H)
    if compile_only:
        _attn_bwd_prep_kernel.warmup(*prep_args, grid=prep_grid, **prep_consts)
        prep = None
    else:
        prep = launch_jit(_attn_bwd_prep_kernel, prep_grid, *prep_args, **prep_consts)
    q_desc, q_rows = _gluon_descriptor(q, [bm, width], width)
    do_desc, do_rows = _gluon_descriptor(dout, [bm, width], width)
    k_desc, kv_rows = _gluon_descriptor(k, [bn, width], width)
    v_desc, _ = _gluon_descriptor(v, [bn, width], width)
    # Each of the kernel's two consumers reduces half the width (none at a split head dim).
    dq_desc = None if dq_acc is None else _gluon_descriptor(dq_acc, [bm, width // 2], width)[0]
    descs = (q_desc, k_desc, v_desc, do_desc, dq_desc, _gluon_flat_descriptor(lse2, bm),
             _gluon_flat_descriptor(delta, bm))
    args = (dk.stride(0), dk.stride(1), dk.stride(2), stride_ab, stride_ah, *bmask_args, H,
            H // k.shape[2], N, *q_rows, *do_rows, *kv_rows, common["qk_scale"],
            variant.softmax_scale, common["cap2"], -common["WIN_LEFT"], common["WIN_RIGHT"],
            timeline)
    consts = dict(DQ_MODE=dq_mode, HAS_LOWER=common["HAS_LOWER"],
                  HAS_UPPER=common["HAS_UPPER"], HAS_SOFTCAP=common["HAS_SOFTCAP"],
                  HAS_ALIBI=_gluon_alibi(common, alibi), LISTED=bmask is not None,
                  MASK_MOD=variant.mask_mod,
                  **configs.gluon_bwd_options(common["HAS_UPPER"], common["HAS_LOWER"],
                                              alibi is not None, width), DIM=D)
    grid = (configs.cdiv(N, bn), B * k.shape[2], 1)
    kernel = bwd._attn_bwd_gluon_kernel
    if compile_only:
        kernel.warmup(*descs, dk, dv, alibi, bmask, *args, grid=grid, **consts)
        return None
    compiled = kernel[grid](*descs, dk, dv, alibi, bmask, *args, **consts)
    if prep is None or not hasattr(compiled, "packed_metadata"):
        return None
    lead = len(descs) + 4
    tail = (*args, *[consts[n] for n in kernel.arg_names[lead + len(args):]])
    views = tuple(None if d is None else (list(d.shape), list(d.strides)) for d in descs)
    return GluonBwdReplay(prep, Replay(compiled, grid, lead, tail, q.get_device(),
                                       compiled.metadata.global_scratch_size > 0), views)


@on_device_of
def attention_backward_gluon(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             causal: bool = False, softmax_scale: Optional[float] = None,
                             window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[torch.Tensor] = None, block_mask=None,
                             _dq_mode: int = 2, _timeline: Optional[torch.Tensor] = None
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gluon backward (kernels/gluon/bwd.py) alone (tests and benchmarks; attention_backward
    chooses it where it fits): dQ, dK, dV in the layouts of q, k, v from the forward's out and
    natural-log lse (B, H, N); the options as attention_forward_gluon's. dQ is summed in an
    order that varies from run to run (not bitwise repeatable) up to head dim 128; over it,
    dQ comes from the Triton dQ kernel and every gradient is repeatable. _dq_mode: 2 TMA reductions, 1
    dQ not added (timing only); _timeline: gluon/bwd._mark's rows (timing only; programs x
    gluon/bwd.TL_ROW int64). Raises ValueError where gluon_backward_misfit names a reason."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or dout.shape != q.shape:
        raise ValueError(f"attention_backward_gluon takes (B, N, H, D) dout, q, k, v, got "
                         f"{tuple(dout.shape)}, {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if _timeline is not None:
        from ..kernels.gluon import bwd
        block_n = configs.gluon_bwd_block_n(configs.gluon_head_dim(q.shape[-1]))
        rows = (configs.cdiv(q.shape[1], block_n) * q.shape[0]
                * k.shape[2],
                bwd.TL_ROW.value)
        if (tuple(_timeline.shape) != rows or _timeline.dtype != torch.int64
                or not _timeline.is_contiguous()):
            raise ValueError(f"_timeline must be a contiguous int64 tensor of shape {rows}, got "
                             f"{_timeline.dtype} {tuple(_timeline.shape)}")
    variant = _gluon_variant(q, causal, softmax_scale, window_size, softcap, alibi_slopes,
                             block_mask)
    reason = gluon_backward_misfit(dout, q, k, v, variant, _dq_mode)
    if reason is not None:
        raise ValueError(reason)
    return _gluon_backward(dout, q, k, v, out, lse, variant, _dq_mode, _timeline)[:3]
