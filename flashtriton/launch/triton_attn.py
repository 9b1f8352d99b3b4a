"""The Triton family's launchers: the forward (kernels.attn_fwd) and the two backward kernels
(kernels.attn_bwd), autotuned over configs' tiles; every variant, any GPU and the
interpreter. Also the decoding kernel's autotuner (flashtriton.decode launches it)."""

import functools
from typing import Optional, Tuple

import torch
import triton

from .. import configs, runtime
from ..kernels.attn_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _varlen_spans_kernel
from ..kernels.attn_fwd import _attn_fwd_kernel
from ..kernels.decode import _attn_decode_kernel
from ..runtime import Replay, autotuned, launch_jit, pointers, recall, remember
from .calls import (_DECODE_KEY, _KEY, Variant, Varlen, _alibi_args, _block_args, _common, _cu,
                    _dims, _mask_args, _signature, _sizes, _strides)

_fwd = autotuned("fwd", _attn_fwd_kernel, (*_KEY, "USE_TMA", "PAGE_SIZE"))
_dkdv = autotuned("dkdv", _attn_bwd_dkdv_kernel, (*_KEY, "USE_TMA"))
_dq = autotuned("dq", _attn_bwd_dq_kernel, (*_KEY, "USE_TMA"))
_decode = autotuned("decode", _attn_decode_kernel, _DECODE_KEY)


def _bounded_spans(q, k, varlen: Varlen) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's (start, end) rows of the packed q and of k, 2B int32s each, with the
    rows of a sequence outside the tensors made empty (kernels.attn_bwd._varlen_spans_kernel):
    the backward kernels' CU_Q / CU_K under IS_VARLEN 2 (kernels.common.seq_bounds)."""
    if varlen.seqused_k is not None:
        raise ValueError("seqused_k is for the forward only")
    B = varlen.cu_seqlens_q.numel() - 1
    k_at = configs.cdiv(2 * B, 4) * 4  # the key pairs start 16-byte aligned
    spans = torch.empty(k_at + 2 * B, dtype=torch.int32, device=q.device)
    launch_jit(_varlen_spans_kernel, (configs.cdiv(B, 256),), varlen.cu_seqlens_q,
               varlen.cu_seqlens_k, spans, B, q.shape[0], k.shape[0], k_at, BLOCK_B=256)
    return spans[:2 * B], spans[k_at:]


