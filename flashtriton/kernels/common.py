"""Shared ``@triton.jit`` helpers for the attention kernels.

Conventions (every kernel of the package):
  B batch, T sequence, H query heads, HKV key/value heads, GROUP = H // HKV,
  D head dim. Tensors are (B, T, H, D) with arbitrary strides except a unit
  stride on D. Tiles: BLOCK_M query rows, BLOCK_N key rows, BLOCK_D = D padded.
  Scores live in the log2 domain: s2 = (q . k) * softmax_scale * log2(e).
  Causal alignment: query i sees key j iff j <= i + DIAG, with DIAG = SK - SQ
  (bottom-right, flash-attn's convention).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Finite stand-in for -inf as the running max: a row whose scores are all
# masked keeps m = NEG_BIG, so exp2(-inf - m) = 0 and exp2(m - m) = 1, no NaN.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def load_tile(ptrs, rows, n_rows, cols, N_COLS,
              CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a (rows x cols) tile, zero-filling rows >= n_rows and cols >= N_COLS."""
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=cols[None, :] < N_COLS, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def store_tile(ptrs, x, rows, n_rows, cols, N_COLS, CHECK_COLS: tl.constexpr):
    """Store a tile, skipping rows >= n_rows and cols >= N_COLS."""
    if CHECK_COLS:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS))
    else:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)


@triton.jit
def heavy_first(IS_CAUSAL: tl.constexpr):
    """Query-block index of this program. Causal query blocks near the end see
    the most keys: launching them first shortens the tail of the grid."""
    if IS_CAUSAL:
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid = tl.program_id(0)
    return pid


@triton.jit
def kv_range(start_m, SK, DIAG, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """Key blocks a query block [start_m, start_m + BLOCK_M) must visit.

    Returns (full_end, hi): blocks starting below ``full_end`` are fully
    visible to every query row (no mask needed); blocks in [full_end, hi) need
    the bounds/causal mask; blocks from ``hi`` on are skipped entirely.
    """
    if IS_CAUSAL:
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + DIAG, 0), SK)
        full_end = (tl.maximum(start_m + DIAG + 1, 0) // BLOCK_N) * BLOCK_N
        full_end = tl.minimum(full_end, (SK // BLOCK_N) * BLOCK_N)
        full_end = tl.minimum(full_end, hi)
    else:
        hi = SK
        full_end = (SK // BLOCK_N) * BLOCK_N
    return full_end, hi


@triton.jit
def q_range(start_n, SQ, SK, DIAG, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """Query blocks a key block [start_n, start_n + BLOCK_N) must visit.

    Returns (lo, mid, full_end): [lo, mid) needs the causal mask, [mid,
    full_end) is fully visible, [full_end, SQ) needs the bounds mask. Blocks
    below ``lo`` see none of these keys and are skipped.
    """
    n_blocks_end = ((SQ + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:
        lo = (tl.maximum(start_n - DIAG, 0) // BLOCK_M) * BLOCK_M
        lo = tl.minimum(lo, n_blocks_end)
        first_full = tl.maximum(start_n + BLOCK_N - 1 - DIAG, 0)
        mid = ((first_full + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.maximum(mid, lo), n_blocks_end)
    else:
        lo = 0
        mid = 0
    if start_n + BLOCK_N <= SK:
        full_end = tl.maximum((SQ // BLOCK_M) * BLOCK_M, mid)
    else:
        full_end = mid
    return lo, mid, full_end


@triton.jit
def causal_keep(rows, cols, SQ, SK, DIAG, IS_CAUSAL: tl.constexpr):
    """(len(rows), len(cols)) mask of the (query, key) pairs that are attended."""
    keep = (rows[:, None] < SQ) & (cols[None, :] < SK)
    if IS_CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None] + DIAG)
    return keep
