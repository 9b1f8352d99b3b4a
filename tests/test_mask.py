"""Who sees whom (kernels/mask.py): the Gluon kernels' per-score masks, visible_by_row (the
forward's) and visible_by_key (the backward's, lane-split), against the Triton kernels'
visible, and visible against the rule itself (key j < SK, i + LOWER <= j <= i + UPPER, a
mask_mod); kv_range / q_range's block ranges against the same rule.

Gluon kernels do not run in Triton 3.6's interpreter, but the three forms are @triton.jit
functions, and the Gluon kernels call these very functions (a @triton.jit helper called
from a Gluon kernel compiles with Gluon's semantics; tools/compile_check.py compiles them
there): a small Triton kernel calls them here, through the interpreter on the CPU (compiled
on a GPU), on a grid of queries, keys, sequence ends, windows and mask_mods."""

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from flashtriton.kernels import mask
from flashtriton.kernels.gluon import bwd as gluon_bwd
from flashtriton.kernels.gluon import fwd as gluon_fwd
from flashtriton.kernels.mask import kv_range, q_range, visible, visible_by_key, visible_by_row

R = C = 64  # a consumer's rows (forward) / keys and a step's queries (backward)
B_, H_ = 1, 2  # MASK_MOD's b and h


@triton.jit
def _stripes(b, h, q_idx, kv_idx):
    """A mask_mod that tells its arguments apart (b, h, query and key)."""
    return (q_idx * 3 + kv_idx * 5 + b + 2 * h) % 7 != 0


def _stripes_py(q, k):
    return (q * 3 + k * 5 + B_ + 2 * H_) % 7 != 0


