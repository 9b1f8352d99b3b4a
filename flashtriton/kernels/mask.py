"""Who sees whom: the causal / window rule of every kernel, in one place.

Query i sees key j iff j < SK and i + LOWER <= j <= i + UPPER, each bound only where its
HAS_ flag is set (kernels.common.seq_bounds: LOWER = DIAG - window_left, UPPER = DIAG +
window_right, DIAG = SK - SQ; causal is UPPER = DIAG). A user's MASK_MOD(b, h, i, j) and a
block mask's lists narrow it further where a kernel takes them.

Per block, which blocks a walk visits and which it runs without a mask: ``kv_range`` (a
query block's key blocks), ``q_range`` (a key block's query blocks), ``rows_hi``.

Per score, three forms of the same rule:
  ``visible``         the Triton kernels' (attn_fwd, attn_bwd, decode): the pairs of a
                      (rows, cols) tile, or of a transposed one, with the ends it checks;
  ``visible_by_row``  the Gluon forward's (kernels/gluon/fwd.py): each query row's keys
                      folded into one end, so a score takes one compare (two with LOWER);
  ``visible_by_key``  the Gluon backward's (kernels/gluon/bwd.py), S^T's (key, query) pairs:
                      each key's first and last query, compared lane-split (one compare a
                      bound, against an immediate).
Each form's docstring says on which pairs it equals ``visible``; tests/test_mask.py runs all
three (the same @triton.jit functions the kernels call; Gluon kernels compile a
``@triton.jit`` helper with Gluon's semantics) through Triton's interpreter over a grid of
queries, keys, windows and ends and checks that they agree.
"""

import triton
import triton.language as tl


