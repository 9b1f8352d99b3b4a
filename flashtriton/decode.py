"""Attention over a KV cache: in-place appends, contiguous or paged caches, split-KV decoding.

Inference only (no autograd). The public API: argument checks and rotary embeddings here;
appends and launches in ``launch/decode.py`` (the launcher), the replays of remembered calls
in ``launch/decode_replay.py``, kernels in ``kernels/decode.py``.
"""

from typing import NamedTuple, Optional, Tuple, Union

import torch

from . import configs, runtime, validation
from .launch import AttentionOutput
from .launch import decode as decode_launch
from .launch.decode import merge_partials
from .launch.decode_replay import replay_step, step_signature
from .validation import (check_alibi, check_block_table, check_cache_indices, check_flag,
                         check_index_tensor, check_num_splits, check_qkv, check_scale,
                         check_sinks, check_softcap, check_unit_stride, check_window, describe)

__all__ = ["attention_with_kvcache", "append_kv", "apply_rotary", "merge_attention_states",
           "merge_partials", "step_signature", "PagedKVCache"]


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
                           num_splits: int = 0, return_lse: bool = True,
                           sinks: Optional[torch.Tensor] = None,
                           batch_invariant: bool = False,
                           k_descale: Optional[torch.Tensor] = None,
                           v_descale: Optional[torch.Tensor] = None,
                           q_descale: Optional[torch.Tensor] = None) -> AttentionOutput:
    """Attention of a few query tokens over a KV cache, after appending k, v to it.

    Args:
        q: (batch, seqlen_q, nheads, headdim), any seqlen_q: decoding and speculative
           tokens run the split-KV kernel; many query tokens over a contiguous cache
           (chunked prefill, ``configs.kvcache_prefill``) run the prefill forward kernel.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or paged:
           (num_blocks, page_size, nheads_k, headdim) with ``block_table``; any strides
           with a unit stride on headdim (e.g. K and V as views of one buffer; another
           head-dim stride is refused, as the kernels write and read them in place). In q's
           dtype, or fp8 (float8_e4m3fn / float8_e5m2, both the same) holding
           value / descale, with ``k_descale`` and ``v_descale``.
        k, v: (batch, seqlen_new, nheads_k, headdim) or None: written into the cache at
           positions cache_seqlens[b] ... (in place, also into pages), then attended. Into
           an fp8 cache: in q's dtype, quantised on the way (value / descale, saturated to
           the fp8 range, rounded to nearest, ties to even, as torch's cast), or already in
           the cache's fp8 (copied).
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
        num_splits: KV splits per sequence, an int >= 0 (0: enough to fill the GPU);
           partial results are merged by their LSEs.
        return_lse: False: no LSE is stored or allocated (lse None), which saves a step host
           time (as flash-attn's ``return_softmax_lse=False``).
        sinks: attention sinks (nheads,), as in ``flash_attention``: one logit a query head
           in every row's softmax denominator (the LSE includes it: a row that sees no key,
           e.g. of an empty cache, gets out 0 and lse the sink's logit).
        batch_invariant: a sequence's output does not depend on the rest of the batch, on
           the grid or on num_splits, and equals bitwise ``flash_attention(q, k, v,
           batch_invariant=True)`` over the same keys (and a training forward's rows at the
           same positions): every call runs the forward kernel over the cache (its one fixed
           tile, no KV splits); slower than the split kernel for small batches
           (docs/perf.md). Not with cache_leftpad over a paged cache, nor fp8 caches.
        k_descale, v_descale: an fp8 cache's dequantisation factors (value = stored x
           descale), float32 (batch, nheads_k) as FlashAttention-3's, or (nheads_k,); None
           for a cache in q's dtype. Decoding reads the fp8 bytes and dequantises in
           registers (the split kernel, whatever the query count).
        q_descale: with q in fp8 (FlashAttention-3's fp8 call): q's factors, float32
           (batch, nheads_k) or (nheads_k,); q is dequantised to bfloat16, and out is
           bfloat16.

    Returns ``AttentionOutput(out, lse)``: out (batch, seqlen_q, nheads, headdim), lse
    (batch, nheads, seqlen_q) float32 or None, -inf for a row that sees no key (with sinks:
    the sink's logit). Not differentiable.

    Index tensors may be views of any layout (the checks copy them contiguous, on their
    device), and are checked as ``flashtriton.validation`` says (their contents on the host
    in validation mode, or when they live on the CPU); whatever they hold, nothing outside
    the caches is read or written: a sequence whose length, row or left padding lies outside
    its cache sees no keys (out 0, lse -inf or the sink's logit), keys in pages outside the
    pool are not attended, and appends outside the cache are dropped. Every argument is
    checked before the append writes: a refused call leaves the caches as they were.
    """
    if q_descale is not None or getattr(q, "dtype", None) in validation.FP8_DTYPES:
        q = _dequantized_q(q, q_descale, k_cache)
    # A plain step (no append, no rotary, per-sequence lengths) whose arguments match an
    # earlier call's in everything but the data replays that call's launches before the
    # checks, which the earlier call passed with the same shapes, strides, dtypes, devices
    # and settings. Its small tensors must be contiguous: the checks hand the launches
    # contiguous copies of views, and a replay reads the tensors it is given.
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
               alibi_slopes, sinks, k_descale, v_descale)
    step = (k is None and rotary_cos is None and isinstance(cache_seqlens, torch.Tensor)
            and isinstance(q, torch.Tensor) and q.stride(-1) == 1
            and type(window_size) is tuple and decode_launch.TIMELINE is None
            and not validation.validating() and type(causal) is bool
            and type(return_lse) is bool and type(batch_invariant) is bool
            and type(num_splits) is int
            and type(rotary_interleaved) is bool and _contiguous(tensors[3:9]))
    signature = None
    if step:
        try:
            signature = step_signature(q, k_cache, v_cache, cache_seqlens, block_table,
                                       cache_batch_idx, cache_leftpad, alibi_slopes, softmax_scale,
                                       causal, window_size, softcap, num_splits, return_lse,
                                       sinks, batch_invariant, k_descale, v_descale)
        except AttributeError:  # not a tensor where one belongs: the checks below say so
            step = False
        replayed = replay_step(signature, tensors, return_lse)
        if replayed is not None:
            return replayed
    causal, return_lse, rotary_interleaved, batch_invariant = (
        check_flag(name, flag) for name, flag in (
            ("causal", causal), ("return_lse", return_lse),
            ("rotary_interleaved", rotary_interleaved), ("batch_invariant", batch_invariant)))
    checked = _check_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                          cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, causal,
                          window_size, k_descale, v_descale)
    cache_seqlens, block_table = checked.cache_seqlens, checked.block_table
    cache_batch_idx, cache_leftpad = checked.cache_batch_idx, checked.cache_leftpad
    B, SQ, H, D = q.shape
    scale = check_scale(softmax_scale, D)
    left, right = checked.window
    right = 0 if causal else right
    softcap = check_softcap(softcap)
    alibi = check_alibi(alibi_slopes, B, H, q.device)
    sinks = check_sinks(sinks, H, q.device)
    num_splits = check_num_splits(num_splits)
    if batch_invariant and block_table is not None and cache_leftpad is not None:
        raise ValueError("batch_invariant: cache_leftpad over a paged cache is not supported "
                         "(left-pad a contiguous cache, or start each sequence at page 0)")
    if batch_invariant and checked.descales[0] is not None:
        raise ValueError(f"batch_invariant runs the forward kernel, which reads no fp8 cache; "
                         f"k_cache is {k_cache.dtype}")
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
    return decode_launch.attend(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                cache_batch_idx, cache_leftpad, alibi, scale, causal, left, right,
                                softcap, num_splits, return_lse, signature, step, sinks,
                                batch_invariant, checked.descales)


