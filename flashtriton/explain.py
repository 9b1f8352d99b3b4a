"""``explain``: which kernel family a call runs, forward and backward, and why not the others
(the reasons the routing in flashtriton.launch computes)."""

from typing import List, NamedTuple, Optional, Tuple

import torch

from . import _env, launch
from .validation import (check_alibi, check_dropout, check_flag, check_qkv, check_scale,
                         check_softcap, check_window)


class Explanation(NamedTuple):
    forward: str          # "gluon", "triton" or "split" (the split-KV kernel: few queries)
    backward: str         # "gluon" or "triton"
    reasons: List[str]    # why the families not taken do not run the call

    def __str__(self) -> str:
        lines = [f"forward: {self.forward}", f"backward: {self.backward}"]
        return "\n".join(lines + [f"  not {r}" for r in self.reasons])


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
            softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
            dropout_p: float = 0.0, block_mask=None, deterministic: bool = False,
            batch_invariant: bool = False) -> Explanation:
    """The kernel families ``flash_attention(q, k, v, **options)`` runs, forward and backward,
    and the reasons the others do not; also logged at debug level. Checks its arguments as
    flash_attention does (ValueError / TypeError); launches nothing."""
    check_qkv(q, k, v)
    left, right = check_window(window_size)
    variant = launch.Variant(check_scale(softmax_scale, q.shape[-1]), bool(causal), left, right,
                             check_softcap(softcap),
                             check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device),
                             dropout_p=check_dropout(dropout_p)[0], deterministic=deterministic,
                             batch_invariant=check_flag("batch_invariant", batch_invariant))
    if block_mask is not None:
        variant = variant._replace(mask_mod=block_mask.mask_mod, kv_blocks=block_mask.kv_blocks,
                                   q_blocks=block_mask.q_blocks, block_size=block_mask.block_size)
    fwd, why_fwd = launch.forward_route(q, k, v, variant)
    bwd, why_bwd = launch.backward_route(q, k, v, variant)
    result = Explanation(fwd, bwd, [f"{r} (forward)" for r in why_fwd]
                         + [f"{r} (backward)" for r in why_bwd])
    _env.logger.debug("explain %s: %s", tuple(q.shape), result)
    return result
