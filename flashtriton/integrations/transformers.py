"""Hugging Face transformers (>= 4.53): an attention implementation named ``"triton_fa"``.

    from flashtriton.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="triton_fa")

(The name avoids "flash": transformers sends such names to its hub-kernel loader.) GQA
runs without repeating K/V; padding masks go through unpad -> varlen -> pad; packed
batches through ``cu_seq_lens_*`` / ``max_length_*`` kwargs or restarting position_ids;
sliding windows (transformers' window w = flash-attn's (w - 1, w - 1)), softcap,
dropout, scaling and is_causal map onto flashtriton's options.
"""

from typing import Optional

import torch

from ..api import flash_attention, flash_attention_varlen
from ..compat.bert_padding import index_first_axis, pad_input, unpad_input

NAME = "triton_fa"


def _cu_from_position_ids(position_ids: torch.Tensor):
    """Packed sequences restart their positions at 0: cumulative lengths and the longest."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().reshape(-1).to(torch.int32)
    total = torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)
    cu = torch.cat([starts, total])
    return cu, int(cu.diff().max())


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention signature: query (B, H, SQ, D), key/value (B, HKV, SK, D);
    attention_mask None or a 2-D (B, SK) padding mask (1 = token). Returns ((B, SQ, H, D), None)."""
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))     # (B, T, H, D) views
    B, SQ, SK = q.shape[0], q.shape[1], k.shape[1]
    window = ((sliding_window - 1, sliding_window - 1)
              if sliding_window is not None and SK > sliding_window else (-1, -1))
    opts = dict(causal=bool(is_causal), softmax_scale=scaling, window_size=window,
                softcap=softcap or 0.0, dropout_p=dropout,
                deterministic=bool(kwargs.get("deterministic")))
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None and attention_mask.dim() == 2:
        mask_k = attention_mask.bool()
        kk, idx_k, cu_k, max_k, _ = unpad_input(k, mask_k)
        vv = index_first_axis(v.reshape(B * SK, *v.shape[2:]), idx_k)
        qq, idx_q, cu_q, max_q, _ = unpad_input(q, mask_k[:, -SQ:])
        out = flash_attention_varlen(qq, kk, vv, cu_q, cu_k, max_q, max_k, **opts)
        return pad_input(out, idx_q, B, SQ), None
    if cu_q is not None and cu_k is not None:
        out = flash_attention_varlen(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                     v.reshape(-1, *v.shape[2:]), cu_q.to(torch.int32),
                                     cu_k.to(torch.int32), int(kwargs["max_length_q"]),
                                     int(kwargs["max_length_k"]), **opts)
        return out.reshape(B, SQ, *out.shape[1:]), None
    if position_ids is not None and B == 1 and SQ == SK and SQ > 1 \
            and bool((position_ids.reshape(-1)[1:] == 0).any()):
        cu, max_len = _cu_from_position_ids(position_ids)
        out = flash_attention_varlen(q[0], k[0], v[0], cu, cu, max_len, max_len, **opts)
        return out[None], None
    return flash_attention(q, k, v, **opts), None


def register(name: str = NAME) -> str:
    """Register the attention function and its mask function with transformers under ``name``."""
    if "flash" in name:
        raise ValueError(f"name {name!r} contains 'flash': transformers would send it to its "
                         "hub-kernel loader")
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
