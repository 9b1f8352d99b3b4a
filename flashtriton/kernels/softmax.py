"""The online softmax of the Triton kernels, one vocabulary (as FlashAttention-4's
flash_attn/cute/softmax.py is for its kernels): a row state (acc, l, m) and its start
(init_rows), its update by one block of scores (online_softmax), a sink logit joining it
(add_sink), its epilogue (finalize: O and the LSE), and the LSE read back by the backward
(lse_log2).

Units: scores and the running max m are in the log2 domain (kernels/common.py); l is the
row's sum of exp2(s - m); the LSE a kernel stores is in natural-log units,
(m + log2 l) * ln 2, and the backward reads it back in log2 units (lse_log2).

NaN guard (one convention for every Triton kernel): the running max starts at NEG_BIG, a
finite stand-in for -inf, and never goes below it. A row whose scores are all masked (-inf)
keeps m = NEG_BIG, so exp2(-inf - m) = 0 and exp2(m - m) = 1, never -inf - -inf; such a row
ends with l == 0, which the epilogue turns into O = 0 and LSE = -inf. The backward's LSE of
such a row is +inf in log2 units, so that exp2(s - lse) = 0 (lse_log2).

Users: the training forward (attn_fwd: every helper), the split-KV decoding kernel (decode:
NEG_BIG, add_sink; its state's start, step and epilogue are these helpers written out, in
the order its compiled code depends on: see there), the backward (attn_bwd: lse_log2, which
its _row_stats writes out: see there).
Not here: the split-KV merge (decode.merge_splits), whose state is per split, in natural-log
LSE units read from memory (where an empty split is -inf), guards with m_safe (a -inf max
read as 0) instead; and the Gluon forward (kernels/gluon/fwd.py), whose state lives in the
wgmma layouts (the rescale of acc needs a convert_layout between the S and O layouts, which
these helpers cannot name) and whose running max starts at -inf, guarded by m_safe and, for
the sink, a clamp at -1e30. Not NEG_BIG there: that would change the Gluon kernel's code and
the result of a row whose scores all lie below -1e30 (P 0 under NEG_BIG), so it is left as it
is. Each of those is written once.
"""

import triton
import triton.language as tl

from .common import LN2, LOG2E

# Finite stand-in for -inf as the running max: a row whose scores are all
# masked keeps m = NEG_BIG, so exp2(-inf - m) = 0 and exp2(m - m) = 1, no NaN.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def init_rows(ROWS: tl.constexpr, COLS: tl.constexpr):
    """The state of ROWS rows that saw no key yet: acc (ROWS, COLS) 0, l 0, m NEG_BIG."""
    m_i = tl.full([ROWS], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    return acc, l_i, m_i


@triton.jit
def online_softmax(s, acc, m_i, l_i, scale, RESCALE_FIRST: tl.constexpr):
    """One block of scores s (rows x keys; -inf: masked) into a row state: (P, acc, l, m),
    P = exp2(s * scale - m) to multiply V, acc's rows times alpha = exp2(m_old - m). The
    scores times ``scale`` (>= 0; 1.0: s is in log2 units already) are in the log2 domain:
    the scale goes into the row max and into one FMA per score.
    RESCALE_FIRST: alpha and acc's rescale written before P, else after l. The same
    arithmetic; but the order the operations are written in changes the instruction schedule
    ptxas picks, and each loop keeps its own. (So does a helper called from here: each
    inlined function's scope adds debug labels to the PTX, and ptxas allocates registers
    otherwise around them.)"""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    if RESCALE_FIRST:
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        p = tl.math.exp2(s * scale - m_new[:, None])
    else:
        p = tl.math.exp2(s * scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if not RESCALE_FIRST:
        acc = acc * alpha[:, None]
    return p, acc, l_i, m_new


@triton.jit
def add_sink(acc, l_i, m_i, sink2):
    """A row state (acc, l, m: log2 units) after a sink logit ``sink2`` (log2 units, no value)
    joins the softmax: the max becomes max(m, sink2) and l gains exp2(sink2 - max). A row that
    saw no key keeps acc 0 and gets l 1 and m sink2 (LSE = the sink)."""
    m_new = tl.maximum(m_i, sink2)
    alpha = tl.math.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.math.exp2(sink2 - m_new), m_new


@triton.jit
def finalize(acc, l_i, m_i):
    """The epilogue of a row state: (O = acc / l, the natural-log LSE (m + log2 l) * ln 2);
    rows that saw no key (l == 0): O 0 and LSE -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    return out, lse


@triton.jit
def lse_log2(lse):
    """A stored (natural-log) LSE in log2 units for the backward's P = exp2(s - lse): rows that
    saw no key (-inf) get +inf, so that their P is 0."""
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
