"""Forward kernel: FlashAttention-2 tiling with online softmax.

One program per (query block, batch * head), the block in two halves of BLOCK_M / 2 rows
whose products and softmaxes interleave (_attn_fwd_inner; SPLIT, while BLOCK_D + BLOCK_DV <=
256: at head dim 256 the two halves' q and accumulators do not fit the registers and one half
is faster).
S and P exist only as (BLOCK_M / 2, BLOCK_N) register tiles; the program writes O and the
natural-log LSE of each row. Rows that see no key get O = 0 and LSE = -inf.

Variants (constexpr): IS_VARLEN (packed sequences delimited by CU_Q / CU_K, SEQUSED_K
not None: per-sequence key counts; 3: keys in pages of PAGE_SIZE rows, sequence b's in the
pages BLOCK_TABLE[b], as flash-attn's paged varlen and vLLM lay them out; 4: 3 without the
sequences of one query, which the split-KV decoding kernel computes in the same call),
HAS_LOWER / HAS_UPPER (window bounds; causal is HAS_UPPER with WIN_RIGHT = 0),
HAS_SOFTCAP, HAS_ALIBI, EVEN_D / EVEN_DV (the head dims HEAD_DIM of q and k, HEAD_DIM_V of v
and O, which differ for MLA, are their powers of two BLOCK_D / BLOCK_DV), USE_TMA (K and V by
tensor descriptor: TMA on Hopper),
HAS_SINK (SINK: one logit per query head that joins every row's softmax denominator and has
no value: O = sum_j p_j v_j / (sum_j p_j + exp(sink)), LSE over the keys and the sink),
INVARIANT (the fully visible key tiles through the masked softmax too: one arithmetic for every
tile, so a row's bits do not depend on which tiles its query block sees whole; tiles that a
row does not see at all leave its state exactly as it was).
"""

import triton
import triton.language as tl

from .common import (KV, LOG2E, Scores, Seq, Variant, apply_attn_mask, dropout_keep, heavy_first,
                     load_kv, load_tile, row_source, scores, seq_bounds, store_tile)
from .mask import kv_range, rows_hi, visible
from .softmax import add_sink, finalize, init_rows, online_softmax

GATHER_TILES = tl.constexpr(64)  # key tiles a chunk of paged keys read by pointers


@triton.jit
def _softmax_step(qk, acc, l_i, m_i, rows, cols, seq, sc, var, HAS_LOWER: tl.constexpr,
                  HAS_UPPER: tl.constexpr, MASK_MOD: tl.constexpr, MASK: tl.constexpr):
    """One key block of the online softmax for some query rows: P (fp32, to multiply V) and
    the running acc, l, m after it. MASK: the bounds HAS_LOWER / HAS_UPPER and the keys' end
    checked."""
    PLAIN: tl.constexpr = (not var.HAS_SOFTCAP and not var.HAS_ALIBI and var.SCORE_MOD is None
                           and var.MASK_KIND == 0 and MASK_MOD is None)
    if PLAIN and not MASK:
        # Plain scores, no mask: the scale (>= 0 here) goes into the row max and into one
        # FMA per score, instead of a multiply and a subtract. No branch here (a lazy
        # rescale of acc was one): a branch makes the compiler wait for every product in
        # flight, which ends the overlap of the two halves (see _attn_fwd_inner).
        p, acc, l_i, m_i = online_softmax(qk, acc, m_i, l_i, sc.qk_scale, True)
    else:
        s, _ = scores(qk, rows, cols, sc.qk_scale, sc.cap2, sc.slope2, sc.alibi_at,
                      var.HAS_SOFTCAP, var.HAS_ALIBI)
        if var.SCORE_MOD is not None:  # natural-log score in (qk_scale: the plain scale), log2 out
            s = var.SCORE_MOD(s, sc.off_b, sc.off_h, rows[:, None], cols[None, :]) * LOG2E
        s = apply_attn_mask(s, sc.mask_base, rows, cols, seq.SQ, seq.SK, sc.stride_mm,
                            sc.stride_mn, var.MASK_KIND)
        if MASK_MOD is not None:
            s = tl.where(MASK_MOD(sc.off_b, sc.off_h, rows[:, None], cols[None, :]), s,
                         float("-inf"))
        if MASK:
            # rows past SQ are never stored: only the keys' end is checked
            s = tl.where(visible(rows, cols, seq.SQ, seq.SK, seq.LOWER, seq.UPPER, HAS_LOWER,
                                 HAS_UPPER, False, 1), s, float("-inf"))
        p, acc, l_i, m_i = online_softmax(s, acc, m_i, l_i, 1.0, False)
    if var.HAS_DROPOUT:  # after the denominator: dropout acts on the normalised P
        keep = dropout_keep(sc.seed, sc.rng_bh, rows, cols, sc.dropout_p, False)
        p = tl.where(keep, p * (1.0 / (1.0 - sc.dropout_p)), 0.0)
    return p, acc, l_i, m_i


