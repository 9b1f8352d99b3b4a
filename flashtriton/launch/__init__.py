"""Launchers: allocate outputs, choose the kernel family, launch.

Plain Python over the ``@triton.jit`` / ``@gluon.jit`` kernels of ``flashtriton.kernels``; no
autograd and no input validation here (``flashtriton.validation`` validates). Every tensor is
(B, T, H, D) with a unit stride on D; everything else may be strided.

- ``calls``: what a call computes (``Variant``, ``Varlen``) and the arguments every family shares;
- ``triton_attn``: the Triton forward and backward (every variant, any GPU, the interpreter);
- ``gluon_attn``: the warp-specialized Gluon forward and backward (Hopper, Triton 3.6);
- this module: ``forward_route`` / ``backward_route``, the one place where a call's family is
  chosen (policy in ``configs``), and the entry points ``attention_forward`` /
  ``attention_backward`` that follow it.
"""

import threading
from typing import List, Optional, Tuple

import torch

from .. import _env, configs, runtime
from ..runtime import on_device_of, output_like, pointers, recall, remember
from .calls import (AttentionOutput, Variant, Varlen, _dims, _lse_buffer, _signature, _windowed,
                    lookup_mods, register_mods)
from .gluon_attn import (_gluon_backward, _gluon_forward, _gluon_signature, _token_rows,
                         attention_backward_gluon, attention_forward_gluon, gluon_backward_ahead,
                         gluon_backward_misfit, gluon_misfit, gluon_triton_misfit)
from .triton_attn import triton_backward, triton_forward

__all__ = ["AttentionOutput", "Variant", "Varlen", "attention_forward", "attention_backward", "forward_route",
           "backward_route", "attention_forward_gluon", "attention_backward_gluon",
           "gluon_misfit", "gluon_backward_misfit", "gluon_triton_misfit", "output_like",
           "on_device_of", "register_mods", "lookup_mods", "triton_forward", "triton_backward"]


def forward_route(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant,
                  varlen: Optional[Varlen] = None) -> Tuple[str, List[str]]:
    """The forward's kernel family for this call, "gluon", "triton" or "split" (the KV-cache
    launcher's split-KV kernel: configs.dense_split), and why the ones not taken do not run
    it."""
    SQ, D = _dims(q, k, varlen)[1], q.shape[-1]
    if _dense_split(q, k, v, variant, varlen):
        return "split", [f"gluon, triton: {SQ} queries over {k.shape[1]} keys, "
                         f"{q.shape[2] // k.shape[2]} query heads a KV head: the split-KV kernel "
                         f"reads each key once a KV head (configs.dense_split)"]
    if not _env.GLUON:
        return "triton", ["gluon: FLASHTRITON_GLUON=0"]
    if variant.batch_invariant:
        return "triton", ["gluon: batch_invariant runs the Triton forward's one fixed tile"]
    if not configs.gluon_forward_first(D, SQ, variant.causal):
        return "triton", [f"gluon: the forward takes it at head dims {configs.GLUON_FWD_HEAD_DIMS}"
                          f" and causal sequences over {configs.GLUON_FWD_CAUSAL_MAX_TRITON}, "
                          f"head dim 64 and padded ones from configs.GLUON_FWD_MIN_SEQLEN, "
                          f"got head dim {D}, {SQ} queries, causal={variant.causal}"]
    reason = gluon_misfit(q, k, v, variant, varlen, variants=configs.GLUON_VARIANTS)
    if reason is not None:
        return "triton", ["gluon: " + reason]
    return "gluon", []


def backward_route(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant,
                   varlen: Optional[Varlen] = None) -> Tuple[str, List[str]]:
    """The backward's kernel family for this call, "gluon" or "triton", and why the ones not
    taken do not run it."""
    if not _env.GLUON:
        return "triton", ["gluon: FLASHTRITON_GLUON=0"]
    width = configs.gluon_head_dim(q.shape[-1])
    if variant.deterministic and not configs.gluon_bwd_split(width):
        # (over head dim 128 dQ comes from the Triton dQ kernel: no sums in varying order)
        return "triton", ["gluon: its dQ sums vary in order from run to run (deterministic=True)"]
    if varlen is not None:
        return "triton", ["gluon: the Gluon backward takes dense batches"]
    if width not in configs.GLUON_BWD_HEAD_DIMS:
        return "triton", [f"gluon: the backward takes head dims {configs.GLUON_BWD_HEAD_DIMS} "
                          f"(configs.GLUON_BWD_HEAD_DIMS) and {configs.GLUON_PADDED_HEAD_DIMS} "
                          f"padded, got {q.shape[-1]}"]
    if q.shape[1] < configs.GLUON_BWD_MIN_SEQLEN:
        return "triton", [f"gluon: the backward takes it from {configs.GLUON_BWD_MIN_SEQLEN} "
                          f"tokens (configs.GLUON_BWD_MIN_SEQLEN), got {q.shape[1]}"]
    if width != q.shape[-1]:
        least = configs.GLUON_PADDED_BWD_MIN_SEQLEN.get(q.shape[-1], float("inf"))
        if q.shape[1] < least:
            return "triton", [f"gluon: the backward takes head dim {q.shape[-1]} (padded) from "
                              f"{least} tokens (configs.GLUON_PADDED_BWD_MIN_SEQLEN), got "
                              f"{q.shape[1]}"]
    reason = gluon_backward_misfit(None, q, k, v, variant)
    if reason is None and not configs.GLUON_BWD_VARIANTS and (
            _windowed(variant) or variant.softcap or variant.alibi_slopes is not None):
        reason = "windows, softcap and ALiBi are off (configs.GLUON_BWD_VARIANTS)"
    if reason is not None:
        return "triton", ["gluon: " + reason]
    return "gluon", []


