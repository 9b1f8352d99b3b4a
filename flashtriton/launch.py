"""Launchers: allocate outputs, pick the config, compute the grid, launch.

Plain Python over the ``@triton.jit`` kernels of ``flashtriton.kernels``; no
autograd and no input validation here (``flashtriton.api`` validates). Every
tensor is (B, T, H, D) with a unit stride on D; everything else may be strided.
"""

import math
from typing import Tuple

import torch
import triton

from . import _env, configs
from .kernels.attn_bwd import (_attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel,
                               _attn_bwd_preprocess_kernel)
from .kernels.attn_fwd import _attn_fwd_kernel

_KEY = ["SQ_BUCKET", "SK_BUCKET", "HEAD_DIM", "IS_CAUSAL"]


def _autotuned(kind: str, kernel):
    cands = configs.candidates(kind)

    def early_prune(cfgs, named_args, **kwargs):
        keep = configs.prune(kind, [_cfg_tuple(c) for c in cfgs], kwargs["BLOCK_D"],
                             named_args["Q"].element_size())
        return [c for c in cfgs if _cfg_tuple(c) in keep]

    return triton.autotune(
        configs=[triton.Config(configs.as_kwargs(c), num_warps=c[2], num_stages=c[3])
                 for c in cands],
        key=_KEY,
        prune_configs_by={"early_config_prune": early_prune},
        cache_results=True,
    )(kernel)


def _cfg_tuple(cfg) -> Tuple[int, int, int, int]:
    return (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages)


_fwd = _autotuned("fwd", _attn_fwd_kernel)
_dkdv = _autotuned("dkdv", _attn_bwd_dkdv_kernel)
_dq = _autotuned("dq", _attn_bwd_dq_kernel)


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    """Every output buffer comes from here (tests poison it with NaN)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _empty(shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _strides(x: torch.Tensor):
    assert x.stride(-1) == 1, "launchers expect a unit stride on the head dim"
    return x.stride(0), x.stride(1), x.stride(2)


def _common(q: torch.Tensor, k: torch.Tensor, causal: bool):
    """Constexpr and runtime arguments shared by every kernel of one call."""
    head_dim = q.shape[3]
    upcast = _env.INTERPRET and q.dtype == torch.bfloat16
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_D=configs.block_d(head_dim),
        EVEN_D=configs.block_d(head_dim) == head_dim,
        IS_CAUSAL=bool(causal),
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=upcast,
        SQ_BUCKET=configs.bucket(q.shape[1]),
        SK_BUCKET=configs.bucket(k.shape[1]),
    )


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                      causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """O (B, SQ, H, D) in q's dtype and LSE (B, H, SQ) fp32, natural log."""
    B, SQ, H, D = q.shape
    SK, HKV = k.shape[1], k.shape[2]
    out = _empty_like(q)
    lse = _empty((B, H, SQ), torch.float32, q.device)
    if out.numel() == 0:
        return out, lse
    if SK == 0:
        return out.zero_(), lse.fill_(float("-inf"))

    def grid(meta):
        return (triton.cdiv(SQ, meta["BLOCK_M"]), B * H)

    _fwd[grid](
        q, k, v, out, lse,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        lse.stride(0), lse.stride(1),
        H, H // HKV, SQ, SK, SK - SQ, softmax_scale * math.log2(math.e),
        **_common(q, k, causal),
    )
    return out, lse


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, softmax_scale: float,
                       causal: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV in the dtypes and shapes of q, k, v (contiguous)."""
    B, SQ, H, D = q.shape
    SK, HKV = k.shape[1], k.shape[2]
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    common = _common(q, k, causal)
    qk_scale = softmax_scale * math.log2(math.e)

    delta = _empty(lse.shape, torch.float32, lse.device)
    prep_m = configs.candidates("prep")[0][0]
    _attn_bwd_preprocess_kernel[(triton.cdiv(SQ, prep_m), B * H)](
        out, dout, delta, *_strides(out), *_strides(dout), delta.stride(0), delta.stride(1),
        H, SQ, D, BLOCK_D=common["BLOCK_D"], EVEN_D=common["EVEN_D"], BLOCK_M=prep_m,
    )
    _dkdv[lambda meta: (triton.cdiv(SK, meta["BLOCK_N"]), B * HKV)](
        q, k, v, dout, lse, delta, dk, dv,
        *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dk), *_strides(dv),
        lse.stride(0), lse.stride(1),
        HKV, H // HKV, SQ, SK, SK - SQ, qk_scale, softmax_scale,
        **common,
    )
    _dq[lambda meta: (triton.cdiv(SQ, meta["BLOCK_M"]), B * H)](
        q, k, v, dout, lse, delta, dq,
        *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq),
        lse.stride(0), lse.stride(1),
        H, H // HKV, SQ, SK, SK - SQ, qk_scale, softmax_scale,
        **common,
    )
    return dq, dk, dv
