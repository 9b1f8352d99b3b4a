"""The native API: validation, defaults, docstrings.

Layout is flash-attn's: (batch, seqlen, nheads, headdim).
"""

import contextlib
from typing import Optional, Tuple

import torch

from .autograd import AttentionOutput, NoBackward, attention, gradients, register_mods
from .block_mask import BlockMask, create_block_mask
from .launch import decode as decode_launch
from .launch.calls import key_counts
from .validation import (_contents as validation_contents, check_alibi, check_block_table,
                         check_cache_indices, check_cu_seqlens, check_deterministic,
                         check_dropout, check_flag, check_index_tensor, check_max_seqlen,
                         check_mods, check_out, check_qkv, check_scale, check_seqused_k,
                         check_sinks, check_softcap, check_varlen_indices, check_window, describe,
                         unit_last)


def _check_mods(q, k, causal, window, softcap, alibi_slopes, attn_mask, dropout_p, score_mod,
                score_mod_grad, mask_mod, block_mask):
    """(kv_blocks, q_blocks, block_size, mods key) for the custom ops."""
    if score_mod is None and mask_mod is None and block_mask is None:
        if score_mod_grad is not None:
            raise ValueError("score_mod_grad was given without score_mod")
        return None, None, 128, 0
    B, SQ, H = q.shape[0], q.shape[1], q.shape[2]
    SK = k.shape[1]
    check_mods(q, k, (B, H, SQ, SK), causal, window, softcap, alibi_slopes, attn_mask, dropout_p,
               score_mod, score_mod_grad, mask_mod, block_mask)
    if block_mask is None and mask_mod is not None:
        block_mask = create_block_mask(mask_mod, B, H, SQ, SK, q.device)
    if block_mask is not None:
        mask_mod = block_mask.mask_mod
        blocks = (block_mask.kv_blocks, block_mask.q_blocks, block_mask.block_size)
    else:
        blocks = (None, None, 128)
    return (*blocks, register_mods(score_mod, score_mod_grad, mask_mod))


def _run(q, k, v, causal, softmax_scale, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
         dropout_p=0.0, names=("q", "k", "v"), attn_mask=None, score_mod=None,
         score_mod_grad=None, mask_mod=None, block_mask=None,
         deterministic=False, sinks=None, batch_invariant=False,
         dropout_seed=None, qkv_checked=False) -> AttentionOutput:
    """``attn_mask``: a (B, H, SQ, SK) view, bool or float (the SDPA drop-in checks it);
    ``dropout_seed``: the dropout mask's seed (``check_dropout``; None: drawn);
    ``qkv_checked``: the caller has checked q, k, v (``validation.supported`` said None)."""
    if not qkv_checked:
        check_qkv(q, k, v, names, own_v_dim=True)
    causal = check_flag("causal", causal)
    deterministic = check_deterministic(deterministic)
    batch_invariant = check_flag("batch_invariant", batch_invariant)
    scale = check_scale(softmax_scale, q.shape[-1])
    left, right = check_window(window_size)
    softcap = check_softcap(softcap)
    alibi_slopes = check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device)
    dropout_p, seed = check_dropout(dropout_p, dropout_seed)
    sinks = check_sinks(sinks, q.shape[2], q.device)
    blocks = _check_mods(q, k, causal, (left, right), softcap, alibi_slopes, attn_mask, dropout_p,
                         score_mod, score_mod_grad, mask_mod, block_mask)
    out, lse = attention(unit_last(q), unit_last(k), unit_last(v), None, None, 0, 0,
                         alibi_slopes, attn_mask, scale, causal, left, right, softcap,
                         dropout_p, seed, *blocks, deterministic, batch_invariant, sinks=sinks)
    return AttentionOutput(out, lse)


