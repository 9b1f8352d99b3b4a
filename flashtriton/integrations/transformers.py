"""Hugging Face transformers (>= 4.53): an attention implementation named ``"triton_fa"``.

    from flashtriton.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="triton_fa")

(The name avoids "flash": transformers sends such names to its hub-kernel loader.) GQA
runs without repeating K/V; padding masks go through unpad -> varlen -> pad; packed
batches through ``cu_seq_lens_*`` / ``max_length_*`` kwargs or position_ids that restart
at 0 (any batch size); sliding windows (transformers' window w = flash-attn's
(w - 1, w - 1)), softcap, dropout, scaling and is_causal map onto flashtriton's options.

Masks. ``attention_mask`` is None, a 2-D (B, SK) padding mask (what the registered
flash-style mask function makes), or a 4-D mask that the caller built (block-diagonal
packing, prefix-bidirectional, image tokens; transformers passes a 4-D mask through
unchanged): boolean (True = attend) or additive float in any float dtype, broadcastable to
(B, H, SQ, SK). The kernels read a 4-D mask tile by tile through a broadcast view (no
(B, H, SQ, SK) copy), and the mask alone decides what each query sees, as in
transformers' eager and sdpa attention: no causal mask and no sliding window on top
(scaling, softcap and dropout still apply). A row that a mask empties gives 0.
The registered mask function is transformers' flash-style one (None or the 2-D padding
mask: no (N, N) mask is built), except for patterns that the attention function could not
rebuild from its arguments -- or/and mask functions (image tokens, prefix-LM, sequence
ids), ``block_sequence_ids`` overlays, chunked attention: those get transformers' 4-D
boolean sdpa mask, which the kernels read as above.

Fallback. What the kernels cannot take goes to transformers' own
``sdpa_attention_forward``, logged at debug level on the ``flashtriton`` logger with the
reason: a 4-D mask of an integer dtype, on another device, that requires grad (a learned
bias, e.g. Parakeet's) or whose shape does not broadcast; ``position_bias`` (T5 family);
q/k/v the kernels do not take (dtype, device, head dim > 256). The causal / window /
padding / packing constraints of such a call are handed to sdpa as a dense boolean mask.
transformers' sdpa refuses softcap: a fallback with softcap raises NotImplementedError.

Keywords that transformers 5.x models pass (``attention_interface(...)`` call sites in
models/*/modeling_*.py and the ``**kwargs`` the models forward):

=================================================  ===========================================
keyword (where from)                               here
=================================================  ===========================================
scaling, dropout, softcap (Gemma 2)                softmax_scale, dropout_p, softcap
is_causal (kwarg, else ``module.is_causal``)       causal; not applied with a 4-D mask
sliding_window (Mistral, Gemma 2, gpt-oss, ...)    window (w - 1, w - 1); not with a 4-D mask
deterministic (ModernBERT)                         deterministic
cu_seq_lens_q/k, max_length_q/k (packing, vision)  varlen
position_ids                                       restarts at 0 -> varlen; else ignored
output_attentions                                  weights are not returned: None, as
                                                   flash-attn's and sdpa's integrations do
                                                   (warned once)
position_bias (T5, LongT5, Pix2Struct, ...)        fallback to transformers' sdpa
s_aux, sinks (gpt-oss, DeepSeek V4, Inkling 2)     sinks (attention sinks, differentiable)
indices, block_indices (DeepSeek V3.2, MiniMax)    NotImplementedError (sparse attention)
head_mask; block_table, k_cache, v_cache (paged)   NotImplementedError unless None
value head dim != query head dim (DeepSeek-V3     out with the value's head dim (MLA's
MLA: 192 / 128)                                    192 / 128), forward and backward
use_cache, cache_position, layer_idx, cache,       ignored (bookkeeping: no effect on the
past_key_value(s), output_hidden_states,           result; seq_idx is for Mamba layers,
output_router_logits, num_items_in_batch,          eager attention ignores it too)
return_dict, seq_idx, kernel_options
anything else                                      ignored when None or False, otherwise
                                                   NotImplementedError naming it
=================================================  ===========================================

A keyword that a newer transformers passes and that does not change the result can be added
to ``IGNORED_KWARGS``.
"""

from typing import Optional

import torch

