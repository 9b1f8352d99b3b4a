"""The online softmax of the Triton kernels, one vocabulary (as FlashAttention-4's
flash_attn/cute/softmax.py is for its kernels): a sink logit joining a row state (add_sink)
and the LSE read back by the backward (lse_log2).

Units: scores and the running max m are in the log2 domain (kernels/common.py); l is the
row's sum of exp2(s - m); the LSE a kernel stores is in natural-log units,
(m + log2 l) * ln 2, and the backward reads it back in log2 units (lse_log2).

NaN guard (one convention for every Triton kernel): the running max starts at NEG_BIG, a
finite stand-in for -inf, and never goes below it. A row whose scores are all masked (-inf)
keeps m = NEG_BIG, so exp2(-inf - m) = 0 and exp2(m - m) = 1, never -inf - -inf; such a row
ends with l == 0, which the epilogue turns into O = 0 and LSE = -inf. The backward's LSE of
such a row is +inf in log2 units, so that exp2(s - lse) = 0 (lse_log2).
"""

import triton
import triton.language as tl

from .common import LN2, LOG2E

# Finite stand-in for -inf as the running max: a row whose scores are all
# masked keeps m = NEG_BIG, so exp2(-inf - m) = 0 and exp2(m - m) = 1, no NaN.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def add_sink(acc, l_i, m_i, sink2):
    """A row state (acc, l, m: log2 units) after a sink logit ``sink2`` (log2 units, no value)
    joins the softmax: the max becomes max(m, sink2) and l gains exp2(sink2 - max). A row that
    saw no key keeps acc 0 and gets l 1 and m sink2 (LSE = the sink)."""
    m_new = tl.maximum(m_i, sink2)
    alpha = tl.math.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.math.exp2(sink2 - m_new), m_new


@triton.jit
def lse_log2(lse):
    """A stored (natural-log) LSE in log2 units for the backward's P = exp2(s - lse): rows that
    saw no key (-inf) get +inf, so that their P is 0."""
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
