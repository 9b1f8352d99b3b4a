"""Backward kernels: recomputation from Q, K, V, O, dO and LSE only.

  _attn_bwd_dq_kernel          one program per (query block, batch * head); first
                               computes delta = rowsum(dO * O) (fp32) of its rows and
                               stores it for the dK/dV kernel, launched after it
  _attn_bwd_dkdv_kernel        one program per (key block, batch * kv head);
                               loops over the GROUP query heads sharing the kv
                               head, so dK/dV of GQA/MQA are summed in registers
  _varlen_spans_kernel         each sequence's (start, end) rows of the packed q and k, an
                               out-of-range sequence made empty, for the two kernels above
                               (IS_VARLEN 2: kernels.common.seq_bounds)
  _attn_bwd_prep_kernel        the log2 LSE and delta (padded rows), and a zeroed fp32 dQ
                               buffer, for the Gluon backward (kernels/gluon/bwd.py)

P is rebuilt tile by tile as exp2(s2 - LSE * log2(e)); no N x N buffer exists
and no atomics are used, so gradients are bitwise repeatable. With softcap,
dS is multiplied by the tanh's derivative 1 - t^2 before the dQ/dK products.
HAS_ALIBI 2 (causal ALiBi, set by the launcher): the one-sided form of
kernels.common.alibi_part, each score's key part added and the rows' part moved into lse2.
"""

import triton
import triton.language as tl

from .common import (KV, LOG2E, Scores, Seq, Variant, alibi_part, apply_attn_mask, dropout_keep,
                     heavy_first, load_rows, load_tile, row_source, scores, seq_bounds,
                     store_tile)
from .mask import kv_range, q_range, visible
from .softmax import lse_log2


@triton.jit
def _lse2(LSE, rows, SQ):
    """LSE in the log2 domain (+inf for padding and empty rows, so P = 0)."""
    return lse_log2(tl.load(LSE + rows, mask=rows < SQ, other=float("inf")))


@triton.jit
def _row_stats(LSE, DELTA, start_m, rows, SQ, MASK: tl.constexpr, STATS_TMA: tl.constexpr):
    """LSE in the log2 domain (+inf past SQ and for empty rows) and delta of rows start_m +
    ... (all < SQ unless MASK), from pointers or (STATS_TMA) from 1-D tensor descriptors: one
    TMA copy each, zero past SQ."""
    if STATS_TMA:
        lse = LSE.load([start_m])
        delta = DELTA.load([start_m])
        if MASK:
            lse = tl.where(rows < SQ, lse, float("inf"))
    elif MASK:
        lse = tl.load(LSE + rows, mask=rows < SQ, other=float("inf"))
        delta = tl.load(DELTA + rows, mask=rows < SQ, other=0.0)
    else:
        lse = tl.load(LSE + rows)
        delta = tl.load(DELTA + rows)
    # softmax.lse_log2, written out: through the helper (the same PTX but for the debug labels
    # of its scope) ptxas allocates dK / dV's registers otherwise where they spill (D256 16x64)
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E), delta


