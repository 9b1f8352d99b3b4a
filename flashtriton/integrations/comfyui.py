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


def _to_bhnd(x: torch.Tensor, head_dim: int, skip_reshape: bool) -> torch.Tensor:
    if skip_reshape:
        return x                                                  # already (B, H, N, D)
    B, N, C = x.shape                                             # (B, N, H*D) -> (B, H, N, D)
    return x.view(B, N, C // head_dim, head_dim).transpose(1, 2)


def _split_misfit(q, k, v, heads) -> Optional[validation.Reason]:
    """Why (B, N, heads * D) q and (B, M, heads_k * D) k, v do not split into heads of q's
    head dim D = q.shape[-1] // heads (ComfyUI's rule: k and v have k.shape[-1] // D heads,
    fewer than q's under GQA), or None."""
    for name, x in zip("qkv", (q, k, v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = (f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor)
                   else type(x).__name__)
            return validation.Reason(f"{name} must be a 3-D (batch, seqlen, heads * headdim) "
                                     f"tensor; got {got}",
                                     ValueError if isinstance(x, torch.Tensor) else TypeError)
    if isinstance(heads, bool) or not isinstance(heads, numbers.Integral) or heads < 1:
        return validation.Reason(f"heads must be a positive int, got {heads!r}", TypeError)
    if q.shape[-1] % heads:
        return validation.Reason(f"q's {q.shape[-1]} channels do not split into {heads} heads")
    D = q.shape[-1] // heads
    for name, x in zip("kv", (k, v)):
        if D == 0 or x.shape[-1] % D:
            return validation.Reason(f"{name}'s {x.shape[-1]} channels do not split into heads "
                                     f"of q's head dim {D} ({heads} heads in q's "
                                     f"{q.shape[-1]} channels)")
    return None


def _as_sdpa(q, k, v, heads, mask, skip_reshape) -> tuple:
    """(q, k, v, mask) as the SDPA drop-in takes them: (B, H, N, D) views (k and v with their
    own head count), a (B, N, M) mask as (B, 1, N, M), an additive mask in q's dtype."""
    D = None if skip_reshape else q.shape[-1] // heads
    qb, kb, vb = (_to_bhnd(x, D, skip_reshape) for x in (q, k, v))
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
    """ComfyUI's attention contract on flashtriton's kernels, as ComfyUI calls a registered
    attention function (``set_model_optimized_attention``, the "Model attention backend"
    node: bare, with every argument of its own attention functions).

    q, k, v: (B, N, heads * D) with D = q.shape[-1] // heads, k and v (B, M, heads_k * D) with
    heads_k = k.shape[-1] // D dividing heads (GQA; ComfyUI's ``enable_gqa``), or with
    ``skip_reshape`` (B, H, N, D) and k, v (B, H_k, M, D). mask: None, or a boolean (True =
    attend) / additive mask broadcastable to (B, H, N, M), e.g. (N, M), (B, N, M) or
    (B, 1, N, M). attn_precision is accepted and not needed (scores are accumulated in
    float32). ``kwargs`` may carry ``scale``; the rest ComfyUI passes (``enable_gqa``,
    ``transformer_options``, ...) is accepted and not needed. Calls the kernels cannot run
    (``misfit`` says why) go to torch's SDPA; flat inputs that do not split into heads raise
    ValueError / TypeError naming the argument.
    Returns (B, N, heads * D of v), or (B, H, N, D of v) with ``skip_output_reshape``.
    """
    if not skip_reshape:
        reason = _split_misfit(q, k, v, heads)
        if reason is not None:
            raise reason.error(reason)
    return _attend(*_as_sdpa(q, k, v, heads, mask, skip_reshape), skip_output_reshape,
                   kwargs.get("scale"))


def attention_override(func, *args, **kwargs):
    """``transformer_options["optimized_attention_override"]``: ComfyUI calls it with its own
    attention function ``func`` and that function's arguments; unsupported calls go to func.
    The node installs it in place of whatever override the model had (one override a model:
    an attention backend chosen by an earlier node is replaced, not called)."""
    call = dict(zip(_PARAMS, args), **kwargs)
    reason, prepared = _prepare(call.get("q"), call.get("k"), call.get("v"), call.get("heads"),
                                call.get("mask"), call.get("skip_reshape", False),
                                call.get("scale"))
    if reason is None:
        return _attend(*prepared, call.get("skip_output_reshape", False), call.get("scale"))
    _env.logger.debug("ComfyUI attention falls back to ComfyUI's own: %s", reason)
    return func(*args, **kwargs)


def register() -> bool:
    """Register ``attention_flashtriton`` as "flashtriton" in ComfyUI's attention registry
    (``comfy.ldm.modules.attention.register_attention_function``, newer ComfyUI), where the
    name is free: the node calls it once, at import. True when "flashtriton" names
    ``attention_flashtriton`` afterwards."""
    try:
        from comfy.ldm.modules import attention
    except ImportError:
        return False
    register_function = getattr(attention, "register_attention_function", None)
    if register_function is None:
        return False
    get_function = getattr(attention, "get_attention_function", None)
    taken = None if get_function is None else get_function("flashtriton", None)
    if taken is None:
        register_function("flashtriton", attention_flashtriton)
        return True
    return taken is attention_flashtriton
