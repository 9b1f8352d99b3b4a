"""Backward kernels: recomputation from Q, K, V, O, dO and LSE only.

  _attn_bwd_preprocess_kernel  delta = rowsum(dO * O), fp32 (B, H, SQ)
  _attn_bwd_dkdv_kernel        one program per (key block, batch * kv head);
                               loops over the GROUP query heads sharing the kv
                               head, so dK/dV of GQA/MQA are summed in registers
  _attn_bwd_dq_kernel          one program per (query block, batch * head)

P is rebuilt tile by tile as exp2(s2 - LSE * log2(e)); no N x N buffer exists
and no atomics are used, so gradients are bitwise repeatable.
"""

import triton
import triton.language as tl

from .common import LOG2E, causal_keep, heavy_first, kv_range, load_tile, q_range, store_tile


@triton.jit
def _attn_bwd_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_ot, stride_oh,
    stride_dob, stride_dot, stride_doh,
    stride_db, stride_dh,
    H, SQ,
    HEAD_DIM, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    r64 = rows.to(tl.int64)[:, None]
    o = load_tile(O + off_b * stride_ob + off_h * stride_oh + r64 * stride_ot + offs_d[None, :],
                  rows, SQ, offs_d, HEAD_DIM, True, not EVEN_D)
    do = load_tile(DO + off_b * stride_dob + off_h * stride_doh + r64 * stride_dot + offs_d[None, :],
                   rows, SQ, offs_d, HEAD_DIM, True, not EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)            # [BLOCK_M]
    tl.store(DELTA + off_b * stride_db + off_h * stride_dh + rows, delta, mask=rows < SQ)