@triton.jit
def _ds(p, dp, delta, t, HAS_SOFTCAP: tl.constexpr):
    """Gradient w.r.t. the pre-scale dot products (the softmax scale is applied at the end)."""
    ds = p * (dp - delta)
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, stride_qt, stride_dot, cols,
                         offs_m, offs_d, offs_dv, HEAD_DIM, HEAD_DIM_V, lo, hi, blk_list, seq, sc,
                         var, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
                         MASK_MOD: tl.constexpr, MASK: tl.constexpr, LISTED: tl.constexpr):
    for it in range(lo, hi, var.BLOCK_M):
        start_m = it  # LISTED: the query blocks that blk_list names (see _attn_fwd_inner)
        if LISTED:
            start_m = tl.load(blk_list + it // var.SPARSE) * var.SPARSE + it % var.SPARSE
        rows = start_m + offs_m                                      # [BLOCK_M]
        q = load_rows(q_base, start_m, offs_m, stride_qt, seq.SQ, offs_d, HEAD_DIM, MASK,
                      not var.EVEN_D, var.USE_TMA)                   # [BLOCK_M, BLOCK_D]
        do = load_rows(do_base, start_m, offs_m, stride_dot, seq.SQ, offs_dv, HEAD_DIM_V, MASK,
                       not var.EVEN_DV, var.USE_TMA)                 # [BLOCK_M, BLOCK_DV]
        if var.UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse2, delta = _row_stats(LSE, DELTA, start_m, rows, seq.SQ, MASK, var.STATS_TMA)
        if var.HAS_ALIBI == 2:  # one-sided ALiBi: the rows' part into lse2 (alibi_part)
            lse2 = lse2 + alibi_part(rows + seq.DIAG, sc.alibi_at, sc.slope2)
        # Transposed tiles [BLOCK_N, BLOCK_M]: dV and dK accumulate p^T dO and dS^T Q.
        # ALiBi's |i + DIAG - j| is symmetric under (i, j, DIAG) -> (j, i, -DIAG).
        qk_t = tl.dot(k, tl.trans(q), input_precision=var.DOT_PREC)
        s_t, t_t = scores(qk_t, cols, rows, sc.qk_scale, sc.cap2, sc.slope2, -seq.DIAG,
                          var.HAS_SOFTCAP, var.HAS_ALIBI == 1)
        if var.HAS_ALIBI == 2:  # the key part, one value per key row of the tile
            s_t = s_t + alibi_part(cols, sc.alibi_at, sc.slope2)[:, None]
        if var.SCORE_MOD is not None:
            t_t = s_t  # the natural-log score, argument of SCORE_GRAD
            s_t = var.SCORE_MOD(s_t, sc.off_b, sc.off_h, rows[None, :], cols[:, None]) * LOG2E
        s_t = apply_attn_mask(s_t, sc.mask_base, cols, rows, seq.SK, seq.SQ, sc.stride_mn,
                              sc.stride_mm, var.MASK_KIND)
        if MASK_MOD is not None:
            s_t = tl.where(MASK_MOD(sc.off_b, sc.off_h, rows[None, :], cols[:, None]), s_t,
                           float("-inf"))
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASK:
            # No end checks without a score_mod: rows past SQ have zero q and dO (and an
            # infinite LSE), keys past SK are not stored. A score_mod may overflow there.
            p_t = tl.where(visible(rows, cols, seq.SQ, seq.SK, seq.LOWER, seq.UPPER, HAS_LOWER,
                                   HAS_UPPER, True, 0 if var.SCORE_MOD is None else 2), p_t, 0.0)
        pd_t = p_t
        if var.HAS_DROPOUT:  # the forward's mask, regenerated
            keep_t = dropout_keep(sc.seed, sc.rng_bh, rows, cols, sc.dropout_p, True)
            pd_t = tl.where(keep_t, p_t * (1.0 / (1.0 - sc.dropout_p)), 0.0)
        dv = tl.dot(pd_t.to(do.dtype), do, dv, input_precision=var.DOT_PREC)  # [BLOCK_N, BLOCK_DV]
        dp_t = tl.dot(v, tl.trans(do), input_precision=var.DOT_PREC)          # [BLOCK_N, BLOCK_M]
        if var.HAS_DROPOUT:
            dp_t = tl.where(keep_t, dp_t * (1.0 / (1.0 - sc.dropout_p)), 0.0)
        ds_t = _ds(p_t, dp_t, delta[None, :], t_t, var.HAS_SOFTCAP)
        if var.SCORE_GRAD is not None:
            ds_t = ds_t * var.SCORE_GRAD(t_t, sc.off_b, sc.off_h, rows[None, :], cols[:, None])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=var.DOT_PREC)   # [BLOCK_N, BLOCK_D]
    return dk, dv


