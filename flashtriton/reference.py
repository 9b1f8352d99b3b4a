"""Float64 reference attention: readable PyTorch with the package's semantics.

Used by tests, benchmarks and users; optimized code never imports it. Runs on
any device; it materialises the (B, H, SQ, SK) score matrix by design.
"""

from typing import NamedTuple, Optional, Tuple

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
    return window_mask(seqlen_q, seqlen_k, causal=True, device=device)


def window_mask(seqlen_q: int, seqlen_k: int, window_size: Tuple[int, int] = (-1, -1),
                causal: bool = False, device=None) -> torch.Tensor:
    """(SQ, SK) bool, True = attend: flash-attn's sliding window, bottom-right
    aligned. Query i sees key j iff i + d - left <= j <= i + d + right with
    d = SK - SQ; -1 leaves a side unbounded; causal sets right = 0."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return keep


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        softmax_scale: Optional[float] = None,
                        window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        alibi_slopes: Optional[torch.Tensor] = None,
                        attn_mask: Optional[torch.Tensor] = None,
                        dropout_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                        sinks: Optional[torch.Tensor] = None,
                        dtype: torch.dtype = torch.float64) -> ReferenceOutput:
    """softmax(scores) v on (B, T, H, D) tensors, computed in ``dtype``.

    scores = q k^T * scale, then softcap * tanh(scores / softcap) if softcap > 0,
    then - slope * |i + SK - SQ - j| with ALiBi slopes of shape (H,) or (B, H),
    then the causal / sliding-window mask (``window_mask``), then an SDPA-style
    ``attn_mask`` broadcastable to (B, H, SQ, SK): bool (True = attend) or
    additive float. With ``dropout_mask`` (bool, broadcastable to (B, H, SQ,
    SK), True = kept) the probabilities are masked and scaled by 1 / (1 -
    dropout_p) after the softmax; lse is unchanged. ``sinks`` (H,): one more
    column of scores, sinks[h] in every row of head h, that takes part in the
    softmax and is dropped after it (it has no value; lse includes it). K/V
    heads are shared by groups of H // HKV query heads (GQA/MQA). A row with no
    visible key (and no sink) yields out = 0 and lse = -inf. Differentiable.
    """
    B, SQ, H, D = q.shape
    SK, HKV = k.shape[1], k.shape[2]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    qf, kf, vf = (x.to(dtype).transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    if HKV != H:
        kf = kf.repeat_interleave(H // HKV, dim=1)
        vf = vf.repeat_interleave(H // HKV, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale               # (B, H, SQ, SK)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype)
        slopes = slopes[None, :] if slopes.dim() == 1 else slopes                # (B or 1, H)
        i = torch.arange(SQ, device=q.device)[:, None] + (SK - SQ)
        j = torch.arange(SK, device=q.device)[None, :]
        s = s - slopes[:, :, None, None] * (i - j).abs().to(dtype)
    if causal or tuple(window_size) != (-1, -1):
        s = s.masked_fill(~window_mask(SQ, SK, window_size, causal, q.device), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(dtype)
    if sinks is not None:
        column = sinks.to(dtype)[None, :, None, None].expand(B, H, SQ, 1)
        s = torch.cat([s, column], dim=-1)
        vf = torch.cat([vf, vf.new_zeros(B, H, 1, vf.shape[-1])], dim=2)
    if s.shape[-1] == 0:  # no key at all: every row is empty
        m = s.new_zeros((*s.shape[:-1], 1))
    else:
        m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, 0.0)                       # empty rows: any finite shift
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)                                  # (B, H, SQ, 1)
    p = e / torch.where(l == 0, 1.0, l)
    if dropout_mask is not None:
        keep = dropout_mask.to(dtype)
        if sinks is not None:  # the sink's column has no value: any factor
            keep = torch.cat([keep.expand(B, H, SQ, SK), keep.new_ones(B, H, SQ, 1)], dim=-1)
        p = p * keep / (1.0 - dropout_p)
    lse = (m + torch.log(l)).squeeze(-1)                             # (B, H, SQ); log(0) = -inf
    out = torch.matmul(p, vf).transpose(1, 2)                        # (B, SQ, H, D)
    return ReferenceOutput(out, lse)