@triton.jit
def _row_stats(LSE, DELTA, rows, SQ):
    """LSE in the log2 domain (+inf for padding and empty rows, so P = 0) and delta."""
    lse = tl.load(LSE + rows, mask=rows < SQ, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.load(DELTA + rows, mask=rows < SQ, other=0.0)
    return lse2, delta


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, stride_qt, stride_dot,
                         cols, offs_m, offs_d, lo, hi, SQ, SK, DIAG, qk_scale,
                         HEAD_DIM, EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                         MASK: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m                                      # [BLOCK_M]
        r64 = rows.to(tl.int64)[:, None]
        q = load_tile(q_base + r64 * stride_qt + offs_d[None, :], rows, SQ, offs_d, HEAD_DIM,
                      MASK, not EVEN_D)                              # [BLOCK_M, BLOCK_D]
        do = load_tile(do_base + r64 * stride_dot + offs_d[None, :], rows, SQ, offs_d, HEAD_DIM,
                       MASK, not EVEN_D)                             # [BLOCK_M, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse2, delta = _row_stats(LSE, DELTA, rows, SQ)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale   # [BLOCK_N, BLOCK_M]
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASK:
            p_t = tl.where(tl.trans(causal_keep(rows, cols, SQ, SK, DIAG, IS_CAUSAL)), p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)      # [BLOCK_N, BLOCK_D]
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)             # [BLOCK_N, BLOCK_M]
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)       # [BLOCK_N, BLOCK_D]
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh,
    stride_lb, stride_lh,
    HKV, GROUP, SQ, SK, DIAG, qk_scale, sm_scale,
    SQ_BUCKET, SK_BUCKET,  # autotuning key only
    HEAD_DIM, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    off_bh = tl.program_id(1)
    off_b = (off_bh // HKV).to(tl.int64)
    off_hk = (off_bh % HKV).to(tl.int64)

    cols = start_n + tl.arange(0, BLOCK_N)                           # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)                                   # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)                                   # [BLOCK_D]
    c64 = cols.to(tl.int64)[:, None]
    k = load_tile(K + off_b * stride_kb + off_hk * stride_kh + c64 * stride_kt + offs_d[None, :],
                  cols, SK, offs_d, HEAD_DIM, True, not EVEN_D)      # [BLOCK_N, BLOCK_D]
    v = load_tile(V + off_b * stride_vb + off_hk * stride_vh + c64 * stride_vt + offs_d[None, :],
                  cols, SK, offs_d, HEAD_DIM, True, not EVEN_D)      # [BLOCK_N, BLOCK_D]
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    lo, mid, full_end = q_range(start_n, SQ, SK, DIAG, IS_CAUSAL, BLOCK_M, BLOCK_N)
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        lse = LSE + off_b * stride_lb + off_h * stride_lh
        delta = DELTA + off_b * stride_lb + off_h * stride_lh
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse, delta, stride_qt,
                                      stride_dot, cols, offs_m, offs_d, lo, mid, SQ, SK, DIAG,
                                      qk_scale, HEAD_DIM, EVEN_D, IS_CAUSAL, True, DOT_PREC,
                                      UPCAST, BLOCK_M)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse, delta, stride_qt,
                                      stride_dot, cols, offs_m, offs_d, mid, full_end, SQ, SK,
                                      DIAG, qk_scale, HEAD_DIM, EVEN_D, IS_CAUSAL, False,
                                      DOT_PREC, UPCAST, BLOCK_M)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse, delta, stride_qt,
                                      stride_dot, cols, offs_m, offs_d, full_end, SQ, SQ, SK,
                                      DIAG, qk_scale, HEAD_DIM, EVEN_D, IS_CAUSAL, True,
                                      DOT_PREC, UPCAST, BLOCK_M)

    dk_ptrs = DK + off_b * stride_dkb + off_hk * stride_dkh + c64 * stride_dkt + offs_d[None, :]
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh + c64 * stride_dvt + offs_d[None, :]
    store_tile(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), cols, SK, offs_d, HEAD_DIM,
               not EVEN_D)
    store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), cols, SK, offs_d, HEAD_DIM, not EVEN_D)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt,
                       rows, offs_n, offs_d, lo, hi, SQ, SK, DIAG, qk_scale,
                       HEAD_DIM, EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                       MASK: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                      # [BLOCK_N]
        c64 = cols.to(tl.int64)[:, None]
        k = load_tile(k_base + c64 * stride_kt + offs_d[None, :], cols, SK, offs_d, HEAD_DIM,
                      MASK, not EVEN_D)                              # [BLOCK_N, BLOCK_D]
        v = load_tile(v_base + c64 * stride_vt + offs_d[None, :], cols, SK, offs_d, HEAD_DIM,
                      MASK, not EVEN_D)                              # [BLOCK_N, BLOCK_D]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale     # [BLOCK_M, BLOCK_N]
        p = tl.math.exp2(s - lse2[:, None])
        if MASK:
            p = tl.where(causal_keep(rows, cols, SQ, SK, DIAG, IS_CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)              # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)        # [BLOCK_M, BLOCK_D]
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh,
    stride_lb, stride_lh,
    H, GROUP, SQ, SK, DIAG, qk_scale, sm_scale,
    SQ_BUCKET, SK_BUCKET,  # autotuning key only
    HEAD_DIM, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m = heavy_first(IS_CAUSAL) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = off_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)

    rows = start_m + tl.arange(0, BLOCK_M)                           # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)                                   # [BLOCK_D]
    r64 = rows.to(tl.int64)[:, None]
    q = load_tile(Q + off_b * stride_qb + off_h * stride_qh + r64 * stride_qt + offs_d[None, :],
                  rows, SQ, offs_d, HEAD_DIM, True, not EVEN_D)      # [BLOCK_M, BLOCK_D]
    do = load_tile(DO + off_b * stride_dob + off_h * stride_doh + r64 * stride_dot + offs_d[None, :],
                   rows, SQ, offs_d, HEAD_DIM, True, not EVEN_D)     # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2, delta = _row_stats(LSE + off_b * stride_lb + off_h * stride_lh,
                             DELTA + off_b * stride_lb + off_h * stride_lh, rows, SQ)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    full_end, hi = kv_range(start_m, SK, DIAG, IS_CAUSAL, BLOCK_M, BLOCK_N)
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, rows,
                            offs_n, offs_d, 0, full_end, SQ, SK, DIAG, qk_scale, HEAD_DIM, EVEN_D,
                            IS_CAUSAL, False, DOT_PREC, UPCAST, BLOCK_N)
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, rows,
                            offs_n, offs_d, full_end, hi, SQ, SK, DIAG, qk_scale, HEAD_DIM, EVEN_D,
                            IS_CAUSAL, True, DOT_PREC, UPCAST, BLOCK_N)

    dq_ptrs = DQ + off_b * stride_dqb + off_h * stride_dqh + r64 * stride_dqt + offs_d[None, :]
    store_tile(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), rows, SQ, offs_d, HEAD_DIM,
               not EVEN_D)