# GROUP stays a runtime value: specialised to the constant 1 (no GQA), the non-causal kernel
# with the stats descriptors crashes Triton 3.6's ptxas (SIGSEGV; compile_check's "full").
@triton.jit(do_not_specialize=["seed", "GROUP", "TOTAL_Q", "TOTAL_K"])
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, ALIBI, AMASK, CU_Q, CU_K, SEQUSED_K, BMASK,
    stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv,  # (batch, token, head)
    stride_lse, stride_alibi,  # (batch, head): LSE's and delta's, ALiBi's
    stride_mask,  # (batch, head, query, key)
    stride_bmask, BM_N,  # (batch, head, block), BMASK's other block count
    HKV, GROUP, SQ, SK, TOTAL_Q, TOTAL_K, HEAD_DIM, HEAD_DIM_V, WIN_LEFT, WIN_RIGHT, qk_scale, cap2,
    sm_scale,
    dropout_p, seed,
    SQ_BUCKET, SK_BUCKET,  # autotuning key only
    IS_VARLEN: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_DV: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
    MASK_MOD: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, SPARSE: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    STATS_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    stride_qb, stride_qt, stride_qh = stride_q
    stride_kb, stride_kt, stride_kh = stride_k
    stride_vb, stride_vt, stride_vh = stride_v
    stride_dob, stride_dot, stride_doh = stride_do
    stride_dkb, stride_dkt, stride_dkh = stride_dk
    stride_dvb, stride_dvt, stride_dvh = stride_dv
    stride_lb, stride_lh = stride_lse
    stride_ab, stride_ah = stride_alibi
    stride_mb, stride_mh, stride_mm, stride_mn = stride_mask
    stride_bb, stride_bh, stride_bq = stride_bmask
    start_n = tl.program_id(0) * BLOCK_N
    off_bh = tl.program_id(1)
    off_b = (off_bh // HKV).to(tl.int64)
    off_hk = (off_bh % HKV).to(tl.int64)
    q_off, k_off, SQ, SK, LOWER, UPPER, DIAG = seq_bounds(CU_Q, CU_K, SEQUSED_K, off_b, SQ, SK,
                                                          TOTAL_Q, TOTAL_K, WIN_LEFT, WIN_RIGHT,
                                                          IS_VARLEN)
    if IS_VARLEN:
        if start_n >= SK:
            return

    cols = start_n + tl.arange(0, BLOCK_N)                           # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)                                   # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)                                   # [BLOCK_D]
    offs_dv = tl.arange(0, BLOCK_DV)                                 # [BLOCK_DV]: V, dO, dV
    c64 = (k_off + cols.to(tl.int64))[:, None]                       # rows of the packed K
    k = load_tile(K + off_b * stride_kb + off_hk * stride_kh + c64 * stride_kt + offs_d[None, :],
                  cols, SK, offs_d, HEAD_DIM, True, not EVEN_D)      # [BLOCK_N, BLOCK_D]
    v = load_tile(V + off_b * stride_vb + off_hk * stride_vh + c64 * stride_vt + offs_dv[None, :],
                  cols, SK, offs_dv, HEAD_DIM_V, True, not EVEN_DV)  # [BLOCK_N, BLOCK_DV]
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    lo, full_lo, full_hi, hi = q_range(start_n, SQ, SK, LOWER, UPPER, HAS_LOWER, HAS_UPPER,
                                       BLOCK_M, BLOCK_N)
    seq = Seq(SQ, SK, LOWER, UPPER, DIAG)
    var = Variant(HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, HAS_DROPOUT, SCORE_MOD, SCORE_GRAD, EVEN_D,
                  EVEN_DV, DOT_PREC, UPCAST, USE_TMA, 0, STATS_TMA, SPARSE, BLOCK_M, BLOCK_N)
    # The GQA loop is never pipelined: with seqlen_q 1 (a constant) the query-block loops
    # inside fold away, and Triton 3.6's pipeliner, given this loop, fails on its descriptor
    # creations ("tensormap_create ... doesn't know how to predicate"; compile_check gqa-sq1).
    for g in tl.range(0, GROUP, num_stages=1):
        off_h = off_hk * GROUP + g
        q_base = Q + off_b * stride_qb + q_off * stride_qt + off_h * stride_qh
        do_base = DO + off_b * stride_dob + q_off * stride_dot + off_h * stride_doh
        q_base = row_source(q_base, SQ, stride_qt, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        do_base = row_source(do_base, SQ, stride_dot, HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA)
        lse = LSE + off_b * stride_lb + off_h * stride_lh + q_off
        delta = DELTA + off_b * stride_lb + off_h * stride_lh + q_off
        if STATS_TMA:  # (the launcher checked that these rows start 16-byte aligned)
            lse = tl.make_tensor_descriptor(lse, shape=[tl.maximum(SQ, 1)], strides=[1],
                                            block_shape=[BLOCK_M])
            delta = tl.make_tensor_descriptor(delta, shape=[tl.maximum(SQ, 1)], strides=[1],
                                              block_shape=[BLOCK_M])
        slope2 = 0.0
        alibi_at = start_n  # one-sided ALiBi: the anchor of alibi_part, the block's first key
        if HAS_ALIBI:
            slope2 = tl.load(ALIBI + off_b * stride_ab + off_h * stride_ah) * LOG2E
        mask_base = AMASK
        if MASK_KIND != 0:
            mask_base = AMASK + off_b * stride_mb + off_h * stride_mh
        rng_bh = (off_b * HKV * GROUP + off_h).to(tl.int32)
        sc = Scores(qk_scale, cap2, slope2, alibi_at, mask_base, stride_mm, stride_mn, seed,
                    rng_bh, dropout_p, off_b, off_h)
        if HAS_BLOCK_MASK:
            # query blocks of this key block: n_partial, n_full, partial indices, full indices
            blocks = BMASK + off_b * stride_bb + off_h * stride_bh + (start_n // SPARSE) * stride_bq
            # full blocks (no mask_mod), then partial ones, each list in one flat loop
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse, delta, stride_qt,
                                          stride_dot, cols, offs_m, offs_d, offs_dv, HEAD_DIM,
                                          HEAD_DIM_V, 0, tl.load(blocks + 1) * SPARSE,
                                          blocks + 2 + BM_N, seq, sc, var, HAS_LOWER, HAS_UPPER,
                                          None, True, True)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse, delta, stride_qt,
                                          stride_dot, cols, offs_m, offs_d, offs_dv, HEAD_DIM,
                                          HEAD_DIM_V, 0, tl.load(blocks) * SPARSE, blocks + 2, seq,
                                          sc, var, HAS_LOWER, HAS_UPPER, MASK_MOD, True, True)
        else:
            # Masked query blocks at the diagonal, fully visible ones, masked ones at the
            # window's far edge; the last start at or past every key's upper bound (q_range's
            # full_lo) and check the lower bound only (HAS_UPPER False there).
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse, delta, stride_qt,
                                          stride_dot, cols, offs_m, offs_d, offs_dv, HEAD_DIM,
                                          HEAD_DIM_V, lo, full_lo, BMASK, seq, sc, var, HAS_LOWER,
                                          HAS_UPPER, MASK_MOD, True, False)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse, delta, stride_qt,
                                          stride_dot, cols, offs_m, offs_d, offs_dv, HEAD_DIM,
                                          HEAD_DIM_V, full_lo, full_hi, BMASK, seq, sc, var,
                                          HAS_LOWER, HAS_UPPER, MASK_MOD, False, False)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse, delta, stride_qt,
                                          stride_dot, cols, offs_m, offs_d, offs_dv, HEAD_DIM,
                                          HEAD_DIM_V, full_hi, hi, BMASK, seq, sc, var, HAS_LOWER,
                                          False, MASK_MOD, True, False)

    dk_ptrs = DK + off_b * stride_dkb + off_hk * stride_dkh + c64 * stride_dkt + offs_d[None, :]
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh + c64 * stride_dvt + offs_dv[None, :]
    store_tile(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), cols, SK, offs_d, HEAD_DIM,
               not EVEN_D)
    store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), cols, SK, offs_dv, HEAD_DIM_V, not EVEN_DV)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, rows, kv, lo, hi, blk_list, seq, sc, var,
                       HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr, MASK_MOD: tl.constexpr,
                       MASK: tl.constexpr, LISTED: tl.constexpr):
    for it in range(lo, hi, var.BLOCK_N):
        start_n = it  # LISTED: the key blocks that blk_list names (see _attn_fwd_inner)
        if LISTED:
            start_n = tl.load(blk_list + it // var.SPARSE) * var.SPARSE + it % var.SPARSE
        cols = start_n + kv.offs_n                                   # [BLOCK_N]
        k = load_rows(kv.k, start_n, kv.offs_n, kv.stride_kt, seq.SK, kv.offs_d, kv.HEAD_DIM, MASK,
                      not var.EVEN_D, var.USE_TMA)                   # [BLOCK_N, BLOCK_D]
        v = load_rows(kv.v, start_n, kv.offs_n, kv.stride_vt, seq.SK, kv.offs_dv, kv.HEAD_DIM_V,
                      MASK, not var.EVEN_DV, var.USE_TMA)            # [BLOCK_N, BLOCK_DV]
        if var.UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=var.DOT_PREC)   # [BLOCK_M, BLOCK_N]
        s, t = scores(qk, rows, cols, sc.qk_scale, sc.cap2, sc.slope2, sc.alibi_at,
                      var.HAS_SOFTCAP, var.HAS_ALIBI == 1)
        if var.HAS_ALIBI == 2:  # the key part (alibi_part); the rows' part is in lse2
            s = s + alibi_part(cols, sc.alibi_at, sc.slope2)[None, :]
        if var.SCORE_MOD is not None:
            t = s  # the natural-log score, argument of SCORE_GRAD
            s = var.SCORE_MOD(s, sc.off_b, sc.off_h, rows[:, None], cols[None, :]) * LOG2E
        s = apply_attn_mask(s, sc.mask_base, rows, cols, seq.SQ, seq.SK, sc.stride_mm,
                            sc.stride_mn, var.MASK_KIND)
        if MASK_MOD is not None:
            s = tl.where(MASK_MOD(sc.off_b, sc.off_h, rows[:, None], cols[None, :]), s,
                         float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])
        if MASK:
            # No end checks without a score_mod: rows past SQ are not stored, keys past SK are
            # zero rows of K (their dS adds nothing). A score_mod may overflow there.
            p = tl.where(visible(rows, cols, seq.SQ, seq.SK, seq.LOWER, seq.UPPER, HAS_LOWER,
                                 HAS_UPPER, False, 0 if var.SCORE_MOD is None else 2), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=var.DOT_PREC)   # [BLOCK_M, BLOCK_N]
        if var.HAS_DROPOUT:
            keep = dropout_keep(sc.seed, sc.rng_bh, rows, cols, sc.dropout_p, False)
            dp = tl.where(keep, dp * (1.0 / (1.0 - sc.dropout_p)), 0.0)
        ds = _ds(p, dp, delta[:, None], t, var.HAS_SOFTCAP)
        if var.SCORE_GRAD is not None:
            ds = ds * var.SCORE_GRAD(t, sc.off_b, sc.off_h, rows[:, None], cols[None, :])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=var.DOT_PREC)  # [BLOCK_M, BLOCK_D]
    return dq