def _run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                softmax_scale, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, names=("q", "k", "v"), deterministic=False,
                sinks=None, seqused_k=None, block_table=None, out=None,
                batch_invariant=False, dropout_seed=None) -> AttentionOutput:
    causal = check_flag("causal", causal)
    deterministic = check_deterministic(deterministic)
    batch_invariant = check_flag("batch_invariant", batch_invariant)
    paged = block_table is not None
    for name, x in zip(names, (q, k, v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        dims = 4 if paged and name != names[0] else 3
        if x.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D " + (
                "(num_blocks, page_size, nheads_k, headdim) pages with block_table"
                if dims == 4 else "(total_tokens, nheads, headdim) for packed sequences")
                + f"; got {describe(x)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{names[1]} and {names[2]} must have the same shape but for the head "
                         f"dim; got {describe(k)} and {describe(v)}")
    # The dense checks on (1, tokens, H, D) views cover dtypes, devices, heads and head dims.
    kv = (k[:1].flatten(0, 1), v[:1].flatten(0, 1)) if paged else (k, v)
    check_qkv(q.unsqueeze(0), kv[0].unsqueeze(0), kv[1].unsqueeze(0), names, own_v_dim=True)
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    B = cu_q.numel() - 1
    if seqused_k is not None:
        seqused_k = check_index_tensor("seqused_k", seqused_k, q.device, (B,),
                                       " (batch,), each sequence's keys")
    cu_k = None
    if cu_seqlens_k is not None or not (paged and seqused_k is not None):
        if cu_seqlens_k is None:
            raise TypeError("cu_seqlens_k is required" + (" (or seqused_k)" if paged else ""))
        cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
        if cu_k.numel() != cu_q.numel():
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length "
                             f"(batch + 1); got {describe(cu_q)} and {describe(cu_k)}")
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    check_varlen_indices(cu_q, cu_k, q.shape[0], None if paged else k.shape[0], max_q, max_k)
    if not paged:
        check_seqused_k(seqused_k, cu_k)
    else:
        block_table = check_block_table(block_table, k.shape[1], B, q.device)
        lengths, lengths_name = seqused_k, "seqused_k"
        if lengths is None and validation_contents(cu_k, block_table):  # (no sync otherwise)
            lengths, lengths_name = cu_k[1:] - cu_k[:-1], "the lengths in cu_seqlens_k: k"
        if lengths is not None:  # their entries: validation mode or CPU tensors
            check_cache_indices(lengths, 0, block_table.shape[1] * k.shape[1], k.shape[0],
                                block_table, k.shape[1], None, None, lengths_name=lengths_name)
    scale = check_scale(softmax_scale, q.shape[-1])
    left, right = check_window(window_size)
    softcap = check_softcap(softcap)
    alibi_slopes = check_alibi(alibi_slopes, B, q.shape[1], q.device)
    dropout_p, seed = check_dropout(dropout_p, dropout_seed)
    sinks = check_sinks(sinks, q.shape[1], q.device)
    if out is not None:
        check_out(out, q, v.shape[-1])
    forward_only = [name for name, x in (("seqused_k", seqused_k), ("block_table", block_table),
                                         ("out", out)) if x is not None]
    grads = [x for x in (q, k, v, sinks) if x is not None and x.requires_grad] \
        if forward_only and torch.is_grad_enabled() else []
    with torch.no_grad() if grads else contextlib.nullcontext():
        if (paged and max_q == 1 and q.shape[0] == B and not dropout_p and not batch_invariant
                and v.shape[-1] == q.shape[-1]):
            # a decoding batch (one query a sequence): the KV-cache path's split kernel
            res = _paged_decode(q, unit_last(k), unit_last(v), cu_k, seqused_k, block_table,
                                scale, causal, (left, right), softcap, alibi_slopes, sinks, out)
        else:
            res = AttentionOutput(*attention(
                unit_last(q), unit_last(k), unit_last(v), cu_q, cu_k, max_q, max_k,
                alibi_slopes, None, scale, causal, left, right, softcap, dropout_p, seed,
                None, None, 128, 0, deterministic, batch_invariant, sinks=sinks,
                seqused_k=seqused_k, block_table=block_table, out=out))
    if grads:  # flash-attn's behaviour: the forward runs, its output requires grad, no backward
        res = AttentionOutput(NoBackward.apply(res.out, " / ".join(forward_only), *grads),
                              res.lse)
    return res


