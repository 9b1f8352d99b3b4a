"""flash-attn 2.x's Python interface on flashtriton's kernels.

``from flashtriton.compat.flash_attn import flash_attn_func`` replaces
``from flash_attn import flash_attn_func``. Signatures, defaults, layouts
(batch, seqlen, nheads, headdim) and return values are flash-attn's,
including the flag-dependent tuple of ``return_attn_probs``. Beyond
flash-attn, float32 inputs are accepted.

The varlen functions take packed (total_tokens, nheads, headdim) tensors and
int32 cu_seqlens as flash-attn's do; ``flashtriton.compat.bert_padding`` has
``unpad_input`` / ``pad_input``.

Unchanged code that imports flash-attn itself runs on flashtriton after ``install()``:

    import flashtriton.compat.flash_attn as fa
    fa.install()
    from flash_attn import flash_attn_func                  # flashtriton's
    from flash_attn.bert_padding import pad_input, unpad_input

Dropout draws its seed from torch's default generator (flash-attn uses the
CUDA generator's Philox state), so masks differ from flash-attn's but are
reproducible under torch.manual_seed. ``return_attn_probs=True`` returns None
for the dropout mask. ``flash_attn_varlen_func`` also speaks vLLM's paged call
(block_table, seqused_k, out=).

flash-attn's private kernel wrappers ``_flash_attn_forward``, ``_flash_attn_varlen_forward``,
``_flash_attn_backward`` and ``_flash_attn_varlen_backward`` are here too (and so in
``flash_attn.flash_attn_interface`` after ``install()``), with flash-attn 2.8's parameters,
defaults and return values, for libraries that call them directly and build their own
autograd on them (ring-flash-attn: docs/integrations.md).
"""

import importlib.machinery
import operator
import sys
import types
import warnings
from typing import Optional, Tuple

import torch

from ..api import _run, _run_varlen
from ..autograd import _attn_bwd, _call
from ..validation import (check_alibi, check_cu_seqlens, check_deterministic, check_dropout,
                          check_flag, check_max_seqlen, check_qkv, check_scale, check_sinks,
                          check_softcap, check_varlen_indices, describe, unit_last,
                          _dropout_p)

# The flash-attn release whose Python interface this module speaks (``flash_attn.__version__``
# after install()).
FLASH_ATTN_VERSION = "2.8.3"
_ALIASES = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding")
_saved = {}


def _returns(out, lse, return_attn_probs):
    if not return_attn_probs:
        return out
    # flash-attn reports +inf (not -inf) as the LSE of rows that see no key.
    lse = torch.where(lse == float("-inf"), float("inf"), lse)
    return out, lse, None


def _sink(learnable_sink, q, heads_dim, names=None, k=None, v=None):
    """FlashAttention-4's learnable_sink (nheads,), checked under its name after q (and, where
    given, k and v: heads on axis heads_dim, head dim last; a packed varlen form as one
    batch): their own errors come first."""
    if learnable_sink is None:
        return None
    if k is not None and all(isinstance(x, torch.Tensor) and x.dim() == heads_dim + 2
                             for x in (q, k, v)):
        batched = [x if heads_dim == 2 else x.unsqueeze(0) for x in (q, k, v)]
        check_qkv(*batched, names, own_v_dim=True)
    if not isinstance(q, torch.Tensor) or q.dim() != heads_dim + 2:
        return learnable_sink  # (q's own checks raise)
    return check_sinks(learnable_sink, q.shape[heads_dim], q.device, "learnable_sink")


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               deterministic, return_attn_probs, names, learnable_sink=None):
    return_attn_probs = check_flag("return_attn_probs", return_attn_probs)
    out, lse = _run(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes,
                    dropout_p, names, deterministic=deterministic,
                    sinks=_sink(learnable_sink, q, 2, names, k, v))
    return _returns(out, lse, return_attn_probs)


def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, block_table, names, learnable_sink=None,
                      seqused_k=None, out=None):
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is None:
            raise TypeError(f"flash_attn_varlen_func() missing argument {name!r}")
    return_attn_probs = check_flag("return_attn_probs", return_attn_probs)
    out, lse = _run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                           names, deterministic, sinks=_sink(learnable_sink, q, 1, names, k, v),
                           seqused_k=seqused_k, block_table=block_table, out=out)
    return _returns(out, lse, return_attn_probs)


