"""Attention over a KV cache: in-place appends, contiguous or paged caches, split-KV decoding.

Inference only (no autograd). Launcher and API in one module: the kernels live in
``kernels/decode.py``.
"""

import functools
import math
from typing import NamedTuple, Optional, Tuple, Union

import torch

from . import _env, configs, launch, runtime, validation
from .api import AttentionOutput
from .kernels.decode import _attn_merge_kernel, _cache_spans_kernel, _kv_append_kernel
from .launch import Variant, triton_attn
from .validation import (check_alibi, check_cache_indices, check_index_tensor, check_qkv,
                         check_scale, check_softcap, check_window, describe)


# Eager steps that read at most configs.DECODE_MERGE_MAX_BYTES of cache, with splits that the
# merge loads at once, merge them in the split kernel (MERGE: one launch, ~7 us less host time
# a step on the H200's host); other steps and CUDA graph captures take the merge kernel (1-8 us
# less GPU time a step). The split kernel's counts and partials live in a workspace per
# (device, stream): steps on one stream run in order.
_COUNTS = 4096  # counters at a workspace's head: one per (sequence, KV head) of a launch
_WORKSPACES = {}  # (device index, stream) -> (workspace, its fp32 elements, its address)
_WORKSPACES_MAX = 64  # more streams start over (torch reuses a freed block in its stream's order)
# Timing only (tools/timeline.py decode): None, or the split and the merge kernel's int64
# tables of (programs, 5) rows (kernels.common.mark); steps with a timeline are not remembered.
TIMELINE = None


def _eager(q: torch.Tensor) -> bool:
    """Not under a CUDA graph's capture (whose replays may run on several streams at once)."""
    return not (q.is_cuda and torch.cuda.is_current_stream_capturing())


def _workspace(x: torch.Tensor, elements: int) -> tuple:
    """The workspace of x's device's current stream, with room for ``elements`` fp32 partials
    after its counters (zero between steps: the split that merges sets its count back)."""
    index = x.get_device()  # -1: the CPU (the interpreter), whose steps run in order
    key = (index, runtime.driver.active.get_current_stream(index) if index >= 0 else 0)
    entry = _WORKSPACES.get(key)
    if entry is None or entry[1] < _COUNTS + elements:
        if entry is None and len(_WORKSPACES) >= _WORKSPACES_MAX:
            _WORKSPACES.clear()
        buf = torch.zeros(_COUNTS + elements, dtype=torch.float32, device=x.device)
        entry = _WORKSPACES[key] = (buf, buf.numel(), buf.data_ptr())
    return entry


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """The device's SMs (the interpreter's CPU: 4)."""
    if device.type == "cpu":
        return 4
    return torch.cuda.get_device_properties(device.index or 0).multi_processor_count


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x (B, S, H, D) at positions (B, S), on its first 2 * cos.shape[1]
    dims; cos, sin: (seqlen_ro, rotary_dim / 2). interleaved: rotate pairs (x0, x1), (x2, x3)
    (GPT-J); else the two halves (GPT-NeoX). Computed in float32, returned in x's dtype."""
    rd = 2 * cos.shape[1]
    # positions past the table (cache indices that validation would refuse) read its ends
    # instead of failing a device-side bounds check
    positions = positions.long().clamp(0, cos.shape[0] - 1)
    c = cos[positions].float()[:, :, None, :]                         # (B, S, 1, rd / 2)
    s = sin[positions].float()[:, :, None, :]
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot.to(x.dtype), x[..., rd:]], dim=-1)


