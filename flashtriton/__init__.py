"""flashtriton: exact softmax attention in Triton, O(N) memory forward and backward.

    from flashtriton import flash_attention
    out = flash_attention(q, k, v, causal=True)   # (batch, seqlen, nheads, headdim)

Also: ``flash_attention_with_lse``, ``scaled_dot_product_attention`` (torch
SDPA drop-in), ``flashtriton.compat.flash_attn`` (flash-attn drop-in) and
``flashtriton.reference`` (float64 reference); with torch >= 2.11,
``torch.nn.attention.activate_flash_attention_impl("flashtriton")`` runs aten's flash-attention
operators (SDPA's flash backend, ``varlen_attn``) on these kernels.
"""

try:
    import triton  # noqa: F401  (torch's Linux CUDA wheels bring it; its CPU builds do not)
except ImportError as _missing:
    raise ImportError(
        "flashtriton needs Triton (>= 3.6): torch's Linux CUDA wheels bring it; with a CPU build "
        "of torch, install the interpreter extra, pip install 'flashtriton[interpreter]' (Triton "
        "and numpy < 2.4), and run with TRITON_INTERPRET=1") from _missing

from .api import (AttentionOutput, flash_attention, flash_attention_varlen,
                  flash_attention_varlen_with_lse, flash_attention_with_lse)
from .explain import Explanation, explain
from .integrations import torch_registry as _torch_registry
from .sdpa import patch_sdpa, scaled_dot_product_attention

# "flashtriton" in torch's flash-attention registry (torch >= 2.11), not activated:
# torch.nn.attention.activate_flash_attention_impl("flashtriton") does that.
_torch_registry.register()

__version__ = "0.1.0"

__all__ = ["AttentionOutput", "flash_attention", "flash_attention_with_lse",
           "flash_attention_varlen", "flash_attention_varlen_with_lse",
           "scaled_dot_product_attention", "patch_sdpa", "explain", "Explanation", "__version__"]