def _check_packed(name, x, n, shape_doc):
    if not isinstance(x, torch.Tensor) or x.dim() != len(shape_doc.split(",")) or x.shape[-3] != n:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a ({shape_doc}) tensor; got {got}")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, learnable_sink=None):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    v's head dim its own where it differs (FlashAttention-3's headdim_v: MLA's 192 / 128).

    nheads must be a multiple of nheads_k (MQA/GQA). Causal masks and
    window_size=(left, right) align to the bottom-right corner when seqlen_q !=
    seqlen_k (flash-attn >= 2.1); softcap > 0 caps the scaled scores with
    softcap * tanh(s / softcap); alibi_slopes (nheads,) or (batch, nheads)
    float32 add -slope * |i + seqlen_k - seqlen_q - j|. As in flash-attn,
    ``deterministic=False`` lets the backward add dQ in an order that varies
    from run to run (the Gluon backward on Hopper at head dims 64 and 128);
    ``deterministic=True`` (or ``torch.use_deterministic_algorithms(True)``)
    runs the bitwise-repeatable Triton backward. ``learnable_sink`` (nheads,)
    (FlashAttention-4's name; gpt-oss's sinks): one logit a query head in every
    row's softmax denominator, differentiable.

    Returns out (batch, seqlen_q, nheads, headdim of v); with
    ``return_attn_probs=True``, ``(out, softmax_lse, None)`` where softmax_lse
    is (batch, nheads, seqlen_q) float32 (+inf for rows that see no key, as
    flash-attn's; with learnable_sink the sink's logit, the row's softmax being the
    sink's alone; out 0 either way).
    """
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, ("q", "k", "v"),
                      learnable_sink)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim).

    k and v are read as strided views of kv (no copy). Otherwise as
    ``flash_attn_func``.
    """
    _check_packed("kv", kv, 2, "batch, seqlen_k, 2, nheads_k, headdim")
    return _attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs,
                      ("q", "kv[:, :, 0]", "kv[:, :, 1]"))


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim), read as strided views (no copy).

    Otherwise as ``flash_attn_func``.
    """
    _check_packed("qkv", qkv, 3, "batch, seqlen, 3, nheads, headdim")
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                      window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                      ("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           learnable_sink=None, seqused_k=None, out=None,
                           return_softmax_lse=False):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim) (v's head dim may
    differ, as in ``flash_attn_func``), or with
    ``block_table`` (batch, max_blocks) int32 a paged KV cache (num_blocks, page_size,
    nheads_k, headdim) (flash-attn 2.6+; page_size any power of two >= 8).

    cu_seqlens_q / cu_seqlens_k: (batch + 1,) int32 cumulative sequence lengths;
    max_seqlen_q / max_seqlen_k: the longest lengths (int, or a 0-d tensor).
    Masks and ALiBi positions are per sequence; learnable_sink as in
    ``flash_attn_func``. vLLM's keywords: ``seqused_k`` (batch,) int32 key counts
    (cu_seqlens_k then optional with block_table), ``out`` (written in place),
    ``return_softmax_lse``; decode rows (one query) and prefill rows mix in one call
    (``flashtriton.flash_attention_varlen`` says more). With block_table, seqused_k or out,
    inputs that require grad run the forward as in flash-attn (the output requires grad) and
    a backward through the call raises NotImplementedError. Returns out (total_q, nheads,
    headdim); with ``return_attn_probs=True``, ``(out, softmax_lse, None)`` with
    softmax_lse (nheads, total_q) float32 (rows that see no key as in ``flash_attn_func``:
    +inf, or the sink's logit); with ``return_softmax_lse=True``, ``(out, softmax_lse)``.
    """
    return_attn_probs = check_flag("return_attn_probs", return_attn_probs)
    return_softmax_lse = check_flag("return_softmax_lse", return_softmax_lse)
    res = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            deterministic, return_attn_probs or return_softmax_lse, block_table,
                            ("q", "k", "v"), learnable_sink, seqused_k, out)
    return res[:2] if return_softmax_lse and not return_attn_probs else res


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim), read as views."""
    _check_packed("kv", kv, 2, "total_k, 2, nheads_k, headdim")
    return _attention_varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, None,
                             ("q", "kv[:, 0]", "kv[:, 1]"))


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv: (total, 3, nheads, headdim), read as views; one cu_seqlens for q and k."""
    _check_packed("qkv", qkv, 3, "total, 3, nheads, headdim")
    return _attention_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                             max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, None,
                             ("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            learnable_sink=None, q_descale=None, k_descale=None,
                            v_descale=None):
    """flash-attn's decoding entry point: appends k, v to the cache in place (also into
    pages with block_table), then attends q over it. See
    ``flashtriton.decode.attention_with_kvcache`` for shapes. Page sizes: any power of two
    >= 8 (flash-attn needs multiples of 256). Rotary embeddings are applied to q and the
    new k as flash-attn does; learnable_sink as in ``flash_attn_func``. FP8 caches as
    FlashAttention-3's: float8_e4m3fn (or e5m2) k_cache / v_cache with float32 k_descale /
    v_descale (batch, nheads_k), q in bf16 / fp16 or in fp8 with q_descale (out bf16).
    Returns out, or (out, softmax_lse) with ``return_softmax_lse=True``: softmax_lse
    (batch, nheads, seqlen_q), as ``attention_with_kvcache``'s: -inf for a row that sees no
    key (not flash_attn_func's +inf), the sink's logit with learnable_sink.
    """
    from ..decode import attention_with_kvcache
    return_softmax_lse = check_flag("return_softmax_lse", return_softmax_lse)
    out, lse = attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                      block_table=block_table, cache_batch_idx=cache_batch_idx,
                                      cache_leftpad=cache_leftpad,
                                      softmax_scale=softmax_scale, causal=causal,
                                      window_size=window_size, softcap=softcap,
                                      alibi_slopes=alibi_slopes, rotary_cos=rotary_cos,
                                      rotary_sin=rotary_sin,
                                      rotary_interleaved=rotary_interleaved,
                                      num_splits=num_splits, return_lse=return_softmax_lse,
                                      sinks=_sink(learnable_sink, q, 2), k_descale=k_descale,
                                      v_descale=v_descale, q_descale=q_descale)
    return (out, lse) if return_softmax_lse else out


