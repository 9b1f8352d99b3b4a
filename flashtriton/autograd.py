"""torch.library custom ops (with fake implementations) and the autograd.Function.

The ops make flashtriton opaque to torch.compile (no graph break, no tracing
into Triton); the Function saves what the backward needs: q, k, v, out and the
LSE (and the ALiBi slopes and sequence offsets), never an N x N tensor.
In plain eager mode the Function calls the ops' implementations directly: the
dispatcher's route through a custom op costs more host time per call than the
kernels of a small attention take on the GPU. Under torch.compile,
export, fake tensors or any dispatch mode, it goes through the ops.

Dense calls pass cu_seqlens_q = cu_seqlens_k = None and max_seqlen_* = 0;
packed (varlen) calls pass (total, H, D) tensors and int32 offsets.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import launch
from .launch import Variant, Varlen

AttentionOutput = launch.AttentionOutput  # the result type, for the API above


def _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
            block_table=None) -> Optional[Varlen]:
    if cu_seqlens_q is None:
        return None
    return Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table)


def _variant(alibi_slopes, attn_mask, softmax_scale, causal, window_left, window_right, softcap,
             dropout_p, dropout_seed, kv_blocks, q_blocks, block_size, mods,
             deterministic, batch_invariant, sinks) -> Variant:
    seed = 0 if dropout_seed is None else int(dropout_seed)  # a CPU tensor: no device sync
    return Variant(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                   attn_mask, dropout_p, seed, *launch.lookup_mods(mods), kv_blocks, q_blocks,
                   block_size, deterministic=deterministic, sinks=sinks,
                   batch_invariant=batch_invariant)


def _attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
             cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
             alibi_slopes: Optional[Tensor], attn_mask: Optional[Tensor], softmax_scale: float,
             causal: bool, window_left: int, window_right: int, softcap: float, dropout_p: float,
             dropout_seed: Optional[Tensor], kv_blocks: Optional[Tensor],
             q_blocks: Optional[Tensor], block_size: int, mods: int,
             deterministic: bool, batch_invariant: bool, sinks: Optional[Tensor],
             seqused_k: Optional[Tensor] = None,
             block_table: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """out in q's shape with v's head dim; lse fp32 (B, H, SQ), or (H, total_q) for packed
    sequences.

    dropout_seed: a CPU int64 tensor (drawn from torch's generator by the caller);
    deterministic: the backward (attn_bwd) is to be bitwise repeatable; batch_invariant: the
    forward's bits for a row do not depend on the rest of the batch (Variant); sinks: (H,) logits
    that join each row's softmax (the LSE includes them); seqused_k, block_table: packed
    sequences' key counts and pages (Varlen; the forward only)."""
    return _forward_into(None, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         alibi_slopes, attn_mask, softmax_scale, causal, window_left,
                         window_right, softcap, dropout_p, dropout_seed, kv_blocks, q_blocks,
                         block_size, mods, deterministic, batch_invariant, sinks, seqused_k,
                         block_table)


def _forward_into(out, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *rest):
    """attn_fwd into ``out`` (None: a new tensor); rest: attn_fwd's arguments after
    max_seqlen_k."""
    variant = _variant(*rest[:16])
    return launch.attention_forward(q, k, v, variant,
                                    _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, *rest[16:]), out)


attn_fwd = torch.library.custom_op("flashtriton::attn_fwd", _attn_fwd, mutates_args=())


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    if cu_seqlens_q is None:
        B, SQ, H, _ = q.shape
        lse_shape = (B, H, SQ)
    else:
        lse_shape = (q.shape[1], q.shape[0])
    return launch.output_like(q, v.shape[-1]), q.new_empty(lse_shape, dtype=torch.float32)


def _attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
             max_seqlen_k: int, alibi_slopes: Optional[Tensor], attn_mask: Optional[Tensor],
             softmax_scale: float, causal: bool, window_left: int, window_right: int,
             softcap: float, dropout_p: float, dropout_seed: Optional[Tensor],
             kv_blocks: Optional[Tensor], q_blocks: Optional[Tensor], block_size: int,
             mods: int, deterministic: bool, batch_invariant: bool, sinks: Optional[Tensor]
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv, dsinks) of attn_fwd, recomputed from q, k, v, out and lse;
    dsinks is empty without sinks (an op returns tensors)."""
    dq, dk, dv, dsinks = launch.attention_backward(
        dout, q, k, v, out, lse,
        _variant(alibi_slopes, attn_mask, softmax_scale, causal, window_left, window_right,
                 softcap, dropout_p, dropout_seed, kv_blocks, q_blocks, block_size, mods,
                 deterministic, batch_invariant, sinks),
        _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return dq, dk, dv, q.new_empty(0) if dsinks is None else dsinks


attn_bwd = torch.library.custom_op("flashtriton::attn_bwd", _attn_bwd, mutates_args=())


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, *args):
    sinks = args[-1]
    return (launch.output_like(q), launch.output_like(k), launch.output_like(v),
            q.new_empty(0) if sinks is None else torch.empty_like(sinks))


def _plain_eager(q: Tensor) -> bool:
    """True when nothing traces or intercepts the call: real tensors, no compile, no modes."""
    return (type(q) is Tensor and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0)


def _call(op, impl, name, *args):
    """The op, or its implementation directly in plain eager mode (under the op's name in
    profiler traces)."""
    if not _plain_eager(args[0]):
        return op(*args)
    return _eager(impl, name, *args)


def _eager(impl, name, *args):
    """An op's implementation called directly, under the op's name in profiler traces."""
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(name):
            return impl(*args)
    return impl(*args)


def _forward(*args) -> Tuple[Tensor, Tensor]:
    """The forward op (out, lse) on attn_fwd's arguments."""
    return _call(torch.ops.flashtriton.attn_fwd, _attn_fwd, "flashtriton::attn_fwd", *args)


