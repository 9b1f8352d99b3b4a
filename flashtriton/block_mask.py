"""Block masks for user ``mask_mod`` functions, computed once and reused.

    @triton.jit
    def document(b, h, q_idx, kv_idx):
        return tl.load(DOC_IDS + q_idx) == tl.load(DOC_IDS + kv_idx)   # (or pure arithmetic)

    bm = create_block_mask(causal_mod, B=None, H=None, seqlen_q=4096, seqlen_k=4096, device="cuda")
    out = flash_attention(q, k, v, block_mask=bm)

``mask_mod(b, h, q_idx, kv_idx) -> bool`` is a ``@triton.jit`` function evaluated
elementwise on broadcast index tiles. The block mask sorts every
(block_size x block_size) tile into empty (skipped by the kernels), full
(computed without calling mask_mod) and partial (mask_mod applied), and stores,
for each query block, the lists of its partial and full key blocks (and the
transposed lists for the backward).
"""

from typing import NamedTuple, Optional

import torch
import triton

from .kernels.block_mask import _block_mask_kernel


class BlockMask(NamedTuple):
    kv_blocks: torch.Tensor  # (Bm, Hm, NQB, 2 + 2 * NKB) int32: n_partial, n_full, partial idx, full idx
    q_blocks: torch.Tensor   # (Bm, Hm, NKB, 2 + 2 * NQB) int32: the same per key block
    block_size: int
    seqlen_q: int
    seqlen_k: int
    mask_mod: object

    def density(self) -> float:
        """Fraction of (query block, key block) tiles that are computed."""
        nkb = (self.kv_blocks.shape[-1] - 2) // 2
        visited = self.kv_blocks[..., 0] + self.kv_blocks[..., 1]
        return float(visited.sum()) / (visited.numel() * max(nkb, 1))


def _lists(cls: torch.Tensor) -> torch.Tensor:
    """(..., N) block classes -> (..., 2 + 2N): counts and indices of partial and full blocks."""
    parts = []
    for value in (1, 2):
        sel = (cls == value).to(torch.int8)
        parts.append((sel.sum(-1, dtype=torch.int32)[..., None],
                      torch.argsort(sel, dim=-1, descending=True, stable=True).to(torch.int32)))
    (n_part, part_idx), (n_full, full_idx) = parts
    return torch.cat([n_part, n_full, part_idx, full_idx], dim=-1).contiguous()


def create_block_mask(mask_mod, B: Optional[int], H: Optional[int], seqlen_q: int, seqlen_k: int,
                      device=None, block_size: int = 128) -> BlockMask:
    """Evaluate ``mask_mod`` once over all tiles. B or H None (or 1): the mask does not
    depend on that index and is shared (b / h passed to mask_mod as 0).

    block_size: a power of two >= 32; the kernels pick tiles that divide it.
    """
    if not isinstance(mask_mod, triton.runtime.JITFunction) and not hasattr(mask_mod, "fn"):
        raise TypeError(f"mask_mod must be a @triton.jit function, got {type(mask_mod).__name__}")
    if block_size < 32 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 32, got {block_size}")
    Bm, Hm = B or 1, H or 1
    nqb, nkb = triton.cdiv(seqlen_q, block_size), triton.cdiv(seqlen_k, block_size)
    cls = torch.empty((Bm, Hm, nqb, nkb), dtype=torch.int8, device=device)
    if cls.numel():
        _block_mask_kernel[(nqb, nkb, Bm * Hm)](cls, seqlen_q, seqlen_k, Hm, nqb, nkb,
                                                MASK_MOD=mask_mod, BLOCK=block_size)
    return BlockMask(_lists(cls), _lists(cls.transpose(-1, -2)), block_size, seqlen_q, seqlen_k,
                     mask_mod)