# flash-attn 2.8's private kernel wrappers (flash_attn_interface._flash_attn_forward & co.).
# Libraries that build their own attention on flash-attn (ring-flash-attn) call them directly,
# by keyword, and read their parameter names and defaults with inspect: both are flash-attn's,
# as are the results. Inputs need no grad (flash-attn's are custom ops without autograd): the
# forwards run under no_grad and the backwards write dq, dk and dv into the given buffers.


def _window_sides(left, right) -> Tuple[int, int]:
    """The private wrappers' window_size_left / window_size_right as (left, right): each an
    int (or int-like: numpy, 0-d tensor) >= -1, -1 unbounded; errors name the side."""
    sides = []
    for name, value in (("window_size_left", left), ("window_size_right", right)):
        index = None
        if not (isinstance(value, bool) or type(value).__name__ == "bool_"
                or isinstance(value, torch.Tensor) and value.dtype == torch.bool):
            try:
                index = operator.index(value)
            except TypeError:
                pass
        if index is None:
            raise TypeError(f"{name} must be an int (-1: unbounded), got {value!r}")
        if index < -1:
            raise ValueError(f"{name} must be >= -1 (-1: unbounded), got {index}")
        sides.append(index)
    return sides[0], sides[1]


def _private_forward(q, k, v, varlen, dropout_p, softmax_scale, causal, window_size_left,
                     window_size_right, softcap, alibi_slopes, return_softmax, paged=None):
    """(out, softmax_lse, S_dmask, rng_state) as flash-attn's; varlen: (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k) or None; paged: _run_varlen's seqused_k and
    block_table."""
    return_softmax = check_flag("return_softmax", return_softmax)
    dropout_p, seed = check_dropout(dropout_p)
    if return_softmax:
        if dropout_p == 0.0:  # flash-attn's own check
            raise RuntimeError("return_softmax is only supported when p_dropout > 0.0")
        raise NotImplementedError(
            "flashtriton: return_softmax=True with dropout_p > 0 (flash-attn's S_dmask, every "
            "attention probability with the dropout mask in its sign bit) is not supported; "
            "pass return_softmax=False. ring-flash-attn asks for it whenever dropout_p > 0, and "
            "its backward does not pass the forward's rng_state, so its dropout masks could not "
            "be replayed anyway: run ring-flash-attn with dropout_p=0")
    window = _window_sides(window_size_left, window_size_right)
    with torch.no_grad():
        if varlen is None:
            out, lse = _run(q, k, v, causal, softmax_scale, window, softcap, alibi_slopes,
                            dropout_p, dropout_seed=seed)
        else:
            out, lse = _run_varlen(q, k, v, *varlen, causal, softmax_scale, window, softcap,
                                   alibi_slopes, dropout_p, dropout_seed=seed, **(paged or {}))
    # flash-attn reports +inf (not -inf) as the LSE of rows that see no key.
    lse = torch.where(lse == float("-inf"), float("inf"), lse)
    # rng_state: flash-attn's (seed, offset) pair, which its backward takes to replay the mask
    rng_state = (torch.zeros(2, dtype=torch.int64, device=q.device) if seed is None
                 else torch.stack((seed, torch.zeros_like(seed))).to(q.device))
    return out, lse, q.new_empty((0,)), rng_state