@triton.jit(do_not_specialize=["seed", "TOTAL_Q", "TOTAL_K"])
def _attn_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DELTA, DQ, ALIBI, AMASK, CU_Q, CU_K, SEQUSED_K, BMASK,
    stride_q, stride_k, stride_v, stride_o, stride_do, stride_dq,  # (batch, token, head)
    stride_lse, stride_alibi,  # (batch, head): LSE's and delta's, ALiBi's
    stride_mask,  # (batch, head, query, key)
    stride_bmask, BM_N,  # (batch, head, block), BMASK's other block count
    H, GROUP, SQ, SK, TOTAL_Q, TOTAL_K, HEAD_DIM, HEAD_DIM_V, WIN_LEFT, WIN_RIGHT, qk_scale, cap2,
    sm_scale,
    dropout_p, seed,
    SQ_BUCKET, SK_BUCKET,  # autotuning key only
    IS_VARLEN: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_DV: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
    MASK_MOD: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, SPARSE: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    stride_qb, stride_qt, stride_qh = stride_q
    stride_kb, stride_kt, stride_kh = stride_k
    stride_vb, stride_vt, stride_vh = stride_v
    stride_ob, stride_ot, stride_oh = stride_o
    stride_dob, stride_dot, stride_doh = stride_do
    stride_dqb, stride_dqt, stride_dqh = stride_dq
    stride_lb, stride_lh = stride_lse
    stride_ab, stride_ah = stride_alibi
    stride_mb, stride_mh, stride_mm, stride_mn = stride_mask
    stride_bb, stride_bh, stride_bq = stride_bmask
    start_m = heavy_first(HAS_LOWER, HAS_UPPER) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = off_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)
    q_off, k_off, SQ, SK, LOWER, UPPER, DIAG = seq_bounds(CU_Q, CU_K, SEQUSED_K, off_b, SQ, SK,
                                                          TOTAL_Q, TOTAL_K, WIN_LEFT, WIN_RIGHT,
                                                          IS_VARLEN)
    if IS_VARLEN:
        if start_m >= SQ:
            return

    rows = start_m + tl.arange(0, BLOCK_M)                           # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)                                   # [BLOCK_D]
    offs_dv = tl.arange(0, BLOCK_DV)                                 # [BLOCK_DV]: V, O, dO
    r64 = (q_off + rows.to(tl.int64))[:, None]                       # rows of the packed Q
    q = load_tile(Q + off_b * stride_qb + off_h * stride_qh + r64 * stride_qt + offs_d[None, :],
                  rows, SQ, offs_d, HEAD_DIM, True, not EVEN_D)      # [BLOCK_M, BLOCK_D]
    do = load_tile(DO + off_b * stride_dob + off_h * stride_doh + r64 * stride_dot
                   + offs_dv[None, :], rows, SQ, offs_dv, HEAD_DIM_V, True,
                   not EVEN_DV)                                      # [BLOCK_M, BLOCK_DV]
    o = load_tile(O + off_b * stride_ob + off_h * stride_oh + r64 * stride_ot + offs_dv[None, :],
                  rows, SQ, offs_dv, HEAD_DIM_V, True, not EVEN_DV)  # [BLOCK_M, BLOCK_DV]
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)         # rowsum(dO * O)
    tl.store(DELTA + off_b * stride_lb + off_h * stride_lh + q_off + rows, delta, mask=rows < SQ)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = _lse2(LSE + off_b * stride_lb + off_h * stride_lh + q_off, rows, SQ)
    slope2 = 0.0
    alibi_at = DIAG  # one-sided ALiBi: the anchor of alibi_part (as in the forward)
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + off_b * stride_ab + off_h * stride_ah) * LOG2E
        if HAS_ALIBI == 2:
            alibi_at = start_m + DIAG
            lse2 = lse2 + alibi_part(rows + DIAG, alibi_at, slope2)
    mask_base = AMASK
    if MASK_KIND != 0:
        mask_base = AMASK + off_b * stride_mb + off_h * stride_mh
    rng_bh = (off_b * H + off_h).to(tl.int32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_base = K + off_b * stride_kb + k_off * stride_kt + off_hk * stride_kh
    v_base = V + off_b * stride_vb + k_off * stride_vt + off_hk * stride_vh
    k_base = row_source(k_base, SK, stride_kt, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_base = row_source(v_base, SK, stride_vt, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
    seq = Seq(SQ, SK, LOWER, UPPER, DIAG)
    sc = Scores(qk_scale, cap2, slope2, alibi_at, mask_base, stride_mm, stride_mn, seed, rng_bh,
                dropout_p, off_b, off_h)
    var = Variant(HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, HAS_DROPOUT, SCORE_MOD, SCORE_GRAD, EVEN_D,
                  EVEN_DV, DOT_PREC, UPCAST, USE_TMA, 0, False, SPARSE, BLOCK_M, BLOCK_N)
    kv = KV(k_base, v_base, stride_kt, stride_vt, 0, 0, 0, offs_n, offs_d, offs_dv, HEAD_DIM,
            HEAD_DIM_V)
    if HAS_BLOCK_MASK:
        # key blocks of this query block: n_partial, n_full, partial indices, full indices
        blocks = BMASK + off_b * stride_bb + off_h * stride_bh + (start_m // SPARSE) * stride_bq
        # full blocks (no mask_mod), then partial ones, each list in one flat loop
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, rows, kv, 0, tl.load(blocks + 1) * SPARSE,
                                blocks + 2 + BM_N, seq, sc, var, HAS_LOWER, HAS_UPPER, None, True,
                                True)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, rows, kv, 0, tl.load(blocks) * SPARSE,
                                blocks + 2, seq, sc, var, HAS_LOWER, HAS_UPPER, MASK_MOD, True,
                                True)
    else:
        lo, full_lo, full_hi, hi = kv_range(start_m, SK, LOWER, UPPER, HAS_LOWER, HAS_UPPER,
                                            BLOCK_M, BLOCK_N)
        # as in the forward: the right edge's blocks check the upper bound only
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, rows, kv, lo, full_lo, BMASK, seq, sc, var,
                                HAS_LOWER, HAS_UPPER, MASK_MOD, True, False)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, rows, kv, full_lo, full_hi, BMASK, seq, sc,
                                var, HAS_LOWER, HAS_UPPER, MASK_MOD, False, False)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, rows, kv, full_hi, hi, BMASK, seq, sc, var,
                                False, HAS_UPPER, MASK_MOD, True, False)

    dq_ptrs = DQ + off_b * stride_dqb + off_h * stride_dqh + r64 * stride_dqt + offs_d[None, :]
    store_tile(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), rows, SQ, offs_d, HEAD_DIM,
               not EVEN_D)


