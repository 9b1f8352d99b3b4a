"""torch.library custom ops (with fake implementations) and the autograd.Function.

The ops make flashtriton opaque to torch.compile (no graph break, no tracing
into Triton); the Function saves what the backward needs: q, k, v, out and the
LSE, never an N x N tensor.
"""

from typing import Tuple

import torch
from torch import Tensor

from . import launch


@torch.library.custom_op("flashtriton::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float,
             causal: bool) -> Tuple[Tensor, Tensor]:
    """(B, SQ, H, D) q, (B, SK, HKV, D) k, v -> out (B, SQ, H, D), lse (B, H, SQ) fp32."""
    return launch.attention_forward(q, k, v, softmax_scale, causal)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, softmax_scale, causal):
    B, SQ, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, SQ), dtype=torch.float32)


@torch.library.custom_op("flashtriton::attn_bwd", mutates_args=())
def attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             softmax_scale: float, causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of attn_fwd, recomputed from q, k, v, out and lse."""
    return launch.attention_backward(dout, q, k, v, out, lse, softmax_scale, causal)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class FlashAttnFunction(torch.autograd.Function):
    """out, lse = FlashAttnFunction.apply(q, k, v, softmax_scale, causal); lse is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal):
        out, lse = torch.ops.flashtriton.attn_fwd(q, k, v, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.flashtriton.attn_bwd(dout, q, k, v, out, lse, ctx.softmax_scale,
                                                    ctx.causal)
        return dq, dk, dv, None, None