@triton.jit
def _masks(OUT, row0, col0, SEQ, LOWER, UPPER, V_UPPER, b, h, IS_CAUSAL: tl.constexpr,
           HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr, V_HAS_UPPER: tl.constexpr,
           MASK_MOD: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """OUT (4, R, C) int8, [query, key] each: visible; visible_by_row with the Gluon forward's
    arguments (IS_CAUSAL, HAS_UPPER, UPPER); visible transposed; visible_by_key with the
    backward's (its queries start at row0). V_UPPER / V_HAS_UPPER: the rule's upper bound
    (causal: 0)."""
    i = tl.arange(0, R)
    j = tl.arange(0, C)
    rows = row0 + i
    cols = col0 + j
    at = OUT + i[:, None] * C + j[None, :]
    at_t = OUT + i[None, :] * C + j[:, None]  # a (C, R) tile into [query, key]
    keep = visible(rows, cols, SEQ, SEQ, LOWER, V_UPPER, HAS_LOWER, V_HAS_UPPER, False, 1)
    keep_t = visible(rows, cols, SEQ, SEQ, LOWER, V_UPPER, HAS_LOWER, V_HAS_UPPER, True, 1)
    if MASK_MOD is not None:
        keep = keep & MASK_MOD(b, h, rows[:, None], cols[None, :])
        keep_t = keep_t & MASK_MOD(b, h, rows[None, :], cols[:, None])
    tl.store(at, keep.to(tl.int8))
    tl.store(at + R * C, visible_by_row(rows, cols, SEQ, LOWER, UPPER, b, h, IS_CAUSAL,
                                        HAS_LOWER, HAS_UPPER, MASK_MOD).to(tl.int8))
    tl.store(at_t + 2 * R * C, keep_t.to(tl.int8))
    tl.store(at_t + 3 * R * C, visible_by_key(cols, rows, SEQ, LOWER, V_UPPER, row0, b, h,
                                              HAS_LOWER, V_HAS_UPPER, MASK_MOD).to(tl.int8))


def _rule(q, k, sk, lower, upper, has_lower, has_upper, mod):
    """The rule on queries q (a column) and keys k (a row), as a (len(q), len(k)) mask."""
    keep = (k < sk) & (q == q)
    if has_upper:
        keep = keep & (k <= q + upper)
    if has_lower:
        keep = keep & (k >= q + lower)
    if mod:
        keep = keep & _stripes_py(q, k)
    return keep


# (IS_CAUSAL, HAS_LOWER, HAS_UPPER, LOWER, UPPER) as the Gluon forward takes them: the plain
# causal kernel, windows with one bound or both (a causal window: UPPER 0), one as narrow
# as the diagonal, one wider than a tile, one below the diagonal.
WINDOWS = [(False, False, False, 0, 0), (True, False, False, 0, 0),
           (False, False, True, 0, 0), (False, False, True, 5, 5), (False, False, True, 0, 70),
           (False, True, False, -3, 0), (False, True, False, -40, 0),
           (False, True, True, -3, 0), (False, True, True, -40, 5), (False, True, True, 0, 0),
           (False, True, True, -20, 20), (False, True, True, -90, 90), (False, True, True, -7, -2)]


@pytest.mark.parametrize("mod", [False, True], ids=["", "mask_mod"])
@pytest.mark.parametrize("window", WINDOWS,
                         ids=["plain", "causal", "upper0", "upper5", "upper70", "lower3",
                              "lower40", "causal-window", "window-40-5", "diagonal",
                              "window-20-20", "window-90-90", "below-diagonal"])
def test_gluon_masks_agree_with_visible(window, mod):
    """On every tile (queries from 0, 32 or 64, keys from 0, 32 or 48: across the diagonal
    and the window's edges) and sequence end (1, 50, 64, 100: inside, at and past a tile):
    visible is the rule (both orientations); the forward's visible_by_row equals it on rows
    < SEQ (the rows it stores); the backward's visible_by_key equals it everywhere (its
    queries are >= 0 and LOWER <= UPPER)."""
    is_causal, has_lower, has_upper, lower, upper = window
    v_has_upper, v_upper = has_upper or is_causal, 0 if is_causal else upper
    out = torch.empty(4, R, C, dtype=torch.int8, device=DEVICE)
    for seq in (1, 50, 64, 100):
        for row0, col0 in ((0, 0), (32, 0), (0, 32), (64, 48), (64, 0)):
            _masks[(1, )](out, row0, col0, seq, lower, upper, v_upper, B_, H_, is_causal,
                          has_lower, has_upper, v_has_upper, _stripes if mod else None, R, C)
            got = out.bool().cpu()
            q = torch.arange(row0, row0 + R)[:, None]
            k = torch.arange(col0, col0 + C)[None, :]
            want = _rule(q, k, seq, lower, v_upper, has_lower, v_has_upper, mod)
            case = (seq, row0, col0)
            assert torch.equal(got[0], want), case
            assert torch.equal(got[2], want), case
            stored = (q < seq).expand(R, C)
            assert torch.equal(got[1][stored], want[stored]), case
            assert torch.equal(got[3], want), case


def test_the_gluon_kernels_call_these_forms():
    """The functions tested above are the ones the Gluon kernels call (not copies)."""
    assert gluon_fwd.visible_by_row is mask.visible_by_row
    assert gluon_bwd.visible_by_key is mask.visible_by_key
    assert gluon_fwd.kv_range is mask.kv_range and gluon_bwd.q_range is mask.q_range


@triton.jit
def _ranges(OUT, start_m, start_n, SQ, SK, LOWER, UPPER, HAS_LOWER: tl.constexpr,
            HAS_UPPER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo, full_lo, full_hi, hi = kv_range(start_m, SK, LOWER, UPPER, HAS_LOWER, HAS_UPPER,
                                        BLOCK_M, BLOCK_N)
    tl.store(OUT + 0, lo)
    tl.store(OUT + 1, full_lo)
    tl.store(OUT + 2, full_hi)
    tl.store(OUT + 3, hi)
    lo, full_lo, full_hi, hi = q_range(start_n, SQ, SK, LOWER, UPPER, HAS_LOWER, HAS_UPPER,
                                       BLOCK_M, BLOCK_N)
    tl.store(OUT + 4, lo)
    tl.store(OUT + 5, full_lo)
    tl.store(OUT + 6, full_hi)
    tl.store(OUT + 7, hi)


@pytest.mark.parametrize("has_lower,has_upper", [(False, False), (False, True), (True, False),
                                                 (True, True)])
def test_block_ranges_agree_with_the_rule(has_lower, has_upper):
    """kv_range (a query block's key blocks) and q_range (a key block's query blocks), SQ and
    SK apart (DIAG = SK - SQ in the bounds): the blocks they skip hold no visible pair, the
    ones they run unmasked hold only visible pairs (q_range: of rows < SQ)."""
    BM, BN = 32, 16
    out = torch.empty(8, dtype=torch.int32, device=DEVICE)
    for sq, sk in ((100, 100), (70, 130), (130, 70)):
        diag = sk - sq
        for left, right in ((0, 0), (20, 0), (5, 37)):
            lower, upper = diag - left, diag + right
            for start in (0, 32, 64, 96):
                _ranges[(1, )](out, start, start, sq, sk, lower, upper, has_lower, has_upper,
                               BM, BN)
                lo, full_lo, full_hi, hi, qlo, qfull_lo, qfull_hi, qhi = out.tolist()
                case = (sq, sk, left, right, start)
                # kv_range: rows start .. start + BM - 1, every key
                q = torch.arange(start, start + BM)[:, None]
                k = torch.arange(0, sk + BN)[None, :]
                seen = _rule(q, k, sk, lower, upper, has_lower, has_upper, False)
                assert not seen[:, :lo].any() and not seen[:, hi:].any(), case
                assert seen[:, full_lo:full_hi].all(), case
                # q_range: keys start .. start + BN - 1, the rows < SQ
                q = torch.arange(0, sq)[:, None]
                k = torch.arange(start, start + BN)[None, :]
                seen = _rule(q, k, sk, lower, upper, has_lower, has_upper, False)
                assert not seen[:qlo].any() and not seen[qhi:].any(), case
                assert seen[qfull_lo:qfull_hi].all(), case
