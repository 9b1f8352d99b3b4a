"""Hopper forward in Gluon (experimental): the softmax of one key block overlaps the P V
product of the block before it (FlashAttention-3's intra-warpgroup pipelining).

Triton 3.6 places each product next to its first use and waits for q k^T before the
softmax, so the tensor cores idle while the exp2s run (docs/perf.md, "Overlapping the softmax
with the next q k^T"). Gluon exposes the asynchronous wgmma and its wait: iteration j issues
S_j = Q K_j^T and O += P_{j-1} V_{j-1}, waits for S_j only, runs the softmax of S_j while the
P V product runs, then waits for it and rescales O (_step). K and V come by TMA into a ring of
NUM_STAGES slots, each with a "full" mbarrier.

The kernel is warp-specialized (FA3's layout): a producer partition (4 warps, few registers)
streams Q, then K and V into the ring; two consumer warpgroups own 64 rows each (_attend) and
release a slot through its "empty" mbarrier, so while one consumer runs its softmax the other
can use the tensor cores. At head dim 64 three consumers share a program's 192 rows over key
blocks of 64 (CONSUMERS; a 64 x 128 S at 160 registers a thread spills). (A plain 8-warp
kernel with the same body, each warp refilling the slots itself, ran slower:
docs/journal/perf-journal.md.)

Scope: bf16 / fp16, head dims 64, 128 and 256 and those under them (80, 96, 112 and 192 in
128- and 256-wide tiles whose extra columns TMA fills with zeros), (B, N, H, D) tensors whose
token rows form a 2-D (B * N) x (heads * D) view with any row stride, GQA (K and V with
H / GROUP heads), SQ == SK;
plain or causal, and (launch.attention_forward_gluon, or attention_forward with
launch.GLUON_VARIANTS) windows, softcap, ALiBi and block masks of 128-blocks (not at head dim
256). launch.attention_forward runs it where a call fits (Hopper, configs.GLUON_FWD_HEAD_DIMS:
launch.gluon_misfit) and launch.attention_forward_gluon raises for anything else; the kernel
static_asserts its tiles (128 x 128, 128 x 64 at head dim 256, 192 x 64 at head dim 64, 4-warp
partitions; configs.gluon_fwd_block_m and configs.gluon_fwd_block_n hold them for the launcher).
The mask is kernels.mask.visible_by_row (beside the Triton kernels' visible); the slots of
its scalar tuple are kernels/gluon/common.py's. Gluon does not run in the interpreter:
tools/compile_check.py compiles it for sm_90 on any machine, and tests/test_gluon.py runs it
on a Hopper GPU.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ..common import LOG2E, alibi_part, scores
from ..mask import kv_range, visible_by_row
from .common import (LIST_BLOCK, LST_FULL, LST_ROW, LST_WIDTH, VAR_BATCH, VAR_CAP2, VAR_HEAD,
                     VAR_SINK2,
                     VAR_KEY0, VAR_LOWER, VAR_QUERY0, VAR_SLOPE2, VAR_UPPER, grid_order,
                     load_rows, store_rows, tile_layout, tile_shape)


@gluon.jit
def _load(desc, bars, smem, row, col, j, NUM_STAGES: gl.constexpr):
    """TMA of ring block j (rows from row of the 2-D view, columns from col) into its ring
    slot, completing on the slot's mbarrier."""
    slot = j % NUM_STAGES
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes)
    load_rows(desc, row, col, bars.index(slot), smem.index(slot))


@gluon.jit
def _first_key(j, kv0, lst, BLOCK_N: gl.constexpr, LISTED: gl.constexpr):
    """The first key of ring block j: kv0 + j * BLOCK_N, or (LISTED: a block mask's lists,
    lst (LST_ROW: the query block's row of kv_blocks)) the j-th of its full then partial key
    blocks."""
    if LISTED:
        at = gl.where(j < lst[LST_FULL], 2 + lst[LST_WIDTH] + j, 2 + j - lst[LST_FULL])
        return gl.load(lst[LST_ROW] + at) * BLOCK_N
    else:
        return kv0 + j * BLOCK_N


