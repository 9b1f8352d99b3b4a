"""Small torch modules that use flashtriton, shared by the tests."""

import torch

from flashtriton import flash_attention


class AttentionBlock(torch.nn.Module):
    """qkv projection, causal flash_attention on views of the packed qkv, output projection."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.heads, C // self.heads)
        o = flash_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
        return self.proj(o.reshape(B, T, C))