from .._env import logger
from ..api import _run, flash_attention, flash_attention_varlen
from ..validation import supported
from ..compat.bert_padding import index_first_axis, pad_input, unpad_input

NAME = "triton_fa"

# Keywords that never change the result.
IGNORED_KWARGS = {"use_cache", "cache_position", "layer_idx", "cache", "past_key_value",
                  "past_key_values", "output_hidden_states", "output_router_logits",
                  "num_items_in_batch", "return_dict", "seq_idx", "kernel_options"}
# Keywords that change the result and that the kernels do not implement (yet).
_REJECTED = {
    "indices": "sparse attention (indices: the keys each query attends to, DeepSeek V3.2 DSA)",
    "block_indices": "block-sparse attention (block_indices)",
    "head_mask": "head_mask (a per-head scaling of the attention weights)",
    "block_table": "a paged KV cache (block_table)",
    "k_cache": "a paged KV cache (k_cache)",
    "v_cache": "a paged KV cache (v_cache)",
}
_warned_attentions = False


def _refuse(what: str):
    return NotImplementedError(
        f"flashtriton's transformers attention ({NAME!r}) does not implement {what}; "
        "running without it would give a wrong result. Use attn_implementation='eager' or "
        "'sdpa' for this model.")


def _check_kwargs(kwargs: dict) -> None:
    """Raise NotImplementedError for a keyword that would change the result and is not
    implemented; let bookkeeping keywords and unset (None / False) values through."""
    for name, value in kwargs.items():
        if name in IGNORED_KWARGS or value is None or value is False:
            continue
        if name in _REJECTED:
            raise _refuse(_REJECTED[name])
        raise NotImplementedError(
            f"flashtriton's transformers attention ({NAME!r}) got the keyword {name!r} "
            f"({type(value).__name__}), which it does not know: it may change the result, so "
            "it is not dropped. If it does not, add it to "
            "flashtriton.integrations.transformers.IGNORED_KWARGS.")


def _cu_from_position_ids(position_ids: torch.Tensor):
    """Packed sequences restart their positions at 0 (and each batch row starts one):
    cumulative lengths over the flattened (B * T) tokens, and the longest."""
    starts = position_ids == 0
    starts[:, 0] = True
    starts = starts.reshape(-1).nonzero().reshape(-1).to(torch.int32)
    total = torch.tensor([position_ids.numel()], dtype=torch.int32, device=position_ids.device)
    cu = torch.cat([starts, total])
    return cu, int(cu.diff().max())


def _packed_positions(position_ids, B: int, SQ: int, SK: int) -> Optional[torch.Tensor]:
    """(B, T) position_ids when they pack several sequences into a row (a restart at 0)."""
    if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or SQ != SK
            or SQ < 2 or position_ids.shape[1] != SQ or position_ids.shape[0] not in (1, B)):
        return None
    if not bool((position_ids[:, 1:] == 0).any()):
        return None
    return position_ids.expand(B, SQ)


def _segments(cu: torch.Tensor, n: int):
    """Segment of each of n packed tokens, and its index inside the segment."""
    t = torch.arange(n, device=cu.device)
    seg = torch.searchsorted(cu[1:].to(torch.int64), t, right=True)
    return seg, t - cu.to(torch.int64)[seg.clamp(max=cu.numel() - 2)]


def _dense_mask(B, SQ, SK, device, causal, window, pad=None, packed=None, cu=None):
    """Boolean (B, 1, SQ, SK), True = attend: what the kernels compute for a causal /
    sliding-window / padding / packed call (bottom-right aligned), for transformers' sdpa.
    packed: (B, T) position_ids that restart at 0; cu: (cu_q, cu_k) of a batch of 1."""
    if cu is not None:  # sequence b holds tokens cu_q[b]:cu_q[b + 1] of q, cu_k[b]:... of k
        cu_q, cu_k = cu
        seg_q, i = _segments(cu_q, SQ)
        seg_k, j = _segments(cu_k, SK)
        last = cu_q.numel() - 2
        i = i + (cu_k.diff() - cu_q.diff()).to(torch.int64)[seg_q.clamp(max=last)]
        keep = (seg_q[:, None] == seg_k[None, :])[None]
    else:
        i = torch.arange(SQ, device=device) + (SK - SQ)
        j = torch.arange(SK, device=device)
        keep = torch.ones(1, SQ, SK, dtype=torch.bool, device=device)
    if packed is not None:  # q and k are the same tokens: positions inside a row align
        starts = packed == 0
        starts[:, 0] = True
        seg = starts.cumsum(-1)
        keep = keep & (seg[:, :, None] == seg[:, None, :])
    rel = j[None, :] - i[:, None]  # key - query, on the aligned diagonal
    left, right = window
    if causal:
        keep = keep & (rel <= 0)
    elif right >= 0:
        keep = keep & (rel <= right)
    if left >= 0:
        keep = keep & (rel >= -left)
    keep = keep[:, None].expand(B, 1, SQ, SK)
    if pad is not None:
        keep = keep & pad[:, None, None, :].bool()
    return keep