def _split_computes(q, v, variant: Variant) -> bool:
    """Whether the split-KV kernel computes this variant: no score mask, mods, block mask,
    dropout, batch invariance or moved diagonal, v's head dim q's."""
    return (variant.attn_mask is None and variant.score_mod is None
            and variant.mask_mod is None and variant.kv_blocks is None and not variant.dropout_p
            and not variant.batch_invariant and variant.diag_offset == 0
            and v.shape[-1] == q.shape[-1])


def _paged_singles(q, v, variant: Variant, varlen: Optional[Varlen]) -> bool:
    """Whether a call is paged varlen whose one-query sequences go to the split-KV kernel
    (configs.paged_singles), which computes this variant."""
    return (varlen is not None and varlen.block_table is not None
            and configs.paged_singles(varlen.cu_seqlens_q.numel() - 1, q.shape[0],
                                      varlen.max_seqlen_q)
            and _split_computes(q, v, variant))


def _dense_split(q, k, v, variant: Variant, varlen: Optional[Varlen]) -> bool:
    """Whether a dense call runs the split-KV kernel (configs.dense_split), which computes
    this variant."""
    return (varlen is None and q.dim() == 4 and k.shape[2] > 0  # (no heads: empty)
            and configs.dense_split(q.shape[2] // k.shape[2], q.shape[1], k.shape[1])
            and _split_computes(q, v, variant))


@on_device_of
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant,
                      varlen: Optional[Varlen] = None, out: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """O in q's shape with v's head dim, in q's dtype (into ``out`` where given: that shape
    and dtype, a unit stride on D); LSE fp32 in natural log, (B, H, SQ) or (H, total_q)."""
    SK = _dims(q, k, varlen)[2]
    out = runtime._empty_like(q, v.shape[-1]) if out is None else out
    lse, stride_lb, stride_lh = _lse_buffer(q, varlen)
    if out.numel() == 0:
        return out, lse
    if SK == 0 or k.numel() == 0:  # no keys: each row's softmax is its sink's alone, if any
        if variant.sinks is None:
            return out.zero_(), lse.fill_(float("-inf"))
        shape = [1] * lse.dim()
        shape[lse.dim() - 2] = -1  # the heads: 1 of (B, H, SQ), 0 of (H, total)
        return out.zero_(), lse.copy_(variant.sinks.float().view(shape).expand_as(lse))
    signature = _signature("fwd", variant, varlen, q, k, v)
    if signature is None and varlen is None:  # ALiBi or a block mask: the Gluon forward's
        signature = _gluon_signature("gluon_fwd", variant, variant.kv_blocks, q, k, v)
    replays = recall(signature)
    # (a Triton replay's signature has no ALiBi, block mask or sinks: None where its
    # 6th .. 8th leading arguments, the score mask and CU_Q, are None too)
    ptrs = (pointers(q, k, v, out, lse, variant.alibi_slopes, variant.kv_blocks, variant.sinks)
            if replays is not None else None)
    if ptrs is not None:
        replays[0](*ptrs)
        return out, lse
    if getattr(TRAINING, "on", False) and varlen is None:  # (not on a replay: not a first call)
        backward_ahead(q, k, v, variant)
    route = forward_route(q, k, v, variant, varlen)[0]
    if route == "gluon":
        remember(signature, _gluon_forward(q, k, v, out, lse, variant))
        return out, lse
    if signature is not None and signature[0] == "gluon_fwd":
        signature = None  # (the Triton forward's and the split route's replays take other
        #   leading tensors)
    if route == "split":
        from .decode import dense_split
        dense_split(q, k, v, out, lse, variant, signature)
        return out, lse
    if _paged_singles(q, v, variant, varlen):
        from .decode import paged_singles
        triton_forward(q, k, v, out, lse, stride_lb, stride_lh, variant,
                       varlen._replace(singles_elsewhere=True))
        paged_singles(q, k, v, out, lse, variant, varlen)
        return out, lse
    remember(signature, triton_forward(q, k, v, out, lse, stride_lb, stride_lh, variant, varlen))
    return out, lse


# The signatures whose backward was compiled ahead (backward_ahead; at most _AHEAD_MAX, then
# forgotten), and its threads not yet joined (under _PENDING_LOCK: backwards of several devices
# run on autograd's threads).
_AHEAD = set()
_AHEAD_MAX = 1024
_PENDING: List[threading.Thread] = []
_PENDING_LOCK = threading.Lock()
# TRAINING.on: the forward being launched has a backward to follow (autograd's forward sets it
# in plain eager mode; per thread)
TRAINING = threading.local()


def backward_ahead(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant) -> None:
    """On a forward that is not a replay (the first of its call signature) whose backward will
    follow (autograd: TRAINING) and run the Gluon backward, compile that backward's kernels in
    a thread (gluon_backward_ahead: meta tensors, no device work) while the forward's compile:
    Triton's compiler releases the GIL, so the two compiles overlap instead of following one
    another. attention_backward joins the thread first. Off with FLASHTRITON_COMPILE_AHEAD=0,
    under the interpreter, during a CUDA graph capture, for packed sequences and for calls of
    no signature (an SDPA mask, dropout, a score_mod; FLASHTRITON_FAST_LAUNCH=0: none)."""
    if (not _env.COMPILE_AHEAD or _env.INTERPRET or not q.is_cuda
            or torch.cuda.is_current_stream_capturing()):
        return
    signature = _gluon_signature("bwd_ahead", variant, variant.q_blocks, q, k, v)
    if signature is None or signature in _AHEAD:
        return
    if len(_AHEAD) >= _AHEAD_MAX:
        _AHEAD.clear()
    _AHEAD.add(signature)
    if backward_route(q, k, v, variant)[0] != "gluon":
        return
    meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            for t in (q, k, v)]
    if _token_rows(q) is None or _token_rows(k) is None:  # (as the backward's misfit says)
        return
    thread = threading.Thread(target=_compile_ahead, args=(*meta, variant, q.get_device()),
                              name="flashtriton-compile-ahead", daemon=True)
    thread.start()
    with _PENDING_LOCK:
        _PENDING.append(thread)


