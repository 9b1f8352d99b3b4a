"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention``."""

from typing import Optional

import torch
import torch.nn.functional as F

from . import _env
from .api import _run
from .validation import MAX_HEAD_DIM, SUPPORTED_DTYPES

# torch's own function, captured at import: the fall-back target, also while patched.
_TORCH_SDPA = F.scaled_dot_product_attention


def _mask_misfit(attn_mask, query, key) -> Optional[str]:
    """Why the kernels cannot read attn_mask in place, or None: it must be bool or query's
    float dtype, broadcastable to (B, H, L, S), and not require grad."""
    if not isinstance(attn_mask, torch.Tensor):
        return f"attn_mask is a {type(attn_mask).__name__}, not a tensor"
    if attn_mask.requires_grad:
        return "attn_mask requires grad (the kernels give no mask gradient)"
    if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
        return f"attn_mask is {attn_mask.dtype}; the kernels take bool or query's {query.dtype}"
    if attn_mask.device != query.device or not 1 <= attn_mask.dim() <= 4:
        return f"attn_mask is {attn_mask.dim()}-D on {attn_mask.device}"
    B, H, L, _ = query.shape
    try:
        torch.broadcast_shapes(attn_mask.shape, (B, H, L, key.shape[2]))
    except RuntimeError:
        return f"attn_mask {tuple(attn_mask.shape)} does not broadcast to {(B, H, L, key.shape[2])}"
    return None


def sdpa_misfit(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                enable_gqa=False) -> Optional[str]:
    """Why ``scaled_dot_product_attention`` sends this call to torch's function instead of
    the kernels, or None where the kernels run it."""
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        return f"dropout_p {dropout_p!r} is not in [0, 1)"
    ts = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in ts):
        return "query, key, value are not all 4-D tensors"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in SUPPORTED_DTYPES:
        return (f"dtypes {query.dtype}, {key.dtype}, {value.dtype}: the kernels take one of "
                "float16, bfloat16, float32")
    if not (query.device == key.device == value.device):
        return f"devices {query.device}, {key.device}, {value.device} differ"
    if not (query.is_cuda or (query.device.type == "cpu" and _env.INTERPRET)):
        return f"{query.device} tensors (the kernels run on CUDA, or the CPU's interpreter)"
    B, H, L, E = query.shape
    if key.shape != value.shape or key.shape[0] != B or key.shape[3] != E:
        return (f"shapes query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                f"{tuple(value.shape)}: the kernels take key and value of one shape with "
                "query's batch and head dim")
    if not 1 <= E <= MAX_HEAD_DIM:
        return f"head dim {E} is outside 1..{MAX_HEAD_DIM}"
    HK = key.shape[1]
    if HK != H and not (enable_gqa and HK > 0 and H % HK == 0):
        return f"{H} query heads and {HK} key heads without enable_gqa"
    if attn_mask is not None:
        if is_causal:
            return "attn_mask with is_causal (torch raises)"
        return _mask_misfit(attn_mask, query, key)
    return None


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """torch's SDPA signature and (batch, heads, seqlen, headdim) layout.

    Routed to flashtriton's kernels when all hold: query/key/value are 4-D,
    float16/bfloat16/float32, on one CUDA device (or the CPU under
    TRITON_INTERPRET=1), key and value of one shape with query's batch and
    head dim (<= 256), heads equal (or a multiple with ``enable_gqa=True``),
    ``0 <= dropout_p < 1`` (the kernels' own RNG: statistically torch's dropout,
    not its exact mask), and ``attn_mask`` None or a mask the kernels read tile by tile in place:
    boolean (True = attend) or additive in query's dtype, broadcastable to
    (batch, heads, L, S) -- (L, S), (batch, 1, L, S), ... -- and not requiring
    grad. A row that the mask empties gives 0, as torch's math path does.

    ``is_causal`` follows torch: query i sees keys j <= i (top-left aligned), also when
    L != S (the kernels' causal mask is bottom-right aligned, flash-attn's rule: for L < S
    the keys past L are invisible and are dropped; for L > S the queries past S see every
    key and run without the mask).

    Everything else falls back to ``torch.nn.functional.scaled_dot_product_attention``
    with the same arguments, so behaviour matches torch's, errors included.
    """
    reason = sdpa_misfit(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if reason is not None:
        _env.logger.debug("scaled_dot_product_attention falls back to torch's: %s", reason)
        kwargs = {"enable_gqa": True} if enable_gqa else {}
        return _TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                           is_causal=is_causal, scale=scale, **kwargs)
    if attn_mask is not None:  # a broadcast view: no (B, H, L, S) copy
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    L, S = q.shape[1], k.shape[1]
    if is_causal and L < S:  # top-left: keys >= L are seen by no query
        k, v = k[:, :L], v[:, :L]
    if is_causal and L > S:  # top-left: queries >= S see every key
        parts = [_sdpa_run(q[:, :S], k, v, True, scale, dropout_p),
                 _sdpa_run(q[:, S:], k, v, False, scale, dropout_p)]
        return torch.cat(parts, dim=1).transpose(1, 2)
    return _sdpa_run(q, k, v, is_causal, scale, dropout_p, attn_mask).transpose(1, 2)


def _sdpa_run(q, k, v, causal, scale, dropout_p, attn_mask=None):
    return _run(q, k, v, causal, scale, dropout_p=dropout_p, names=("query", "key", "value"),
                attn_mask=attn_mask).out


class _SDPAPatch:
    """Handle of ``patch_sdpa``: ``restore()``, or use it as a context manager."""

    def __init__(self):
        self._previous = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = scaled_dot_product_attention

    def restore(self) -> None:
        F.scaled_dot_product_attention = self._previous

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False


def patch_sdpa() -> _SDPAPatch:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through flashtriton.

        flashtriton.patch_sdpa()             # from here on (handle.restore() undoes it)
        with flashtriton.patch_sdpa():       # or only inside the block
            model(x)

    Calls the kernels support go to them; the rest go to torch's original function (see
    ``scaled_dot_product_attention``). Code that imported the function itself
    (``from torch.nn.functional import scaled_dot_product_attention``) before the patch
    keeps torch's.
    """
    return _SDPAPatch()
