"""Hopper backward in Gluon: FlashAttention-3's warp-specialized form, five products per
block pair.

The Triton backward (kernels.attn_bwd) runs two kernels and seven products per block pair: its
dQ kernel recomputes S and dP so that no program adds into another's dQ (bitwise repeatable).
Here a program owns BLOCK_N (128) keys of one KV head, keeps dK and dV in registers, and walks
the query blocks (BLOCK_M = 64 rows) of every query head of its group. Two consumer
warpgroups own 64 keys each; per query block each runs

    S^T = K Q^T and dP^T = V dO^T       issued together (asynchronous wgmma)
    P^T = exp2(S^T * scale - lse)       while dP^T runs
    dV += P^T dO                        issued, then dS^T = P^T (dP^T - delta) while it runs
    dK += dS^T Q                        issued; dS^T goes to shared memory
    dQ  = dS K                          the columns of its half of the head dim, from both
                                        consumers' dS^T (exchanged through shared memory)

and stages its dQ half; a producer partition (4 warps, few registers) streams Q and dO, and
their rows' LSE and delta, into a two-slot ring by TMA and adds the staged dQ tiles into an
fp32 buffer by TMA bulk reductions (`cp.reduce.async.bulk.tensor`, in L2), so the
tensor-core warps never wait for a reduction (DQ_MODE 2; DQ_MODE 1 keeps the product but
adds nothing: a timing ablation). The sum's order varies from run to run: the backward is
not bitwise repeatable (launch dispatches it unless a deterministic backward is asked for).
A one-kernel, 8-warp form with the same body ran slower than the Triton backward and was
removed (docs/journal/perf-journal.md).

The consumers read the LSE and delta from shared memory where they use them, rather than
holding 32 registers of them through the step: fewer spills (docs/journal/perf-journal.md).
Two forms of the step
(configs.GLUON_BWD_OPTIONS, configs.gluon_bwd_options): EARLY_S issues the next step's S^T
before dQ's staging, so that the product runs while the consumers stage (on where the walk
has an upper bound and three loops, where it measured faster).

The rows of a ragged last query block read the next head's Q and dO rows (the 2-D view has
no per-head bound): the prep kernel pads each head's LSE rows to a multiple of 128 (a block
mask walks both halves of its last 128-row query block) with +inf, so P = dS = 0 there and
they add zeros.

Head dim 256 (SPLIT, above SPLIT_DIM): a consumer's dK and dV of 64 keys would take 256
registers a thread. There a program owns 64 keys, both consumers all of them, and each
consumer the dK and dV columns of its half of the head dim (64 + 64 registers). Each computes
S^T, dP^T, P^T and dS^T of the 64 keys over its half of the step's 64 rows (64 x 32), adds
dV[:, half] += P^T dO[rows, half] and dK[:, half] += dS^T Q[rows, half] from its registers,
stores P^T and dS^T in shared memory (32 KB for both slots), and once the consumers meet adds
the same products over the other consumer's rows from there: the 4 counted products, none
twice. No dQ: the launcher runs the Triton dQ kernel beside it (which recomputes S and dP).
dQ added here from registers by atomics ran at half the rate of the kernel without it, below
the two kernels (docs/perf.md). Both kernels are bitwise repeatable there.

Variants: a window (HAS_LOWER / HAS_UPPER: query i sees keys i + LOWER .. i + UPPER; causal is
HAS_UPPER with UPPER 0), softcap and ALiBi (kernels.common.scores, as the forward), and a block
mask of 128-blocks (LISTED: the key block's row of the transposed lists names its full, then
partial query blocks; MASK_MOD(b, h, i, j) on the partial ones). Each key block walks, per
query head, masked query blocks (a causal or window bound's edge), those that see all its
keys (no mask), then masked ones again (a window's far edge, the ragged end, partial blocks).
The mask is kernels.mask.visible_by_key (beside the Triton kernels' visible); the slots of
its scalar tuple are kernels/gluon/common.py's, the forward's.

Scope: bf16 / fp16, head dims 64, 128 and 256 and those under them (80, 96, 112, 192 as the
forward takes them; attention_backward runs it at
configs.GLUON_BWD_HEAD_DIMS), SQ == SK, GQA, q / k / v / dO in the 2-D token-row views of
launch._token_rows, block masks at 64 and 128; the kernel static_asserts its tiles (64-row
query blocks, 128-key programs (64 at 256), 4-warp partitions; configs.GLUON_BWD_BLOCK_M and
gluon_bwd_block_n hold them for the launcher).
The prep kernel (kernels.attn_bwd) computes the log2 LSE and delta of padded rows and zeroes
the fp32 dQ buffer (where there is one) first. Gluon does not run in the interpreter:
tools/compile_check.py compiles this kernel for sm_90 on any machine, tests/test_gluon.py
runs it on a Hopper GPU.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ..common import LOG2E, alibi_part, scores
from ..mask import q_range, visible_by_key
from .common import (LIST_BLOCK, LST_FULL, LST_ROW, LST_WIDTH, VAR_BATCH, VAR_CAP2, VAR_HEAD,
                     VAR_KEY0, VAR_LOWER, VAR_QUERY0, VAR_SLOPE2, VAR_UPPER, grid_order,
                     load_rows, store_rows, tile_layout, tile_shape)


@builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """dst[coord...] += src (a shared-memory tile) by one TMA bulk reduction (Gluon 3.6 has
    the op, ttng.async_tma_reduce, but no wrapper for it); tma.store_wait covers it."""
    from triton._C.libtriton import ir
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle,
                                              coord, src.handle)


# Head dims above SPLIT_DIM split the head dim between the consumers (module docstring).
SPLIT_DIM = gl.constexpr(128)

# The slots of a program's walk (cnt, m_lo, h0, q_rb, q_rh, q_ch, o_rb, o_rh, o_ch, off_b,
# lst: _block_coords) and of its cfg (ALIBI, stride_ab, stride_ah, SEQ, qk_scale, sm_scale,
# cap2, LOWER, UPPER, the program's first key: _consume), those read by index.
WALK_CNT = gl.constexpr(0)
WALK_M_LO = gl.constexpr(1)
WALK_BATCH = gl.constexpr(9)
CFG_SEQ = gl.constexpr(3)
CFG_SM_SCALE = gl.constexpr(5)
CFG_LOWER = gl.constexpr(7)
CFG_UPPER = gl.constexpr(8)

# Timing only (TL, tools/timeline.py backward): a program's row at TL holds 8 marks (_mark),
# then TL_MARKS of each consumer in each of its first TL_STEPS steps, one a warp of the
# consumer's TL_WARPS (_mark_step).
TL_STEPS = gl.constexpr(32)
TL_MARKS = gl.constexpr(13)
TL_WARPS = gl.constexpr(4)
TL_ROW = gl.constexpr(8 + 2 * TL_MARKS.value * TL_STEPS.value * TL_WARPS.value)


@gluon.jit
def _tl_row(TL):
    return TL + (gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)) * TL_ROW


@gluon.jit
def _mark(TL, slot: gl.constexpr):
    """Timing only (TL not None; tools/timeline.py backward): %globaltimer (ns) now into slot
    `slot` of the program's row at TL (slot 1: the SM's %smid instead)."""
    if TL is not None:
        if slot == 1:
            t = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                          is_pure=False, pack=1).to(gl.int64)
        else:
            t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                          is_pure=False, pack=1)
        gl.store(_tl_row(TL) + slot, t)


@gluon.jit
def _mark_step(TL, t, W: gl.constexpr, k: gl.constexpr):
    """Timing only: each warp's %clock64 now (lane 0 of each of consumer W's TL_WARPS warps)
    into mark k of its step t (t < TL_STEPS)."""
    if TL is not None:
        if t < TL_STEPS:
            layout: gl.constexpr = gl.BlockedLayout([1], [32], [TL_WARPS], [0])
            lane = gl.arange(0, 32 * TL_WARPS, layout=layout)
            c = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [lane],
                                          dtype=gl.int64, is_pure=False, pack=1)
            at = _tl_row(TL) + 8 + ((t * 2 + W) * TL_MARKS + k) * TL_WARPS + lane // 32
            gl.store(at, c, mask=lane % 32 == 0)


@gluon.jit
def _block_coords(t, walk, BLOCK_M: gl.constexpr, LISTED: gl.constexpr, g=None):
    """Step t of a program's walk (cnt, m_lo, h0, q_rb, q_rh, q_ch, o_rb, o_rh, o_ch, off_b,
    lst): query head h0 + t // cnt and its query block, m_lo + t % cnt or (LISTED; lst
    (LST_ROW: the key block's row of the transposed lists)) the (t % cnt)-th 64-row half of
    its full, then partial 128-blocks. Returns the block's first row in q's and dO's 2-D
    views (launch._token_rows), their columns, h and m. g: t // cnt where the caller knows it
    (no division)."""
    cnt, m_lo, h0, q_rb, q_rh, q_ch, o_rb, o_rh, o_ch, off_b, lst = walk
    if g is None:
        h = h0 + t // cnt
        i = t % cnt
    else:
        h = h0 + g
        i = t - g * cnt
    if LISTED:
        SUB: gl.constexpr = LIST_BLOCK // BLOCK_M
        j = i // SUB
        at = gl.where(j < lst[LST_FULL], 2 + lst[LST_WIDTH] + j, 2 + j - lst[LST_FULL])
        m = gl.load(lst[LST_ROW] + at) * SUB + i % SUB
    else:
        m = m_lo + i
    return (off_b * q_rb + h * q_rh + m * BLOCK_M, h * q_ch,
            off_b * o_rb + h * o_rh + m * BLOCK_M, h * o_ch, h, m)


@gluon.jit
def _request(q_desc, do_desc, q_smem, do_smem, full, t, walk, stats, H, SEQ,
             LISTED: gl.constexpr):
    """TMA of step t's Q and dO blocks, and of their rows' log2 LSE and delta (stats =
    (lse_desc, delta_desc, lse_smem, delta_smem): the prep kernel's B * H rows padded to
    cdiv(SEQ, 128) * 128), into slot t % 2."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    lse_desc, delta_desc, lse_smem, delta_smem = stats
    q_row, q_col, o_row, o_col, h, m = _block_coords(t, walk, BLOCK_M, LISTED)
    slot = t % 2
    mbarrier.expect(full.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                    + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
    load_rows(q_desc, q_row, q_col, full.index(slot), q_smem.index(slot))
    load_rows(do_desc, o_row, o_col, full.index(slot), do_smem.index(slot))
    row = ((walk[WALK_BATCH] * H + h) * (gl.cdiv(SEQ, LIST_BLOCK) * LIST_BLOCK)
           + m * BLOCK_M)
    tma.async_copy_global_to_shared(lse_desc, [row], full.index(slot), lse_smem.index(slot))
    tma.async_copy_global_to_shared(delta_desc, [row], full.index(slot), delta_smem.index(slot))


@gluon.jit
def _walk_bounds(n, SEQ, LOWER, UPPER, lst, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr, LISTED: gl.constexpr):
    """Key block n's query blocks per query head: the first (m_lo), how many (cnt), and the
    steps [a, b) of them that see every key of the block (no mask; none for a ragged key
    block). Steps before a and from b on are masked."""
    if LISTED:
        SUB: gl.constexpr = LIST_BLOCK // BLOCK_M
        m_lo = 0
        cnt = (gl.load(lst[LST_ROW]) + lst[LST_FULL]) * SUB
        a = 0
        b = gl.where((n + 1) * BLOCK_N > SEQ, 0, lst[LST_FULL] * SUB)
    else:
        lo, full_lo, full_hi, hi = q_range(n * BLOCK_N, SEQ, SEQ, LOWER, UPPER, HAS_LOWER,
                                           HAS_UPPER, BLOCK_M, BLOCK_N)
        m_lo = lo // BLOCK_M
        cnt = gl.maximum(gl.cdiv(hi, BLOCK_M) - m_lo, 0)
        a = (full_lo - lo) // BLOCK_M
        b = (full_hi - lo) // BLOCK_M
    return m_lo, cnt, a, b


@gluon.jit
def _empty_steps(key0, cnt, m_lo, cfg, KEYS: gl.constexpr, BLOCK_M: gl.constexpr,
                 HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr):
    """The steps [e0, e1) of a walk (query blocks m_lo .. m_lo + cnt - 1 of a query head)
    whose queries see some key of key0 .. key0 + KEYS - 1 (q_range of the group's keys); none
    where every one of them is past SEQ. cfg: _consume's."""
    SEQ = cfg[CFG_SEQ]
    lo, _, _, hi = q_range(key0, SEQ, SEQ, cfg[CFG_LOWER], cfg[CFG_UPPER], HAS_LOWER, HAS_UPPER,
                           BLOCK_M, KEYS)
    e0 = gl.minimum(gl.maximum(lo // BLOCK_M - m_lo, 0), cnt)
    e1 = gl.minimum(gl.maximum(gl.cdiv(hi, BLOCK_M) - m_lo, e0), cnt)
    return e0, gl.where(key0 < SEQ, e1, e0)


@gluon.jit
def _lse2(lse_s, cols, var, layout: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """The step's rows' LSE (log2 domain, +inf for padding rows and rows that see no key)
    from the slot's shared tile, one-sided ALiBi's rows' part added (_dkdv_products), read
    where it is used rather than held in registers through the step's products."""
    lse2 = lse_s.load(layout)
    if HAS_ALIBI == 2:
        lse2 = lse2 + alibi_part(cols, var[VAR_KEY0], var[VAR_SLOPE2])
    return lse2


@gluon.jit
def _issue_s(t, q_smem, k_s, full, st_layout: gl.constexpr, TL, now, W: gl.constexpr,
             SPLIT: gl.constexpr):
    """S^T = K Q^T of step t, issued (asynchronous) once its Q and dO blocks have landed in
    slot t % 2 (TL: mark 7 of consumer W's step `now` then): over the block's rows, or
    (SPLIT) over consumer W's half of them."""
    KEYS: gl.constexpr = k_s.shape[0]
    ROWS: gl.constexpr = q_smem.shape[1] // 2 if SPLIT else q_smem.shape[1]
    mbarrier.wait(full.index(t % 2), (t // 2) & 1)
    _mark_step(TL, now, W, 7)
    zero = gl.zeros([KEYS, ROWS], gl.float32, layout=st_layout)
    q_s = q_smem.index(t % 2)
    if SPLIT:
        q_s = q_s.slice(W * ROWS, ROWS, dim=0)
    return warpgroup_mma(k_s, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _dkdv_products(k_s, v_s, do_s, q_h, do_h, st, dk, dv, lse_s, delta_s, keys, cols, SEQ,
                   qk_scale, var, st_layout: gl.constexpr, a_layout: gl.constexpr,
                   MASK: gl.constexpr, HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr,
                   HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, MASK_MOD: gl.constexpr,
                   S_DONE: gl.constexpr, LATE_DV: gl.constexpr):
    """dP^T = V dO^T issued behind S^T = K Q^T (st: in flight, or S_DONE complete); P^T while dP^T
    runs; dV += P^T dO issued, dS^T = P^T (dP^T - delta) while it runs; dK += dS^T Q issued
    (q_h, do_h: the columns of Q and dO that dK's and dV's products take: the consumer's half of
    the head dim where it is split). var: the slots of gluon/common.py (VAR_KEY0: the program's
    first key, one-sided ALiBi's anchor; VAR_QUERY0: the step's first query); lse_s and delta_s:
    the step's rows' shared tiles. HAS_ALIBI 2 (one-sided ALiBi, every visible key at or left of
    the diagonal): the keys' part of the bias (common.alibi_part relative to the anchor) here,
    the rows' part in lse2 (_lse2); MASK: a masked step (kernels.mask.visible_by_key: keys past
    SEQ, the window, MASK_MOD). LATE_DV (consumer 1: the worker partition, 240 registers against
    the default partition's 248, spills where consumer 0 does not): dV's product issued after
    dS^T is formed, so that the bf16 P^T it reads from registers is not held through dS^T's
    arithmetic (fewer live registers, less overlap: faster causal walks). Returns
    dS^T and P^T (in the inputs' dtype) and dK, dV (their products still in flight)."""
    KEYS: gl.constexpr = k_s.shape[0]
    ROWS: gl.constexpr = do_s.shape[0]
    zero = gl.zeros([KEYS, ROWS], gl.float32, layout=st_layout)
    dpt = warpgroup_mma(v_s, do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    if not S_DONE:
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
    lse2 = _lse2(lse_s, cols, var, gl.SliceLayout(0, st_layout), HAS_ALIBI)
    if HAS_SOFTCAP or HAS_ALIBI:  # log2-domain scores; ALiBi's |j - i| is symmetric
        s2, tc = scores(st, keys, cols, qk_scale, var[VAR_CAP2], var[VAR_SLOPE2], 0,
                        HAS_SOFTCAP, HAS_ALIBI == 1)
        if HAS_ALIBI == 2:
            s2 = s2 + alibi_part(keys, var[VAR_KEY0], var[VAR_SLOPE2])[:, None]
        pt = gl.exp2(s2 - lse2[None, :])
    else:
        pt = gl.exp2(st * qk_scale - lse2[None, :])
    if MASK:  # keys past SEQ (a ragged key block), the window, MASK_MOD
        pt = gl.where(visible_by_key(keys, cols, SEQ, var[VAR_LOWER], var[VAR_UPPER],
                                     var[VAR_QUERY0], var[VAR_BATCH], var[VAR_HEAD], HAS_LOWER,
                                     HAS_UPPER, MASK_MOD), pt, 0.0)
    pg = pt  # P^T times the scores' derivative (softcap * tanh(x / softcap): 1 - tanh^2),
    if HAS_SOFTCAP:  # formed now so that the tanh is not kept through dP^T's wait
        pg = pt * (1.0 - tc * tc)
    if LATE_DV:
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
    else:
        ptb = pt.to(k_s.dtype)
        dv = warpgroup_mma(gl.convert_layout(ptb, a_layout), do_h, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
    delta = delta_s.load(gl.SliceLayout(0, st_layout))
    dst = (pg * (dpt - delta[None, :])).to(k_s.dtype)
    if LATE_DV:
        ptb = pt.to(k_s.dtype)
        dv = warpgroup_mma(gl.convert_layout(ptb, a_layout), do_h, dv, is_async=True)
    dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q_h, dk, is_async=True)
    return dst, ptb, dk, dv


@gluon.jit
def _stage_dq(dq, sm_scale, dq_w, dq_empty, dq_full, i, phase, TL, t, W: gl.constexpr):
    """Stage dQ columns (64 x D / 2 fp32, times sm_scale) in slot i of dq_w for the producer's
    reduction (TL: marks 9-11 of consumer W's step t)."""
    mbarrier.wait(dq_empty.index(i), phase)
    _mark_step(TL, t, W, 9)  # the staging slot free
    dq_w.index(i).store(dq * sm_scale)
    fence_async_shared()
    _mark_step(TL, t, W, 10)  # dQ stored, fenced
    gl.thread_barrier()
    mbarrier.arrive(dq_full.index(i), count=1)
    _mark_step(TL, t, W, 11)  # dQ staged


@gluon.jit
def _step(t, last, st, walk, q_smem, do_smem, k_w, v_w, k_cols, ds_smem, dq_w, full, empty,
          ds_ready, dq_full, dq_empty, stats_smem, dk, dv, keys, cfg, W: gl.constexpr,
          MASK: gl.constexpr, HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr,
          HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, LISTED: gl.constexpr,
          MASK_MOD: gl.constexpr, EARLY_S: gl.constexpr, TL, g=None):
    """Query block t of the steps 0 .. last for consumer W (keys `keys`; cfg as _consume's): returns
    dK, dV of its keys and S^T of the next step. EARLY_S: st is this step's S^T, issued by the
    step before, and this step issues the next one's (step last: its own again, discarded)
    before it stages dQ, so that the product runs during the staging; else the step issues its
    own. (Issued before the wait for the step's own products, ptxas serializes the products for
    want of registers.) The rows' LSE and delta come from the slot's shared tiles (stats_smem,
    loaded by the producer with Q and dO). dQ's product: each group its column half (k_cols)
    over both groups' dS^T (they meet at ds_ready every step), staged in dq_w for the producer's
    reduction. SPLIT (the head dim split, both groups over the same keys): each group computes
    S^T, dP^T, P^T and dS^T of its half of the step's rows and their parts of its columns of dK
    and dV from registers, stores P^T and dS^T in ds_smem (slot * 2 + W and 4 + slot * 2 + W),
    and once the groups meet adds the other half's parts from there; no dQ. g: t // cnt, or
    None (_block_coords). MASK: 0 none, 1 the step masked (visible_by_key), 2 none of
    the group's keys seen by the step's queries (SKIP_EMPTY): its rows of dS^T are zeros, and
    S^T, dP^T, dV's and dK's products are not issued (the step still meets the other group, adds
    its part of dQ and stages it)."""
    ALIBI, stride_ab, stride_ah, SEQ, qk_scale, sm_scale, cap2, LOWER, UPPER, anchor = cfg
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    KEYS: gl.constexpr = k_w.shape[0]
    SPLIT: gl.constexpr = HEAD_DIM > SPLIT_DIM
    DKV: gl.constexpr = HEAD_DIM // 2 if SPLIT else HEAD_DIM  # a consumer's dK, dV columns
    ROWS: gl.constexpr = BLOCK_M // 2 if SPLIT else BLOCK_M  # a consumer's rows of S^T
    ROW0: gl.constexpr = W * ROWS if SPLIT else 0
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
    dkv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DKV, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM // 2, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dkv_layout, k_width=2)
    _mark_step(TL, t, W, 0)  # (timing only: marks 0-12 of the step)
    off_b = walk[WALK_BATCH]
    _, _, _, _, h, m = _block_coords(t, walk, BLOCK_M, LISTED, g)
    slot = t % 2
    phase = (t // 2) & 1
    do_s = do_smem.index(slot)
    if SPLIT:  # this group's rows (S^T, dP^T) and columns (dK, dV)
        do_s = do_s.slice(ROW0, ROWS, dim=0)
        q_h = q_smem.index(slot).slice(ROW0, ROWS, dim=0).slice(W * DKV, DKV, dim=1)
        do_h = do_s.slice(W * DKV, DKV, dim=1)
        query0 = m * BLOCK_M + ROW0
    else:
        q_h = q_smem.index(slot)
        do_h = do_s
        query0 = m * BLOCK_M
    cols = query0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, st_layout))
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = gl.load(ALIBI + off_b * stride_ab + h * stride_ah) * LOG2E
    if MASK == 2:  # (Q and dO unread: the other group waited for them)
        dst = gl.zeros([KEYS, ROWS], k_w.dtype, layout=st_layout)
    else:
        s_now = st
        if not EARLY_S:
            s_now = _issue_s(t, q_smem, k_w, full, st_layout, None, t, W, SPLIT)
        lse_s = stats_smem[0].index(slot)
        delta_s = stats_smem[1].index(slot)
        if SPLIT:
            lse_s = lse_s.slice(ROW0, ROWS, dim=0)
            delta_s = delta_s.slice(ROW0, ROWS, dim=0)
        dst, pt, dk, dv = _dkdv_products(k_w, v_w, do_s, q_h, do_h, s_now, dk, dv, lse_s,
                                         delta_s, keys, cols, SEQ, qk_scale,
                                         (anchor, LOWER, UPPER, cap2, slope2, off_b, h, query0),
                                         st_layout, a_layout, MASK == 1, HAS_LOWER, HAS_UPPER,
                                         HAS_SOFTCAP, HAS_ALIBI, MASK_MOD, EARLY_S, W == 1)
    _mark_step(TL, t, W, 1)  # dS^T formed, dK's product issued
    # This group's rows of dS^T: dQ's product needs the other group's too. SPLIT: its P^T and
    # dS^T, for the other group's dK and dV columns (none on an empty step, for either group:
    # they own the same keys).
    if SPLIT:
        if MASK != 2:
            ds_smem.index(slot * 2 + W).store(pt)
            ds_smem.index(4 + slot * 2 + W).store(dst)
            fence_async_shared()
    else:
        ds_smem.index(slot).slice(W * KEYS, KEYS, dim=0).store(dst)
        fence_async_shared()
    _mark_step(TL, t, W, 2)  # this group's dS^T stored, fenced
    gl.thread_barrier()  # (this partition's warps)
    mbarrier.arrive(ds_ready.index(slot), count=1)
    _mark_step(TL, t, W, 3)  # this group's warps met and arrived
    mbarrier.wait(ds_ready.index(slot), phase)
    _mark_step(TL, t, W, 4)  # both groups' dS^T stored
    if SPLIT:
        dq = 0.0
        if MASK != 2:  # the other group's rows: dV += P^T dO, dK += dS^T Q over its half
            O: gl.constexpr = 1 - W
            q_o = q_smem.index(slot).slice(O * ROWS, ROWS, dim=0).slice(W * DKV, DKV, dim=1)
            do_o = do_smem.index(slot).slice(O * ROWS, ROWS, dim=0).slice(W * DKV, DKV, dim=1)
            dv = warpgroup_mma(ds_smem.index(slot * 2 + O), do_o, dv, is_async=True)
            dk = warpgroup_mma(ds_smem.index(4 + slot * 2 + O), q_o, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
    else:
        dq = gl.zeros([BLOCK_M, HEAD_DIM // 2], gl.float32, layout=dq_layout)
        dq = warpgroup_mma(ds_smem.index(slot).permute((1, 0)), k_cols, dq, use_acc=False,
                           is_async=True)
        _mark_step(TL, t, W, 5)  # dQ's product issued
        if MASK == 2:
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        else:
            dq, dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dv, dk))
    _mark_step(TL, t, W, 6)  # the step's products complete
    mbarrier.arrive(empty.index(slot), count=1)  # Q, dO and dS^T of this slot: read
    if EARLY_S:  # (mark 7: the next step's Q and dO landed)
        st = _issue_s(gl.minimum(t + 1, last), q_smem, k_w, full, st_layout, TL, t, W, SPLIT)
    else:
        _mark_step(TL, t, W, 7)
    _mark_step(TL, t, W, 8)  # (EARLY_S) the next step's S^T issued
    if not SPLIT:  # this group's dQ columns, staged for the producer's reduction
        _stage_dq(dq, sm_scale, dq_w, dq_empty, dq_full, W * 2 + slot, phase, TL, t, W)
    if EARLY_S:  # (no product in flight across the loop's branch: ptxas would serialize)
        st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
    _mark_step(TL, t, W, 12)  # (EARLY_S) the next step's S^T complete
    return dk, dv, st


@gluon.jit
def _steps(lo, hi, last, st, walk, q_smem, do_smem, k_w, v_w, k_cols, ds_smem, dq_w, full,
           empty, ds_ready, dq_full, dq_empty, stats_smem, dk, dv, keys, cfg, W: gl.constexpr,
           MASK: gl.constexpr, HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr,
           HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, LISTED: gl.constexpr,
           MASK_MOD: gl.constexpr, EARLY_S: gl.constexpr, TL, g=None):
    """_step over steps lo .. hi - 1 (MASK: none, masked or empty, as _step's; g: the query
    head's index in the group where the caller loops over them)."""
    for t in range(lo, hi):
        dk, dv, st = _step(t, last, st, walk, q_smem, do_smem, k_w, v_w, k_cols, ds_smem, dq_w,
                           full, empty, ds_ready, dq_full, dq_empty, stats_smem, dk, dv, keys,
                           cfg, W, MASK, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED,
                           MASK_MOD, EARLY_S, TL, g)
    return dk, dv, st


@gluon.jit
def _consume(walk, bounds, q_smem, do_smem, k_w, v_w, k_cols, ds_smem, dq_w, kv_full, full,
             empty, ds_ready, dq_full, dq_empty, stats_smem, DK, DV, stride_kb, stride_kt,
             stride_kh, key0, off_hk, cfg, W: gl.constexpr, HAS_LOWER: gl.constexpr,
             HAS_UPPER: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
             LISTED: gl.constexpr, MASK_MOD: gl.constexpr, EARLY_S: gl.constexpr,
             ONE_LOOP: gl.constexpr, SKIP_EMPTY: gl.constexpr, DIM: gl.constexpr, TL):
    """Consumer W: keys key0 .. key0 + 63 over every step (bounds = (GROUP, a, b) of
    _walk_bounds: per query head, steps [a, b) unmasked); stores their dK and dV (where the
    head dim is split: the columns of its half). cfg = (ALIBI,
    stride_ab, stride_ah, SEQ, qk_scale, sm_scale, cap2, LOWER, UPPER, the program's first
    key: one-sided ALiBi's anchor). SKIP_EMPTY (a walk in one loop with a bound, not listed):
    the steps whose queries see none of this group's keys (_empty_steps: outside [e0, e1))
    run empty (_step's MASK 2), in loops of their own."""
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    KEYS: gl.constexpr = k_w.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    dtype: gl.constexpr = k_w.dtype
    SPLIT: gl.constexpr = HEAD_DIM > SPLIT_DIM
    DKV: gl.constexpr = HEAD_DIM // 2 if SPLIT else HEAD_DIM
    ROWS: gl.constexpr = BLOCK_M // 2 if SPLIT else BLOCK_M  # a consumer's rows of S^T
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
    dkv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DKV, 16])
    SEQ = cfg[CFG_SEQ]
    cnt = walk[WALK_CNT]
    GROUP, a, b = bounds
    keys = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([KEYS, DKV], gl.float32, layout=dkv_layout)
    dv = gl.zeros([KEYS, DKV], gl.float32, layout=dkv_layout)
    mbarrier.wait(kv_full, 0)
    if W == 0:
        _mark(TL, 2)  # K and V have landed
    last = GROUP * cnt - 1
    if cnt > 0:  # (EARLY_S: the first S^T waits for step 0's blocks; a walk may be empty)
        st = gl.zeros([KEYS, ROWS], gl.float32, layout=st_layout)
        if EARLY_S:
            st = _issue_s(0, q_smem, k_w, full, st_layout, None, 0, W, SPLIT)
            st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
        ring = (walk, q_smem, do_smem, k_w, v_w, k_cols, ds_smem, dq_w, full, empty, ds_ready,
                dq_full, dq_empty, stats_smem)
        skips: gl.constexpr = SKIP_EMPTY and ONE_LOOP and (HAS_LOWER or HAS_UPPER) and not LISTED
        if skips:  # per query head: empty, masked, empty
            e0, e1 = _empty_steps(key0, cnt, walk[WALK_M_LO], cfg, KEYS, BLOCK_M, HAS_LOWER,
                                  HAS_UPPER)
            for g in range(GROUP):
                dk, dv, st = _steps(g * cnt, g * cnt + e0, last, st, *ring, dk, dv, keys, cfg, W,
                                    2, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED,
                                    MASK_MOD, EARLY_S, TL, g)
                dk, dv, st = _steps(g * cnt + e0, g * cnt + e1, last, st, *ring, dk, dv, keys,
                                    cfg, W, 1, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI,
                                    LISTED, MASK_MOD, EARLY_S, TL, g)
                dk, dv, st = _steps(g * cnt + e1, (g + 1) * cnt, last, st, *ring, dk, dv, keys,
                                    cfg, W, 2, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI,
                                    LISTED, MASK_MOD, EARLY_S, TL, g)
        elif ONE_LOOP:  # every step masked: one loop body
            dk, dv, st = _steps(0, GROUP * cnt, last, st, *ring, dk, dv, keys, cfg, W, True,
                                HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED, MASK_MOD,
                                EARLY_S, TL)
        else:
            for g in range(GROUP):
                if HAS_UPPER:  # query blocks across the causal / window upper bound
                    dk, dv, st = _steps(g * cnt, g * cnt + a, last, st, *ring, dk, dv, keys, cfg, W,
                                        True, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED,
                                        MASK_MOD, EARLY_S, TL)
                dk, dv, st = _steps(g * cnt + a, g * cnt + b, last, st, *ring, dk, dv, keys, cfg, W,
                                    False, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED,
                                    MASK_MOD, EARLY_S, TL)
                dk, dv, st = _steps(g * cnt + b, (g + 1) * cnt, last, st, *ring, dk, dv, keys, cfg,
                                    W, True, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED,
                                    MASK_MOD, EARLY_S, TL)
    _mark(TL, 3 + 2 * W)  # the walk is done
    # Through shared memory (store_rows): dV into this group's rows of V (read by its own
    # products only), dK into the slot of Q (consumer 0) or dO (consumer 1) that the last
    # step does not use: both groups are past the step before it (this group has waited on
    # the last step's ds_ready), and the producer loads no more. SPLIT (both groups read all
    # of V): dK and dV into this group's columns of that slot of Q and of dO.
    free = (GROUP * cnt) % 2
    off = walk[WALK_BATCH] * stride_kb + off_hk * stride_kh
    if SPLIT:
        dk_s = q_smem.index(free).slice(W * DKV, DKV, dim=1)
        dv_s = do_smem.index(free).slice(W * DKV, DKV, dim=1)
        off = off + W * DKV
    elif W == 0:
        dk_s = q_smem.index(free)
        dv_s = v_w
    else:
        dk_s = do_smem.index(free)
        dv_s = v_w
    dk_s.store((dk * cfg[CFG_SM_SCALE]).to(dtype))
    dv_s.store(dv.to(dtype))
    gl.thread_barrier()  # (this partition's warps)
    COLS: gl.constexpr = DIM - W * DKV if SPLIT else DIM  # (this group's columns under DIM)
    store_rows(dk_s, DK, off, key0, stride_kt, SEQ, COLS)
    store_rows(dv_s, DV, off, key0, stride_kt, SEQ, COLS)
    _mark(TL, 4 + 3 * W)  # dK and dV stored (issued)


@gluon.jit
def _reduce(dq_desc, dq_smem, dq_full, t, walk, DQ_MODE: gl.constexpr, LISTED: gl.constexpr):
    """Step t's dQ: both groups' staged column halves, each by one TMA reduction (the fp32
    buffer has q's layout: its rows and columns are q's)."""
    BLOCK_M: gl.constexpr = dq_desc.block_type.shape[0]
    HALF_D: gl.constexpr = tile_shape(dq_desc)[1]
    THREE_D: gl.constexpr = len(dq_desc.block_type.shape) == 3  # (col: the head's index)
    row, col, _, _, _, _ = _block_coords(t, walk, BLOCK_M, LISTED)
    for w in gl.static_range(2):
        mbarrier.wait(dq_full.index(w * 2 + t % 2), (t // 2) & 1)
        if DQ_MODE == 2:
            staged = dq_smem.index(w * 2 + t % 2)
            if THREE_D:  # (columns past the head dim: out of bounds, not written)
                _tma_reduce_add(dq_desc, [row, col, w * HALF_D],
                                staged._reinterpret(staged.dtype, dq_desc.block_type.shape,
                                                    dq_desc.layout))
            else:
                _tma_reduce_add(dq_desc, [row, col + w * HALF_D], staged)


@gluon.jit
def _produce(q_desc, do_desc, dq_desc, q_smem, do_smem, dq_smem, full, empty, dq_full,
             dq_empty, walk, total, stats, H, SEQ, DQ_MODE: gl.constexpr, LISTED: gl.constexpr,
             TL):
    """The producer: step t's Q and dO once both consumers have released the slot (step t -
    2), then step t - 1's dQ reductions; a staging slot is released once its reductions
    have read it (tma.store_wait). (Requesting step t + 1 before step t - 1's reductions
    did not pay: docs/journal/perf-journal.md.) Where the head dim is split (no dQ) the
    producer only loads."""
    SPLIT: gl.constexpr = tile_shape(q_desc)[1] > SPLIT_DIM
    for t in range(total + 1):
        if t < total:
            mbarrier.wait(empty.index(t % 2), (t // 2) & 1)
            _request(q_desc, do_desc, q_smem, do_smem, full, t, walk, stats, H, SEQ, LISTED)
        if not SPLIT:
            if t >= 1:
                _reduce(dq_desc, dq_smem, dq_full, t - 1, walk, DQ_MODE, LISTED)
                if t >= 2:
                    tma.store_wait(2)  # step t - 2's reductions done: free its staging
                    for w in gl.static_range(2):
                        mbarrier.arrive(dq_empty.index(w * 2 + t % 2), count=1)
    tma.store_wait(0)
    _mark(TL, 6)  # the last reductions have read their staging


@gluon.jit
def _attn_bwd_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc, DK,
                           DV, ALIBI, BMASK, stride_kb, stride_kt, stride_kh,
                           stride_ab, stride_ah, stride_bb, stride_bh, stride_bq, BM_N, H,
                           GROUP, SEQ, q_rb, q_rh, q_ch, o_rb, o_rh, o_ch, kv_rb, kv_rh, kv_ch,
                           qk_scale, sm_scale, cap2, LOWER, UPPER, TL,
                           DQ_MODE: gl.constexpr,
                           HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr,
                           HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                           LISTED: gl.constexpr, MASK_MOD: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           EARLY_S: gl.constexpr, ONE_LOOP: gl.constexpr,
                           SKIP_EMPTY: gl.constexpr, ORDER: gl.constexpr, DIM: gl.constexpr,
                           num_warps: gl.constexpr):
    """Program (key block of 128, or of 64 where the head dim is split; batch * KV head). The
    descriptors view q, k, v and dO as 2-D token rows (launch._token_rows: head h of batch b
    starts at row b * rb + h * rh, column h * ch; 3-D descriptors where DIM, the tensors' head
    dim, is under the tiles' width: gluon/common.load_rows, ch then in heads, dK and dV stored
    at DIM, dQ reduced at DIM); dq_desc views the fp32 dQ buffer, in q's
    layout (its rows and columns are q's), in blocks of 64 x D / 2 (one per consumer; None where
    the head dim is split: no dQ); lse_desc and delta_desc view the prep kernel's log2 LSE and
    delta (B * H rows of cdiv(SEQ, 128) * 128) as one row, in blocks of 64. dK and dV (strides
    stride_k*) take k's layout; TL: None, or (timing only) rows of TL_ROW int64 per program
    (_mark, _mark_step). Variants as the module docstring (qk_scale, cap2, LOWER, UPPER, ALIBI
    as the forward's; BMASK: the block mask's transposed lists, one row per key block, shared by
    the group's query heads). num_warps (4) is consumer 0; consumer 1 and the producer are
    worker partitions of 4 warps. The launch constants (CONSUMER_REGS .. ORDER, num_warps):
    configs.gluon_bwd_options."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = tile_shape(q_desc)[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    SPLIT: gl.constexpr = HEAD_DIM > SPLIT_DIM
    KEYS: gl.constexpr = BLOCK_N if SPLIT else BLOCK_N // 2  # a consumer's keys
    # The tiles the kernel is written for (configs.GLUON_BWD_BLOCK_M, gluon_bwd_block_n).
    gl.static_assert(num_warps == 4 and TL_WARPS == 4, "the Gluon backward: num_warps 4 (the "
                     "first consumer)")
    gl.static_assert(BLOCK_M == 64, "the Gluon backward: query blocks of 64 rows (the halves "
                     "of a block mask's 128)")
    gl.static_assert(BLOCK_N == 64 if SPLIT else BLOCK_N == LIST_BLOCK, "the Gluon backward: "
                     "128 keys a program (two consumers of 64), 64 where the head dim is split")
    gl.static_assert(HEAD_DIM == 64 or HEAD_DIM == 128 or HEAD_DIM == 256,
                     "the Gluon backward: head dim 64, 128 or 256")
    gl.static_assert(not (SPLIT and LISTED), "the Gluon backward: block masks (of 128) at head "
                     "dims 64 and 128")
    gl.static_assert(do_desc.block_type.shape[0] == BLOCK_M
                     and tile_shape(do_desc)[1] == HEAD_DIM
                     and tile_shape(k_desc)[1] == HEAD_DIM
                     and v_desc.block_type.shape[0] == BLOCK_N
                     and tile_shape(v_desc)[1] == HEAD_DIM and DIM <= HEAD_DIM,
                     "the Gluon backward: dO blocks as Q's, V blocks as K's")
    gl.static_assert(lse_desc.block_type.shape[0] == BLOCK_M
                     and delta_desc.block_type.shape[0] == BLOCK_M,
                     "the Gluon backward: LSE and delta blocks of BLOCK_M")
    if not SPLIT:
        gl.static_assert(dq_desc.block_type.shape[0] == BLOCK_M
                         and tile_shape(dq_desc)[1] == HEAD_DIM // 2,
                         "the Gluon backward: dQ blocks of BLOCK_M x HEAD_DIM / 2 (one a "
                         "consumer)")
    dtype: gl.constexpr = q_desc.dtype
    DS_ROWS: gl.constexpr = BLOCK_M // 2 if SPLIT else BLOCK_M  # a consumer's rows of S^T
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DS_ROWS], dtype)

    _mark(TL, 0)  # the program starts
    _mark(TL, 1)
    # (ORDER 1: the key blocks whose window walks run whole, to SEQ: n < (SEQ + LOWER) / 128)
    n, bh = grid_order(gl.minimum(gl.maximum((SEQ + LOWER) // BLOCK_N, 0), gl.num_programs(0)),
                       ORDER)
    off_b = bh // (H // GROUP)
    off_hk = bh % (H // GROUP)
    if LISTED:
        row = BMASK + off_b * stride_bb + off_hk * GROUP * stride_bh + n * stride_bq
        lst = (row, gl.load(row + 1), BM_N)
    else:
        lst = (0, 0, 0)
    m_lo, cnt, a, b = _walk_bounds(n, SEQ, LOWER, UPPER, lst, BLOCK_M, BLOCK_N, HAS_LOWER,
                                   HAS_UPPER, LISTED)
    total = GROUP * cnt
    walk = (cnt, m_lo, off_hk * GROUP, q_rb, q_rh, q_ch, o_rb, o_rh, o_ch, off_b, lst)
    cfg = (ALIBI, stride_ab, stride_ah, SEQ, qk_scale, sm_scale, cap2, LOWER, UPPER,
           n * BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], tile_layout(q_desc.layout))
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM],
                                        tile_layout(do_desc.layout))
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], tile_layout(k_desc.layout))
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], tile_layout(v_desc.layout))
    if SPLIT:  # P^T, dS^T: (kind * 4 + slot * 2 + consumer) -> its 64 x 32 (no dQ)
        ds_smem = gl.allocate_shared_memory(dtype, [8, BLOCK_N, DS_ROWS], ds_layout)
        dq_smem: gl.constexpr = None
    else:
        # dS^T: (slot) -> both consumers' rows; dQ's staging: (consumer, slot) -> 64 x
        # HEAD_DIM / 2 fp32
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M, HEAD_DIM // 2],
                                            tile_layout(dq_desc.layout))
    # the rows' log2 LSE and delta: (slot) -> 64 fp32 each
    stats_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                      rank=1)
    lse_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], stats_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], stats_layout)
    stats_smem = (lse_smem, delta_smem)
    kv_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_full, count=1)
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # released by both consumers
        mbarrier.arrive(empty.index(i), count=2)  # every slot starts released
        mbarrier.init(ds_ready.index(i), count=2)
    for i in gl.static_range(4):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
        mbarrier.arrive(dq_empty.index(i), count=1)
    fence_async_shared()

    kv_row = off_b * kv_rb + off_hk * kv_rh + n * BLOCK_N
    mbarrier.expect(kv_full, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    load_rows(k_desc, kv_row, off_hk * kv_ch, kv_full, k_smem)
    load_rows(v_desc, kv_row, off_hk * kv_ch, kv_full, v_smem)

    K1: gl.constexpr = 0 if SPLIT else KEYS  # consumer 1's first key in the block
    gl.warp_specialize(
        [(_consume, (walk, (GROUP, a, b), q_smem, do_smem, k_smem.slice(0, KEYS, dim=0),
                     v_smem.slice(0, KEYS, dim=0), k_smem.slice(0, HEAD_DIM // 2, dim=1),
                     ds_smem, dq_smem, kv_full, full, empty, ds_ready, dq_full, dq_empty,
                     stats_smem, DK, DV, stride_kb, stride_kt, stride_kh, n * BLOCK_N, off_hk,
                     cfg, 0, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED, MASK_MOD,
                     EARLY_S, ONE_LOOP, SKIP_EMPTY, DIM, TL)),
         (_consume, (walk, (GROUP, a, b), q_smem, do_smem, k_smem.slice(K1, KEYS, dim=0),
                     v_smem.slice(K1, KEYS, dim=0),
                     k_smem.slice(HEAD_DIM // 2, HEAD_DIM // 2, dim=1), ds_smem, dq_smem,
                     kv_full, full, empty, ds_ready, dq_full, dq_empty, stats_smem, DK, DV,
                     stride_kb, stride_kt, stride_kh, n * BLOCK_N + K1, off_hk, cfg, 1,
                     HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, LISTED, MASK_MOD,
                     EARLY_S, ONE_LOOP, SKIP_EMPTY, DIM, TL)),
         (_produce, (q_desc, do_desc, dq_desc, q_smem, do_smem, dq_smem, full, empty,
                     dq_full, dq_empty, walk, total,
                     (lse_desc, delta_desc, lse_smem, delta_smem), H, SEQ, DQ_MODE,
                     LISTED, TL))],
        [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
