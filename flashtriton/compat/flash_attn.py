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
"""

import importlib.machinery
import sys
import types
import warnings

import torch

from ..api import _run, _run_varlen
from ..validation import check_flag, check_qkv, check_sinks

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
