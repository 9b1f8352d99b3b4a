"""Decoding kernels: split-KV attention over a KV cache (contiguous or paged) and the merge
of partial results by their LSEs (flash decoding).

_attn_decode_kernel   one program per (KV split, batch * kv head, row block). The GROUP query
                      heads sharing the kv head and the SQ query tokens are packed into rows
                      (row r: head r // SQ, token r % SQ), BLOCK_M of them a program (one row
                      block reads each K/V byte once; more query rows than the tile's cap
                      take several row blocks). Writes the split's normalised partial
                      output and its LSE (with one split, O_PART and LSE_PART are the output
                      and LSE themselves; LSE_PART None: no LSE wanted).
                      MERGE (eager steps over small caches with one row block: decode.py's
                      rule): each split
                      counts itself done in COUNTERS (one per program column, zero before the
                      launch), and the one that counts last merges the column's partials into
                      OUT and LSE and sets its count back to zero: one launch a step.
                      With PDL (Hopper), both kernels are launched as programmatic dependents:
                      each may start before the kernel ahead of it on the stream ends and
                      waits for it (griddepcontrol.wait) before reading what it wrote; the
                      split kernel lets the merge launch once its loop is done, so the merge's
                      launch overlaps the split kernel's stores.
_kv_append_kernel     one program per (new token, batch * kv head): writes the token's K and
                      V rows into the cache at position CACHE_SEQLENS[b] + i (into its page
                      with BLOCK_TABLE), quantised into an fp8 cache; a position outside the
                      cache, a page outside the pool or a cache row outside the cache writes
                      nothing.
_attn_merge_kernel    one program per (batch * head * query token): out = sum_s w_s o_s with
                      w_s = exp(lse_s - lse), lse = log sum_s exp(lse_s) (merge_splits, which
                      the split kernel's MERGE runs too).
_cache_spans_kernel   one program: the offsets and key counts of the prefill forward's Varlen
                      over a contiguous cache's rows (decode.py's prefill route).

Attention sinks (SINK: one logit a query head): HAS_SINK 1, the split kernel that writes the
output itself (one split) adds the sink to its rows before the store; 2, the merge adds it
(merge_splits starts from the sink as a split with no value), in the split kernel's MERGE or
in the merge kernel.

FP8 caches (float8_e4m3fn / e5m2) hold value / descale with one float32 factor a (sequence,
KV head) for K and one for V: the split kernel reads the fp8 bytes, converts them to q's dtype
in registers (to fp16 under a bf16 q, whose rows it scales into fp16 exactly), folds K's factor
into the scores' scale and multiplies the output sums by V's.

Packed queries (CU_Q not None, both kernels): q (TOTAL_Q, H, D) holds the sequences' queries
one after another, sequence b's from row CU_Q[b] (int32, B + 1) to CU_Q[b + 1]; a sequence of SQ
queries is computed from those rows into OUT (TOTAL_Q, H, D) and LSE (H, TOTAL_Q) by way of the
partials (never one split into the output), one of another count (paged varlen's prefill rows,
which the forward computes) or outside q is not touched.

Query token t of a sequence whose cache holds SK keys (the new ones included) sits at
position SK - SQ + t: causal and window masks are aligned to the end of the cache. Both kernels
take TL: None, or a timeline (timing only: common.mark, tools/timeline.py decode).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import LN2, LOG2E, load_tile, mark, scores
from .mask import visible
from .softmax import NEG_BIG, add_sink


@triton.jit(do_not_specialize=["WAVES", "ROWS", "CAPACITY", "TOTAL_Q"])
def _attn_decode_kernel(
    Q, K, V, CACHE_SEQLENS, BLOCK_TABLE, BATCH_IDX, LEFTPAD, ALIBI, SINK,
    K_DESCALE, V_DESCALE,  # FP8 only: float32 factors at b * stride_kdb + kv head * stride_kdh
    O_PART, LSE_PART,
    OUT, LSE, COUNTERS,  # MERGE only: the output (B, SQ, H, D), its LSE (B, H, SQ), the counts
    TL,  # None, or a timeline (common.mark): start, loop end, stores, end (after MERGE), SM
    CU_Q,  # None, or packed queries (see below)
    stride_q, stride_k, stride_v,  # (batch, token, head) strides
    stride_bt, stride_alibi,  # the block table's rows; ALiBi's (batch, head)
    stride_part,  # O_PART's (split, batch, head, token)
    stride_lse_part,  # LSE_PART's (split, batch, head)
    stride_out,  # MERGE's OUT: (batch, token, head)
    stride_kd, stride_vd,  # the descales' (batch, kv head)
    HKV, GROUP, SQ, HEAD_DIM, WIN_LEFT, WIN_RIGHT, qk_scale, cap2, SPLIT_SIZE, TOTAL_Q,
    ROWS,  # the cache's rows (contiguous: k_cache.shape[0]) or pages (paged)
    CAPACITY,  # positions a sequence can hold: k_cache.shape[1], or block_table's pages x size
    PAGE_SIZE: tl.constexpr,  # a power of two: the page arithmetic is shifts and masks
    SPLIT_BUCKET,  # autotuning key only
    WAVES,  # autotuning key only: the grid's waves over the SMs (1, 2, 4 for 4 or more)
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, PAGED: tl.constexpr, SAME_LAYOUT: tl.constexpr,
    HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    DOT_PREC: tl.constexpr, PDL: tl.constexpr, MERGE: tl.constexpr, HAS_SINK: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,  # MERGE: pow2 >= GROUP * SQ; splits a load
    UPCAST: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    stride_qb, stride_qt, stride_qh = stride_q
    stride_kb, stride_kt, stride_kh = stride_k
    stride_vb, stride_vt, stride_vh = stride_v
    stride_ab, stride_ah = stride_alibi
    stride_os, stride_ob, stride_oh, stride_ot = stride_part
    stride_ls, stride_lb, stride_lh = stride_lse_part
    stride_Ob, stride_Ot, stride_Oh = stride_out
    stride_kdb, stride_kdh = stride_kd
    stride_vdb, stride_vdh = stride_vd
    program = ((tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0)
               + tl.program_id(0))
    mark(TL, program, 0)
    mark(TL, program, 4)
    if PDL:  # launched early (programmatic dependent launch): wait for the kernels before
        gdc_wait()
    split = tl.program_id(0)
    off_b = tl.program_id(1) // HKV
    off_hk = (tl.program_id(1) % HKV).to(tl.int64)
    q_at = off_b.to(tl.int64) * stride_qb  # the sequence's first query row
    if CU_Q is not None:
        q_start, q_at = packed_rows(CU_Q, off_b, SQ, TOTAL_Q, stride_qt)
        if q_start < 0:  # not a sequence of SQ queries: the forward's (or nobody's)
            return
    if CACHE_SEQLENS is None:  # a dense call's full cache (launch.decode.dense_split)
        SK = CAPACITY
    else:
        SK = tl.load(CACHE_SEQLENS + off_b)
    in_cache = (SK >= 0) & (SK <= CAPACITY)
    cache_b = off_b.to(tl.int64)
    if HAS_BATCH_IDX:
        cache_b = tl.load(BATCH_IDX + off_b).to(tl.int64)
        in_cache = in_cache & (cache_b >= 0) & (cache_b < ROWS)
        cache_b = tl.where(in_cache, cache_b, 0)
    SK = tl.where(in_cache, SK, 0)  # indices outside the cache: the sequence sees no keys
    DIAG = SK - SQ
    LOWER = DIAG - WIN_LEFT
    UPPER = DIAG + WIN_RIGHT

    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)           # packed (head, token) rows
    g = r // SQ
    t = r % SQ                                                       # query token of each row
    row_ok = g < GROUP
    heads = (off_hk * GROUP + g).to(tl.int64)                        # [BLOCK_M] query heads
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = (Q + q_at + t.to(tl.int64)[:, None] * stride_qt
              + heads[:, None] * stride_qh + offs_d[None, :])
    q = load_tile(q_ptrs, g, GROUP, offs_d, HEAD_DIM, True, not EVEN_D)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    if FP8:  # the cache holds value / descale: K's factor joins the scores' scale
        qk_scale = qk_scale * tl.load(K_DESCALE + off_b * stride_kdb + off_hk * stride_kdh)
        if q.dtype == tl.bfloat16:
            # Products in fp16, which fp8 converts to in one instruction a pair (to bf16: three,
            # which bound the loop). Each row of q at the power of two that puts its largest
            # |value| in [2^14, 2^15): exact for bf16's 8 significant bits.
            q32 = q.to(tl.float32)
            top = tl.maximum(tl.max(tl.abs(q32), 1), 1e-30)
            shift = tl.minimum(14.0 - tl.floor(tl.log2(top)), 126.0)
            q = (q32 * tl.exp2(shift)[:, None]).to(tl.float16)
            qk_scale = qk_scale * tl.exp2(-shift)[:, None]
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = (tl.load(ALIBI + off_b * stride_ab + heads * stride_ah, mask=row_ok, other=0.0)
                  * LOG2E)[:, None]

    lo = split * SPLIT_SIZE
    hi = tl.minimum(lo + SPLIT_SIZE, SK)
    if HAS_LOWER:  # keys below every row's window are skipped
        lo = tl.maximum(lo, ((DIAG - WIN_LEFT) // BLOCK_N) * BLOCK_N)
    first = 0  # the cache's first valid key (left padding)
    if HAS_LEFTPAD:
        first = tl.load(LEFTPAD + off_b)
        lo = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)
    # (softmax.init_rows, written out: through the helper the constants' order differs)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if PAGED:  # page of each key of the first tile; the loop loads the next tile's ahead
        table = BLOCK_TABLE + off_b.to(tl.int64) * stride_bt
        raw = tl.load(table + (lo + offs_n) // PAGE_SIZE, mask=lo + offs_n < SK, other=0)
        next_ok = raw.to(tl.uint32) < ROWS  # a page inside the pool (one unsigned compare)
        next_page = tl.where(next_ok, raw, 0).to(tl.int64)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                      # [BLOCK_N] cache positions
        if PAGED:
            # K/V addresses from a loop-carried value, not from a load in the same iteration:
            # the compiler can then pipeline the K/V loads as deep as the contiguous case.
            # A page index outside the pool reads page 0, and its keys are masked.
            page, page_ok = next_page, next_ok
            ahead = cols + BLOCK_N
            raw = tl.load(table + ahead // PAGE_SIZE, mask=ahead < SK, other=0)
            next_ok = raw.to(tl.uint32) < ROWS
            next_page = tl.where(next_ok, raw, 0).to(tl.int64)
            k_rows = page * stride_kb + (cols % PAGE_SIZE).to(tl.int64) * stride_kt
            if not SAME_LAYOUT:
                v_rows = page * stride_vb + (cols % PAGE_SIZE).to(tl.int64) * stride_vt
        else:
            k_rows = cache_b * stride_kb + cols.to(tl.int64) * stride_kt
            if not SAME_LAYOUT:
                v_rows = cache_b * stride_vb + cols.to(tl.int64) * stride_vt
        if SAME_LAYOUT:  # V's strides are K's: one set of row offsets serves both
            v_rows = k_rows
        k = load_tile(K + off_hk * stride_kh + k_rows[:, None] + offs_d[None, :], cols, hi, offs_d,
                      HEAD_DIM, True, not EVEN_D)                    # [BLOCK_N, BLOCK_D]
        v = load_tile(V + off_hk * stride_vh + v_rows[:, None] + offs_d[None, :], cols, hi, offs_d,
                      HEAD_DIM, True, not EVEN_D)                    # [BLOCK_N, BLOCK_D]
        if UPCAST or FP8:  # fp8 bytes converted in registers (exactly): products in q's dtype
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if HAS_LEFTPAD:  # the padding's values, whatever they hold, add nothing (0 x NaN is NaN)
            v = tl.where((cols >= first)[:, None], v, tl.zeros_like(v))
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)       # [BLOCK_M, BLOCK_N]
        s, _ = scores(qk, t, cols, qk_scale, cap2, slope2, DIAG, HAS_SOFTCAP, HAS_ALIBI)
        if PAGED:  # a key of a page outside the pool: past hi for the mask
            keep = visible(t, tl.where(page_ok, cols, hi), SQ, hi, LOWER, UPPER, HAS_LOWER,
                           HAS_UPPER)
        else:
            keep = visible(t, cols, SQ, hi, LOWER, UPPER, HAS_LOWER, HAS_UPPER)
        if HAS_LEFTPAD:
            keep = keep & (cols[None, :] >= first)
        s = tl.where(keep, s, float("-inf"))
        # softmax.online_softmax(s, acc, m_i, l_i, 1.0, False) but for the rescale of acc in
        # the product's argument, written out: through the helper (the same PTX but for the
        # debug labels of its scope) ptxas allocates the loop's registers otherwise
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    mark(TL, program, 1)
    if FP8:  # V's factor, once on the sums
        acc = acc * tl.load(V_DESCALE + off_b * stride_vdb + off_hk * stride_vdh)
    if PDL:  # the merge kernel may launch now (it waits for this grid before its loads)
        gdc_launch_dependents()
    if HAS_SINK == 1:  # this split is the output: its rows' sinks join here
        sink2 = tl.load(SINK + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        acc, l_i, m_i = add_sink(acc, l_i, m_i, sink2)
    # softmax.finalize, written out: O's factor after the LSE (as the helper has it, other code)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    o_ptrs = (O_PART + split * stride_os + off_b * stride_ob + heads[:, None] * stride_oh
              + t.to(tl.int64)[:, None] * stride_ot + offs_d[None, :])
    tl.store(o_ptrs, acc * (1.0 / l_safe)[:, None],
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    if LSE_PART is not None:  # None: one split, and the caller wants no LSE
        tl.store(LSE_PART + split * stride_ls + off_b * stride_lb + heads * stride_lh + t, lse,
                 mask=row_ok)
    mark(TL, program, 2)
    if MERGE:
        tl.debug_barrier()  # every thread's stores above happen before the count
        # acq_rel: the split that counts last sees every other split's partials
        done = tl.atomic_add(COUNTERS + tl.program_id(1), 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            tl.store(COUNTERS + tl.program_id(1), 0)  # zero again for the next step
            r2 = tl.arange(0, BLOCK_R)                               # unpadded (head, token) rows
            g2 = r2 // SQ
            t2 = (r2 % SQ).to(tl.int64)
            heads2 = (off_hk * GROUP + g2).to(tl.int64)
            d_ok = offs_d < HEAD_DIM
            o_row, lse_row = merge_splits(
                O_PART + off_b * stride_ob
                + (heads2 * stride_oh + t2 * stride_ot)[:, None] + offs_d[None, :],
                LSE_PART + off_b * stride_lb + heads2 * stride_lh + t2, stride_os, stride_ls,
                g2 < GROUP, d_ok, tl.num_programs(0), SINK, heads2, HAS_SINK == 2, BLOCK_R,
                BLOCK_D, BLOCK_C)
            out_at = off_b * stride_Ob
            lse_at = (off_b * HKV * GROUP + heads2) * SQ + t2
            if CU_Q is not None:  # packed rows: OUT (TOTAL_Q, H, D), LSE (H, TOTAL_Q)
                out_at = q_start.to(tl.int64) * stride_Ot
                lse_at = heads2 * TOTAL_Q + q_start + t2
            tl.store(OUT + out_at + (t2 * stride_Ot + heads2 * stride_Oh)[:, None]
                     + offs_d[None, :], o_row.to(OUT.dtype.element_ty),
                     mask=(g2 < GROUP)[:, None] & d_ok[None, :])
            if LSE is not None:  # None: no LSE wanted
                tl.store(LSE + lse_at, lse_row, mask=g2 < GROUP)
    mark(TL, program, 3)


@triton.jit
def packed_rows(CU_Q, b, SQ, TOTAL_Q, stride_t):
    """Sequence b of packed queries (CU_Q: B + 1 int32 offsets into TOTAL_Q rows): its first row
    and that row's offset (x stride_t, int64) if it holds SQ queries inside the rows, else
    (-1, 0): no row outside them is addressed, whatever CU_Q holds."""
    start = tl.load(CU_Q + b)
    end = tl.load(CU_Q + b + 1)
    ok = ((start.to(tl.uint32) <= end.to(tl.uint32)) & (end.to(tl.uint32) <= TOTAL_Q)
          & (end - start == SQ))
    return tl.where(ok, start, -1), tl.where(ok, start, 0).to(tl.int64) * stride_t


@triton.jit
def merge_splits(o_ptrs, lse_ptrs, stride_os, stride_ls, row_ok, d_ok, n_splits, SINK, heads,
                 HAS_SINK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """Rows' partial outputs o_ptrs [BLOCK_R, BLOCK_D] and LSEs lse_ptrs [BLOCK_R] of split 0
    (split s at + s * stride_os / stride_ls) merged over n_splits: (out, lse). BLOCK_C splits a
    load, their weights rescaled online; empty splits (lse -inf) weigh 0, all empty gives out
    0, lse -inf. HAS_SINK: the rows' sinks (SINK + heads) join as one more split with no value
    (the start: max = the sink, weight 1). Loads bypass L1 (.cg): under MERGE other programs
    wrote the partials."""
    c = tl.arange(0, BLOCK_C)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_SINK:
        m = tl.load(SINK + heads, mask=row_ok, other=float("-inf")).to(tl.float32)
        total = tl.where(m == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_C):
        s = s0 + c
        s_ok = s < n_splits
        lses = tl.load(lse_ptrs[None, :] + s[:, None] * stride_ls,
                       mask=s_ok[:, None] & row_ok[None, :], other=float("-inf"),
                       cache_modifier=".cg")                          # [BLOCK_C, BLOCK_R]
        parts = tl.load(o_ptrs[None, :, :] + s[:, None, None] * stride_os,
                        mask=s_ok[:, None, None] & row_ok[None, :, None] & d_ok[None, None, :],
                        other=0.0, cache_modifier=".cg")              # [BLOCK_C, BLOCK_R, BLOCK_D]
        m_new = tl.maximum(m, tl.max(lses, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)        # no -inf - -inf
        alpha = tl.math.exp2((m - m_safe) * LOG2E)
        w = tl.math.exp2((lses - m_safe[None, :]) * LOG2E)           # 0 for empty splits
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(parts * w[:, :, None], 0)
        m = m_new
    total_safe = tl.where(total == 0.0, 1.0, total)                  # 0: every split empty
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return (acc / total_safe[:, None],
            tl.where(total == 0.0, float("-inf"), m_safe + tl.log2(total_safe) * LN2))


@triton.jit
def _attn_merge_kernel(
    O_PART, LSE_PART, OUT, LSE, SINK,
    TL,  # None, or a timeline (common.mark): start, after the wait, stores, end, SM
    CU_Q,  # None, or packed queries: OUT (TOTAL_Q, H, D), LSE (H, TOTAL_Q) (_attn_decode_kernel)
    stride_os, stride_ls, stride_ob, stride_ot, stride_oh,
    H, SQ, N_SPLITS, HEAD_DIM, TOTAL_Q, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """Partials O_PART (S, B, H, SQ, D) fp32 and LSE_PART (S, B, H, SQ), contiguous; OUT
    (B, SQ, H, D) strided; LSE (B, H, SQ) contiguous, or None (no LSE wanted); HAS_SINK: the
    heads' sinks at SINK (H,) join the merge."""
    pid = tl.program_id(0).to(tl.int64)                              # ((b * H) + h) * SQ + t
    mark(TL, pid, 0)
    mark(TL, pid, 4)
    t = pid % SQ
    bh = pid // SQ
    b = bh // H
    h = bh % H
    row = tl.arange(0, 1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if PDL:  # launched while the split kernel runs: wait until its partials are written
        gdc_wait()
    out_at = b * stride_ob + t * stride_ot
    lse_at = pid
    if CU_Q is not None:
        q_start, out_at = packed_rows(CU_Q, b, SQ, TOTAL_Q, stride_ot)
        if q_start < 0:  # not a sequence of SQ queries: the split kernel wrote no partials
            return
        out_at += t * stride_ot
        lse_at = h * TOTAL_Q + q_start + t
    mark(TL, pid, 1)
    out, lse = merge_splits(O_PART + (pid + row)[:, None] * HEAD_DIM + offs_d[None, :],
                            LSE_PART + pid + row, stride_os, stride_ls, row == 0, d_ok,
                            N_SPLITS, SINK, h + row, HAS_SINK, 1, BLOCK_D, BLOCK_C)
    tl.store(OUT + out_at + h * stride_oh + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=d_ok[None, :])
    if LSE is not None:
        tl.store(LSE + lse_at + row, lse)
    mark(TL, pid, 2)
    mark(TL, pid, 3)


@triton.jit
def _kv_append_kernel(
    K_NEW, V_NEW, K_CACHE, V_CACHE, CACHE_SEQLENS, BLOCK_TABLE, BATCH_IDX, K_DESCALE, V_DESCALE,
    stride_knb, stride_knt, stride_knh,
    stride_vnb, stride_vnt, stride_vnh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt, stride_kdb, stride_kdh, stride_vdb, stride_vdh, S_NEW, HKV, HEAD_DIM, ROWS,
    CAPACITY, FP8_MAX,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    QUANTIZE: tl.constexpr, ROUND_FIRST: tl.constexpr, MANTISSA: tl.constexpr,
    MIN_EXP: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """K_NEW / V_NEW (B, S_NEW, HKV, D) into K_CACHE / V_CACHE (ROWS rows or pages, CAPACITY
    positions a sequence) at positions CACHE_SEQLENS[b] + i, in place. QUANTIZE (an fp8 cache,
    new rows in q's dtype): each value / its descale (K_DESCALE, V_DESCALE float32 at
    b * stride_kdb + kv head * stride_kdh, V's alike), saturated to +-FP8_MAX, rounded to the
    cache's fp8."""
    off_b = tl.program_id(0) // S_NEW
    i = tl.program_id(0) % S_NEW
    off_h = tl.program_id(1).to(tl.int64)
    pos = tl.load(CACHE_SEQLENS + off_b) + i
    ok = (pos >= 0) & (pos < CAPACITY)
    pos = tl.where(ok, pos, 0).to(tl.int64)
    if PAGED:
        page = tl.load(BLOCK_TABLE + off_b.to(tl.int64) * stride_bt + pos // PAGE_SIZE).to(tl.int64)
        ok = ok & (page >= 0) & (page < ROWS)
        k_row = page * stride_kb + (pos % PAGE_SIZE) * stride_kt
        v_row = page * stride_vb + (pos % PAGE_SIZE) * stride_vt
    else:
        row = off_b.to(tl.int64)
        if HAS_BATCH_IDX:
            row = tl.load(BATCH_IDX + off_b).to(tl.int64)
            ok = ok & (row >= 0) & (row < ROWS)
        k_row = row * stride_kb + pos * stride_kt
        v_row = row * stride_vb + pos * stride_vt
    d = tl.arange(0, BLOCK_D)
    m = (d < HEAD_DIM) & ok
    src = off_b.to(tl.int64) * stride_knb + i.to(tl.int64) * stride_knt + off_h * stride_knh
    k = tl.load(K_NEW + src + d, mask=m)
    src = off_b.to(tl.int64) * stride_vnb + i.to(tl.int64) * stride_vnt + off_h * stride_vnh
    v = tl.load(V_NEW + src + d, mask=m)
    if QUANTIZE:
        k = _quantize(k, tl.load(K_DESCALE + off_b * stride_kdb + off_h * stride_kdh), FP8_MAX,
                      K_CACHE.dtype.element_ty, ROUND_FIRST, MANTISSA, MIN_EXP)
        v = _quantize(v, tl.load(V_DESCALE + off_b * stride_vdb + off_h * stride_vdh), FP8_MAX,
                      V_CACHE.dtype.element_ty, ROUND_FIRST, MANTISSA, MIN_EXP)
    tl.store(K_CACHE + k_row + off_h * stride_kh + d, k, mask=m)
    tl.store(V_CACHE + v_row + off_h * stride_vh + d, v, mask=m)


@triton.jit
def _quantize(x, descale, fp8_max, dtype: tl.constexpr, ROUND_FIRST: tl.constexpr,
              MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """x / descale saturated to +-fp8_max and rounded to the nearest fp8 of ``dtype`` (ties to
    even, as torch's cast). ROUND_FIRST (the interpreter, whose cast loses the carry when a
    mantissa rounds up into the next power of two): rounded in fp32 on the fp8 grid of
    MANTISSA bits and smallest normal exponent MIN_EXP first, then cast exactly."""
    x = tl.clamp(x.to(tl.float32) / descale, -fp8_max, fp8_max)
    if ROUND_FIRST:
        ulp = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(x), 1e-30))), MIN_EXP)
                      - MANTISSA)
        y = x / ulp
        r = tl.floor(y + 0.5)
        r = tl.where((r - y == 0.5) & (r % 2 != 0), r - 1, r)  # ties to even
        x = tl.where(r == 0, x * 0.0, r * ulp)  # zeros keep x's sign
    return x.to(dtype)