class FlashAttnFunction(torch.autograd.Function):
    """out, lse = FlashAttnFunction.apply(q, k, v, sinks, rest), rest = attn_fwd's arguments
    between v and sinks as one tuple (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    alibi_slopes, attn_mask, softmax_scale, causal, window_left, window_right, softcap,
    dropout_p, dropout_seed, kv_blocks, q_blocks, block_size, mods, deterministic,
    batch_invariant): autograd
    processes every argument of apply on every call (host time), and only q, k, v and the
    sinks are differentiable; the tensors in ``rest`` are inputs the backward reads, kept on
    ctx."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, rest):
        if _plain_eager(q):  # the backward's kernels may compile beside this forward's
            launch.TRAINING.on = True
            try:
                out, lse = _forward(q, k, v, *rest, sinks)
            finally:
                launch.TRAINING.on = False
        else:
            out, lse = _forward(q, k, v, *rest, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.rest = rest
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = gradients(dout, q, k, v, out, lse, *ctx.rest, sinks=sinks)
        return dq, dk, dv, None if sinks is None else dsinks, None


class NoBackward(torch.autograd.Function):
    """``NoBackward.apply(out, options, *inputs)``: ``out`` (computed without autograd) as the
    output of a call whose inputs require grad but that has no backward (varlen with
    block_table / seqused_k / out=): it requires grad, as flash-attn's does, and a backward
    that reaches it raises NotImplementedError naming ``options``."""

    @staticmethod
    def forward(ctx, out, options, *inputs):
        ctx.options = options
        return out.view_as(out)  # a view: out= callers keep their buffer's storage

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"flashtriton: the backward of a varlen call with {ctx.options} is not supported "
            "(flash-attn has none either): gradients do not flow into a paged KV cache, "
            "seqused_k or out=; for training, pass k and v packed with cu_seqlens_k")


def register_mods(score_mod, score_mod_grad, mask_mod) -> int:
    """The integer key that the custom ops carry for the user's ``@triton.jit`` modifiers
    (0: none); their schemas cannot hold functions (``launch.calls._MODS`` maps it back)."""
    return launch.register_mods(score_mod, score_mod_grad, mask_mod)


def attention(q: Tensor, k: Tensor, v: Tensor, *args, sinks: Optional[Tensor] = None,
              seqused_k: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
              out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse) = FlashAttnFunction.apply(q, k, v, sinks, args), or, in plain eager mode
    when no gradient can flow (inference, ``torch.no_grad()``), the forward op alone: the
    autograd.Function's bookkeeping costs more host time than a small attention's kernel.
    seqused_k, block_table and out (written in place) are for the forward alone (the API runs
    such a call without autograd and marks its output NoBackward where a gradient would flow)."""
    if seqused_k is None and block_table is None and out is None:
        if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or (sinks is not None and sinks.requires_grad))) \
                or not _plain_eager(q):
            return FlashAttnFunction.apply(q, k, v, sinks, args)
        return _eager(_attn_fwd, "flashtriton::attn_fwd", q, k, v, *args, sinks)  # plain eager
    if out is not None and _plain_eager(q):  # the kernel writes into out
        return _eager(_forward_into, "flashtriton::attn_fwd", out, q, k, v, *args, sinks,
                      seqused_k, block_table)
    res, lse = _forward(q, k, v, *args, sinks, seqused_k, block_table)
    return (res, lse) if out is None else (out.copy_(res), lse)


def gradients(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *args,
              sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks) of ``attention(q, k, v, *args, sinks=sinks)`` from its out and lse,
    without autograd: the backward op (its implementation directly in plain eager mode), for
    callers that record the graph themselves (torch's flash-attention operators:
    ``integrations.torch_registry``). dsinks is empty without sinks."""
    return _call(torch.ops.flashtriton.attn_bwd, _attn_bwd, "flashtriton::attn_bwd", dout, q, k,
                 v, out, lse, *args, sinks)
