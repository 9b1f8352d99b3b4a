"""Launchers: allocate outputs, pick the config, compute the grid, launch.

Plain Python over the ``@triton.jit`` kernels of ``flashtriton.kernels``; no
autograd and no input validation here (``flashtriton.api`` validates). Every
tensor is (B, T, H, D) with a unit stride on D; everything else may be strided.
"""

import math
from typing import NamedTuple, Optional, Tuple

import torch
import triton

from . import _env, configs
from .kernels.attn_bwd import (_attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel,
                               _attn_bwd_preprocess_kernel)
from .kernels.attn_fwd import _attn_fwd_kernel

LOG2E = math.log2(math.e)
_KEY = ["SQ_BUCKET", "SK_BUCKET", "HEAD_DIM", "HAS_LOWER", "HAS_UPPER", "HAS_SOFTCAP", "HAS_ALIBI"]


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


class Variant(NamedTuple):
    """What one call computes, beyond q, k, v (the arguments of every kernel)."""
    softmax_scale: float
    causal: bool = False
    window_left: int = -1       # -1: unbounded
    window_right: int = -1      # -1: unbounded (causal forces 0)
    softcap: float = 0.0        # 0: off
    alibi_slopes: Optional[torch.Tensor] = None  # (H,) or (B, H) float32


def _alibi_args(variant: Variant):
    a = variant.alibi_slopes
    if a is None:
        return None, 0, 0
    return (a, 0, a.stride(0)) if a.dim() == 1 else (a, a.stride(0), a.stride(1))


def _common(q: torch.Tensor, k: torch.Tensor, variant: Variant):
    """Constexpr and runtime arguments shared by every kernel of one call.

    The mask: query i sees key j iff i + LOWER <= j <= i + UPPER, both bounds
    aligned to the bottom-right corner (DIAG = SK - SQ), flash-attn's rule.
    """
    SQ, head_dim = q.shape[1], q.shape[3]
    SK = k.shape[1]
    diag = SK - SQ
    right = 0 if variant.causal else variant.window_right
    has_softcap = variant.softcap > 0.0
    qk_scale = variant.softmax_scale * (1.0 / variant.softcap if has_softcap else LOG2E)
    return dict(
        HEAD_DIM=head_dim,
        LOWER=diag - variant.window_left,
        UPPER=diag + right,
        DIAG=diag,
        qk_scale=qk_scale,
        cap2=variant.softcap * LOG2E,
        BLOCK_D=configs.block_d(head_dim),
        EVEN_D=configs.block_d(head_dim) == head_dim,
        HAS_LOWER=variant.window_left >= 0,
        HAS_UPPER=right >= 0,
        HAS_SOFTCAP=has_softcap,
        HAS_ALIBI=variant.alibi_slopes is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=_env.INTERPRET and q.dtype == torch.bfloat16,
        SQ_BUCKET=configs.bucket(SQ),
        SK_BUCKET=configs.bucket(SK),
    )


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      variant: Variant) -> Tuple[torch.Tensor, torch.Tensor]:
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

    alibi, stride_ab, stride_ah = _alibi_args(variant)
    _fwd[grid](
        q, k, v, out, lse, alibi,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        lse.stride(0), lse.stride(1), stride_ab, stride_ah,
        H, H // HKV, SQ, SK,
        **_common(q, k, variant),
    )
    return out, lse


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor,
                       variant: Variant) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV in the dtypes and shapes of q, k, v (contiguous)."""
    B, SQ, H, D = q.shape
    SK, HKV = k.shape[1], k.shape[2]
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    common = _common(q, k, variant)
    alibi, stride_ab, stride_ah = _alibi_args(variant)

    delta = _empty(lse.shape, torch.float32, lse.device)
    prep_m = configs.candidates("prep")[0][0]
    _attn_bwd_preprocess_kernel[(triton.cdiv(SQ, prep_m), B * H)](
        out, dout, delta, *_strides(out), *_strides(dout), delta.stride(0), delta.stride(1),
        H, SQ, D, BLOCK_D=common["BLOCK_D"], EVEN_D=common["EVEN_D"], BLOCK_M=prep_m,
    )
    _dkdv[lambda meta: (triton.cdiv(SK, meta["BLOCK_N"]), B * HKV)](
        q, k, v, dout, lse, delta, dk, dv, alibi,
        *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dk), *_strides(dv),
        lse.stride(0), lse.stride(1), stride_ab, stride_ah,
        HKV, H // HKV, SQ, SK, sm_scale=variant.softmax_scale,
        **common,
    )
    _dq[lambda meta: (triton.cdiv(SQ, meta["BLOCK_M"]), B * H)](
        q, k, v, dout, lse, delta, dq, alibi,
        *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq),
        lse.stride(0), lse.stride(1), stride_ab, stride_ah,
        H, H // HKV, SQ, SK, sm_scale=variant.softmax_scale,
        **common,
    )
    return dq, dk, dv
