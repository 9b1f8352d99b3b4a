"""The KV-cache launcher: appends, the split count (configs.decode_splits), the split-KV and
merge launches, the prefill route (``flashtriton.decode`` checks the arguments and calls
``attend``; no validation here). Kernels in ``kernels/decode.py``; the split kernel's
autotuner is ``triton_attn._decode``. Each launch path makes the record of its launches
that a later call with the same signature replays (``launch.decode_replay``).
"""
import functools
import math
from typing import Optional, Tuple

import torch

from .. import _env, configs, launch, runtime, validation
from ..kernels.decode import _attn_merge_kernel, _cache_spans_kernel, _kv_append_kernel
from . import triton_attn
from .calls import AttentionOutput, Variant, Varlen, key_counts
from .decode_replay import (_COUNTS, MergedInKernel, MergeKernel, OneSplit, PrefillRoute, _eager,
                            _remember, _workspace, remembered)


# Eager steps that read at most configs.DECODE_MERGE_MAX_BYTES of cache, with splits that the
# merge loads at once, merge them in the split kernel (MERGE: one launch, less host time a
# step); other steps and CUDA graph captures take the merge kernel (less GPU time a step).
# Timing only (tools/timeline.py decode): None, or the split and the merge kernel's int64
# tables of (programs, 5) rows (kernels.common.mark); steps with a timeline are not remembered.
TIMELINE = None


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """The device's SMs (the interpreter's CPU: 4)."""
    if device.type == "cpu":
        return 4
    return torch.cuda.get_device_properties(device.index or 0).multi_processor_count


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None,
              cache_batch_idx=None, descales=(None, None)) -> None:
    """Write k, v (B, S_new, HKV, D) into the caches at positions cache_seqlens[b] + i, in
    place (into pages with block_table; rows cache_batch_idx[b]); no host sync. Positions
    past the cache's end, pages outside the pool and rows outside the cache are not written
    (kernels.decode._kv_append_kernel). An fp8 cache takes k, v in its dtype as they are, or
    quantises them by ``descales`` (k's and v's factors, (B, HKV) float32 views)."""
    B, S_new, HKV, D = k.shape
    if B * S_new * HKV == 0:
        return
    paged = block_table is not None
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    quantize = k.dtype != k_cache.dtype
    kd = vd = None
    if quantize:  # (a public function: its descales checked here, as the API's are)
        if k_cache.dtype not in validation.FP8_DTYPES or None in descales:
            raise ValueError(f"append_kv: k {k.dtype} into a {k_cache.dtype} cache takes an fp8 "
                             f"cache and descales=(k_descale, v_descale); got {descales!r:.80}")
        kd, vd = (validation.check_descale(name, d, B, HKV, k.device)
                  for name, d in zip(("k_descale", "v_descale"), descales))
    fp8_max, mantissa, min_exp = _fp8_format(k_cache.dtype) if quantize else (0.0, 0, 0)
    runtime.launch_jit(
        _kv_append_kernel, (B * S_new, HKV), k, v, k_cache, v_cache, cache_seqlens,
        block_table, cache_batch_idx, kd, vd, *k.stride()[:3], *v.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0) if paged else 0,
        *_strides(kd), *_strides(vd), S_new, HKV, D, k_cache.shape[0], capacity, fp8_max,
        PAGE_SIZE=k_cache.shape[1] if paged else 1, PAGED=paged,
        HAS_BATCH_IDX=cache_batch_idx is not None, QUANTIZE=quantize,
        ROUND_FIRST=quantize and _env.INTERPRET, MANTISSA=mantissa, MIN_EXP=min_exp,
        BLOCK_D=configs.block_d(D), num_warps=1)


@functools.lru_cache(maxsize=None)
def _fp8_format(dtype) -> Tuple[float, int, int]:
    """An fp8 dtype's largest finite value, mantissa bits and smallest normal exponent."""
    fp8 = torch.finfo(dtype)
    return fp8.max, -round(math.log2(fp8.eps)), round(math.log2(fp8.smallest_normal))


def _strides(descale) -> Tuple[int, int]:
    """A (B, HKV) descale view's strides (0, 0 for None)."""
    return (0, 0) if descale is None else descale.stride()