@triton.jit(do_not_specialize=["B", "SQ", "S", "ROWS", "SEG"])
def _cache_spans_kernel(
    CACHE_SEQLENS, BATCH_IDX, LEFTPAD, SPANS, B, SQ, S, ROWS, SEG,
    HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """The prefill forward's Varlen over a contiguous cache seen as (ROWS * S) key rows:
    SPANS[0:B + 1] = b * SQ (the packed queries' offsets), SPANS[SEG + b] = the first key row
    of sequence b (cache row * S + left padding), SPANS[2 * SEG + b] = its keys (seqused_k).
    A length, row or left padding outside the cache gives the sequence no keys."""
    b = tl.arange(0, BLOCK_B)
    live = b < B
    n = tl.load(CACHE_SEQLENS + b, mask=live, other=0)
    ok = (n >= 0) & (n <= S)
    row = b
    if HAS_BATCH_IDX:
        row = tl.load(BATCH_IDX + b, mask=live, other=0)
        ok = ok & (row >= 0) & (row < ROWS)
    pad = tl.zeros([BLOCK_B], dtype=tl.int32)
    if HAS_LEFTPAD:
        pad = tl.load(LEFTPAD + b, mask=live, other=0)
        ok = ok & (pad >= 0) & (pad <= n)
    tl.store(SPANS + b, b * SQ, mask=b <= B)
    tl.store(SPANS + SEG + b, tl.where(ok, row * S + pad, 0), mask=live)
    tl.store(SPANS + 2 * SEG + b, tl.where(ok, n - pad, 0), mask=live)
