"""``explain``: which kernel family a call runs, forward and backward, and why not the others
(the reasons the routing in flashtriton.launch computes)."""

from typing import List, NamedTuple, Optional, Tuple

import torch

from . import _env, launch
from .validation import (_dropout_p, check_alibi, check_deterministic, check_flag, check_mods,
                         check_qkv, check_scale, check_sinks, check_softcap, check_window)


class Explanation(NamedTuple):
    forward: str          # "gluon", "triton" or "split" (the split-KV kernel: few queries)
    backward: str         # "gluon" or "triton"
    reasons: List[str]    # why the families not taken do not run the call
    interpreted: bool = False  # Triton's interpreter runs the kernels (TRITON_INTERPRET=1)

    def __str__(self) -> str:
        lines = [f"forward: {self.forward}", f"backward: {self.backward}"]
        if self.interpreted:
            lines.append("interpreter: TRITON_INTERPRET=1: Triton's interpreter runs these "
                         "kernels on the CPU (CPU tensors run only so), not a GPU's compiled code")
        return "\n".join(lines + [f"  not {r}" for r in self.reasons])


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
            softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
            dropout_p: float = 0.0, score_mod=None, score_mod_grad=None, mask_mod=None,
            block_mask=None, deterministic: bool = False, sinks: Optional[torch.Tensor] = None,
            batch_invariant: bool = False) -> Explanation:
    """The kernel families ``flash_attention(q, k, v, **options)`` runs, forward and backward,
    and the reasons the others do not; ``interpreted``: Triton's interpreter runs them
    (TRITON_INTERPRET=1, as CPU tensors need). Takes every option flash_attention takes and
    checks its arguments as flash_attention does (ValueError / TypeError); launches nothing
    (a mask_mod without block_mask is routed as the block mask flash_attention would make)."""
    check_qkv(q, k, v, own_v_dim=True)
    causal = check_flag("causal", causal)
    left, right = check_window(window_size)
    softcap = check_softcap(softcap)
    B, SQ, H = q.shape[:3]
    alibi_slopes = check_alibi(alibi_slopes, B, H, q.device)
    dropout_p = _dropout_p(dropout_p)
    if score_mod is not None or score_mod_grad is not None or mask_mod is not None \
            or block_mask is not None:
        check_mods(q, k, (B, H, SQ, k.shape[1]), causal, (left, right), softcap, alibi_slopes,
                   None, dropout_p, score_mod, score_mod_grad, mask_mod, block_mask)
    variant = launch.Variant(check_scale(softmax_scale, q.shape[-1]), causal, left, right,
                             softcap, alibi_slopes, dropout_p=dropout_p,
                             score_mod=score_mod, score_mod_grad=score_mod_grad,
                             deterministic=check_deterministic(deterministic),
                             sinks=check_sinks(sinks, H, q.device),
                             batch_invariant=check_flag("batch_invariant", batch_invariant))
    if block_mask is not None:
        variant = variant.with_block_mask(block_mask)
    elif mask_mod is not None:  # the lists' shapes as create_block_mask makes them, unfilled
        lists = torch.empty((B, H, 0, 0), dtype=torch.int32, device="meta")
        variant = variant._replace(mask_mod=mask_mod, kv_blocks=lists, q_blocks=lists)
    fwd, why_fwd = launch.forward_route(q, k, v, variant)
    bwd, why_bwd = launch.backward_route(q, k, v, variant)
    result = Explanation(fwd, bwd, [f"{r} (forward)" for r in why_fwd]
                         + [f"{r} (backward)" for r in why_bwd], _env.INTERPRET)
    _env.logger.debug("explain %s: %s", tuple(q.shape), result)
    return result