def _run_backward(dout, q, k, v, out, lse, causal, softmax_scale, window_size=(-1, -1),
                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                  deterministic=False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a ``_run`` call (or a ``_run_varlen`` one, with the offsets) without
    softcap, ALiBi, dropout, masks, mods or sinks, from its out and lse and without autograd:
    for callers that record the graph themselves (``integrations.torch_registry``). The
    forward checked q, k, v and the offsets."""
    left, right = check_window(window_size)
    scale = check_scale(softmax_scale, q.shape[-1])
    dq, dk, dv, _ = gradients(dout, unit_last(q), unit_last(k), unit_last(v), out, lse,
                              cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, None,
                              scale, check_flag("causal", causal), left, right, 0.0, 0.0, None,
                              None, None, 128, 0, check_deterministic(deterministic), False)
    return dq, dk, dv


def _paged_decode(q, k, v, cu_k, seqused_k, block_table, scale, causal, window, softcap,
                  alibi_slopes, sinks, out) -> AttentionOutput:
    """Paged varlen with one query a sequence (total_q = batch), its arguments checked, on the
    KV-cache launcher (the split-KV kernel): lse (nheads, batch) as the varlen kernel's."""
    B, H, D = q.shape
    left, right = window
    res, lse = decode_launch.attend(q.view(B, 1, H, D), k, v, None, None,
                                    key_counts(cu_k, seqused_k), block_table, None, None,
                                    alibi_slopes, scale, causal, left, 0 if causal else right,
                                    softcap, 0, True, None, False, sinks, False, (None, None))
    res = res.view(B, H, D)
    if out is not None:
        res = out.copy_(res)
    return AttentionOutput(res, lse[:, :, 0].t())


_OPTIONS_DOC = """
    Args:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32.
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads
           must be a multiple of nheads_k (GQA/MQA share each k/v head between
           nheads // nheads_k query heads without copying).
        v: k's shape, or with a head dim of its own (1..256): MLA's (DeepSeek-V3: q and k
           192, v 128); out then has v's head dim.
        causal: mask aligned to the bottom-right corner (flash-attn's
           convention): query i sees key j iff j <= i + seqlen_k - seqlen_q.
           With seqlen_q=2, seqlen_k=5 (1 = attend)::

               1 1 1 1 0
               1 1 1 1 1

           and with seqlen_q=5, seqlen_k=2 the first three rows see no key;
           their output is 0 and their gradient is finite::

               0 0
               0 0
               0 0
               1 0
               1 1
        softmax_scale: defaults to 1 / sqrt(headdim).
        window_size: (left, right), flash-attn's sliding window: query i sees
           keys j with i + d - left <= j <= i + d + right, d = seqlen_k -
           seqlen_q; -1 leaves a side unbounded. With ``causal=True`` right is
           0. Blocks outside the window are skipped: cost O(seqlen * window).
        softcap: if > 0, scores s become softcap * tanh(s / softcap) (Gemma 2),
           applied after the scale.
        alibi_slopes: float32 (nheads,) or (batch, nheads); adds
           -slope * |i + seqlen_k - seqlen_q - j| to the scaled scores.
        dropout_p: probability of zeroing each attention weight (after the
           softmax, survivors scaled by 1 / (1 - p)). The mask comes from a
           counter-based RNG seeded from torch's default generator
           (``torch.manual_seed`` makes it reproducible); the backward
           regenerates the same mask. Applied whenever > 0 (no train/eval mode).
        score_mod: a ``@triton.jit`` function (score, b, h, q_idx, kv_idx) ->
           score applied to the scaled scores (natural log units), as in
           FlexAttention but compiled into flashtriton's kernels;
           score_mod_grad: its derivative with respect to score (same
           arguments), required for the backward.
        mask_mod: a ``@triton.jit`` function (b, h, q_idx, kv_idx) -> bool
           (True = attend). block_mask: ``create_block_mask(mask_mod, ...)``
           computed once and reused: empty tiles are skipped, full tiles run
           without calling mask_mod. mask_mod without block_mask builds one
           per call. The mods do not combine with causal / window_size /
           softcap / alibi_slopes / dropout_p (express those in the mods).
        deterministic: a bitwise-repeatable backward (also under
           ``torch.use_deterministic_algorithms(True)``). By default (False), as in
           flash-attn, the backward may add dQ in an order that varies from run to run
           (the Gluon backward on Hopper at head dims 64 and 128; the Triton kernels that run
           everything else are repeatable either way).
        sinks: attention sinks (gpt-oss), float (nheads,): one logit a query head that joins
           every row's softmax denominator without a value, p_j = exp(s_j) / (exp(sink) +
           sum_j' exp(s_j')); differentiable (sinks get a gradient). The LSE includes it: a
           row that sees no key gets output 0 and LSE the sink's logit (log(exp(sink))),
           not -inf.
        batch_invariant: the forward's bits for a row depend only on the row, its keys and
           the options: not on the rest of the batch, the row's place among the query
           tokens, seqlen_q or the grid (one fixed tile, no autotuning, every key tile
           through the same masked softmax, the Triton forward). Bitwise equal to
           ``attention_with_kvcache(..., batch_invariant=True)`` over the same keys: a
           training forward's log-probs match decoding's (RL rollouts). Costs forward time
           (docs/perf.md); the backward is unchanged.
"""


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                    dropout_p: float = 0.0, score_mod=None, score_mod_grad=None, mask_mod=None,
                    block_mask: Optional[BlockMask] = None, deterministic: bool = False,
                    sinks: Optional[torch.Tensor] = None,
                    batch_invariant: bool = False) -> torch.Tensor:
    return _run(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                score_mod=score_mod, score_mod_grad=score_mod_grad, mask_mod=mask_mod,
                block_mask=block_mask, deterministic=deterministic, sinks=sinks,
                batch_invariant=batch_invariant).out


