"""ComfyUI: an attention function with ComfyUI's signature, and the override that installs it.

The node itself lives in ``integrations/comfyui/`` (a folder for ComfyUI/custom_nodes); this
module holds what can be tested without ComfyUI (it is not on PyPI).
"""

from typing import Optional

import torch

from ..validation import MAX_HEAD_DIM, SUPPORTED_DTYPES
from ..sdpa import scaled_dot_product_attention
from .. import _env


def _to_bhnd(x: torch.Tensor, heads: int, skip_reshape: bool) -> torch.Tensor:
    if skip_reshape:
        return x                                                  # already (B, H, N, D)
    B, N, C = x.shape
    return x.view(B, N, heads, C // heads).transpose(1, 2)       # (B, N, H*D) -> (B, H, N, D)


def misfit(q, k, v, heads, mask=None, skip_reshape=False) -> Optional[str]:
    """Why ``attention_flashtriton`` cannot run these inputs on its kernels, or None."""
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        return "q, k, v are not all tensors"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.is_cuda or (q.device.type == "cpu" and _env.INTERPRET)):
        return f"{q.device} tensors"
    if q.dim() != (4 if skip_reshape else 3) or k.dim() != q.dim() or v.shape != k.shape:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    D = q.shape[-1] if skip_reshape else q.shape[-1] // heads
    kv_heads = k.shape[1] if skip_reshape else heads
    q_heads = q.shape[1] if skip_reshape else heads
    if not skip_reshape and (q.shape[-1] % heads or k.shape[-1] != q.shape[-1]):
        return f"q's {q.shape[-1]} channels do not split into {heads} heads like k's"
    if not 1 <= D <= MAX_HEAD_DIM or kv_heads == 0 or q_heads % kv_heads:
        return f"head dim {D}, {q_heads} query heads, {kv_heads} key heads"
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.requires_grad
                             or mask.dim() > 4):
        return "a mask that is not a tensor of at most 4 dims without grad"
    return None


def supported(q, k, v, heads, mask=None, skip_reshape=False) -> bool:
    """Whether ``attention_flashtriton`` runs these inputs on its kernels."""
    return misfit(q, k, v, heads, mask, skip_reshape) is None


def attention_flashtriton(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                          skip_output_reshape=False, **kwargs):
    """ComfyUI's attention contract on flashtriton's kernels.

    q, k, v: (B, N, heads * D) (or (B, H, N, D) with ``skip_reshape``; k/v may have fewer
    heads, GQA). mask: None, or a boolean (True = attend) / additive mask broadcastable to
    (B, H, N, M), e.g. (N, M), (B, N, M) or (B, 1, N, M). attn_precision is accepted and
    not needed (scores are accumulated in float32). ``kwargs`` may carry ``scale``.
    Returns (B, N, heads * D), or (B, H, N, D) with ``skip_output_reshape``.
    """
    qb, kb, vb = (_to_bhnd(x, heads, skip_reshape) for x in (q, k, v))
    if mask is not None:
        if mask.dim() == 3:                                      # (B, N, M): one mask per batch
            mask = mask[:, None]
        if mask.dtype != torch.bool:
            mask = mask.to(qb.dtype)
    out = scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=kwargs.get("scale"),
                                       enable_gqa=kb.shape[1] != qb.shape[1])
    if skip_output_reshape:
        return out                                               # (B, H, N, D)
    B, H, N, D = out.shape
    return out.transpose(1, 2).reshape(B, N, H * D)


def attention_override(func, *args, **kwargs):
    """``transformer_options["optimized_attention_override"]``: ComfyUI calls it with its own
    attention function ``func`` and that function's arguments; unsupported calls go to func."""
    call = dict(zip(("q", "k", "v", "heads"), args), **kwargs)
    reason = misfit(call.get("q"), call.get("k"), call.get("v"), call.get("heads"),
                    call.get("mask"), call.get("skip_reshape", False))
    if reason is None:
        return attention_flashtriton(*args, **kwargs)
    _env.logger.debug("ComfyUI attention falls back to ComfyUI's own: %s", reason)
    return func(*args, **kwargs)