@triton.jit
def _attn_bwd_prep_kernel(O, DO, LSE, LSE2, DELTA, DQ, stride_ob, stride_ot, stride_oh, stride_dob,
                          stride_dot, stride_doh, stride_lb, stride_lh, stride_qb, stride_qt,
                          stride_qh, H, SQ, SQ_PAD, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, DIM: tl.constexpr):
    """Program (row block, batch * head): the rows' LSE in the log2 domain (+inf for rows
    that see no key) and delta = rowsum(dO * O), fp32, into LSE2 and DELTA (B * H rows of
    SQ_PAD, a multiple of BLOCK_M: padding rows get +inf and 0, so P = dS = 0 there, and every
    head's rows start aligned for the Gluon backward's TMA), and zeros into the rows of the
    fp32 dQ buffer (B, SQ, H, HEAD_DIM; strides stride_q*: q's layout, so that dQ's copy
    out of it keeps the order of memory; DQ None: none). DIM: the tensors' head dim (<= HEAD_DIM,
    the tiles' power of two). The grid covers SQ_PAD rows."""
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    r64 = rows.to(tl.int64)[:, None]
    keep = rows[:, None] < SQ
    if DIM < HEAD_DIM:
        keep = keep & (cols[None, :] < DIM)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + r64 * stride_ot + cols[None, :],
                mask=keep, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + r64 * stride_dot + cols[None, :],
                 mask=keep, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    padded = off_bh.to(tl.int64) * SQ_PAD + rows
    tl.store(LSE2 + padded, _lse2(LSE + off_b * stride_lb + off_h * stride_lh, rows, SQ))
    tl.store(DELTA + padded, delta)
    if DQ is not None:
        tl.store(DQ + off_b * stride_qb + off_h * stride_qh + r64 * stride_qt + cols[None, :],
                 tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), mask=keep)