def flash_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             causal: bool = False, softmax_scale: Optional[float] = None,
                             window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[torch.Tensor] = None,
                             dropout_p: float = 0.0, score_mod=None, score_mod_grad=None,
                             mask_mod=None, block_mask: Optional[BlockMask] = None,
                             deterministic: bool = False,
                             sinks: Optional[torch.Tensor] = None,
                             batch_invariant: bool = False) -> AttentionOutput:
    return _run(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                score_mod=score_mod, score_mod_grad=score_mod_grad, mask_mod=mask_mod,
                block_mask=block_mask, deterministic=deterministic, sinks=sinks,
                batch_invariant=batch_invariant)


flash_attention.__doc__ = """Exact softmax attention, out = softmax(q k^T * softmax_scale) v, differentiable.
""" + _OPTIONS_DOC + """
    Returns:
        out: (batch, seqlen_q, nheads, headdim of v), dtype of q, in q's memory layout when q
            is dense (e.g. a transposed (batch, nheads, seqlen, headdim) tensor), else
            contiguous.

    Any strides are accepted (e.g. views of a packed qkv tensor); only a
    non-unit stride on headdim is copied. headdim 1..256. S and P are never
    stored: memory is O(seqlen), forward and backward.
"""

flash_attention_with_lse.__doc__ = """``flash_attention`` that also returns the log-sum-exp of each row.
""" + _OPTIONS_DOC + """
    Returns:
        ``AttentionOutput(out, lse)``: out as ``flash_attention``; lse (batch,
        nheads, seqlen_q) float32, the natural log of the softmax denominator of
        each row (of the final scores, after softcap and ALiBi), -inf for rows
        that see no key (with sinks: the sink's logit). lse is not differentiable.
"""