def _splits(num_splits: int, B: int, HKV: int, capacity: int, block_n: int, device,
            paged: bool = False) -> int:
    """One program per SM (one wave) where that makes >= 8 splits of >= 256 keys each of a
    contiguous cache, else at most two programs per SM (the decode tiles fit two per SM).
    H200, 8 KV heads, graph replays (docs/perf.md, session 12): one wave beat two programs per
    SM by 1-3% from 32K keys (B=1 64K 16 splits 3441-3507 GB/s in four runs against 33 splits'
    3384-3395); session 25, one tile (64 keys, 4 warps): also below, from 256 keys a split (B=1
    4K 16 splits 1118 GB/s against 33's 1051, 8K 1649 / 1603, 16K 2189 / 2178; B=2 2K 8 splits
    1116 / 1090, 4K 1657 / 1636, 8K 2185 / 2196), not at 128 (B=1 2K: 672 / 701); one wave's
    16 splits also merge in the kernel (eager: one launch). With fewer, longer splits the
    tuner's tile was not stable (B=8 64K, 2 splits:
    4422-4457 GB/s, then 3301 in a run where it picked another tile), and paged caches ran
    12-19% behind contiguous with one wave. Rounding up past two per SM left a nearly empty
    second wave (B=4, 64K: 9 splits 3353 GB/s, 8 splits 4219). One tile per split at least.
    Short caches split too: one program per (sequence, KV head) over 1K keys ran B=1 at 207
    GB/s against 383 split; with one split (batch x KV heads >= SMs) no merge runs."""
    max_splits = max(1, configs.cdiv(capacity, block_n))
    if num_splits > 0:
        return min(num_splits, max_splits)
    sms = _num_sms(device)
    one_wave = sms // (B * HKV)
    if not paged and one_wave >= 8 and capacity >= 256 * one_wave:
        return min(max_splits, one_wave, 128)
    return max(1, min(max_splits, (2 * sms) // (B * HKV), 128))


@runtime.on_device_of
def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, *,
                           cache_seqlens: Union[int, torch.Tensor, None] = None,
                           block_table: Optional[torch.Tensor] = None,
                           cache_batch_idx: Optional[torch.Tensor] = None,
                           cache_leftpad: Optional[torch.Tensor] = None,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None,
                           rotary_cos: Optional[torch.Tensor] = None,
                           rotary_sin: Optional[torch.Tensor] = None,
                           rotary_interleaved: bool = True,
                           num_splits: int = 0, return_lse: bool = True) -> AttentionOutput:
    """Attention of a few query tokens over a KV cache, after appending k, v to it.

    Args:
        q: (batch, seqlen_q, nheads, headdim), any seqlen_q: decoding and speculative
           tokens run the split-KV kernel; many query tokens over a contiguous cache
           (chunked prefill, ``configs.kvcache_prefill``) run the prefill forward kernel.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or paged:
           (num_blocks, page_size, nheads_k, headdim) with ``block_table``; any strides
           with a unit stride on headdim (e.g. K and V as views of one buffer).
        k, v: (batch, seqlen_new, nheads_k, headdim) or None: written into the cache at
           positions cache_seqlens[b] ... (in place, also into pages), then attended.
        cache_seqlens: int or (batch,) int32: keys in the cache before the append
           (None: the whole cache).
        block_table: (batch, max_blocks) int32 page indices, in any order; page_size a
           power of two >= 8.
        cache_batch_idx: (batch,) int32, the cache row of each sequence (contiguous caches).
        cache_leftpad: (batch,) int32, the first valid cache position of each sequence
           (left-padded caches): keys before it are ignored; positions (rotary, appends)
           stay the cache's indices, as in flash-attn.
        causal / window_size: aligned to the end of the cache: query token t sits at
           position cache_len - seqlen_q + t.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2): rotary embedding applied to
           the new k at positions cache_seqlens[b] + i and to q at the same positions if
           causal or windowed, else at cache_seqlens[b] for every query token (flash-attn's
           rule: cache indices, left padding included); rotary_interleaved as in flash-attn.
        num_splits: KV splits per sequence (0: enough to fill the GPU); partial results
           are merged by their LSEs.
        return_lse: False: no LSE is stored or allocated (lse None), a step's host time ~2 us
           shorter (as flash-attn's ``return_softmax_lse=False``).

    Returns ``AttentionOutput(out, lse)``: out (batch, seqlen_q, nheads, headdim), lse
    (batch, nheads, seqlen_q) float32 or None. Not differentiable.

    Index tensors are checked as ``flashtriton.validation`` says (their contents on the host
    in validation mode, or when they live on the CPU); whatever they hold, nothing outside
    the caches is read or written: a sequence whose length, row or left padding lies outside
    its cache sees no keys (out 0, lse -inf), keys in pages outside the pool are not
    attended, and appends outside the cache are dropped.
    """
    # A plain step (no append, no rotary, per-sequence lengths) whose arguments match an
    # earlier call's in everything but the data replays that call's launches before the
    # checks, which the earlier call passed with the same shapes, strides, dtypes, devices
    # and settings.
    step = (k is None and rotary_cos is None and isinstance(cache_seqlens, torch.Tensor)
            and isinstance(q, torch.Tensor) and q.stride(-1) == 1
            and type(window_size) is tuple and TIMELINE is None
            and not validation.validating())
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
               alibi_slopes)
    signature = None
    if step:
        try:
            signature = step_signature(q, k_cache, v_cache, cache_seqlens, block_table,
                                       cache_batch_idx, cache_leftpad, alibi_slopes, softmax_scale,
                                       causal, window_size, softcap, num_splits, return_lse)
        except AttributeError:  # not a tensor where one belongs: the checks below say so
            step = False
        known = runtime.recall(signature)
        if known is not None:
            B, SQ, H, _ = q.shape
            out = runtime._empty(q.shape, q.dtype, q.device)
            lse = (runtime._empty((B, H, SQ), torch.float32, q.device)
                   if return_lse or known[2] == 3 else None)  # (the prefill route writes one)
            if _replay(known, tensors, out, lse):
                return AttentionOutput(out, lse if return_lse else None)
    checked = _check_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                          cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, causal,
                          window_size)
    cache_seqlens = checked.cache_seqlens
    B, SQ, H, D = q.shape
    if rotary_cos is not None:  # positions: the cache's indices (left padding included)
        steps = torch.arange(SQ, device=q.device)
        local = causal or checked.window != (-1, -1)
        q = apply_rotary(q, rotary_cos, rotary_sin,
                         cache_seqlens[:, None] + (steps if local else 0 * steps),
                         rotary_interleaved)
        if k is not None:
            k = apply_rotary(k, rotary_cos, rotary_sin,
                             cache_seqlens[:, None] + torch.arange(k.shape[1], device=q.device),
                             rotary_interleaved)
    s_new = 0
    if k is not None:
        s_new = k.shape[1]
        append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx)
    seqlens = cache_seqlens if s_new == 0 else (cache_seqlens + s_new).to(torch.int32)
    scale = check_scale(softmax_scale, D)
    left, right = checked.window
    right = 0 if causal else right
    softcap = check_softcap(softcap)
    alibi = check_alibi(alibi_slopes, B, H, q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if configs.kvcache_prefill(H // k_cache.shape[2], SQ) and block_table is None:
        prefill = _prefill(q, k_cache, v_cache, seqlens, cache_batch_idx, cache_leftpad,
                           Variant(scale, causal, left, right, softcap, alibi), return_lse,
                           signature if step else None, step)
        if prefill is not None:
            return prefill
    return _decode(q, k_cache, v_cache, seqlens, block_table, cache_batch_idx, cache_leftpad,
                   alibi, scale, left, right, softcap, num_splits, return_lse,
                   signature if step else None, step)


class _Checked(NamedTuple):
    cache_seqlens: torch.Tensor  # (B,) int32 on q's device
    window: Tuple[int, int]


def _check_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx,
                cache_leftpad, rotary_cos, rotary_sin, causal, window_size) -> _Checked:
    """attention_with_kvcache's checks (validation.py's, and the index contents where
    validation says so); raises TypeError / ValueError naming the argument."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                    ("cache_seqlens", cache_seqlens), ("block_table", block_table),
                    ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                    ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        int_ok, none_ok = name == "cache_seqlens", name not in ("k_cache", "v_cache")
        if not (isinstance(x, torch.Tensor) or (none_ok and x is None)
                or (int_ok and isinstance(x, int))):
            raise TypeError(f"{name} must be a torch.Tensor{', an int' if int_ok else ''}"
                            f"{' or None' if none_ok else ''}, got {type(x).__name__}")
    paged = block_table is not None
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be 4-D of one shape; got k_cache "
                         f"{describe(k_cache)}, v_cache {describe(v_cache)}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a 4-D (batch, seqlen_q, nheads, headdim) tensor")
    B, SQ, H, D = q.shape
    # dtypes, devices, heads and head dim of q against the cache (whose batch may differ)
    check_qkv(q, k_cache, v_cache, ("q", "k_cache", "v_cache"), same_batch=False)
    HKV = k_cache.shape[2]
    page_size = k_cache.shape[1]
    if paged:
        if page_size < 8 or page_size & (page_size - 1):
            raise ValueError(f"page_size (k_cache.shape[1]) must be a power of two >= 8; got "
                             f"{page_size}")
        check_index_tensor("block_table", block_table, q.device, dims=2,
                           what=" (batch, max_blocks)")
        if block_table.shape[0] != B:
            raise ValueError(f"block_table must be (batch, max_blocks) int32 with batch {B}; "
                             f"got {describe(block_table)}")
        capacity = block_table.shape[1] * page_size
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx applies to contiguous caches, not paged ones")
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] < B:
            raise ValueError(f"k_cache has {k_cache.shape[0]} rows for a batch of {B}; pass "
                             f"cache_batch_idx or a larger cache")
    if cache_seqlens is None:
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    check_index_tensor("cache_seqlens", cache_seqlens, q.device, (B,), what=" (or an int)")
    if cache_batch_idx is not None:
        check_index_tensor("cache_batch_idx", cache_batch_idx, q.device, (B,))
    if cache_leftpad is not None:
        check_index_tensor("cache_leftpad", cache_leftpad, q.device, (B,))
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None and (rotary_cos.shape != rotary_sin.shape or rotary_cos.dim() != 2
                                   or 2 * rotary_cos.shape[1] > D):
        raise ValueError(f"rotary_cos / rotary_sin must be (seqlen_ro, rotary_dim / 2) with "
                         f"rotary_dim <= headdim {D}; got {describe(rotary_cos)} and "
                         f"{describe(rotary_sin)}")
    s_new = 0
    if k is not None:
        check_qkv(q, k, v, ("q", "k", "v"))
        if k.shape[2] != HKV:
            raise ValueError(f"k has {k.shape[2]} heads, the cache {HKV}")
        s_new = k.shape[1]
    window = check_window(window_size)
    rotary_len = None
    if rotary_cos is not None:  # the last position a rotary embedding is taken at, + 1
        local = causal or window != (-1, -1)
        rotary_len = (rotary_cos.shape[0], max(s_new, SQ if local else 1))
    check_cache_indices(cache_seqlens, s_new, capacity, k_cache.shape[0], block_table,
                        page_size, cache_batch_idx, cache_leftpad, rotary_len)
    return _Checked(cache_seqlens, window)


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None,
              cache_batch_idx=None) -> None:
    """Write k, v (B, S_new, HKV, D) into the caches at positions cache_seqlens[b] + i, in
    place (into pages with block_table; rows cache_batch_idx[b]); no host sync. Positions
    past the cache's end, pages outside the pool and rows outside the cache are not written
    (kernels.decode._kv_append_kernel)."""
    B, S_new, HKV, D = k.shape
    if B * S_new == 0:
        return
    paged = block_table is not None
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    runtime.launch_jit(
        _kv_append_kernel, (B * S_new, HKV), k, v, k_cache, v_cache, cache_seqlens,
        block_table, cache_batch_idx, *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3],
        *v_cache.stride()[:3], block_table.stride(0) if paged else 0, S_new, HKV, D,
        k_cache.shape[0], capacity, PAGE_SIZE=k_cache.shape[1] if paged else 1, PAGED=paged,
        HAS_BATCH_IDX=cache_batch_idx is not None, BLOCK_D=configs.block_d(D), num_warps=1)


def _prefill(q, k_cache, v_cache, seqlens, cache_batch_idx, cache_leftpad, variant, return_lse,
             signature, step) -> Optional[AttentionOutput]:
    """Many query tokens over a contiguous cache: the prefill forward kernel over packed views
    (q as (B * SQ, H, D), the cache as (rows * S, HKV, D); sequence b's keys are the
    seqlens[b] - leftpad[b] rows from cache_row(b) * S + leftpad[b] on, Varlen's seqused_k,
    computed on the device by _cache_spans_kernel), two launches that a later call with the
    same signature replays. None where q or the cache do not flatten (the split kernel runs
    instead)."""
    B, SQ, H, D = q.shape
    rows, S = k_cache.shape[0], k_cache.shape[1]
    if (q.stride(0) != SQ * q.stride(1) or rows * S >= 2**31
            or any(c.stride(0) != S * c.stride(1) for c in (k_cache, v_cache))):
        return None
    if variant.alibi_slopes is not None:
        signature = None
    elif not step:  # appends, rotary: the same call but for the data replays its launches
        signature = runtime.call_signature("kvcache-prefill", (variant, return_lse), q, k_cache,
                                          v_cache, seqlens, cache_batch_idx, cache_leftpad,
                                          gluon=False)
    out = runtime._empty(q.shape, q.dtype, q.device)
    lse = runtime._empty((B, H, SQ), torch.float32, q.device)
    tensors = (q, k_cache, v_cache, seqlens, None, cache_batch_idx, cache_leftpad)
    known = runtime.recall(signature)
    if known is not None and _replay(known, tensors, out, lse):
        return AttentionOutput(out, lse if return_lse else None)
    seg = configs.cdiv(B + 1, 4) * 4  # int32s: each part of the spans 16-byte aligned
    spans = torch.empty(3 * seg, dtype=torch.int32, device=q.device)
    run_spans = runtime.launch_jit(
        _cache_spans_kernel, (1,), seqlens, cache_batch_idx, cache_leftpad, spans, B, SQ, S,
        rows, seg, HAS_BATCH_IDX=cache_batch_idx is not None,
        HAS_LEFTPAD=cache_leftpad is not None, BLOCK_B=configs.next_pow2(B + 1), num_warps=1)
    flat = [c.as_strided((rows * S, c.shape[2], D), (c.stride(1), c.stride(2), 1))
            for c in (k_cache, v_cache)]
    # LSE (B, H, SQ) in place: row i of sequence b (packed row b * SQ + i), head h at
    # b * (H - 1) * SQ + h * SQ + (b * SQ + i)
    run_fwd = launch.triton_forward(
        q.view(B * SQ, H, D), *flat, out.view(B * SQ, H, D), lse, (H - 1) * SQ, SQ, variant,
        launch.Varlen(spans[:B + 1], spans[seg:seg + B], SQ, S, spans[2 * seg:2 * seg + B]))
    runtime.remember(signature, run_spans, run_fwd, 3, (seg,))
    return AttentionOutput(out, lse if return_lse else None)


def _decode(q, k_cache, v_cache, seqlens, block_table, cache_batch_idx, cache_leftpad, alibi,
            scale, left, right, softcap, num_splits, return_lse, signature,
            step) -> AttentionOutput:
    """The split kernel (and the merge kernel, or its in-kernel merge) over checked
    arguments; a plain step's launches are remembered under ``signature``."""
    B, SQ, H, D = q.shape
    HKV = k_cache.shape[2]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    out = runtime._empty(q.shape, q.dtype, q.device)
    lse = runtime._empty((B, H, SQ), torch.float32, q.device) if return_lse else None
    if out.numel() == 0:
        return AttentionOutput(out, lse)
    tensors = (q, k_cache, v_cache, seqlens, block_table, cache_batch_idx, cache_leftpad, alibi)
    block_m, row_blocks = configs.decode_rows(H // HKV, SQ, D)
    merge_ok = configs.DECODE_MERGE_IN_KERNEL and _eager(q) and row_blocks == 1  # may merge in the split kernel
    if not step and TIMELINE is None:  # appends, rotary: the same call but for the data replays
        signature = runtime.call_signature(
            "decode", (scale, left, right, softcap, num_splits, return_lse, merge_ok), *tensors,
            gluon=False)
        known = runtime.recall(signature)
        if known is not None and _replay(known, tensors, out, lse):
            return AttentionOutput(out, lse)
    granule = configs.decode_split_granule()  # a multiple of every BLOCK_N the tuner tries
    splits = _splits(num_splits, B * row_blocks, HKV, capacity, granule, q.device, paged)
    split_size = configs.cdiv(configs.cdiv(capacity, splits), granule) * granule
    block_r = configs.next_pow2((H // HKV) * SQ)
    bd = configs.block_d(D)
    block_c = max(1, 8192 // (block_r * bd))  # splits the in-kernel merge loads at once
    has_softcap = softcap > 0
    flags = dict(BLOCK_D=bd, EVEN_D=bd == D, PAGED=paged,
                 SAME_LAYOUT=k_cache.stride()[:3] == v_cache.stride()[:3], HAS_LOWER=left >= 0,
                 HAS_UPPER=right >= 0, HAS_SOFTCAP=has_softcap, HAS_ALIBI=alibi is not None,
                 HAS_BATCH_IDX=cache_batch_idx is not None,
                 HAS_LEFTPAD=cache_leftpad is not None, PDL=runtime.use_pdl(q.device),
                 BLOCK_M=block_m)
    # One tile for both merges, per split length and grid: a tile tuned for B=1 128K's one
    # wave of 16 splits of 8K keys read B=64 8K's four waves (one split of 8K keys) at 0.995x
    # SDPA; tuned there, 1.009x.
    waves = min(4, configs.next_pow2(configs.cdiv(splits * B * HKV * row_blocks,
                                                  _num_sms(q.device))))
    key = (q.dtype, configs.bucket(split_size), waves, *flags.values())

    def split_kernel(o_part, lse_part, merge_args=(None, None, None, 0, 0, 0)):
        """Launch the split kernel; merge_args: MERGE's OUT, LSE, COUNTERS, OUT's strides."""
        merge = merge_args[0] is not None
        if o_part is out:  # one split: (split, b, h, t) of the output and its LSE (or None)
            o_strides = (0, out.stride(0), out.stride(2), out.stride(1))
            lse_strides = (0, 0, 0) if lse is None else (0, lse.stride(0), lse.stride(1))
        else:
            o_strides, lse_strides = o_part.stride()[:4], lse_part.stride()[:3]
        return runtime._launch(
            triton_attn._decode, (splits, B * HKV, row_blocks), key, *tensors, o_part, lse_part,
            *merge_args[:3], None if TIMELINE is None else TIMELINE[0],
            *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_table.stride(0) if paged else 0,
            (alibi.stride(0) if alibi.dim() == 2 else 0) if alibi is not None else 0,
            alibi.stride(-1) if alibi is not None else 0,
            *o_strides, *lse_strides, *merge_args[3:],
            HKV, H // HKV, SQ, D, left, right,
            scale * (1.0 / softcap if has_softcap else math.log2(math.e)),
            softcap * math.log2(math.e),
            split_size, k_cache.shape[0], capacity, k_cache.shape[1] if paged else 1,
            configs.bucket(split_size), waves,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=_env.INTERPRET and q.dtype == torch.bfloat16, **flags, MERGE=merge,
            BLOCK_R=block_r if merge else 1, BLOCK_C=block_c if merge else 1,
            **runtime.pdl_option(flags["PDL"]))

    if splits == 1:  # the split's normalised result and LSE are the output
        runtime.remember(signature, split_kernel(out, lse), (), 0, (0, 0))
        return AttentionOutput(out, lse)
    parts = _partials_layout(splits, B, H, SQ, D)
    in_kernel = (merge_ok and splits <= block_c and B * HKV <= _COUNTS
                 and 2 * B * capacity * HKV * D * q.element_size() <= configs.DECODE_MERGE_MAX_BYTES)
    if not in_kernel or signature is not None:
        # The merge kernel's way; into spare outputs before a merge in the kernel whose step
        # will replay: a capture of the same step takes this way, and finds its kernels
        # compiled and its tile tuned.
        o_part, lse_part = _partials(
            splits, B, H, SQ, D, torch.empty(parts[0], dtype=torch.float32, device=q.device))
        run_decode = split_kernel(o_part, lse_part)
        run_merge = merge_partials(o_part, lse_part, *(
            (torch.empty_like(out), lse if lse is None else torch.empty_like(lse)) if in_kernel
            else (out, lse)))
    if in_kernel:
        ws = _workspace(q, parts[0])[0]
        o_part, lse_part = _partials(splits, B, H, SQ, D, ws[_COUNTS:])
        run_decode = split_kernel(o_part, lse_part,
                                  (out, lse, ws[:_COUNTS].view(torch.int32), *out.stride()[:3]))
        runtime.remember(signature, run_decode, (), 2, parts)
    else:
        runtime.remember(signature, run_decode, run_merge, 1, parts)
    return AttentionOutput(out, lse)


def step_signature(q, k_cache, v_cache, cache_seqlens, block_table=None, cache_batch_idx=None,
                   cache_leftpad=None, alibi_slopes=None, softmax_scale=None, causal=False,
                   window_size=(-1, -1), softcap=0.0, num_splits=0, return_lse=True):
    """What a plain step of attention_with_kvcache with these arguments is remembered under
    (``runtime.recall`` of it: the step's Replays; the tools in tools/ read them)."""
    return runtime.call_signature(
        "decode-step", (softmax_scale, causal, window_size, softcap, num_splits, return_lse,
                        configs.DECODE_MERGE_IN_KERNEL and _eager(q)), q, k_cache, v_cache, cache_seqlens,
        block_table, cache_batch_idx, cache_leftpad, alibi_slopes, gluon=False)


def _replay(known, tensors, out, lse) -> bool:
    """Launch a remembered call's kernels on new tensors (False: not 16-byte aligned). Its
    mode: 0 one split, 1 splits and the merge kernel, 2 splits merged in the split kernel,
    3 the prefill route (_prefill: its spans, then the forward; lse always given)."""
    if known[2] == 3:
        run_spans, run_fwd, _, (seg,) = known
        q, k_cache, v_cache, seqlens, _, cache_batch_idx, cache_leftpad = tensors[:7]
        spans = torch.empty(3 * seg, dtype=torch.int32, device=out.device)
        ptrs = runtime.pointers(q, k_cache, v_cache, out, lse, seqlens, cache_batch_idx,
                               cache_leftpad, spans)
        if ptrs is None:
            return False
        run_spans(*ptrs[5:])
        run_fwd(*ptrs[:5], None, None, ptrs[8], ptrs[8] + 4 * seg, ptrs[8] + 8 * seg)
        return True
    run_decode, run_merge, mode, (size, lse_at) = known
    if mode != 1:
        ptrs = runtime.pointers(*tensors, out, lse)
        if ptrs is None:
            return False
        if mode == 0:
            run_decode(*ptrs)
        else:
            counts = _workspace(out, size)[2]  # 512-byte aligned (torch's allocator)
            o_part = counts + 4 * _COUNTS
            run_decode(*ptrs[:-2], o_part, o_part + 4 * lse_at, *ptrs[-2:], counts)
        return True
    # the partials as one allocation, passed as two addresses (see _partials)
    ptrs = runtime.pointers(*tensors, torch.empty(size, dtype=torch.float32, device=out.device),
                           out, lse)
    if ptrs is None:
        return False
    o_part = ptrs[-3]
    lse_part = o_part + 4 * lse_at
    run_decode(*ptrs[:-3], o_part, lse_part)
    run_merge(o_part, lse_part, ptrs[-2], ptrs[-1])
    return True


def _partials_layout(splits, B, H, SQ, D) -> Tuple[int, int]:
    """fp32 elements of the partials' one allocation, and where its LSEs start (a multiple of
    4: 16-byte aligned like the outputs before them)."""
    n = splits * B * H * SQ
    lse_at = -(-n * D // 4) * 4
    return lse_at + n, lse_at


def _partials(splits, B, H, SQ, D, buf):
    """The split kernel's fp32 partial outputs (S, B, H, SQ, D) and LSEs (S, B, H, SQ): views of
    one buffer laid out by _partials_layout (a replayed step passes its two addresses)."""
    n = splits * B * H * SQ
    lse_at = _partials_layout(splits, B, H, SQ, D)[1]
    return buf[:n * D].view(splits, B, H, SQ, D), buf[lse_at:lse_at + n].view(splits, B, H, SQ)


@runtime.on_device_of
def merge_partials(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
                   lse: Optional[torch.Tensor]) -> Optional[runtime.Replay]:
    """out (B, SQ, H, D), lse (B, H, SQ) or None <- S partial results o_part (S, B, H, SQ, D)
    fp32 and lse_part (S, B, H, SQ), weighted by exp(lse_s - lse). Empty partials (lse -inf)
    weigh 0; all empty gives out 0, lse -inf. Returns the launch's Replay, if any."""
    S, B, H, SQ, D = o_part.shape
    pdl = runtime.use_pdl(out.device)
    return runtime.launch_jit(
        _attn_merge_kernel, (B * H * SQ,),
        o_part, lse_part, out, lse, None if TIMELINE is None else TIMELINE[1],
        o_part.stride(0), lse_part.stride(0),
        out.stride(0), out.stride(1), out.stride(2), H, SQ, S, D,
        BLOCK_C=min(configs.next_pow2(S), 8192 // configs.block_d(D)), BLOCK_D=configs.block_d(D),
        PDL=pdl,
        **runtime.pdl_option(pdl))


def merge_attention_states(outs, lses) -> AttentionOutput:
    """Merge attention over disjoint key sets (e.g. a cached prefix and a suffix).

    outs: list of (B, SQ, H, D) outputs; lses: list of (B, H, SQ) float32 LSEs, each from
    flash_attention_with_lse or attention_with_kvcache over its own keys. Returns the
    attention over the union of the keys, and its LSE.
    """
    if not outs or len(outs) != len(lses):
        raise ValueError("merge_attention_states needs as many outputs as LSEs, at least one")
    o_part = torch.stack([o.float().transpose(1, 2) for o in outs]).contiguous()
    lse_part = torch.stack([x.float() for x in lses]).contiguous()
    out = torch.empty_like(outs[0], memory_format=torch.contiguous_format)
    lse = torch.empty_like(lse_part[0])
    merge_partials(o_part, lse_part, out, lse)
    return AttentionOutput(out, lse)


class PagedKVCache:
    """A paged KV cache for a changing batch of sequences (vLLM-style pages).

        cache = PagedKVCache(num_pages=1024, page_size=16, num_kv_heads=8, head_dim=128,
                             dtype=torch.bfloat16, device="cuda")
        cache.add(seq_id)                                  # new sequence
        out = cache.attend(q, k, v, [seq_a, seq_b], causal=True)   # append, then attend
        cache.free(seq_id)                                 # its pages go back to the pool

    Page bookkeeping is host-side (Python lists); the pages themselves and the block
    tables live on the device. Pages of one sequence need not be contiguous.
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.bfloat16, device=None):
        if page_size < 8 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 8, got {page_size}")
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))
        self._pages = {}
        self._lengths = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def add(self, seq_id) -> None:
        if seq_id in self._pages:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        self._pages[seq_id], self._lengths[seq_id] = [], 0

    def free(self, seq_id) -> None:
        self._known(seq_id)
        self._free.extend(reversed(self._pages.pop(seq_id)))
        del self._lengths[seq_id]

    def length(self, seq_id) -> int:
        return self._lengths[self._known(seq_id)]

    def _known(self, seq_id):
        if seq_id not in self._pages:
            raise KeyError(f"sequence {seq_id!r} is not in the cache (add() it first)")
        return seq_id

    def _reserve(self, seq_ids, n_new: int) -> None:
        """Pages for n_new more tokens of every sequence of seq_ids, or none at all: a
        MemoryError leaves the pool and the page lists as they were."""
        need = {}
        for s in seq_ids:
            self._known(s)
            pages = configs.cdiv(self._lengths[s] + n_new, self.page_size)
            need[s] = max(need.get(s, 0), pages - len(self._pages[s]))
        if sum(need.values()) > len(self._free):
            short = ", ".join(f"{s!r}: {n}" for s, n in need.items() if n)
            raise MemoryError(f"PagedKVCache: {sum(need.values())} more pages needed ({short}), "
                              f"{len(self._free)} free")
        for s, n in need.items():
            self._pages[s].extend(self._free.pop() for _ in range(n))

    def block_table(self, seq_ids) -> torch.Tensor:
        """(batch, max_pages) int32 on the cache's device (unused slots 0)."""
        width = max(1, max(len(self._pages[s]) for s in seq_ids))
        rows = [self._pages[s] + [0] * (width - len(self._pages[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int32, device=self.k.device)

    def attend(self, q, k, v, seq_ids, **options) -> torch.Tensor:
        """Append k, v (batch, n_new, nheads_k, headdim) to the sequences ``seq_ids`` (one per
        batch row) and attend q (batch, seqlen_q, nheads, headdim) over their caches.
        ``options`` go to ``attention_with_kvcache`` (causal, window_size, softcap, ...)."""
        n_new = 0 if k is None else k.shape[1]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must name each sequence once, got {list(seq_ids)!r}")
        pages = {s: len(self._pages[self._known(s)]) for s in seq_ids}
        self._reserve(seq_ids, n_new)
        try:
            lens = torch.tensor([self._lengths[s] for s in seq_ids], dtype=torch.int32,
                                device=self.k.device)
            out, _ = attention_with_kvcache(q, self.k, self.v, k, v, cache_seqlens=lens,
                                            block_table=self.block_table(seq_ids),
                                            return_lse=False, **options)
        except BaseException:  # the call's checks refused it: give the new pages back
            for s, n in pages.items():
                self._free.extend(reversed(self._pages[s][n:]))
                del self._pages[s][n:]
            raise
        for s in seq_ids:
            self._lengths[s] += n_new
        return out