@triton.jit(do_not_specialize=["B", "TOTAL_Q", "TOTAL_K", "K_AT"])
def _varlen_spans_kernel(CU_Q, CU_K, SPANS, B, TOTAL_Q, TOTAL_K, K_AT, BLOCK_B: tl.constexpr):
    """SPANS[2b], SPANS[2b + 1]: sequence b's first and end query row (CU_Q[b], CU_Q[b + 1]);
    SPANS[K_AT + 2b], SPANS[K_AT + 2b + 1]: its key rows; a sequence whose rows fall outside
    [0, TOTAL] (or end before they start) gets end = start: no rows."""
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    _span_pairs(CU_Q, TOTAL_Q, SPANS, b, b < B)
    _span_pairs(CU_K, TOTAL_K, SPANS + K_AT, b, b < B)


@triton.jit
def _span_pairs(CU, TOTAL, PAIRS, b, live):
    start = tl.load(CU + b, mask=live, other=0)
    end = tl.load(CU + b + 1, mask=live, other=0)
    ok = (start.to(tl.uint32) <= end.to(tl.uint32)) & (end.to(tl.uint32) <= TOTAL)
    tl.store(PAIRS + 2 * b, start, mask=live)
    tl.store(PAIRS + 2 * b + 1, tl.where(ok, end, start), mask=live)
