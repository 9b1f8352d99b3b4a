"""flash-attn's ``bert_padding`` helpers: between padded batches and packed tokens.

    x_packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out = flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_seqlens, cu_seqlens,
                                 max_seqlen, max_seqlen)
    out_padded = pad_input(out, indices, batch, seqlen)

Same arguments and return values as flash-attn 2.7's module. Both directions are
differentiable (index_select / index_put) and copy only the kept tokens.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x[indices] along dim 0 (differentiable)."""
    return x.index_select(0, indices)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """
    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen), bool or int, 1 = a valid token.
        unused_mask: (batch, seqlen), bool or int, 1 = allocated but unused (kept
            in the packed tensor, not counted in seqused).

    Returns:
        hidden_states: (total_nnz, ...), the selected tokens in order.
        indices: (total_nnz,) int64, their positions in the flattened (batch * seqlen).
        cu_seqlens: (batch + 1,) int32 cumulative lengths.
        max_seqlen_in_batch: int (one host sync, as in flash-attn).
        seqused: (batch,) int32, the valid tokens of each sequence.
    """
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int,
              seqlen: int) -> torch.Tensor:
    """(total_nnz, ...) tokens back to (batch, seqlen, ...), zeros at the padding."""
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
