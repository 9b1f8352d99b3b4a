"""torch.library custom ops (with fake implementations) and the autograd.Function.

The ops make flashtriton opaque to torch.compile (no graph break, no tracing
into Triton); the Function saves what the backward needs: q, k, v, out and the
LSE (and the ALiBi slopes), never an N x N tensor.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import launch
from .launch import Variant


@torch.library.custom_op("flashtriton::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], softmax_scale: float,
             causal: bool, window_left: int, window_right: int,
             softcap: float) -> Tuple[Tensor, Tensor]:
    """(B, SQ, H, D) q, (B, SK, HKV, D) k, v -> out (B, SQ, H, D), lse (B, H, SQ) fp32."""
    return launch.attention_forward(q, k, v, Variant(softmax_scale, causal, window_left,
                                                     window_right, softcap, alibi_slopes))


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, alibi_slopes, softmax_scale, causal, window_left, window_right,
                   softcap):
    B, SQ, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, SQ), dtype=torch.float32)


@torch.library.custom_op("flashtriton::attn_bwd", mutates_args=())
def attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int,
             window_right: int, softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of attn_fwd, recomputed from q, k, v, out and lse."""
    return launch.attention_backward(dout, q, k, v, out, lse,
                                     Variant(softmax_scale, causal, window_left, window_right,
                                             softcap, alibi_slopes))


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, alibi_slopes, softmax_scale, causal, window_left,
                   window_right, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class FlashAttnFunction(torch.autograd.Function):
    """out, lse = FlashAttnFunction.apply(q, k, v, alibi_slopes, softmax_scale, causal,
    window_left, window_right, softcap); lse and alibi_slopes are not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, softmax_scale, causal, window_left, window_right,
                softcap):
        out, lse = torch.ops.flashtriton.attn_fwd(q, k, v, alibi_slopes, softmax_scale, causal,
                                                  window_left, window_right, softcap)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
        ctx.options = (softmax_scale, causal, window_left, window_right, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
        dq, dk, dv = torch.ops.flashtriton.attn_bwd(dout, q, k, v, out, lse, alibi_slopes,
                                                    *ctx.options)
        return dq, dk, dv, None, None, None, None, None, None