def _check_like(name, x, shape, like, dtype=None):
    dtype = like.dtype if dtype is None else dtype
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype or x.device != like.device:
        raise ValueError(f"{name} must have shape {tuple(shape)}, dtype {dtype} and device "
                         f"{like.device}; got {describe(x)}")


def _private_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, varlen, dropout_p,
                      softmax_scale, causal, window_size_left, window_size_right, softcap,
                      alibi_slopes, deterministic, rng_state):
    """dq, dk, dv (where not None) written in place; returns flash-attn's softmax_d,
    (1 - dropout_p) rowsum(dout * out) in its padded layout."""
    names = ("q", "k", "v")
    if varlen is None:
        check_qkv(q, k, v, names, own_v_dim=True)
        B, H = q.shape[0], q.shape[2]
        lse_shape = (B, H, q.shape[1])
        cu_q = cu_k = None
        max_q = max_k = 0
    else:
        for name, x in zip(names, (q, k, v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3:
                got = describe(x) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} must be a (total_tokens, nheads, headdim) tensor; "
                                 f"got {got}")
        check_qkv(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), names, own_v_dim=True)
        cu_q = check_cu_seqlens("cu_seqlens_q", varlen[0], q.device)
        cu_k = check_cu_seqlens("cu_seqlens_k", varlen[1], q.device)
        if cu_k.numel() != cu_q.numel():
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length "
                             f"(batch + 1); got {describe(cu_q)} and {describe(cu_k)}")
        max_q = check_max_seqlen("max_seqlen_q", varlen[2])
        max_k = check_max_seqlen("max_seqlen_k", varlen[3])
        check_varlen_indices(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
        B, H = cu_q.numel() - 1, q.shape[1]
        lse_shape = (H, q.shape[0])
    out_shape = (*q.shape[:-1], v.shape[-1])
    _check_like("dout", dout, out_shape, q)
    _check_like("out", out, out_shape, q)
    _check_like("softmax_lse", softmax_lse, lse_shape, q, torch.float32)
    for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if buf is not None:
            _check_like(name, buf, like.shape, like)
    causal = check_flag("causal", causal)
    deterministic = check_deterministic(deterministic)
    scale = check_scale(softmax_scale, q.shape[-1])
    left, right = _window_sides(window_size_left, window_size_right)
    softcap = check_softcap(softcap)
    alibi_slopes = check_alibi(alibi_slopes, B, H, q.device)
    dropout_p, seed = _dropout_p(dropout_p), None
    if dropout_p:
        if not isinstance(rng_state, torch.Tensor) or rng_state.numel() < 1 \
                or rng_state.dtype != torch.int64:
            raise ValueError(
                "dropout_p > 0 in the backward needs the forward's rng_state (the int64 (2,) "
                "tensor that _flash_attn_forward returned) to replay its dropout mask; got "
                f"{describe(rng_state) if isinstance(rng_state, torch.Tensor) else rng_state!r}"
                ". (ring-flash-attn passes none: run it with dropout_p=0.)")
        seed = rng_state.reshape(-1)[0].cpu()
    with torch.no_grad():
        grads = _call(torch.ops.flashtriton.attn_bwd, _attn_bwd, "flashtriton::attn_bwd",
                      unit_last(dout), unit_last(q), unit_last(k), unit_last(v), unit_last(out),
                      softmax_lse.contiguous(), cu_q, cu_k, max_q, max_k, alibi_slopes, None,
                      scale, causal, left, right, softcap, dropout_p, seed, None, None, 128, 0,
                      deterministic, False, None)
        for buf, grad in zip((dq, dk, dv), grads):
            if buf is not None:
                buf.copy_(grad)
        delta = (dout.float() * out.float()).sum(-1).mul_(1.0 - dropout_p)  # (..., rows, H)
        if varlen is None:  # (B, H, seqlen_q rounded up to 128)
            rows = lse_shape[2]
            softmax_d = delta.new_zeros((B, H, (rows + 127) // 128 * 128))
            softmax_d[:, :, :rows] = delta.transpose(1, 2)
        else:  # (H, total_q + 128 B): sequence b's rows from cu_seqlens_q[b] + 128 b
            rows = torch.arange(q.shape[0], device=q.device)
            seq = torch.searchsorted(cu_q[1:], rows.to(cu_q.dtype), right=True)
            softmax_d = delta.new_zeros((H, q.shape[0] + 128 * B))
            # q's rows past cu_seqlens_q[-1] belong to no sequence: 0 (their dout and out are
            # never read), at places past every sequence's (no host sync to drop them)
            softmax_d[:, rows + 128 * seq] = torch.where(seq < B, delta.t(), 0.0)
    return softmax_d


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn 2.8's private forward on (batch, seqlen, nheads, headdim) q, k, v.

    Returns (out, softmax_lse, S_dmask, rng_state): out in q's dtype with v's head dim,
    softmax_lse (batch, nheads, seqlen_q) float32 (+inf for rows that see no key), S_dmask
    an empty tensor of q's dtype, rng_state an int64 (2,) tensor on q's device (the dropout
    seed and 0; ``_flash_attn_backward`` replays the mask from it). Dropout draws its seed
    from torch's default generator. return_softmax=True raises: flash-attn's RuntimeError
    without dropout, NotImplementedError with it (S_dmask is not materialized)."""
    return _private_forward(q, k, v, None, dropout_p, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, alibi_slopes, return_softmax)


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn 2.8's private varlen forward on packed (total, nheads, headdim) q, k, v
    (or a paged k, v with block_table, as ``flash_attn_varlen_func``'s).

    Returns (out, softmax_lse, S_dmask, rng_state) as ``_flash_attn_forward``'s, softmax_lse
    (nheads, total_q). zero_tensors has nothing to do (every row of out is written);
    leftpad_k is not supported (NotImplementedError)."""
    check_flag("zero_tensors", zero_tensors)
    if leftpad_k is not None:
        raise NotImplementedError("flashtriton: _flash_attn_varlen_forward's leftpad_k is not "
                                  "supported (flash_attn_with_kvcache's cache_leftpad is)")
    return _private_forward(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                            dropout_p, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, alibi_slopes, return_softmax,
                            dict(seqused_k=seqused_k, block_table=block_table))


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """flash-attn 2.8's private backward: the gradients of attention over q, k, v given the
    forward's out and softmax_lse (the final ones: a ring's merged LSE), written into dq, dk
    and dv (those not None; each in its input's shape, dtype and device, any strides).

    Returns softmax_d (batch, nheads, seqlen_q rounded up to 128) float32:
    (1 - dropout_p) rowsum(dout * out), zero past seqlen_q. With dropout_p > 0, rng_state
    must be the forward's (ValueError otherwise: the mask could not be replayed)."""
    return _private_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, None, dropout_p,
                             softmax_scale, causal, window_size_left, window_size_right,
                             softcap, alibi_slopes, deterministic, rng_state)


def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    """flash-attn 2.8's private varlen backward, as ``_flash_attn_backward`` on packed
    (total, nheads, headdim) tensors with softmax_lse (nheads, total_q). Returns softmax_d
    (nheads, total_q + 128 batch) float32, sequence b's rows from cu_seqlens_q[b] + 128 b
    (flash-attn's padded layout; zero elsewhere). zero_tensors has nothing to do."""
    check_flag("zero_tensors", zero_tensors)
    return _private_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv,
                             (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), dropout_p,
                             softmax_scale, causal, window_size_left, window_size_right,
                             softcap, alibi_slopes, deterministic, rng_state)


def install() -> types.ModuleType:
    """Make ``import flash_attn`` (and ``flash_attn.flash_attn_interface``,
    ``flash_attn.bert_padding``) give flashtriton's drop-ins, for code that imports flash-attn
    itself; returns the ``flash_attn`` module. Modules that imported flash-attn before the
    call keep what they imported (a warning says so when the real package was loaded);
    ``uninstall()`` puts the previous modules back."""
    from . import bert_padding
    current = sys.modules.get("flash_attn")
    if current is not None and getattr(current, "__flashtriton__", False):
        return current
    if current is not None:
        warnings.warn("flash_attn was imported before flashtriton.compat.flash_attn.install(): "
                      "modules that imported from it keep the real flash-attn", stacklevel=2)
    for name in _ALIASES:
        _saved[name] = sys.modules.get(name)
    package = types.ModuleType("flash_attn", "flashtriton's flash-attn drop-in (install())")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    package.__path__ = []
    package.__version__ = FLASH_ATTN_VERSION
    package.__flashtriton__ = True
    interface = sys.modules[__name__]
    for name in __all__:
        setattr(package, name, getattr(interface, name))
    package.flash_attn_interface = interface
    package.bert_padding = bert_padding
    sys.modules.update({"flash_attn": package, "flash_attn.flash_attn_interface": interface,
                        "flash_attn.bert_padding": bert_padding})
    return package


def uninstall() -> None:
    """Undo ``install()``: the modules that ``flash_attn`` names had before it."""
    for name in _ALIASES:
        if name in _saved:
            previous = _saved.pop(name)
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
