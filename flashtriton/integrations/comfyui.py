"""ComfyUI: an attention function with ComfyUI's signature, and the override that installs it.

The node itself lives in ``integrations/comfyui/`` (a folder for ComfyUI/custom_nodes); this
module holds what can be tested without ComfyUI (it is not on PyPI).
"""

import numbers
from typing import Optional, Tuple

import torch

from .. import _env, validation
from ..sdpa import scaled_dot_product_attention

# attention_flashtriton's parameters, in ComfyUI's order.
_PARAMS = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape",
           "skip_output_reshape")


def _to_bhnd(x: torch.Tensor, heads: int, skip_reshape: bool) -> torch.Tensor:
    if skip_reshape:
        return x                                                  # already (B, H, N, D)
    B, N, C = x.shape
    return x.view(B, N, heads, C // heads).transpose(1, 2)       # (B, N, H*D) -> (B, H, N, D)


def _split_misfit(q, k, v, heads) -> Optional[str]:
    """Why (B, N, heads * D) q, k, v do not split into ``heads`` heads, or None."""
    for name, x in zip("qkv", (q, k, v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = (f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor)
                   else type(x).__name__)
            return f"{name} must be a 3-D (batch, seqlen, heads * headdim) tensor; got {got}"
    if isinstance(heads, bool) or not isinstance(heads, numbers.Integral) or heads < 1:
        return f"heads must be a positive int, got {heads!r}"
    for name, x in zip("qkv", (q, k, v)):
        if x.shape[-1] % heads:
            return f"{name}'s {x.shape[-1]} channels do not split into {heads} heads"
    return None


def _as_sdpa(q, k, v, heads, mask, skip_reshape) -> tuple:
    """(q, k, v, mask) as the SDPA drop-in takes them: (B, H, N, D) views, a (B, N, M) mask
    as (B, 1, N, M), an additive mask in q's dtype."""
    qb, kb, vb = (_to_bhnd(x, heads, skip_reshape) for x in (q, k, v))
    if isinstance(mask, torch.Tensor) and isinstance(qb, torch.Tensor):
        if mask.dim() == 3:                                      # (B, N, M): one mask per batch
            mask = mask[:, None]
        if mask.dtype != torch.bool:
            mask = mask.to(qb.dtype)
    return qb, kb, vb, mask


def _prepare(q, k, v, heads, mask, skip_reshape, scale=None) -> Tuple[Optional[str], tuple]:
    """(reason, ``_as_sdpa``'s tensors): reason None where the kernels run these inputs,
    else why not (``validation.supported`` on the (B, H, N, D) views)."""
    if not skip_reshape:
        reason = _split_misfit(q, k, v, heads)
        if reason is not None:
            return reason, ()
    prepared = _as_sdpa(q, k, v, heads, mask, skip_reshape)
    return validation.supported(*prepared[:3], layout="bhsd", attn_mask=prepared[3],
                                mask_name="mask", softmax_scale=scale), prepared


def misfit(q, k, v, heads, mask=None, skip_reshape=False) -> Optional[str]:
    """Why ``attention_flashtriton`` cannot run these inputs on its kernels, or None."""
    return _prepare(q, k, v, heads, mask, skip_reshape)[0]


def supported(q, k, v, heads, mask=None, skip_reshape=False) -> bool:
    """Whether ``attention_flashtriton`` runs these inputs on its kernels."""
    return misfit(q, k, v, heads, mask, skip_reshape) is None


def _attend(qb, kb, vb, mask, skip_output_reshape, scale):
    out = scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                       enable_gqa=kb.shape[1] != qb.shape[1])
    if skip_output_reshape:
        return out                                               # (B, H, N, D)
    B, H, N, D = out.shape
    return out.transpose(1, 2).reshape(B, N, H * D)


def attention_flashtriton(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                          skip_output_reshape=False, **kwargs):
    """ComfyUI's attention contract on flashtriton's kernels.

    q, k, v: (B, N, heads * D) (or (B, H, N, D) with ``skip_reshape``; k/v may have fewer
    heads, GQA). mask: None, or a boolean (True = attend) / additive mask broadcastable to
    (B, H, N, M), e.g. (N, M), (B, N, M) or (B, 1, N, M). attn_precision is accepted and
    not needed (scores are accumulated in float32). ``kwargs`` may carry ``scale``.
    Returns (B, N, heads * D), or (B, H, N, D) with ``skip_output_reshape``.
    """
    return _attend(*_as_sdpa(q, k, v, heads, mask, skip_reshape), skip_output_reshape,
                   kwargs.get("scale"))


def attention_override(func, *args, **kwargs):
    """``transformer_options["optimized_attention_override"]``: ComfyUI calls it with its own
    attention function ``func`` and that function's arguments; unsupported calls go to func."""
    call = dict(zip(_PARAMS, args), **kwargs)
    reason, prepared = _prepare(call.get("q"), call.get("k"), call.get("v"), call.get("heads"),
                                call.get("mask"), call.get("skip_reshape", False),
                                call.get("scale"))
    if reason is None:
        return _attend(*prepared, call.get("skip_output_reshape", False), call.get("scale"))
    _env.logger.debug("ComfyUI attention falls back to ComfyUI's own: %s", reason)
    return func(*args, **kwargs)
