"""Float64 reference attention: readable PyTorch with the package's semantics.

Used by tests, benchmarks and users; optimized code never imports it. Runs on
any device; it materialises the (B, H, SQ, SK) score matrix by design.
"""

from typing import NamedTuple, Optional

import torch


class ReferenceOutput(NamedTuple):
    out: torch.Tensor  # (B, SQ, H, D), dtype of `dtype`
    lse: torch.Tensor  # (B, H, SQ), dtype of `dtype`; -inf for rows that see no key


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(SQ, SK) bool, True = attend. Bottom-right aligned: query i sees key j
    iff j <= i + SK - SQ, so the last query row sees every key:

        SQ=2, SK=5:  1 1 1 1 0        SQ=5, SK=2:  0 0
                     1 1 1 1 1                     0 0
                                                   0 0
                                                   1 0
                                                   1 1
    """
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        softmax_scale: Optional[float] = None,
                        dtype: torch.dtype = torch.float64) -> ReferenceOutput:
    """softmax(q k^T * scale) v on (B, T, H, D) tensors, computed in ``dtype``.

    K/V heads are shared by groups of H // HKV query heads (GQA/MQA). A row
    with no visible key yields out = 0 and lse = -inf. Differentiable.
    """
    B, SQ, H, D = q.shape
    SK, HKV = k.shape[1], k.shape[2]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    qf, kf, vf = (x.to(dtype).transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    if HKV != H:
        kf = kf.repeat_interleave(H // HKV, dim=1)
        vf = vf.repeat_interleave(H // HKV, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale               # (B, H, SQ, SK)
    if causal:
        s = s.masked_fill(~causal_mask(SQ, SK, q.device), float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, 0.0)                       # empty rows: any finite shift
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)                                  # (B, H, SQ, 1)
    p = e / torch.where(l == 0, 1.0, l)
    lse = (m + torch.log(l)).squeeze(-1)                             # (B, H, SQ); log(0) = -inf
    out = torch.matmul(p, vf).transpose(1, 2)                        # (B, SQ, H, D)
    return ReferenceOutput(out, lse)