@triton.jit
def _attn_fwd_tiles(acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, rows_a, rows_b, kv, pages,
                    chunk_lo, lo, hi, blk_list, seq, sc, var, HAS_LOWER: tl.constexpr,
                    HAS_UPPER: tl.constexpr, MASK_MOD: tl.constexpr, MASK: tl.constexpr,
                    SPLIT: tl.constexpr, LISTED: tl.constexpr):
    """Key blocks lo..hi for the two row halves a and b of the query block. Both q k^T
    products are issued before the first softmax, so that the tensor cores compute half b's
    scores (and then half a's P V) while the other half's softmax runs: the overlap FA3 gets
    from its warpgroups, within one program (Triton 3.6 waits for a product right before its
    first use, and ptxas interleaves the next product's issue with the exp2s). Without
    SPLIT, half a is the whole block and b is untouched. LISTED: lo..hi count through the
    key blocks (of SPARSE keys) that blk_list names, one flat loop for the pipeliner.
    PAGE_SIZE > 0: the keys and values sit in pages (common.load_kv; ``pages``: the
    sequence's block-table row, or under a gather the page of each key from ``chunk_lo`` on,
    _attn_fwd_inner's chunk)."""
    for it in range(lo, hi, var.BLOCK_N):
        start_n = it
        if LISTED:
            start_n = tl.load(blk_list + it // var.SPARSE) * var.SPARSE + it % var.SPARSE
        cols = start_n + kv.offs_n                                   # [BLOCK_N]
        k = load_kv(kv.k, pages, chunk_lo, start_n, kv.offs_n, kv.stride_kt, kv.stride_kp, seq.SK,
                    kv.NUM_PAGES, kv.offs_d, kv.HEAD_DIM, MASK, not var.EVEN_D, var.USE_TMA,
                    var.PAGE_SIZE, var.BLOCK_N)                      # [BLOCK_N, BLOCK_D]
        v = load_kv(kv.v, pages, chunk_lo, start_n, kv.offs_n, kv.stride_vt, kv.stride_vp, seq.SK,
                    kv.NUM_PAGES, kv.offs_dv, kv.HEAD_DIM_V, MASK, not var.EVEN_DV, var.USE_TMA,
                    var.PAGE_SIZE, var.BLOCK_N)                      # [BLOCK_N, BLOCK_DV]
        if var.UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk_a = tl.dot(q_a, tl.trans(k), input_precision=var.DOT_PREC)  # [HALF, BLOCK_N]
        if SPLIT:
            qk_b = tl.dot(q_b, tl.trans(k), input_precision=var.DOT_PREC)
        p, acc_a, l_a, m_a = _softmax_step(qk_a, acc_a, l_a, m_a, rows_a, cols, seq, sc, var,
                                           HAS_LOWER, HAS_UPPER, MASK_MOD, MASK)
        acc_a = tl.dot(p.to(v.dtype), v, acc_a, input_precision=var.DOT_PREC)
        if SPLIT:
            p, acc_b, l_b, m_b = _softmax_step(qk_b, acc_b, l_b, m_b, rows_b, cols, seq, sc, var,
                                               HAS_LOWER, HAS_UPPER, MASK_MOD, MASK)
            acc_b = tl.dot(p.to(v.dtype), v, acc_b, input_precision=var.DOT_PREC)
    return acc_a, l_a, m_a, acc_b, l_b, m_b


@triton.jit
def _attn_fwd_inner(acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, rows_a, rows_b, kv, pages, lo, hi,
                    blk_list, seq, sc, var, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
                    MASK_MOD: tl.constexpr, MASK: tl.constexpr, SPLIT: tl.constexpr,
                    LISTED: tl.constexpr):
    """Key blocks lo..hi (_attn_fwd_tiles). Paged keys read by pointers: in chunks of
    GATHER_TILES tiles (or a page), each chunk's pages loaded once before its tiles, so that no
    load inside the pipelined loop feeds the addresses of the key and value loads (Triton's
    pipeliner then prefetches them num_stages - 1 tiles ahead, as for contiguous keys; with
    the block table read in the loop it prefetched one)."""
    PAGE_SIZE: tl.constexpr = var.PAGE_SIZE
    if PAGE_SIZE > 0 and not var.USE_TMA:
        # chunks start at multiples of CHUNK, a multiple of PAGE_SIZE: whole pages
        CHUNK: tl.constexpr = (GATHER_TILES * var.BLOCK_N if GATHER_TILES * var.BLOCK_N
                               >= PAGE_SIZE else PAGE_SIZE)
        n_entries = tl.cdiv(seq.SK, PAGE_SIZE)  # the sequence's pages in its block-table row
        for chunk_lo in range(lo // CHUNK * CHUNK, hi, CHUNK):
            entries = chunk_lo // PAGE_SIZE + tl.arange(0, CHUNK // PAGE_SIZE)
            chunk = tl.load(pages + entries, mask=entries < n_entries, other=0)
            acc_a, l_a, m_a, acc_b, l_b, m_b = _attn_fwd_tiles(
                acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, rows_a, rows_b, kv, chunk, chunk_lo,
                tl.maximum(chunk_lo, lo), tl.minimum(chunk_lo + CHUNK, hi), blk_list, seq, sc,
                var, HAS_LOWER, HAS_UPPER, MASK_MOD, MASK, SPLIT, LISTED)
    else:
        acc_a, l_a, m_a, acc_b, l_b, m_b = _attn_fwd_tiles(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, rows_a, rows_b, kv, pages, 0, lo, hi,
            blk_list, seq, sc, var, HAS_LOWER, HAS_UPPER, MASK_MOD, MASK, SPLIT, LISTED)
    return acc_a, l_a, m_a, acc_b, l_b, m_b


@triton.jit
def _store_rows(acc, l_i, m_i, rows, o_base, stride_ot, lse_base, SQ, offs_d, HEAD_DIM, sink2,
                EVEN_D: tl.constexpr, HAS_SINK: tl.constexpr):
    """O = acc / l and the natural-log LSE of some rows (rows without keys: 0 and -inf).
    HAS_SINK: the sink's log2 logit ``sink2`` joins l (rows without keys: 0 and the sink)."""
    if HAS_SINK:
        acc, l_i, m_i = add_sink(acc, l_i, m_i, sink2)
    out, lse = finalize(acc, l_i, m_i)
    store_tile(o_base + rows.to(tl.int64)[:, None] * stride_ot + offs_d[None, :],
               out.to(o_base.dtype.element_ty), rows, SQ, offs_d, HEAD_DIM, not EVEN_D)
    tl.store(lse_base + rows, lse, mask=rows < SQ)


# a new seed per call, and varlen's packed totals: one compiled kernel
@triton.jit(do_not_specialize=["seed", "TOTAL_Q", "TOTAL_K", "NUM_PAGES"])
def _attn_fwd_kernel(
    Q, K, V, O, LSE, ALIBI, AMASK, CU_Q, CU_K, SEQUSED_K, BMASK, SINK, BLOCK_TABLE,
    stride_q, stride_k, stride_v, stride_o,  # (batch, token, head) strides
    stride_lse, stride_alibi,  # (batch, head)
    stride_mask,  # (batch, head, query, key)
    stride_bmask, BM_N, stride_tb,  # (batch, head, block), BMASK's other block count, table's
    H, GROUP, SQ, SK, TOTAL_Q, TOTAL_K, NUM_PAGES, HEAD_DIM, HEAD_DIM_V, WIN_LEFT, WIN_RIGHT,
    qk_scale, cap2, sm_scale,
    dropout_p, seed,
    SQ_BUCKET, SK_BUCKET,  # autotuning key only
    IS_VARLEN: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_DV: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
    MASK_MOD: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, SPARSE: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, HAS_SINK: tl.constexpr,
    PAGE_SIZE: tl.constexpr, INVARIANT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    stride_qb, stride_qt, stride_qh = stride_q
    stride_kb, stride_kt, stride_kh = stride_k
    stride_vb, stride_vt, stride_vh = stride_v
    stride_ob, stride_ot, stride_oh = stride_o
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
        if IS_VARLEN == 4:  # one-query sequences: the split-KV decoding kernel's
            if SQ == 1:
                return

    # two halves while q and the accumulator fit (at D=256 the split ran slower: docs/perf.md)
    SPLIT: tl.constexpr = BLOCK_D + BLOCK_DV <= 256
    HALF: tl.constexpr = BLOCK_M // (1 + SPLIT)
    rows_a = start_m + tl.arange(0, HALF)                            # [HALF] each
    rows_b = rows_a + HALF
    offs_n = tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)                                   # [BLOCK_D]
    offs_dv = tl.arange(0, BLOCK_DV)                                 # [BLOCK_DV]: V and O
    q_base = Q + off_b * stride_qb + q_off * stride_qt + off_h * stride_qh
    # paged: TMA over the pool's rows (pages of PAGE_SIZE rows: the launcher checks) where a
    # tile lies in one page
    TMA_KV: tl.constexpr = USE_TMA and (PAGE_SIZE == 0 or PAGE_SIZE >= BLOCK_N)
    if PAGE_SIZE > 0:  # K, V (pages, PAGE_SIZE, HKV, D): stride_kb / stride_vb step pages
        pages = BLOCK_TABLE + off_b * stride_tb
        k_base = K + off_hk * stride_kh
        v_base = V + off_hk * stride_vh
        k_base = row_source(k_base, NUM_PAGES * PAGE_SIZE, stride_kt, HEAD_DIM, BLOCK_N, BLOCK_D,
                            TMA_KV)
        v_base = row_source(v_base, NUM_PAGES * PAGE_SIZE, stride_vt, HEAD_DIM_V, BLOCK_N,
                            BLOCK_DV, TMA_KV)
    else:
        pages = BLOCK_TABLE
        k_base = K + off_b * stride_kb + k_off * stride_kt + off_hk * stride_kh
        v_base = V + off_b * stride_vb + k_off * stride_vt + off_hk * stride_vh
        k_base = row_source(k_base, SK, stride_kt, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        v_base = row_source(v_base, SK, stride_vt, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)

    q_a = load_tile(q_base + rows_a.to(tl.int64)[:, None] * stride_qt + offs_d[None, :], rows_a,
                    SQ, offs_d, HEAD_DIM, True, not EVEN_D)          # [HALF, BLOCK_D]
    q_b = q_a
    if SPLIT:
        q_b = load_tile(q_base + rows_b.to(tl.int64)[:, None] * stride_qt + offs_d[None, :],
                        rows_b, SQ, offs_d, HEAD_DIM, True, not EVEN_D)
    if UPCAST:
        q_a = q_a.to(tl.float32)
        q_b = q_b.to(tl.float32)
    # A negative scale moves onto q (negation is exact): the loops see qk_scale >= 0.
    q_a = tl.where(qk_scale < 0, -q_a, q_a)
    q_b = tl.where(qk_scale < 0, -q_b, q_b)
    qk_scale = tl.abs(qk_scale)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + off_b * stride_ab + off_h * stride_ah) * LOG2E
    mask_base = AMASK
    if MASK_KIND != 0:
        mask_base = AMASK + off_b * stride_mb + off_h * stride_mh
    rng_bh = (off_b * H + off_h).to(tl.int32)
    acc_a, l_a, m_a = init_rows(HALF, BLOCK_DV)
    m_b, l_b, acc_b = m_a, l_a, acc_a

    seq = Seq(SQ, SK, LOWER, UPPER, DIAG)
    sc = Scores(qk_scale, cap2, slope2, DIAG, mask_base, stride_mm, stride_mn, seed, rng_bh,
                dropout_p, off_b, off_h)
    var = Variant(HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, HAS_DROPOUT, SCORE_MOD, SCORE_GRAD, EVEN_D,
                  EVEN_DV, DOT_PREC, UPCAST, TMA_KV, PAGE_SIZE, False, SPARSE, BLOCK_M, BLOCK_N)
    kv = KV(k_base, v_base, stride_kt, stride_vt, stride_kb, stride_vb, NUM_PAGES, offs_n,
            offs_d, offs_dv, HEAD_DIM, HEAD_DIM_V)
    if HAS_BLOCK_MASK:
        # key blocks of this query block: n_partial, n_full, partial indices, full indices
        blocks = BMASK + off_b * stride_bb + off_h * stride_bh + (start_m // SPARSE) * stride_bq
        # Full blocks (no mask_mod), then partial ones; each list in one flat loop. Sub-blocks
        # past the end of the keys (a ragged last block) are masked by MASK.
        acc_a, l_a, m_a, acc_b, l_b, m_b = _attn_fwd_inner(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, rows_a, rows_b, kv, pages, 0,
            tl.load(blocks + 1) * SPARSE, blocks + 2 + BM_N, seq, sc, var, HAS_LOWER, HAS_UPPER,
            None, True, SPLIT, True)
        acc_a, l_a, m_a, acc_b, l_b, m_b = _attn_fwd_inner(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, rows_a, rows_b, kv, pages, 0,
            tl.load(blocks) * SPARSE, blocks + 2, seq, sc, var, HAS_LOWER, HAS_UPPER, MASK_MOD,
            True, SPLIT, True)
    else:
        lo, full_lo, full_hi, hi = kv_range(start_m, SK, LOWER, UPPER, HAS_LOWER, HAS_UPPER,
                                            BLOCK_M, BLOCK_N)
        # Masked blocks at the window's left edge, fully visible blocks, masked blocks at the
        # right edge (the causal diagonal and the ragged end of the keys). The right edge's
        # blocks start at or past every row's lower bound (kv_range's full_lo): they check the
        # upper bound only (HAS_LOWER False there).
        acc_a, l_a, m_a, acc_b, l_b, m_b = _attn_fwd_inner(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, rows_a, rows_b, kv, pages, lo, full_lo,
            BMASK, seq, sc, var, HAS_LOWER, HAS_UPPER, MASK_MOD, True, SPLIT, False)
        acc_a, l_a, m_a, acc_b, l_b, m_b = _attn_fwd_inner(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, rows_a, rows_b, kv, pages, full_lo,
            full_hi, BMASK, seq, sc, var, HAS_LOWER, HAS_UPPER, MASK_MOD, INVARIANT, SPLIT, False)
        mid = hi
        if SPLIT and HAS_UPPER:
            mid = rows_hi(start_m, HALF, SK, UPPER, full_hi, hi, BLOCK_N)
        acc_a, l_a, m_a, acc_b, l_b, m_b = _attn_fwd_inner(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, rows_a, rows_b, kv, pages, full_hi, mid,
            BMASK, seq, sc, var, False, HAS_UPPER, MASK_MOD, True, SPLIT, False)
        # Past half a's last visible key (the causal diagonal of its rows) only half b runs:
        # the b state goes in as the "a" arguments of a one-half (SPLIT=False) loop.
        if SPLIT and HAS_UPPER:
            acc_b, l_b, m_b, _, _, _ = _attn_fwd_inner(
                acc_b, l_b, m_b, acc_b, l_b, m_b, q_b, q_b, rows_b, rows_b, kv, pages, mid, hi,
                BMASK, seq, sc, var, False, HAS_UPPER, MASK_MOD, True, False, False)

    o_base = O + off_b * stride_ob + q_off * stride_ot + off_h * stride_oh
    lse_base = LSE + off_b * stride_lb + off_h * stride_lh + q_off
    sink2 = 0.0
    if HAS_SINK:
        sink2 = tl.load(SINK + off_h).to(tl.float32) * LOG2E
    _store_rows(acc_a, l_a, m_a, rows_a, o_base, stride_ot, lse_base, SQ, offs_dv, HEAD_DIM_V,
                sink2, EVEN_DV, HAS_SINK)
    if SPLIT:
        _store_rows(acc_b, l_b, m_b, rows_b, o_base, stride_ot, lse_base, SQ, offs_dv, HEAD_DIM_V,
                    sink2, EVEN_DV, HAS_SINK)
