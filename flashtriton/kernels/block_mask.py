"""Block classification for user mask_mod functions (FlexAttention-style block masks)."""

import triton
import triton.language as tl


@triton.jit
def _block_mask_kernel(OUT, SQ, SK, HM, NQB, NKB, MASK_MOD: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[b, h, qb, kb] = 0 if mask_mod hides every in-bounds pair of the block, 2 if it
    shows every one, 1 otherwise. One program per (query block, key block, b * h)."""
    qb = tl.program_id(0)
    kb = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // HM
    h = bh % HM
    rows = qb * BLOCK + tl.arange(0, BLOCK)                          # [BLOCK]
    cols = kb * BLOCK + tl.arange(0, BLOCK)                          # [BLOCK]
    inb = (rows[:, None] < SQ) & (cols[None, :] < SK)
    keep = MASK_MOD(b, h, rows[:, None], cols[None, :]) & inb
    n_keep = tl.sum(tl.sum(keep.to(tl.int32), 1), 0)
    n_inb = tl.sum(tl.sum(inb.to(tl.int32), 1), 0)
    cls = tl.where(n_keep == 0, 0, tl.where(n_keep == n_inb, 2, 1))
    tl.store(OUT + (bh * NQB + qb) * NKB + kb, cls.to(tl.int8))