def triton_forward(q, k, v, out, lse, stride_lb: int, stride_lh: int, variant: Variant,
                   varlen: Optional[Varlen] = None) -> Optional[Replay]:
    """The Triton forward kernel into ``out`` and ``lse`` (LSE row i of batch b, head h at
    b * stride_lb + h * stride_lh + i, i counted from the sequence's first row in the packed
    tensors under varlen). Returns the launch's Replay, if any: its leading arguments are
    q, k, v, out, lse, ALiBi, the score mask, CU_Q, CU_K, SEQUSED_K, the block mask, the
    sinks, the block table. Paged keys (varlen.block_table): k and v (pages, page_size,
    HKV, D), read by TMA where pages are whole row blocks of one tensor. v's head dim may
    differ from q's and k's (MLA): out has v's."""
    B, SQ, SK, H, HKV, D = _dims(q, k, varlen)
    alibi, stride_ab, stride_ah = _alibi_args(variant)
    (mask, *mask_strides), _ = _mask_args(variant)
    common, key = _common(q, varlen, SQ, SK, variant, v.shape[-1])
    if common["HAS_ALIBI"] == 2:  # the forward kernel has the general form only
        common = dict(common, HAS_ALIBI=1)
    table = None if varlen is None else varlen.block_table
    page_size = 0 if table is None else k.shape[1]
    use_tma = runtime._use_tma(k, v)
    if table is not None:
        common = dict(common, IS_VARLEN=4 if varlen.singles_elsewhere else 3)
        use_tma = use_tma and k.shape[0] * page_size < 2**31 and all(
            x.stride(0) == page_size * x.stride(1) for x in (k, v))
    blocks, *block_strides, bm_n = _block_args(variant.kv_blocks)
    args = (q, k, v, out, lse, alibi, mask, *_cu(varlen), blocks, variant.sinks, table,
            _strides(q), _strides(k), _strides(v), _strides(out), (stride_lb, stride_lh),
            (stride_ab, stride_ah), tuple(mask_strides), tuple(block_strides), bm_n,
            0 if table is None else table.stride(0),
            H, H // HKV, *_sizes(q, k, varlen, SQ, SK), k.shape[0] if table is not None else 0)
    flags = dict(USE_TMA=use_tma, HAS_SINK=variant.sinks is not None, PAGE_SIZE=page_size,
                 INVARIANT=variant.batch_invariant, **common)

    def grid(meta):
        return configs.cdiv(SQ, meta["BLOCK_M"]), B * H
    if variant.batch_invariant:  # one tile for every call (no autotuning)
        return runtime.launch_jit(_attn_fwd_kernel, grid, *args,
                                  _cfg=_invariant_config(max(common["BLOCK_D"], common["BLOCK_DV"]),
                                                         q.element_size()),
                                  **flags)
    return runtime._launch(_fwd, grid, (*key, use_tma, page_size), *args, **flags)


@functools.lru_cache(maxsize=None)
def _invariant_config(block_d: int, elem_bytes: int) -> triton.Config:
    """The Triton config of configs.invariant_tile (one object a tile: launch_jit keys its
    compiled kernels by the config's identity)."""
    bm, bn, warps, stages = tile = configs.invariant_tile(block_d, elem_bytes)
    return triton.Config(configs.as_kwargs(tile), num_warps=warps, num_stages=stages)



def triton_backward(dout, q, k, v, out, lse, variant: Variant, varlen: Optional[Varlen] = None,
                    dkdv: bool = True
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two Triton backward kernels (dQ, then dK/dV): dQ, dK, dV in the layouts of q, k, v,
    and delta = rowsum(dO * O) in lse's shape; a call whose signature was seen replays both.
    dkdv False: the dQ kernel alone (dK and dV None; the Gluon backward at head dim 256)."""
    B, SQ, SK, H, HKV, D = _dims(q, k, varlen)
    dq = runtime._empty_like(q)
    dk, dv = (runtime._empty_like(k), runtime._empty_like(v)) if dkdv else (None, None)
    if varlen is not None:  # packed rows past the last sequence get no program: their gradient
        # is 0 (the last offset is on the device: no slice of the rows without a sync)
        for g in (dq, dk, dv):
            if g is not None:
                g.zero_()
    lse = lse.contiguous()  # delta below shares its strides
    # The dQ kernel also computes delta = rowsum(dO * O) of its rows for the dK/dV kernel
    # (launched after it on the same stream).
    delta = runtime._empty(lse.shape, torch.float32, lse.device)
    # (the backward kernels read no sinks: the LSE holds them)
    signature = _signature("bwd" if dkdv else "bwd_dq", variant._replace(sinks=None), varlen, q,
                           k, v, out, dout)
    replays = recall(signature)
    ptrs = pointers(q, k, v, out, dout, lse, delta, dq, dk, dv) if replays is not None else None
    if ptrs is not None:
        q_, k_, v_, out_, dout_, lse_, delta_, dq_, dk_, dv_ = ptrs
        replays[0](q_, k_, v_, out_, dout_, lse_, delta_, dq_)
        if dkdv:
            replays[1](q_, k_, v_, dout_, lse_, delta_, dk_, dv_)
        return dq, dk, dv, delta
    common, key = _common(q, varlen, SQ, SK, variant, v.shape[-1])
    cu = _cu(varlen)
    if varlen is not None:  # the sequences' rows bounded once, not in each program
        cu = (*_bounded_spans(q, k, varlen), None)
        common = dict(common, IS_VARLEN=2)
    alibi, stride_ab, stride_ah = _alibi_args(variant)
    (mask, *mask_strides), _ = _mask_args(variant)
    stride_lb, stride_lh = (lse.stride(0), lse.stride(1)) if varlen is None else (0, lse.stride(0))
    use_tma = runtime._use_tma(q, k, v, dout)  # dQ reads K and V by TMA, dK/dV reads Q and dO
    key = (*key, use_tma)
    stats = ((stride_lb, stride_lh), (stride_ab, stride_ah), tuple(mask_strides))
    blocks, *block_strides, bm_n = _block_args(variant.kv_blocks)
    replay_dq = runtime._launch(
        _dq, lambda meta: (configs.cdiv(SQ, meta["BLOCK_M"]), B * H), key,
        q, k, v, out, dout, lse, delta, dq, alibi, mask, *cu, blocks,
        _strides(q), _strides(k), _strides(v), _strides(out), _strides(dout), _strides(dq),
        *stats, tuple(block_strides), bm_n,
        H, H // HKV, *_sizes(q, k, varlen, SQ, SK),
        USE_TMA=use_tma, **common,
    )
    if not dkdv:
        remember(signature, replay_dq)
        return dq, dk, dv, delta
    # dK/dV reads each query block's LSE and delta by TMA too where their rows start 16-byte
    # aligned (delta is allocated like lse): no varlen offsets, SQ a multiple of 4.
    stats_tma = (use_tma and varlen is None and lse.data_ptr() % 16 == 0
                 and stride_lb % 4 == 0 and stride_lh % 4 == 0)
    blocks, *block_strides, bm_n = _block_args(variant.q_blocks)
    replay_dkdv = runtime._launch(
        _dkdv, lambda meta: (configs.cdiv(SK, meta["BLOCK_N"]), B * HKV), (*key, stats_tma),
        q, k, v, dout, lse, delta, dk, dv, alibi, mask, *cu, blocks,
        _strides(q), _strides(k), _strides(v), _strides(dout), _strides(dk), _strides(dv),
        *stats, tuple(block_strides), bm_n,
        HKV, H // HKV, *_sizes(q, k, varlen, SQ, SK),
        USE_TMA=use_tma, STATS_TMA=stats_tma, **common,
    )
    remember(signature, replay_dq, replay_dkdv)
    return dq, dk, dv, delta