def _contiguous(tensors) -> bool:
    """Whether each of ``tensors`` is None or a contiguous tensor (a loop: a generator costs a
    step more host time)."""
    for x in tensors:
        if x is not None and not (isinstance(x, torch.Tensor) and x.is_contiguous()):
            return False
    return True


def _dequantized_q(q, q_descale, k_cache) -> torch.Tensor:
    """An fp8 q (FlashAttention-3's fp8 call) times its factors q_descale (batch, nheads_k)
    or (nheads_k,), in bfloat16."""
    if not isinstance(q, torch.Tensor) or q.dtype not in validation.FP8_DTYPES:
        raise ValueError(f"q_descale applies to an fp8 q; got q "
                         f"{describe(q) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.dim() != 4 or not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4 \
            or q.shape[2] % max(k_cache.shape[2], 1):
        raise ValueError(f"q must be 4-D (batch, seqlen_q, nheads, headdim) with nheads a "
                         f"multiple of k_cache's; got q {describe(q)}")
    B, SQ, H, D = q.shape
    HKV = k_cache.shape[2]
    if q_descale is None:
        raise ValueError(f"q_descale is needed with an fp8 q ({describe(q)}): float32 "
                         f"(batch, nheads_k) = ({B}, {HKV}) or (nheads_k,)")
    factor = validation.check_descale("q_descale", q_descale, B, HKV, q.device)
    grouped = q.view(B, SQ, HKV, H // HKV, D).float() * factor[:, None, :, None, None]
    return grouped.to(torch.bfloat16).view(B, SQ, H, D)


class _Checked(NamedTuple):
    cache_seqlens: torch.Tensor  # (B,) int32 on q's device
    window: Tuple[int, int]
    descales: tuple  # an fp8 cache's (k_descale, v_descale) as (B, HKV) views, else Nones
    block_table: Optional[torch.Tensor]  # the index tensors, contiguous
    cache_batch_idx: Optional[torch.Tensor]
    cache_leftpad: Optional[torch.Tensor]


def _check_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx,
                cache_leftpad, rotary_cos, rotary_sin, causal, window_size, k_descale=None,
                v_descale=None) -> _Checked:
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
        own = (" (the KV cache takes no head dim of its own for v_cache: MLA's runs in "
               "flash_attention and flash_attention_varlen, paged too)"
               if k_cache.dim() == 4 and v_cache.shape[:3] == k_cache.shape[:3] else "")
        raise ValueError(f"k_cache and v_cache must be 4-D of one shape{own}; got k_cache "
                         f"{describe(k_cache)}, v_cache {describe(v_cache)}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a 4-D (batch, seqlen_q, nheads, headdim) tensor")
    B, SQ, H, D = q.shape
    # dtypes, devices, heads and head dim of q against the cache (whose batch may differ)
    fp8 = k_cache.dtype if k_cache.dtype in validation.FP8_DTYPES else None
    check_qkv(q, k_cache, v_cache, ("q", "k_cache", "v_cache"), same_batch=False, kv_dtype=fp8)
    check_unit_stride("k_cache", k_cache)
    check_unit_stride("v_cache", v_cache)
    descales = validation.check_descales(k_cache, v_cache, k_descale, v_descale, B, q.device)
    HKV = k_cache.shape[2]
    page_size = k_cache.shape[1]
    if paged:
        block_table = check_block_table(block_table, page_size, B, q.device)
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
    cache_seqlens, cache_batch_idx = _cache_rows(cache_seqlens, cache_batch_idx, B, q.device)
    if cache_leftpad is not None:
        cache_leftpad = check_index_tensor("cache_leftpad", cache_leftpad, q.device, (B,))
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
        given = getattr(k, "dtype", None)
        if given in validation.FP8_DTYPES and given != fp8:
            raise TypeError(f"k and v in {given} go into a cache of that dtype (copied as "
                            f"they are); k_cache is {k_cache.dtype}")
        check_qkv(q, k, v, ("q", "k", "v"), kv_dtype=fp8 if given == fp8 else None)
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
    return _Checked(cache_seqlens, window, descales, block_table, cache_batch_idx, cache_leftpad)


def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cache_seqlens: Union[int, torch.Tensor], block_table: Optional[torch.Tensor] = None,
              cache_batch_idx: Optional[torch.Tensor] = None,
              descales: tuple = (None, None)) -> None:
    """attention_with_kvcache's append alone: k, v (batch, seqlen_new, nheads_k, headdim) into
    the caches at positions cache_seqlens[b] + i, in place (into pages with block_table; cache
    rows cache_batch_idx[b]); positions past a cache's end, pages outside the pool and rows
    outside the cache are not written. The caches need a unit stride on headdim; index
    tensors may be views of any layout; both are checked before anything is written. An fp8
    cache takes k, v in its dtype as they are, or quantises them by ``descales`` = (k's and
    v's factors, float32 (batch, nheads_k) or (nheads_k,))."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor; got "
                             f"{describe(x) if isinstance(x, torch.Tensor) else type(x).__name__}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        validation.check_unit_stride(name, c)
    B = k.shape[0]
    cache_seqlens, cache_batch_idx = _cache_rows(cache_seqlens, cache_batch_idx, B, k.device)
    if block_table is not None:
        block_table = check_block_table(block_table, k_cache.shape[1], B, k.device)
    decode_launch.append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx,
                            descales)


def _cache_rows(cache_seqlens, cache_batch_idx, B: int, device):
    """cache_seqlens (an int for every sequence, or (B,) int32) and cache_batch_idx (None or
    (B,) int32) checked, as contiguous int32 tensors on ``device``."""
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=device)
    cache_seqlens = check_index_tensor("cache_seqlens", cache_seqlens, device, (B,),
                                       what=" (or an int)")
    if cache_batch_idx is not None:
        cache_batch_idx = check_index_tensor("cache_batch_idx", cache_batch_idx, device, (B,))
    return cache_seqlens, cache_batch_idx


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
    decode_launch.merge_partials(o_part, lse_part, out, lse)
    return AttentionOutput(out, lse)


class PagedKVCache:
    """A paged KV cache for a changing batch of sequences (vLLM-style pages).

        cache = PagedKVCache(num_pages=1024, page_size=16, num_kv_heads=8, head_dim=128,
                             dtype=torch.bfloat16, device="cuda")
        cache.add(seq_id)                                  # new sequence
        out = cache.attend(q, k, v, [seq_a, seq_b], causal=True)   # append, then attend
        cache.free(seq_id)                                 # its pages go back to the pool

    Page bookkeeping is host-side (Python lists); the pages themselves and the block
    tables live on the device. Pages of one sequence need not be contiguous. An fp8 cache
    (dtype torch.float8_e4m3fn or float8_e5m2) takes k_descale and v_descale, float32
    (num_kv_heads,): appends quantise into it, attention dequantises.
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.bfloat16, device=None, k_descale: Optional[torch.Tensor] = None,
                 v_descale: Optional[torch.Tensor] = None):
        if page_size < 8 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 8, got {page_size}")
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        validation.check_descales(self.k, self.v, k_descale, v_descale, 1, self.k.device)
        for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
            if d is not None and d.dim() != 1:  # one factor a KV head, for any batch
                raise ValueError(f"{name} must have shape (num_kv_heads,) = ({num_kv_heads},); "
                                 f"got {describe(d)}")
        self.k_descale, self.v_descale = k_descale, v_descale
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
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must name each sequence once, got {list(seq_ids)!r}")
        for name, x in (("q", q), ("k", k), ("v", v)):  # (before any page is taken)
            if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[0] != len(seq_ids):
                raise ValueError(f"{name} has a batch of {x.shape[0]} for {len(seq_ids)} "
                                 f"seq_ids; got {name} {describe(x)}")
        n_new = 0 if k is None else k.shape[1]
        pages = {s: len(self._pages[self._known(s)]) for s in seq_ids}
        self._reserve(seq_ids, n_new)
        try:
            lens = torch.tensor([self._lengths[s] for s in seq_ids], dtype=torch.int32,
                                device=self.k.device)
            out, _ = attention_with_kvcache(q, self.k, self.v, k, v, cache_seqlens=lens,
                                            block_table=self.block_table(seq_ids),
                                            return_lse=False, k_descale=self.k_descale,
                                            v_descale=self.v_descale, **options)
        except BaseException:  # the call's checks refused it: give the new pages back, the
            # last taken first, so the pool's order is what it was
            for s, n in reversed(pages.items()):
                self._free.extend(reversed(self._pages[s][n:]))
                del self._pages[s][n:]
            raise
        for s in seq_ids:
            self._lengths[s] += n_new
        return out