_VARLEN_DOC = """
    Packed variable-length sequences (no padding): sequence b occupies rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1]
    of k and v; zero-length sequences are allowed. Masks (causal, window_size)
    and ALiBi positions are per sequence, bottom-right aligned.

    Args:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim) (v's head dim may
           differ, as in ``flash_attention``).
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 on q's device, starting at 0.
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (they size the
           grid: rows beyond them are not computed). An int, or a 0-d tensor
           (a CUDA tensor costs one host sync: pass an int on hot paths).
        causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
           deterministic, sinks: as in ``flash_attention`` (alibi_slopes (nheads,) or
           (batch, nheads); the packed backward is always repeatable).
        seqused_k: (batch,) int32: sequence b has seqused_k[b] keys (from row
           cu_seqlens_k[b] on, or from position 0 of its pages), not cu_seqlens_k[b + 1] -
           cu_seqlens_k[b].
        block_table: (batch, max_blocks) int32: k and v are a paged KV cache
           (num_blocks, page_size, nheads_k, headdim), page_size a power of two >= 8, and
           sequence b's keys fill its pages block_table[b] in order from position 0
           (flash-attn's and vLLM's layout); cu_seqlens_k may then be None beside
           seqused_k. Decode rows (one query) and prefill rows mix in one call; a batch of
           one query a sequence (max_seqlen_q 1, v's head dim q's) runs the KV-cache split
           kernel (``attention_with_kvcache``). No host synchronisation; entries are checked as
           ``flashtriton.validation`` says, and whatever they hold nothing outside k, v and
           the table is read (a sequence longer than its pages sees no keys; a page outside
           the pool is not read: its keys count as zeros, or, for the split kernel, are
           left out).
        out: (total_q, nheads, headdim of v) in q's dtype: the output is written there.
        seqused_k, block_table and out have no backward: as in flash-attn, the forward runs
           with inputs that require grad and its output requires grad, but a backward that
           reaches it raises NotImplementedError.
        batch_invariant: as in ``flash_attention`` (a decode batch over pages then stays on
           the forward kernel).
"""


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor],
                           max_seqlen_q, max_seqlen_k, *, causal: bool = False,
                           softmax_scale: Optional[float] = None,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None,
                           dropout_p: float = 0.0, deterministic: bool = False,
                           sinks: Optional[torch.Tensor] = None,
                           seqused_k: Optional[torch.Tensor] = None,
                           block_table: Optional[torch.Tensor] = None,
                           out: Optional[torch.Tensor] = None,
                           batch_invariant: bool = False) -> torch.Tensor:
    return _run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                       softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                       deterministic=deterministic, sinks=sinks, seqused_k=seqused_k,
                       block_table=block_table, out=out, batch_invariant=batch_invariant).out


def flash_attention_varlen_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: Optional[torch.Tensor],
                                    max_seqlen_q, max_seqlen_k, *, causal: bool = False,
                                    softmax_scale: Optional[float] = None,
                                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[torch.Tensor] = None,
                                    dropout_p: float = 0.0, deterministic: bool = False,
                                    sinks: Optional[torch.Tensor] = None,
                                    seqused_k: Optional[torch.Tensor] = None,
                                    block_table: Optional[torch.Tensor] = None,
                                    out: Optional[torch.Tensor] = None,
                                    batch_invariant: bool = False) -> AttentionOutput:
    return _run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                       softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                       deterministic=deterministic, sinks=sinks, seqused_k=seqused_k,
                       block_table=block_table, out=out, batch_invariant=batch_invariant)


flash_attention_varlen.__doc__ = """``flash_attention`` on packed sequences; returns out (total_q, nheads, headdim).
""" + _VARLEN_DOC

flash_attention_varlen_with_lse.__doc__ = """``flash_attention_varlen`` that also returns the LSE.
""" + _VARLEN_DOC + """
    Returns ``AttentionOutput(out, lse)`` with lse (nheads, total_q) float32
    (flash-attn's varlen layout), -inf for rows that see no key (with sinks: the sink's
    logit).
"""