def _fallback(reason, module, query, key, value, mask, dropout, scaling, is_causal,
              softcap, position_bias):
    """transformers' own sdpa attention, for what the kernels cannot take."""
    where = type(module).__name__
    if getattr(module, "layer_idx", None) is not None:
        where += f" (layer {module.layer_idx})"
    if softcap:
        raise NotImplementedError(
            f"flashtriton's transformers attention cannot run {reason} on its kernels, and "
            "transformers' sdpa attention, its fallback, does not take softcap "
            f"({softcap}); use attn_implementation='eager'")
    logger.debug("transformers attention in %s: transformers' sdpa attention instead of "
                 "flashtriton's kernels: %s", where, reason)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal,
                                  position_bias=position_bias)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention signature: query (B, H, SQ, D), key/value (B, HKV, SK, D)
    (value's head dim may differ: MLA);
    attention_mask None, a 2-D (B, SK) padding mask (1 = token) or a 4-D mask (see the
    module's docstring). Returns ((B, SQ, H, D), None): attention weights are never
    returned (``output_attentions`` gets None)."""
    global _warned_attentions
    position_ids = kwargs.pop("position_ids", None)
    deterministic = bool(kwargs.pop("deterministic", None))
    position_bias = kwargs.pop("position_bias", None)
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
    max_q, max_k = kwargs.pop("max_length_q", None), kwargs.pop("max_length_k", None)
    sinks = kwargs.pop("s_aux", None)
    if kwargs.get("sinks") is not None:
        if sinks is not None:
            raise ValueError("attention sinks given twice (s_aux and sinks)")
        sinks = kwargs.pop("sinks")
    kwargs.pop("sinks", None)
    if kwargs.pop("output_attentions", False) and not _warned_attentions:
        _warned_attentions = True
        logger.warning("output_attentions=True: flashtriton's transformers attention does "
                       "not compute the attention weights; they are returned as None (use "
                       "attn_implementation='eager' to get them)")
    _check_kwargs(kwargs)
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise _refuse(f"an attention_mask of type {type(attention_mask).__name__} (a tensor "
                      "or None)")
    if attention_mask is not None and attention_mask.dim() not in (2, 4):
        raise ValueError(f"attention_mask must be 2-D (batch, kv_len) or 4-D (batch, heads, "
                         f"q_len, kv_len); got shape {tuple(attention_mask.shape)}")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))     # (B, T, H, D) views
    B, SQ, SK, H = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    full_mask = attention_mask is not None and attention_mask.dim() == 4
    if full_mask:  # the mask alone decides, as in transformers' eager and sdpa attention
        causal, window = False, (-1, -1)
    else:
        causal = bool(is_causal)
        window = ((sliding_window - 1, sliding_window - 1)
                  if sliding_window is not None and SK > sliding_window else (-1, -1))

    reason = supported(q, k, v, names=("query", "key", "value"), own_v_dim=True,
                       attn_mask=attention_mask if full_mask else None,
                       mask_name="attention_mask")
    if reason is None and position_bias is not None:
        reason = "position_bias (an additive bias the kernels do not take)"
    packed = None  # position_ids that pack sequences: only without a mask and cu_seq_lens
    if attention_mask is None and (cu_q is None or cu_k is None):
        packed = _packed_positions(position_ids, B, SQ, SK)
    if reason is not None and sinks is not None:
        raise _refuse(f"attention sinks where the kernels cannot run the call ({reason}): "
                      "transformers' sdpa attention, the fallback, takes no sinks")
    if reason is not None:
        mask = attention_mask if full_mask else None
        if not full_mask:  # sdpa gets this call's constraints as a dense boolean mask
            pad, cu = attention_mask, None
            if pad is None and cu_q is not None and cu_k is not None:
                if B != 1:
                    raise _refuse(f"cu_seq_lens with batch {B} ({reason})")
                cu = (cu_q, cu_k)
            if (pad is not None or cu is not None or packed is not None or window != (-1, -1)
                    or (causal and SQ != SK and SQ > 1)):
                mask = _dense_mask(B, SQ, SK, q.device, causal, window, pad, packed, cu)
        return _fallback(reason, module, query, key, value, mask, dropout, scaling,
                         causal and mask is None, softcap, position_bias)

    opts = dict(causal=causal, softmax_scale=scaling, window_size=window,
                softcap=softcap or 0.0, dropout_p=dropout, deterministic=deterministic,
                sinks=sinks)
    if full_mask:  # a broadcast view: the kernels read it tile by tile, no (B, H, SQ, SK) copy
        return _run(q, k, v, causal=False, softmax_scale=scaling, softcap=softcap or 0.0,
                    dropout_p=dropout, names=("query", "key", "value"),
                    attn_mask=attention_mask.expand(B, H, SQ, SK),
                    deterministic=deterministic, sinks=sinks).out, None
    if attention_mask is not None:
        mask_k = attention_mask.bool()
        kk, idx_k, cu_k, max_k, _ = unpad_input(k, mask_k)
        vv = index_first_axis(v.reshape(B * SK, *v.shape[2:]), idx_k)
        qq, idx_q, cu_q, max_q, _ = unpad_input(q, mask_k[:, -SQ:])
        out = flash_attention_varlen(qq, kk, vv, cu_q, cu_k, max_q, max_k, **opts)
        return pad_input(out, idx_q, B, SQ), None
    if cu_q is not None and cu_k is not None:
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        max_q = int(cu_q.diff().max()) if max_q is None else int(max_q)
        max_k = int(cu_k.diff().max()) if max_k is None else int(max_k)
        out = flash_attention_varlen(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                     v.reshape(-1, *v.shape[2:]), cu_q, cu_k, max_q, max_k,
                                     **opts)
        return out.reshape(B, SQ, *out.shape[1:]), None
    if packed is not None:
        cu, max_len = _cu_from_position_ids(packed)
        out = flash_attention_varlen(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                     v.reshape(-1, *v.shape[2:]), cu, cu, max_len, max_len,
                                     **opts)
        return out.reshape(B, SQ, *out.shape[1:]), None
    return flash_attention(q, k, v, **opts), None


def _pattern_needs_mask(mask_function, kwargs) -> bool:
    """Whether transformers' mask pattern has parts that the attention function cannot rebuild
    from its own arguments (causal, sliding window, padding, packing): or / and mask
    functions (image tokens, prefix-LM, sequence ids; ``use_vmap`` marks them),
    ``block_sequence_ids`` overlays (``or_masks``) and chunked attention (Llama 4)."""
    if kwargs.get("use_vmap"):
        return True
    seen, todo = set(), [mask_function]
    while todo:
        f = todo.pop()
        if not callable(f) or id(f) in seen:
            continue
        seen.add(id(f))
        if getattr(f, "__qualname__", "").startswith(("or_masks.", "chunked_", "blockwise_")):
            return True
        for cell in getattr(f, "__closure__", None) or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            todo.extend(inner if isinstance(inner, (tuple, list)) else [inner])
    return False


def mask_interface(*args, **kwargs):
    """The mask function registered with the attention function: transformers'
    flash-style one (None or the 2-D padding mask; the attention function adds causal,
    window and packing itself), except for patterns it would drop (see
    ``_pattern_needs_mask``): those get sdpa's 4-D boolean mask, which the kernels read."""
    from transformers.masking_utils import flash_attention_mask, sdpa_mask

    if _pattern_needs_mask(kwargs.get("mask_function"), kwargs):
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return sdpa_mask(*args, **kwargs)
    return flash_attention_mask(*args, **kwargs)


def register(name: str = NAME) -> str:
    """Register the attention function and its mask function with transformers under ``name``."""
    if "flash" in name:
        raise ValueError(f"name {name!r} contains 'flash': transformers would send it to its "
                         "hub-kernel loader")
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_interface)
    return name