@triton.jit
def _floor_to(x, B: tl.constexpr):
    return (x // B) * B


@triton.jit
def _ceil_to(x, B: tl.constexpr):
    return ((x + B - 1) // B) * B


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def kv_range(start_m, SK, LOWER, UPPER, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks that the query block [start_m, start_m + BLOCK_M) visits.

    Query i sees key j iff i + LOWER <= j <= i + UPPER (each bound only if its
    HAS_ flag is set) and j < SK. Returns (lo, full_lo, full_hi, hi): blocks in
    [full_lo, full_hi) are visible to every row and run without a mask; blocks
    in [lo, full_lo) and [full_hi, hi) need the mask; all others are skipped.
    """
    if HAS_UPPER:
        hi = _clamp(start_m + BLOCK_M + UPPER, 0, SK)
        full_hi = _floor_to(_clamp(start_m + UPPER + 1, 0, SK), BLOCK_N)
    else:
        hi = SK
        full_hi = _floor_to(SK, BLOCK_N)
    if HAS_LOWER:
        lo = _floor_to(_clamp(start_m + LOWER, 0, SK), BLOCK_N)
        full_lo = _ceil_to(_clamp(start_m + BLOCK_M - 1 + LOWER, 0, SK), BLOCK_N)
    else:
        lo = 0
        full_lo = 0
    full_lo = _clamp(full_lo, lo, hi)
    full_hi = _clamp(full_hi, full_lo, hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def rows_hi(start_m, ROWS: tl.constexpr, SK, UPPER, full_hi, hi, BLOCK_N: tl.constexpr):
    """The first key block, in [full_hi, hi], that none of the query rows
    [start_m, start_m + ROWS) sees under the upper bound (query i sees keys j <= i + UPPER)."""
    return _clamp(_ceil_to(_clamp(start_m + ROWS + UPPER, 0, SK), BLOCK_N), full_hi, hi)


@triton.jit
def q_range(start_n, SQ, SK, LOWER, UPPER, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks that see some key of [start_n, start_n + BLOCK_N).

    Same contract as ``kv_range`` with the roles swapped: rows in
    [full_lo, full_hi) see every key of the block (and are < SQ, the block
    < SK), [lo, full_lo) and [full_hi, hi) need the mask.
    """
    if HAS_UPPER:
        lo = _floor_to(_clamp(start_n - UPPER, 0, SQ), BLOCK_M)
        full_lo = _ceil_to(_clamp(start_n + BLOCK_N - 1 - UPPER, 0, SQ), BLOCK_M)
    else:
        lo = 0
        full_lo = 0
    if HAS_LOWER:
        hi = _clamp(start_n + BLOCK_N - LOWER, 0, SQ)
        full_hi = _floor_to(_clamp(start_n - LOWER + 1, 0, SQ), BLOCK_M)
    else:
        hi = SQ
        full_hi = _floor_to(SQ, BLOCK_M)
    full_hi = tl.where(start_n + BLOCK_N > SK, full_lo, full_hi)  # a ragged key block: all masked
    full_lo = _clamp(full_lo, lo, hi)
    full_hi = _clamp(full_hi, full_lo, hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def visible(rows, cols, SQ, SK, LOWER, UPPER, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
            TRANSPOSED: tl.constexpr = False, ENDS: tl.constexpr = 2):
    """(len(rows), len(cols)) mask of the (query, key) pairs that are attended, or
    (len(cols), len(rows)) when TRANSPOSED (built in that orientation: transposing a mask
    tile costs a layout conversion and registers). ENDS: which ends it checks, 2 rows < SQ
    and cols < SK, 1 cols < SK only, 0 neither (where a kernel's zero-filled rows past the
    ends contribute nothing: each test is one more select per score)."""
    if TRANSPOSED:
        r = rows[None, :]
        c = cols[:, None]
    else:
        r = rows[:, None]
        c = cols[None, :]
    keep = c == c
    if ENDS >= 1:
        keep = c < SK
    if ENDS >= 2:
        keep = keep & (r < SQ)
    if HAS_UPPER:
        keep = keep & (c <= r + UPPER)
    if HAS_LOWER:
        keep = keep & (c >= r + LOWER)
    return keep


@triton.jit
def visible_by_row(rows, cols, SK, LOWER, UPPER, b, h, IS_CAUSAL: tl.constexpr,
                   HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr, MASK_MOD: tl.constexpr):
    """The Gluon forward's form (kernels/gluon/fwd.py: _softmax): the (len(rows), len(cols))
    mask of the pairs kept; IS_CAUSAL: the plain causal kernel (SQ == SK, the diagonal only),
    else keys past SK and, where set, outside [i + LOWER, i + UPPER]; and MASK_MOD(b, h, i, j).
    SK and UPPER are folded into one end per row first, so a score takes one compare for
    them (two with LOWER) instead of one a bound.

    Equals visible(rows, cols, SK, SK, LOWER, UPPER, HAS_LOWER, HAS_UPPER, ENDS=1) (causal:
    HAS_UPPER with UPPER 0) and MASK_MOD on rows < SK. Causal drops the keys' end (keys past
    SK are seen only by rows past SK), and no form checks the rows' end: rows past SK are
    never stored."""
    if IS_CAUSAL:
        keep = cols[None, :] < (rows + 1)[:, None]
    else:
        end = rows * 0 + SK
        if HAS_UPPER:
            end = tl.minimum(end, rows + (UPPER + 1))
        keep = cols[None, :] < end[:, None]
    if HAS_LOWER:
        keep = keep & (cols[None, :] >= (rows + LOWER)[:, None])
    if MASK_MOD is not None:
        keep = keep & MASK_MOD(b, h, rows[:, None], cols[None, :])
    return keep


@triton.jit
def visible_by_key(keys, cols, SEQ, LOWER, UPPER, first, b, h, HAS_LOWER: tl.constexpr,
                   HAS_UPPER: tl.constexpr, MASK_MOD: tl.constexpr):
    """The Gluon backward's form (kernels/gluon/bwd.py: _dkdv_products): which (key, query)
    pairs of a masked step's S^T are kept, (len(keys), len(cols)), cols = first + offs the
    step's queries (offs >= 0). SEQ and the window's bounds are folded into each key's first
    and last query first (query i sees key j where j <= i + UPPER, i.e. i >= j - UPPER, and
    j >= i + LOWER, i.e. i <= j - LOWER; a key past SEQ: none), so a score takes one compare
    a bound instead of one a condition; and the columns are split as gluon/fwd.alibi_lanes
    does (offs = (offs & 6) + (offs & -7)): each key's bounds less the thread's lane part,
    one value a thread a bound, compared with the register's constant part, an immediate
    (a masked step of fewer cycles).

    Equals visible(cols, keys, SEQ, SEQ, LOWER, UPPER, HAS_LOWER, HAS_UPPER, TRANSPOSED=True,
    ENDS=1) and MASK_MOD(b, h, i, j) for queries 0 <= i < 2**30 and, with both bounds,
    LOWER <= UPPER (the launcher's windows): no form checks the queries' end (padding rows
    have an infinite LSE, P = 0)."""
    valid = keys < SEQ
    if HAS_LOWER or HAS_UPPER:
        offs = cols - first
        reg = (offs & -7)[None, :]
        lane = (first + (offs & 6))[None, :]
        if HAS_UPPER:
            lo = tl.where(valid, keys - UPPER, 1 << 30)[:, None] - lane
            if HAS_LOWER:  # lo <= reg <= lo + UPPER - LOWER: one unsigned compare (a key
                # past SEQ: reg - lo wraps past any window's width)
                keep = (reg - lo).to(tl.uint32, bitcast=True) <= (UPPER - LOWER)
            else:
                keep = reg >= lo
        else:
            keep = reg <= tl.where(valid, keys - LOWER, -1)[:, None] - lane
    else:  # keys past SEQ only (a ragged key block)
        keep = valid[:, None]
    if MASK_MOD is not None:
        keep = keep & MASK_MOD(b, h, cols[None, :], keys[:, None])
    return keep
