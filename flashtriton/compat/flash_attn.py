"""flash-attn 2.x's Python interface on flashtriton's kernels.

``from flashtriton.compat.flash_attn import flash_attn_func`` replaces
``from flash_attn import flash_attn_func``. Signatures, defaults, layouts
(batch, seqlen, nheads, headdim) and return values are flash-attn's,
including the flag-dependent tuple of ``return_attn_probs``. Beyond
flash-attn, float32 inputs are accepted.

Not yet supported (raises NotImplementedError): dropout_p > 0.
"""

import torch

from ..api import _run


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               return_attn_probs, names):
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout is not supported yet; use 0.0")
    out, lse = _run(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, names)
    if not return_attn_probs:
        return out
    # flash-attn reports +inf (not -inf) as the LSE of rows that see no key.
    lse = torch.where(lse == float("-inf"), float("inf"), lse)
    return out, lse, None


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).

    nheads must be a multiple of nheads_k (MQA/GQA). Causal masks and
    window_size=(left, right) align to the bottom-right corner when seqlen_q !=
    seqlen_k (flash-attn >= 2.1); softcap > 0 caps the scaled scores with
    softcap * tanh(s / softcap); alibi_slopes (nheads,) or (batch, nheads)
    float32 add -slope * |i + seqlen_k - seqlen_q - j|. The
    backward is always deterministic here (no atomics), so ``deterministic``
    changes nothing.

    Returns out (batch, seqlen_q, nheads, headdim); with
    ``return_attn_probs=True``, ``(out, softmax_lse, None)`` where softmax_lse
    is (batch, nheads, seqlen_q) float32 (+inf for rows that see no key).
    """
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, return_attn_probs, ("q", "k", "v"))


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim).

    k and v are read as strided views of kv (no copy). Otherwise as
    ``flash_attn_func``.
    """
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError("kv must be a (batch, seqlen_k, 2, nheads_k, headdim) tensor; got "
                         f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    return _attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, return_attn_probs, ("q", "kv[:, :, 0]", "kv[:, :, 1]"))


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim), read as strided views (no copy).

    Otherwise as ``flash_attn_func``.
    """
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError("qkv must be a (batch, seqlen, 3, nheads, headdim) tensor; got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                      window_size, softcap, alibi_slopes, return_attn_probs,
                      ("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"))