@gluon.jit
def _wait(bars, j, NUM_STAGES: gl.constexpr):
    """Wait for key block j's slot (its (j // NUM_STAGES)-th completion)."""
    mbarrier.wait(bars.index(j % NUM_STAGES), (j // NUM_STAGES) & 1)


@gluon.jit
def _release(empty, j, NUM_STAGES: gl.constexpr):
    """Key block j's slot has been read by this consumer (the producer waits for both)."""
    mbarrier.arrive(empty.index(j % NUM_STAGES), count=1)


@gluon.jit
def _step(j, q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, p, acc, m_i, l_i,
          rows, offs_n, s_zero, SEQ, qk_scale, var, lst, p_layout: gl.constexpr,
          alpha_layout: gl.constexpr, IS_CAUSAL: gl.constexpr, MASK: gl.constexpr,
          NUM_STAGES: gl.constexpr, HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr,
          HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, LISTED: gl.constexpr,
          MASK_MOD: gl.constexpr):
    """Key block j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued in that order, then the
    softmax of S_j while P V runs, then O rescaled. No branch from the first issue to the
    last wait (a branch between an asynchronous wgmma and its wait makes ptxas wait at the
    join). offs_n: 0 .. BLOCK_N - 1; the block's keys start at _first_key."""
    _wait(k_full, j, NUM_STAGES)
    s = warpgroup_mma(q_smem, k_smem.index(j % NUM_STAGES).permute((1, 0)), s_zero,
                      use_acc=False, is_async=True)
    _wait(v_full, j - 1, NUM_STAGES)
    acc = warpgroup_mma(gl.convert_layout(p.to(q_smem.dtype), p_layout),
                        v_smem.index((j - 1) % NUM_STAGES), acc, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S_j, the older group
    _release(k_empty, j, NUM_STAGES)
    p, m_new, l_i, alpha = _softmax(s, m_i, l_i, rows, _first_key(j, var[VAR_KEY0], lst,
                                                                  s.shape[1], LISTED),
                                    offs_n, SEQ, qk_scale, var, IS_CAUSAL, MASK, HAS_LOWER,
                                    HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, MASK_MOD)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _release(v_empty, j - 1, NUM_STAGES)
    acc = acc * gl.convert_layout(alpha, alpha_layout)[:, None]
    return p, acc, m_new, l_i


@gluon.jit
def _softmax(s, m_i, l_i, rows, first, offs_n, SEQ, qk_scale, var, IS_CAUSAL: gl.constexpr,
             MASK: gl.constexpr, HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr,
             HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, MASK_MOD: gl.constexpr):
    """The online softmax of one block of raw dot products s (keys first + offs_n): (P, the
    new max, the new sum, the accumulator's factor). Plain scores keep the scale in the
    exp2's FFMA; softcap and ALiBi scores (common.scores, log2 domain) are formed first, then
    masked (kernels.mask.visible_by_row: keys past SEQ, the causal diagonal or the window,
    MASK_MOD). HAS_ALIBI 2: one-sided ALiBi (every visible key at or left of the diagonal):
    the key part of the bias only, relative to var[VAR_QUERY0] (alibi_lanes, one FFMA a
    column; with softcap common.alibi_part, as softcap's loop has fewer registers to spare:
    its spills 60 / 68 -> 100 / 107 by alibi_lanes); the row part moves into the LSE.
    (kernels/softmax.online_softmax in the wgmma layouts, with the max starting at -inf:
    m_safe keeps exp2's arguments finite.)"""
    cols = first + offs_n
    if HAS_SOFTCAP or HAS_ALIBI == 1:
        s, _ = scores(s, rows, cols, qk_scale, var[VAR_CAP2], var[VAR_SLOPE2], 0, HAS_SOFTCAP,
                      HAS_ALIBI == 1)
        if HAS_ALIBI == 2:
            s = s + alibi_part(cols, var[VAR_QUERY0], var[VAR_SLOPE2])[None, :]
        scale: gl.constexpr = 1.0
    elif HAS_ALIBI == 2:  # one FFMA a score, the keys' part one FFMA a column
        s = gl.fma(s, qk_scale, alibi_lanes(first, offs_n, var[VAR_QUERY0],
                                            var[VAR_SLOPE2])[None, :])
        scale: gl.constexpr = 1.0
    else:
        scale = qk_scale
    if MASK:
        s = gl.where(visible_by_row(rows, cols, SEQ, var[VAR_LOWER], var[VAR_UPPER],
                                    var[VAR_BATCH], var[VAR_HEAD], IS_CAUSAL, HAS_LOWER,
                                    HAS_UPPER, MASK_MOD), s, -float("inf"))
    # m in the scaled (log2) domain; the scale folds into the exp2's argument (one FFMA)
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
    m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s * scale - m_safe[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def alibi_lanes(first, offs, anchor, slope2):
    """common.alibi_part(first + offs, anchor, slope2) for an arange offs along the columns of
    the products' layout, one FFMA a column: offs splits exactly into bits 1-2 and the rest
    (offs = (offs & 6) + (offs & -7)); there bits 1-2 are the lane's part (2 * (lane % 4))
    and the rest a constant of the register, so slope2 times the rest folds into each FFMA
    as an immediate and the lane's part joins one value a thread (VIADD, I2FP and FMUL a
    column otherwise; the same sum in any layout, only slower)."""
    return gl.fma((offs & -7).to(gl.float32), slope2,
                  slope2 * (first - anchor + (offs & 6)).to(gl.float32))


@gluon.jit
def _attend(q_smem, k_smem, v_smem, q_full, k_full, v_full, k_empty, v_empty, O, LSE, off_b,
            off_h, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, tile, SEQ, qk_scale,
            W: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
            HEAD_DIM: gl.constexpr, IS_CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
            HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
            HAS_ALIBI: gl.constexpr, LISTED: gl.constexpr, MASK_MOD: gl.constexpr,
            HAS_SINK: gl.constexpr, DIM: gl.constexpr):
    """A consumer partition (4 warps): rows W * ROWS .. W * ROWS + ROWS - 1 of the program's
    query block (q_smem holds it) over key blocks 0 .. n_blocks - 1 (tile = (blocks, lst,
    var): blocks = (n_blocks, full_lo, full_hi); block j holds the keys from
    _first_key(j); var's slots: gluon/common.py's VAR_*); blocks before full_lo (a window's
    lower edge) and from full_hi on (the causal diagonal, a window's upper edge, the ragged
    end, a block mask's partial blocks) are masked. HAS_SINK: var[VAR_SINK2] joins every
    row's denominator before the store. Stores O and the LSE."""
    WARPS: gl.constexpr = 4
    gl.static_assert(ROWS == 16 * WARPS, "a consumer's rows: one wgmma M of its 4 warps (64)")
    # S and O in the wgmma accumulator layout: 16-row atoms, warps stacked along the rows.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    alpha_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    blocks, lst, var = tile
    n_blocks, full_lo, full_hi = blocks
    q_smem = q_smem.slice(W * ROWS, ROWS, dim=0)
    row_start = var[VAR_QUERY0] + W * ROWS
    rows = row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([ROWS], -float("inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))

    mbarrier.wait(q_full, 0)
    # Block 0: S_0 and its softmax (nothing to overlap with yet).
    _wait(k_full, 0, NUM_STAGES)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    _release(k_empty, 0, NUM_STAGES)
    p, m_i, l_i, _ = _softmax(s, m_i, l_i, rows, _first_key(0, var[VAR_KEY0], lst, BLOCK_N,
                                                            LISTED),
                              offs_n, SEQ, qk_scale, var, IS_CAUSAL, True, HAS_LOWER,
                              HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, MASK_MOD)  # (masked: once)
    # Masked blocks below full_lo, blocks that see every key, masked blocks from full_hi on.
    lo_end = 1
    if HAS_LOWER:
        lo_end = gl.maximum(full_lo, 1)
        for j in range(1, lo_end):
            p, acc, m_i, l_i = _step(j, q_smem, k_smem, v_smem, k_full, v_full, k_empty,
                                     v_empty, p, acc, m_i, l_i, rows, offs_n, s_zero, SEQ,
                                     qk_scale, var, lst, p_layout, alpha_layout, IS_CAUSAL,
                                     True, NUM_STAGES, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP,
                                     HAS_ALIBI, LISTED, MASK_MOD)
    for j in range(lo_end, gl.maximum(full_hi, lo_end)):
        p, acc, m_i, l_i = _step(j, q_smem, k_smem, v_smem, k_full, v_full, k_empty,
                                 v_empty, p, acc, m_i, l_i, rows, offs_n, s_zero, SEQ, qk_scale,
                                 var, lst, p_layout, alpha_layout, IS_CAUSAL, False,
                                 NUM_STAGES, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI,
                                 LISTED, MASK_MOD)
    for j in range(gl.maximum(full_hi, lo_end), n_blocks):
        p, acc, m_i, l_i = _step(j, q_smem, k_smem, v_smem, k_full, v_full, k_empty,
                                 v_empty, p, acc, m_i, l_i, rows, offs_n, s_zero, SEQ, qk_scale,
                                 var, lst, p_layout, alpha_layout, IS_CAUSAL, True,
                                 NUM_STAGES, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI,
                                 LISTED, MASK_MOD)
    # The last block's P V.
    _wait(v_full, n_blocks - 1, NUM_STAGES)
    acc = warpgroup_mma(gl.convert_layout(p.to(q_smem.dtype), p_layout),
                        v_smem.index((n_blocks - 1) % NUM_STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    if HAS_SINK:  # the sink joins the row state (in one-sided ALiBi's shifted units: + part)
        sink2 = gl.zeros_like(l_i) + var[VAR_SINK2]
        if HAS_ALIBI == 2:
            sink2 = sink2 + alibi_part(rows, var[VAR_QUERY0], var[VAR_SLOPE2])
        m_new = gl.maximum(gl.maximum(m_i, sink2), -1.0e30)  # (a -inf sink: no NaN)
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.exp2(sink2 - m_new)
        acc = acc * gl.convert_layout(alpha, alpha_layout)[:, None]
        m_i = m_new
    # O = acc / l; LSE (natural log) = (m + log2 l) * ln 2; rows that saw no key: O 0, -inf.
    l_o = gl.convert_layout(l_i, alpha_layout)
    out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    # Through this group's rows of Q (its last S has read them), whole rows a warp
    # (store_rows: the products' layout writes 16 bytes of 8 rows a store, slower).
    q_smem.store(out.to(q_smem.dtype))
    gl.thread_barrier()  # (this partition's warps)
    store_rows(q_smem, O, off_b * stride_ob + off_h * stride_oh, row_start, stride_ot, SEQ,
               DIM)
    lse2 = m_i + gl.log2(l_i)
    if HAS_ALIBI == 2:  # the rows' part of one-sided ALiBi (see _softmax)
        lse2 = lse2 - alibi_part(rows, var[VAR_QUERY0], var[VAR_SLOPE2])
    lse = gl.where(l_i == 0.0, -float("inf"), lse2 * 0.6931471805599453)
    gl.store(LSE + off_b * stride_lb + off_h * stride_lh + rows, lse, mask=rows < SEQ)


@gluon.jit
def _bounds(start_m, SEQ, LOWER, UPPER, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            IS_CAUSAL: gl.constexpr, HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr):
    """The ring's blocks of query block start_m: (n_blocks, full_lo, full_hi) in ring blocks
    (see _attend), and the first key of ring block 0 (a window's first visible block)."""
    if HAS_LOWER or HAS_UPPER:
        lo, full_lo, full_hi, hi = kv_range(start_m * BLOCK_M, SEQ, LOWER, UPPER, HAS_LOWER,
                                            HAS_UPPER, BLOCK_M, BLOCK_N)
        return ((hi - lo + BLOCK_N - 1) // BLOCK_N, (full_lo - lo) // BLOCK_N,
                (full_hi - lo) // BLOCK_N), lo
    hi = SEQ
    if IS_CAUSAL:
        hi = gl.minimum(SEQ, (start_m + 1) * BLOCK_M)
    first_masked = SEQ // BLOCK_N
    if IS_CAUSAL:
        first_masked = gl.minimum(first_masked, (start_m * BLOCK_M) // BLOCK_N)
    return ((hi + BLOCK_N - 1) // BLOCK_N, 0, first_masked), 0


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, k_full, v_full, k_empty,
             v_empty, q_row, q_col, row0, col, tile, NUM_STAGES: gl.constexpr,
             LISTED: gl.constexpr, BLOCK_M: gl.constexpr):
    """The producer partition: Q of the program's query block, then K and V of its key blocks
    0 .. n_blocks - 1 (block j from row row0 + _first_key(j)) into the ring, each slot once
    both consumers have released it (the empty barriers start released)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    # Q's BLOCK_M rows in loads of the descriptor's block (TMA boxes are powers of two: 192
    # rows take three)
    Q_BLOCK: gl.constexpr = q_desc.block_type.shape[0]
    Q_LOADS: gl.constexpr = BLOCK_M // Q_BLOCK
    mbarrier.expect(q_full, Q_LOADS * q_desc.block_type.nbytes)
    for i in gl.static_range(Q_LOADS):
        load_rows(q_desc, q_row + i * Q_BLOCK, q_col, q_full,
                  q_smem.slice(i * Q_BLOCK, Q_BLOCK, dim=0))
    blocks, lst, var = tile
    n_blocks, _, _ = blocks
    for j in range(n_blocks):
        row = row0 + _first_key(j, var[VAR_KEY0], lst, BLOCK_N, LISTED)
        _wait(k_empty, j, NUM_STAGES)
        _load(k_desc, k_full, k_smem, row, col, j, NUM_STAGES)
        _wait(v_empty, j, NUM_STAGES)
        _load(v_desc, v_full, v_smem, row, col, j, NUM_STAGES)


@gluon.jit
def _attn_fwd_gluon_kernel(q_desc, k_desc, v_desc, O, LSE, ALIBI, BMASK, SINK, stride_ob, stride_ot,
                           stride_oh, stride_lb, stride_lh, stride_ab, stride_ah, stride_bb,
                           stride_bh, stride_bq, BM_N, H, GROUP, SEQ, q_rb, q_rh, q_ch, kv_rb,
                           kv_rh, kv_ch, qk_scale, cap2, LOWER, UPPER,
                           IS_CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr,
                           HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                           LISTED: gl.constexpr, MASK_MOD: gl.constexpr,
                           HEAVY_FIRST: gl.constexpr, ORDER: gl.constexpr,
                           HAS_SINK: gl.constexpr, CONSUMERS: gl.constexpr,
                           DIM: gl.constexpr, num_warps: gl.constexpr):
    """The descriptors view each tensor as 2-D token rows; head h of batch b starts at row
    b * rb + h * rh, column h * ch (tokens-major (B, N, H, D): rb N, rh 0, ch D; heads-major
    (B, H, N, D) memory: rb H * N, rh N, ch 0); DIM: the tensors' head dim, under the tiles'
    width HEAD_DIM where the descriptors are 3-D (common.load_rows: zero columns past DIM,
    O stored at DIM; ch is then 1 or 0, in heads). num_warps (4) is the first consumer's
    warpgroup; the second consumer and the producer are worker partitions of 4 warps each.
    Variants (the launcher's _common): a window (HAS_LOWER / HAS_UPPER: query i sees keys
    i + LOWER .. i + UPPER; causal with a window is HAS_UPPER with UPPER 0, IS_CAUSAL is
    the plain causal kernel), softcap (qk_scale = scale / softcap, cap2 = softcap * log2 e)
    and ALiBi (slopes at ALIBI, per head or per batch and head; HAS_ALIBI 1 the general
    form, 2 the one-sided one where every visible key is at or left of the diagonal, as
    _softmax says); LISTED: a block mask of 128-blocks (flashtriton.block_mask: BMASK's row
    of this query block lists its full then partial key blocks; MASK_MOD(b, h, i, j) on the
    partial ones); HAS_SINK: one sink logit a query head at SINK (_attend). The launch
    constants (CONSUMER_REGS .. ORDER, num_warps): configs.gluon_fwd_options."""
    ROWS: gl.constexpr = 64  # a consumer's rows (one wgmma M of its 4 warps)
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    HEAD_DIM: gl.constexpr = tile_shape(q_desc)[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    # The tiles the kernel is written for (configs.GLUON_FWD_BLOCK_M / _N).
    gl.static_assert(num_warps == 4, "the Gluon forward: num_warps 4 (the first consumer)")
    gl.static_assert(CONSUMERS == 2 or (CONSUMERS == 3 and HEAD_DIM == 64 and not LISTED),
                     "the Gluon forward: 128 query rows a program (two consumers of 64), or 192 "
                     "(three) at head dim 64 without a block mask")
    gl.static_assert(BLOCK_M % q_desc.block_type.shape[0] == 0,
                     "the Gluon forward: Q's descriptor blocks tile the query block")
    gl.static_assert(BLOCK_N == LIST_BLOCK or ((HEAD_DIM == 256 or CONSUMERS == 3) and
                                               BLOCK_N == 64 and not LISTED),
                     "the Gluon forward: key blocks of 128 (a block mask's blocks), or of 64 "
                     "at head dim 256 without a block mask")
    gl.static_assert(HEAD_DIM == 64 or HEAD_DIM == 128 or HEAD_DIM == 256,
                     "the Gluon forward: head dim 64, 128 or 256")
    gl.static_assert(tile_shape(k_desc)[1] == HEAD_DIM and v_desc.block_type.shape[0] ==
                     BLOCK_N and tile_shape(v_desc)[1] == HEAD_DIM and DIM <= HEAD_DIM,
                     "the Gluon forward: K and V blocks of BLOCK_N x HEAD_DIM")
    dtype: gl.constexpr = q_desc.dtype
    heavy_first: gl.constexpr = HEAVY_FIRST and (IS_CAUSAL or (HAS_UPPER and not HAS_LOWER))
    if ORDER == 0:
        start_m = gl.program_id(0)
        if heavy_first:  # (HEAVY_FIRST)
            start_m = gl.num_programs(0) - 1 - start_m
        off_b = gl.program_id(1) // H
        off_h = gl.program_id(1) % H
    else:  # (ORDER) ORDER 1: the query blocks that see a whole window (m >= -LOWER / 128)
        # first, taken last block first as heavy_first takes causal ones (reversed indices)
        nb = gl.num_programs(0)
        whole = nb - gl.minimum(gl.maximum(gl.cdiv(-LOWER, BLOCK_M), 0), nb)
        start_m, bh = grid_order(whole, ORDER)
        if ORDER == 1 or heavy_first:
            start_m = nb - 1 - start_m
        off_b = bh // H
        off_h = bh % H
    off_hk = off_h // GROUP  # K and V: the query head's KV head (GQA)
    col = off_hk * kv_ch
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = gl.load(ALIBI + off_b * stride_ab + off_h * stride_ah) * LOG2E
    sink2 = 0.0
    if HAS_SINK:
        sink2 = gl.load(SINK + off_h).to(gl.float32) * LOG2E
    if LISTED:  # full blocks (unmasked unless SEQ is ragged), then partial ones; at least
        # one block (a query block with none: its first partial slot, all masked by MASK_MOD)
        row = BMASK + off_b * stride_bb + off_h * stride_bh + start_m * stride_bq
        n_full = gl.load(row + 1)
        lst = (row, n_full, BM_N)
        blocks = (gl.maximum(gl.load(row) + n_full, 1), 0,
                  gl.where(SEQ % BLOCK_N == 0, n_full, 0))
        kv0 = 0
    else:
        lst = (0, 0, 0)
        blocks, kv0 = _bounds(start_m, SEQ, LOWER, UPPER, BLOCK_M, BLOCK_N, IS_CAUSAL,
                              HAS_LOWER, HAS_UPPER)
    # the walk as _attend and _produce take it (var: the slots VAR_KEY0 .. VAR_QUERY0)
    tile = (blocks, lst, (kv0, LOWER, UPPER, cap2, slope2, off_b, off_h, start_m * BLOCK_M,
                          sink2))
    row0 = off_b * kv_rb + off_hk * kv_rh

    # (a power of two of rows: 256 for a 192-row block, its last 64 unused)
    Q_ROWS: gl.constexpr = 4 * ROWS if CONSUMERS == 3 else BLOCK_M
    q_smem = gl.allocate_shared_memory(dtype, [Q_ROWS, HEAD_DIM], tile_layout(q_desc.layout))
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM],
                                       tile_layout(k_desc.layout))
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM],
                                       tile_layout(v_desc.layout))
    q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_full, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # released by every consumer
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
        mbarrier.arrive(k_empty.index(i), count=CONSUMERS)  # every slot starts released
        mbarrier.arrive(v_empty.index(i), count=CONSUMERS)
    fence_async_shared()

    # (the partitions written out per consumer count: warp_specialize takes its list as
    # written, and a tuple built in a kernel would turn the constexprs into tensors)
    if CONSUMERS == 3:
        gl.warp_specialize(
            [(_attend, (q_smem, k_smem, v_smem, q_full, k_full, v_full, k_empty, v_empty, O, LSE,
                        off_b, off_h, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, tile,
                        SEQ, qk_scale, 0, ROWS, BLOCK_N, HEAD_DIM, IS_CAUSAL, NUM_STAGES,
                        HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED, MASK_MOD, HAS_SINK,
                        DIM)),
             (_attend, (q_smem, k_smem, v_smem, q_full, k_full, v_full, k_empty, v_empty, O, LSE,
                        off_b, off_h, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, tile,
                        SEQ, qk_scale, 1, ROWS, BLOCK_N, HEAD_DIM, IS_CAUSAL, NUM_STAGES,
                        HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED, MASK_MOD, HAS_SINK,
                        DIM)),
             (_attend, (q_smem, k_smem, v_smem, q_full, k_full, v_full, k_empty, v_empty, O, LSE,
                        off_b, off_h, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, tile,
                        SEQ, qk_scale, 2, ROWS, BLOCK_N, HEAD_DIM, IS_CAUSAL, NUM_STAGES,
                        HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED, MASK_MOD, HAS_SINK,
                        DIM)),
             (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, k_full, v_full,
                         k_empty, v_empty, off_b * q_rb + off_h * q_rh + start_m * BLOCK_M,
                         off_h * q_ch, row0, col, tile, NUM_STAGES, LISTED,
                         BLOCK_M))],
            [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize(
            [(_attend, (q_smem, k_smem, v_smem, q_full, k_full, v_full, k_empty, v_empty, O, LSE,
                        off_b, off_h, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, tile,
                        SEQ, qk_scale, 0, ROWS, BLOCK_N, HEAD_DIM, IS_CAUSAL, NUM_STAGES,
                        HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED, MASK_MOD, HAS_SINK,
                        DIM)),
             (_attend, (q_smem, k_smem, v_smem, q_full, k_full, v_full, k_empty, v_empty, O, LSE,
                        off_b, off_h, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, tile,
                        SEQ, qk_scale, 1, ROWS, BLOCK_N, HEAD_DIM, IS_CAUSAL, NUM_STAGES,
                        HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED, MASK_MOD, HAS_SINK,
                        DIM)),
             (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, k_full, v_full,
                         k_empty, v_empty, off_b * q_rb + off_h * q_rh + start_m * BLOCK_M,
                         off_h * q_ch, row0, col, tile, NUM_STAGES, LISTED,
                         BLOCK_M))],
            [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