def _compile_ahead(q, k, v, variant: Variant, device: int) -> None:
    """backward_ahead's thread: a failure is the real backward's to report."""
    try:
        with torch.cuda.device(device):
            gluon_backward_ahead(q, k, v, variant)
    except Exception as e:  # noqa: BLE001 (the backward compiles and raises on its own)
        _env.logger.debug("compile ahead of the Gluon backward failed: %r", e)


def join_ahead() -> None:
    """Wait for backward_ahead's threads (the backward's kernels they compile)."""
    with _PENDING_LOCK:
        threads = _PENDING[:]
        _PENDING.clear()
    for thread in threads:
        thread.join()


@on_device_of
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, variant: Variant,
                       varlen: Optional[Varlen] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """dQ, dK, dV in the dtypes, shapes and (dense) layouts of q, k, v, and the sinks'
    gradient (None without sinks).

    With sinks, ``lse`` and ``out`` are the forward's (the sink in each row's denominator), so
    the kernels' P = exp(S - lse) and dS = P (dP - delta) need nothing else: the sink has no
    value, so its dP is 0 and delta = rowsum(dO * O) is unchanged. The sink's own gradient is
    P_sink (0 - delta) = -exp(sink - lse) delta summed over every row of its head."""
    if _PENDING:
        join_ahead()
    SK = _dims(q, k, varlen)[2]
    if q.numel() == 0 or k.numel() == 0 or SK == 0:
        empty = runtime._empty_like
        dsinks = None if variant.sinks is None else torch.zeros_like(variant.sinks)
        return empty(q).zero_(), empty(k).zero_(), empty(v).zero_(), dsinks
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if backward_route(q, k, v, variant, varlen)[0] == "gluon":
        if _token_rows(dout) is None:
            dout = dout.contiguous()  # e.g. the expanded gradient of a sum
        dq, dk, dv, delta = _gluon_backward(dout, q, k, v, out, lse, variant)
    else:
        dq, dk, dv, delta = triton_backward(dout, q, k, v, out, lse, variant, varlen)
    return dq, dk, dv, _sinks_grad(variant.sinks, lse, delta)


def _sinks_grad(sinks: Optional[torch.Tensor], lse: torch.Tensor,
                delta: torch.Tensor) -> Optional[torch.Tensor]:
    """-sum over rows of exp(sink - lse) delta per head: lse and delta (B, H, SQ), or (H, total)
    for packed sequences."""
    if sinks is None:
        return None
    axis = lse.dim() - 2  # the heads: 1 of (B, H, SQ), 0 of (H, total)
    shape = [1] * lse.dim()
    shape[axis] = -1
    p_sink = torch.exp(sinks.float().view(shape) - lse)
    rows = tuple(d for d in range(lse.dim()) if d != axis)
    return (-(p_sink * delta).sum(rows)).to(sinks.dtype)