def attend(*args, **kwargs) -> AttentionOutput:
    """_attend; under torch.compile, outside the graph: Dynamo's trace of these launches
    computes a wrong step over 8K keys (tests/test_gpu.py::
    test_compiled_decoding_steps_on_the_split_route), so they run eagerly at a graph break.
    The torch.compiler.disable wrapper is made on the first compiled call: making it imports
    torch._dynamo (seconds), which eager calls never need."""
    if torch.compiler.is_compiling():
        return _attend_outside_graphs()(*args, **kwargs)
    return _attend(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _attend_outside_graphs():
    return torch.compiler.disable(_attend)


def _attend(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx,
           cache_leftpad, alibi, scale, causal, left, right, softcap, num_splits, return_lse,
           signature, step, sinks=None, batch_invariant=False,
           descales=(None, None)) -> AttentionOutput:
    """attention_with_kvcache over checked arguments (q and k rotated; an fp8 cache's
    ``descales`` as (B, HKV) views): append k, v, then the forward kernel over the cache
    (many query tokens, configs.kvcache_prefill, or every call under batch_invariant: the
    prefill route over a contiguous cache, _paged_prefill over pages without left padding)
    or the split kernel (always over an fp8 cache); a plain step (``step``) is remembered
    under ``signature``."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    # batch_invariant runs the forward kernel over packed views of a contiguous cache: one
    # whose rows do not flatten is read through contiguous copies after the append (not
    # remembered: a replay would read the cache itself), one too large is refused before it
    copies = batch_invariant and block_table is None and _packed_misfit(k_cache, v_cache)
    if copies and k_cache.shape[0] * k_cache.shape[1] >= 2**31:
        raise ValueError(f"batch_invariant runs the forward kernel over packed views: {copies}")
    s_new = 0
    if k is not None:
        s_new = k.shape[1]
        append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, descales)
    if copies:
        k_cache, v_cache, signature, step = k_cache.contiguous(), v_cache.contiguous(), None, False
    seqlens = cache_seqlens if s_new == 0 else (cache_seqlens + s_new).to(torch.int32)
    variant = Variant(scale, causal, left, right, softcap, alibi, sinks=sinks,
                      batch_invariant=batch_invariant)
    group = q.shape[2] // max(k_cache.shape[2], 1)  # (no heads: empty results)
    prefill = (configs.kvcache_prefill(group, q.shape[1])
               and descales[0] is None)
    if block_table is not None and (batch_invariant or prefill and cache_leftpad is None):
        return _paged_prefill(q, k_cache, v_cache, seqlens, block_table, variant, return_lse)
    if batch_invariant or (prefill and block_table is None):
        prefill = _prefill(q, k_cache, v_cache, seqlens, cache_batch_idx, cache_leftpad,
                           variant, return_lse, signature, step)
        if prefill is not None:
            return prefill
    return _decode(q, k_cache, v_cache, seqlens, block_table, cache_batch_idx, cache_leftpad,
                   alibi, scale, left, right, softcap, num_splits, return_lse, signature, step,
                   sinks, descales)


def _prefill(q, k_cache, v_cache, seqlens, cache_batch_idx, cache_leftpad, variant, return_lse,
             signature, step) -> Optional[AttentionOutput]:
    """Many query tokens over a contiguous cache: the prefill forward kernel over packed views
    (q as (B * SQ, H, D), the cache as (rows * S, HKV, D); sequence b's keys are the
    seqlens[b] - leftpad[b] rows from cache_row(b) * S + leftpad[b] on, Varlen's seqused_k,
    computed on the device by _cache_spans_kernel), two launches that a later call with the
    same signature replays. None where q or the cache do not flatten (the split kernel runs
    instead), but under batch_invariant a q whose rows do not flatten is copied."""
    B, SQ, H, D = q.shape
    rows, S = k_cache.shape[0], k_cache.shape[1]
    if _packed_misfit(k_cache, v_cache) is not None:
        return None
    if q.stride(0) != SQ * q.stride(1):  # (a slice of a longer q)
        if not variant.batch_invariant:
            return None
        q, signature = q.contiguous(), None  # (a replay would read the slice's pointer)
    if variant.alibi_slopes is not None:
        signature = None
    elif not step:  # appends, rotary: the same call but for the data replays its launches
        signature = runtime.call_signature(
            "kvcache-prefill", (variant._replace(sinks=None), return_lse), q, k_cache, v_cache,
            seqlens, cache_batch_idx, cache_leftpad, variant.sinks)
    out = runtime._empty(q.shape, q.dtype, q.device)
    lse = runtime._empty((B, H, SQ), torch.float32, q.device)
    if out.numel() == 0:
        return AttentionOutput(out, lse if return_lse else None)
    tensors = (q, k_cache, v_cache, seqlens, None, cache_batch_idx, cache_leftpad, None,
               variant.sinks, None, None)
    known = remembered(signature)
    if known is not None and known.replay(tensors, out, lse):
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
        Varlen(spans[:B + 1], spans[seg:seg + B], SQ, S, spans[2 * seg:2 * seg + B]))
    _remember(signature, PrefillRoute(run_spans, run_fwd, seg))
    return AttentionOutput(out, lse if return_lse else None)


def _packed_misfit(k_cache, v_cache) -> Optional[str]:
    """Why the prefill route cannot see a contiguous cache as (rows * S, HKV, D) token rows
    (None: it can; a q whose rows do not flatten is _prefill's to handle)."""
    rows, S = k_cache.shape[:2]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(0) != S * c.stride(1):
            return (f"{name} must hold each row's positions at one stride (row stride = "
                    f"seqlen_cache x token stride); got shape {tuple(c.shape)}, strides "
                    f"{c.stride()}")
    if rows * S >= 2**31:
        return f"k_cache must hold fewer than 2**31 tokens; got shape {tuple(k_cache.shape)}"
    return None


def _paged_prefill(q, k_cache, v_cache, seqlens, block_table, variant,
                   return_lse) -> AttentionOutput:
    """The forward kernel over a paged cache (many query tokens, or batch_invariant): q as
    (B * SQ, H, D) packed sequences of SQ queries, sequence b's seqlens[b] keys in its pages
    (Varlen's block_table); not remembered (a launch's Python each call)."""
    B, SQ, H, D = q.shape
    out = runtime._empty(q.shape, q.dtype, q.device)
    lse = runtime._empty((B, H, SQ), torch.float32, q.device)
    if out.numel():
        q = q.contiguous()
        # (cached; made anew under a CUDA graph's capture, whose replays alone fill it)
        offsets = _query_offsets if _eager(q) else _query_offsets.__wrapped__
        launch.triton_forward(q.view(B * SQ, H, D), k_cache, v_cache, out.view(B * SQ, H, D),
                              lse, (H - 1) * SQ, SQ, variant,
                              Varlen(offsets(B, SQ, q.device), None, SQ,
                                     block_table.shape[1] * k_cache.shape[1], seqlens,
                                     block_table))
    return AttentionOutput(out, lse if return_lse else None)


@functools.lru_cache(maxsize=64)
def _query_offsets(B: int, SQ: int, device) -> torch.Tensor:
    """cu_seqlens of B packed sequences of SQ queries each: 0, SQ, ..., B * SQ (int32)."""
    return torch.arange(0, (B + 1) * SQ, SQ, dtype=torch.int32, device=device)


def paged_singles(q, k, v, out, lse, variant: Variant, varlen: Varlen) -> None:
    """The one-query sequences of a paged varlen call (q, out (total_q, H, D), lse (H, total_q))
    on the split-KV kernel, whose tiles hold a KV head's query heads (each key read once a KV
    head, as a decoding step's); the forward (IS_VARLEN 4) computes the other sequences."""
    _decode(q, k, v, key_counts(varlen.cu_seqlens_k, varlen.seqused_k), varlen.block_table,
            None, None, variant.alibi_slopes, variant.softmax_scale, variant.window_left,
            variant.right_bound, variant.softcap, 0, True, None, False,
            variant.sinks, packed=(varlen.cu_seqlens_q, out, lse))


def dense_split(q, k, v, out, lse, variant: Variant, signature=None) -> None:
    """A dense call of few query rows over many keys (configs.dense_split: a decoding step
    handed to flash_attention with its whole cache) on the split-KV kernel, k and v (B, SK,
    HKV, D) a full cache: into out (B, SQ, H, D) and lse (B, H, SQ), whose launches are
    remembered under attention_forward's ``signature`` (a DenseSplit). The splits merge in
    the merge kernel, never in the split kernel, and the key counts are the cache's length
    (no seqlens tensor): a long-lived tensor allocated during torch.compile's CUDA-graph
    warmup of a model would sit in the graph's pool untracked."""
    if TIMELINE is not None:
        signature = None
    _decode(q, k, v, None, None, None, None, variant.alibi_slopes, variant.softmax_scale,
            variant.window_left, variant.right_bound,
            variant.softcap, 0, True, signature, True, variant.sinks, merge_in_kernel=False,
            into=(out, lse))


def _decode(q, k_cache, v_cache, seqlens, block_table, cache_batch_idx, cache_leftpad, alibi,
            scale, left, right, softcap, num_splits, return_lse, signature, step,
            sinks=None, descales=(None, None), packed=None,
            merge_in_kernel: bool = True, into=None) -> AttentionOutput:
    """The split kernel (and the merge kernel, or its in-kernel merge) over checked
    arguments (an fp8 cache's ``descales``: (B, HKV) views); a plain step's launches are
    remembered under ``signature``. ``packed``: (cu_q, out, lse): q, out (total_q, H, D) and
    lse (H, total_q) hold packed sequences, of which the kernels compute those of one query
    (by way of the partials and a merge; not remembered). merge_in_kernel False: the merge
    kernel merges the splits whatever configs.DECODE_MERGE_IN_KERNEL says. ``into``: (out,
    lse) of a dense call (dense_split) to write, its launches remembered under ``signature``
    as a DenseSplit."""
    if packed is None:
        B, SQ, H, D = q.shape
        if into is not None:
            out, lse = into
        else:
            out = runtime._empty(q.shape, q.dtype, q.device)
            lse = runtime._empty((B, H, SQ), torch.float32, q.device) if return_lse else None
        cu_q, q_strides, out_strides = None, q.stride()[:3], out.stride()[:3]
    else:
        (cu_q, out, lse), (_, H, D), SQ = packed, q.shape, 1
        B = cu_q.numel() - 1
        q_strides, out_strides = (0, *q.stride()[:2]), (0, *out.stride()[:2])
        signature, step = None, True
    HKV = k_cache.shape[2]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if out.numel() == 0:
        return AttentionOutput(out, lse)
    tensors = (q, k_cache, v_cache, seqlens, block_table, cache_batch_idx, cache_leftpad, alibi,
               sinks, *descales)
    block_m, row_blocks = configs.decode_rows(H // HKV, SQ, D)
    merge_ok = (merge_in_kernel and configs.DECODE_MERGE_IN_KERNEL and _eager(q)
                and row_blocks == 1)  # may merge in the split kernel
    if not step and TIMELINE is None:  # appends, rotary: the same call but for the data replays
        signature = runtime.call_signature(
            "decode", (scale, left, right, softcap, num_splits, return_lse, merge_ok), *tensors)
        known = remembered(signature)
        if known is not None and known.replay(tensors, out, lse):
            return AttentionOutput(out, lse)
    granule = configs.decode_split_granule()  # a multiple of every BLOCK_N the tuner tries
    splits = configs.decode_splits(num_splits, B * row_blocks, HKV, capacity, granule,
                                   _num_sms(q.device), paged, descales[0] is not None)
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
                 FP8=descales[0] is not None, BLOCK_M=block_m)
    # One tile for both merges, per split length and grid (waves): the best tile for one wave
    # of splits is not the best for several waves of the same split length.
    waves = min(4, configs.next_pow2(configs.cdiv(splits * B * HKV * row_blocks,
                                                  _num_sms(q.device))))
    key = (q.dtype, configs.bucket(split_size), waves, *flags.values())

    def split_kernel(o_part, lse_part, merge_args=(None, None, None, 0, 0, 0)):
        """Launch the split kernel; merge_args: MERGE's OUT, LSE, COUNTERS, OUT's strides."""
        merge = merge_args[0] is not None
        if o_part is out:  # one split: (split, b, h, t) of the output and its LSE (or None)
            o_strides = (0, out_strides[0], out_strides[2], out_strides[1])
            lse_strides = (0, 0, 0) if lse is None else (0, lse.stride(0), lse.stride(1))
        else:
            o_strides, lse_strides = o_part.stride()[:4], lse_part.stride()[:3]
        return runtime._launch(
            triton_attn._decode, (splits, B * HKV, row_blocks), key, *tensors, o_part, lse_part,
            *merge_args[:3], None if TIMELINE is None else TIMELINE[0], cu_q,
            q_strides, k_cache.stride()[:3], v_cache.stride()[:3],
            block_table.stride(0) if paged else 0,
            ((alibi.stride(0) if alibi.dim() == 2 else 0) if alibi is not None else 0,
             alibi.stride(-1) if alibi is not None else 0),
            tuple(o_strides), tuple(lse_strides), tuple(merge_args[3:]), _strides(descales[0]),
            _strides(descales[1]), HKV, H // HKV, SQ, D, left, right,
            scale * (1.0 / softcap if has_softcap else math.log2(math.e)),
            softcap * math.log2(math.e),
            split_size, q.shape[0], k_cache.shape[0], capacity, k_cache.shape[1] if paged else 1,
            configs.bucket(split_size), waves,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=_env.INTERPRET and q.dtype == torch.bfloat16 and not flags["FP8"], **flags,
            MERGE=merge,
            HAS_SINK=0 if sinks is None else 1 if o_part is out else 2,
            BLOCK_R=block_r if merge else 1, BLOCK_C=block_c if merge else 1,
            **runtime.pdl_option(flags["PDL"]))

    dense = None if into is None else q.device
    if splits == 1 and cu_q is None:  # the split's normalised result and LSE are the output
        _remember(signature, OneSplit(split_kernel(out, lse)), dense)
        return AttentionOutput(out, lse)
    size, lse_at = _partials_layout(splits, B, H, SQ, D)
    in_kernel = (merge_ok and splits <= block_c and B * HKV <= _COUNTS
                 and 2 * B * capacity * HKV * D * k_cache.element_size()
                 <= configs.DECODE_MERGE_MAX_BYTES)
    if not in_kernel or signature is not None:
        # The merge kernel's way; into spare outputs before a merge in the kernel whose step
        # will replay: a capture of the same step takes this way, and finds its kernels
        # compiled and its tile tuned.
        o_part, lse_part = _partials(
            splits, B, H, SQ, D, torch.empty(size, dtype=torch.float32, device=q.device))
        run_decode = split_kernel(o_part, lse_part)
        run_merge = merge_partials(o_part, lse_part, *(
            (torch.empty_like(out), lse if lse is None else torch.empty_like(lse)) if in_kernel
            else (out, lse)), sinks, cu_q)
    if in_kernel:
        ws = _workspace(q, size)[0]
        o_part, lse_part = _partials(splits, B, H, SQ, D, ws[_COUNTS:])
        run_decode = split_kernel(o_part, lse_part,
                                  (out, lse, ws[:_COUNTS].view(torch.int32), *out_strides))
        _remember(signature, MergedInKernel(run_decode, size, lse_at))
    else:
        _remember(signature, MergeKernel(run_decode, run_merge, size, lse_at), dense)
    return AttentionOutput(out, lse)


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
                   lse: Optional[torch.Tensor], sinks: Optional[torch.Tensor] = None,
                   cu_q: Optional[torch.Tensor] = None) -> Optional[runtime.Replay]:
    """out (B, SQ, H, D), lse (B, H, SQ) or None <- S partial results o_part (S, B, H, SQ, D)
    fp32 and lse_part (S, B, H, SQ), weighted by exp(lse_s - lse). Empty partials (lse -inf)
    weigh 0; all empty gives out 0, lse -inf; sinks (H,): one more partial a head with no
    value. cu_q (B + 1 int32): out (total_q, H, D) and lse (H, total_q) hold packed sequences,
    sequence b's from row cu_q[b]; only those of SQ queries are written. Returns the launch's
    Replay, if any."""
    S, B, H, SQ, D = o_part.shape
    pdl = runtime.use_pdl(out.device)
    strides = out.stride()[:3] if cu_q is None else (0, *out.stride()[:2])
    return runtime.launch_jit(
        _attn_merge_kernel, (B * H * SQ,),
        o_part, lse_part, out, lse, sinks, None if TIMELINE is None else TIMELINE[1], cu_q,
        o_part.stride(0), lse_part.stride(0), *strides, H, SQ, S, D,
        out.shape[0] if cu_q is not None else 0,
        BLOCK_C=min(configs.next_pow2(S), 8192 // configs.block_d(D)), BLOCK_D=configs.block_d(D),
        PDL=pdl, HAS_SINK=sinks is not None,
        **runtime.pdl_option(pdl))
