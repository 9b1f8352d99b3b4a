"""The native API: validation, defaults, docstrings.

Layout is flash-attn's: (batch, seqlen, nheads, headdim).
"""

import math
from typing import NamedTuple, Optional

import torch

from . import _env
from .autograd import FlashAttnFunction

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class AttentionOutput(NamedTuple):
    out: torch.Tensor  # (batch, seqlen_q, nheads, headdim), dtype of q
    lse: torch.Tensor  # (batch, nheads, seqlen_q) float32, natural log; -inf for rows with no key


def _describe(x: torch.Tensor) -> str:
    return f"shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"


def check_qkv(q, k, v, names=("q", "k", "v")) -> None:
    """Raise TypeError/ValueError naming the argument for input the kernels cannot take."""
    for name, x in zip(names, (q, k, v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    nq, nk, nv = names
    for name, x in zip(names, (q, k, v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, nheads, headdim); got {_describe(x)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {x.dtype}; flashtriton computes in "
                            f"float16, bfloat16 or float32 ({_describe(x)})")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{nq}, {nk}, {nv} must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{nq}, {nk}, {nv} must be on one device; got {q.device}, {k.device}, {v.device}")
    if q.device.type == "cpu" and not _env.INTERPRET:
        raise ValueError(f"{nq} is a CPU tensor ({_describe(q)}); flashtriton runs on a GPU, or on "
                         "the CPU through Triton's interpreter: set TRITON_INTERPRET=1 in the "
                         "environment before importing flashtriton")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{nq} is on device {q.device}; flashtriton supports CUDA/ROCm GPUs "
                         "(and the CPU with TRITON_INTERPRET=1)")
    B, SQ, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{nk} and {nv} must have the same shape; got {nk} {_describe(k)} and "
                         f"{nv} {_describe(v)}")
    if k.shape[0] != B:
        raise ValueError(f"batch mismatch: {nq} {_describe(q)}, {nk} {_describe(k)}")
    if k.shape[3] != D:
        raise ValueError(f"headdim mismatch: {nq} {_describe(q)}, {nk} {_describe(k)}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"headdim must be in 1..{MAX_HEAD_DIM}; got {D} ({nq} {_describe(q)})")
    HKV = k.shape[2]
    if HKV == 0 or H % HKV != 0:
        raise ValueError(f"nheads of {nq} ({H}) must be a multiple of nheads of {nk} ({HKV}); "
                         f"{nq} {_describe(q)}, {nk} {_describe(k)}")


def _check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    return float(softmax_scale)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _run(q, k, v, causal, softmax_scale, names=("q", "k", "v")) -> AttentionOutput:
    check_qkv(q, k, v, names)
    scale = _check_scale(softmax_scale, q.shape[-1])
    out, lse = FlashAttnFunction.apply(_unit_last(q), _unit_last(k), _unit_last(v), scale,
                                       bool(causal))
    return AttentionOutput(out, lse)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Exact softmax attention, out = softmax(q k^T * softmax_scale) v, differentiable.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32.
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads
           must be a multiple of nheads_k (GQA/MQA share each k/v head between
           nheads // nheads_k query heads without copying).
        v: same shape as k.
        causal: mask aligned to the bottom-right corner (flash-attn's
           convention): query i sees key j iff j <= i + seqlen_k - seqlen_q.
           With seqlen_q=2, seqlen_k=5 (1 = attend)::

               1 1 1 1 0
               1 1 1 1 1

           and with seqlen_q=5, seqlen_k=2 the first three rows see no key;
           their output is 0 and their gradient is finite::

               0 0
               0 0
               0 0
               1 0
               1 1
        softmax_scale: defaults to 1 / sqrt(headdim).

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q, contiguous.

    Any strides are accepted (e.g. views of a packed qkv tensor); only a
    non-unit stride on headdim is copied. headdim 1..256. S and P are never
    stored: memory is O(seqlen), forward and backward.
    """
    return _run(q, k, v, causal, softmax_scale).out


def flash_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             causal: bool = False,
                             softmax_scale: Optional[float] = None) -> AttentionOutput:
    """``flash_attention`` that also returns the log-sum-exp of each row.

    Returns ``AttentionOutput(out, lse)``: out as ``flash_attention``; lse
    (batch, nheads, seqlen_q) float32, natural log of sum_j exp(q_i k_j *
    softmax_scale), -inf for rows that see no key. lse is not differentiable.
    """
    return _run(q, k, v, causal, softmax_scale)
