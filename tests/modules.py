"""Small torch modules that use flashtriton, shared by the tests."""

import torch
import torch.nn.functional as F

from flashtriton import flash_attention


class AttentionBlock(torch.nn.Module):
    """qkv projection, causal flash_attention on views of the packed qkv, output projection.

    ``options`` go to flash_attention (window_size, softcap, alibi=True for per-head slopes)."""

    def __init__(self, dim=64, heads=4, alibi=False, **options):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.options = options
        slopes = torch.tensor([2.0 ** (-(h + 1)) for h in range(heads)]) if alibi else None
        self.register_buffer("alibi_slopes", slopes)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.heads, C // self.heads)
        o = flash_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True,
                            alibi_slopes=self.alibi_slopes, **self.options)
        return self.proj(o.reshape(B, T, C))


class SdpaBlock(torch.nn.Module):
    """A plain torch causal block that calls F.scaled_dot_product_attention (looked up at call
    time, so patch_sdpa() reaches it); returns (batch, heads, seqlen, headdim)."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
