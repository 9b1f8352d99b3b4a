"""Hopper backward in Gluon (experimental): one kernel, five products per block pair.

The Triton backward (kernels.attn_bwd) runs two kernels and seven products per block pair: its
dQ kernel recomputes S and dP so that no program adds into another's dQ (bitwise repeatable).
This kernel is FlashAttention-2/3's form: a program owns BLOCK_N (128) keys of one KV head,
keeps dK and dV in registers, and walks the query blocks (BLOCK_M = 64 rows) of every query
head of its group. Per query block:

    S^T = K Q^T and dP^T = V dO^T       issued together (asynchronous wgmma)
    P^T = exp2(S^T * scale - lse)       while dP^T runs
    dV += P^T dO                        issued, then dS^T = P^T (dP^T - delta) while it runs
    dK += dS^T Q                        issued; dS^T goes to shared memory
    dQ  = dS K                          (dS^T read transposed; columns split over the two
                                        warpgroups) and added into an fp32 buffer

dQ is added by one TMA bulk reduction per 64 x D tile (DQ_MODE 2, FlashAttention-3's way:
the tile is staged in shared memory, `cp.reduce.async.bulk.tensor` adds it in L2; block t's
tile is sent after block t + 1's barrier, so no second barrier an iteration, and it has a
block's time to finish before its staging slot is written again), by per-element atomics
(DQ_MODE 0), or not at all (DQ_MODE 1, the product kept: a timing ablation). Either way the
sum's order varies from run to run: the backward is not bitwise repeatable. (Measured and
removed, docs/perf.md: a second staging barrier, dQ staged but not added, reductions never
waited for, each key block's walk rotated to its diagonal.)

Q and dO come by TMA into a two-slot ring: block t + 1 is requested once every warp has
passed block t's barrier (so block t - 1's slot is free). The rows of a ragged last query
block read the next head's rows (the 2-D view has no per-head bound): their LSE is +inf, so
P = dS = 0 there and they add zeros. A ragged key block masks its keys in every step.

Scope: bf16 / fp16, head dim 64 or 128, SQ == SK, plain or causal, GQA, q / k / v / dO in the
2-D token-row views of launch._token_rows. The prep kernel (kernels.attn_bwd) computes delta
and zeroes the fp32 dQ buffer first. Gluon does not run in the interpreter:
scripts/compile_check.py compiles this kernel for sm_90 on any machine, tests/test_gluon.py
runs it on a Hopper GPU.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)


@builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """dst[coord...] += src (a shared-memory tile) by one TMA bulk reduction (Gluon 3.6 has
    the op, ttng.async_tma_reduce, but no wrapper for it); tma.store_wait covers it."""
    from triton._C.libtriton import ir
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle,
                                              coord, src.handle)


@gluon.jit
def _block_coords(t, walk, BLOCK_M: gl.constexpr):
    """Step t of a program's walk (cnt, m_lo, h0, q_rb, q_rh, q_ch, o_rb, o_rh, o_ch, off_b):
    query head h0 + t // cnt, query block m_lo + t % cnt; its first row in
    q's and dO's 2-D views (launch._token_rows), their columns, h and m."""
    cnt, m_lo, h0, q_rb, q_rh, q_ch, o_rb, o_rh, o_ch, off_b = walk
    h = h0 + t // cnt
    m = m_lo + t % cnt
    return (off_b * q_rb + h * q_rh + m * BLOCK_M, h * q_ch,
            off_b * o_rb + h * o_rh + m * BLOCK_M, h * o_ch, h, m)


@gluon.jit
def _request(q_desc, do_desc, q_smem, do_smem, full, t, total, walk, BLOCK_M: gl.constexpr):
    """TMA of step t's Q and dO blocks into slot t % 2 (nothing past the last step)."""
    q_row, q_col, o_row, o_col, _, _ = _block_coords(t, walk, BLOCK_M)
    slot = t % 2
    go = t < total
    mbarrier.expect(full.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes,
                    pred=go)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], full.index(slot),
                                    q_smem.index(slot), pred=go)
    tma.async_copy_global_to_shared(do_desc, [o_row, o_col], full.index(slot),
                                    do_smem.index(slot), pred=go)


@gluon.jit
def _walk_bounds(n, SEQ, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Key block n's query blocks: the first (the diagonal's, causal), how many per head, and
    how many of those are masked (the diagonal's; all of them for a ragged key block)."""
    m_lo = 0
    if IS_CAUSAL:
        m_lo = (n * BLOCK_N) // BLOCK_M
    cnt = gl.cdiv(SEQ, BLOCK_M) - m_lo
    n_masked = 0
    if IS_CAUSAL:
        n_masked = gl.minimum(BLOCK_N // BLOCK_M, cnt)
    if (n + 1) * BLOCK_N > SEQ:
        n_masked = cnt
    return m_lo, cnt, n_masked


@gluon.jit
def _row_stats(LSE, DELTA, base, m, SEQ, BLOCK_M: gl.constexpr, st_layout: gl.constexpr):
    """Query block m's rows (the columns of S^T), their LSE in the log2 domain (+inf past
    SEQ: P = 0 there) and delta."""
    cols = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    lse = gl.load(LSE + base + cols, mask=cols < SEQ, other=float("inf"))
    delta = gl.load(DELTA + base + cols, mask=cols < SEQ, other=0.0)
    return cols, lse * 1.4426950408889634, delta


@gluon.jit
def _dkdv_products(k_s, v_s, q_s, do_s, dk, dv, lse2, delta, keys, cols, SEQ, qk_scale,
                   st_layout: gl.constexpr, a_layout: gl.constexpr, IS_CAUSAL: gl.constexpr,
                   MASK: gl.constexpr):
    """S^T = K Q^T and dP^T = V dO^T issued together; P^T while dP^T runs; dV += P^T dO
    issued, dS^T = P^T (dP^T - delta) while it runs; dK += dS^T Q issued. Returns dS^T (in
    the inputs' dtype) and dK, dV (their products still in flight)."""
    KEYS: gl.constexpr = k_s.shape[0]
    ROWS: gl.constexpr = q_s.shape[0]
    zero = gl.zeros([KEYS, ROWS], gl.float32, layout=st_layout)
    st = warpgroup_mma(k_s, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_s, do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
    pt = gl.exp2(st * qk_scale - lse2[None, :])
    if MASK:  # keys past SEQ (a ragged key block), and past the diagonal
        keep = keys[:, None] < SEQ
        if IS_CAUSAL:
            keep = keep & (keys[:, None] <= cols[None, :])
        pt = gl.where(keep, pt, 0.0)
    dv = warpgroup_mma(gl.convert_layout(pt.to(k_s.dtype), a_layout), do_s, dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
    dst = (pt * (dpt - delta[None, :])).to(k_s.dtype)
    dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q_s, dk, is_async=True)
    return dst, dk, dv


@gluon.jit
def _step(t, total, walk, q_desc, do_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, ds_smem,
          dq_smem, full, dk, dv, LSE, DELTA, DQ, stride_lb, stride_lh, stride_dqh, H, keys,
          SEQ, qk_scale, sm_scale, st_layout: gl.constexpr, dq_layout: gl.constexpr,
          dkv_layout: gl.constexpr, IS_CAUSAL: gl.constexpr, MASK: gl.constexpr,
          DQ_MODE: gl.constexpr):
    """Query block t of the program (see the module docstring); returns dK, dV."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.shape[1]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dkv_layout, k_width=2)
    off_b = walk[9]
    _, _, _, _, h, m = _block_coords(t, walk, BLOCK_M)
    slot = t % 2
    q_s = q_smem.index(slot)
    do_s = do_smem.index(slot)
    cols, lse2, delta = _row_stats(LSE, DELTA, off_b * stride_lb + h * stride_lh, m, SEQ,
                                   BLOCK_M, st_layout)
    mbarrier.wait(full.index(slot), (t // 2) & 1)
    dst, dk, dv = _dkdv_products(k_smem, v_smem, q_s, do_s, dk, dv, lse2, delta, keys, cols,
                                 SEQ, qk_scale, st_layout, a_layout, IS_CAUSAL, MASK)
    ds_s = ds_smem.index(slot)
    ds_s.store(dst)
    fence_async_shared()
    if DQ_MODE == 2:
        tma.store_wait(0)  # block t - 2's reduction has read its staging tile
    gl.thread_barrier()  # every warp is past block t - 1 (and staged its dQ) and stored dS^T
    _request(q_desc, do_desc, q_smem, do_smem, full, t + 1, total, walk, BLOCK_M)
    if DQ_MODE == 2:  # block t - 1's dQ (t = 0: slot 1's zeros, to block 0)
        _, _, _, _, h_p, m_p = _block_coords(gl.maximum(t - 1, 0), walk, BLOCK_M)
        _tma_reduce_add(dq_desc, [(off_b * H + h_p) * SEQ + m_p * BLOCK_M, 0],
                        dq_smem.index(1 - slot))
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
    dq = warpgroup_mma(ds_s.permute((1, 0)), k_smem, dq, use_acc=False, is_async=True)
    dq, dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dv, dk))
    dq = dq * sm_scale
    rows = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    dcols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    ptrs = DQ + (off_b * H + h) * stride_dqh + rows[:, None] * HEAD_DIM + dcols[None, :]
    if DQ_MODE == 2:
        dq_smem.index(slot).store(dq)  # added at block t + 1 (after its barrier)
        fence_async_shared()
    if DQ_MODE == 0:
        gl.atomic_add(ptrs, dq, mask=rows[:, None] < SEQ, sem="relaxed")
    if DQ_MODE == 1:  # the product kept alive, nothing stored (no row is negative)
        gl.store(ptrs, dq, mask=rows[:, None] < 0)
    return dk, dv


# The kernel's launch constants (8 warps: two warpgroups, 64 keys of the block each).
OPTIONS = dict(num_warps=8)


@gluon.jit
def _attn_bwd_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, DQ, DK, DV,
                           stride_lb, stride_lh, stride_dqh, stride_kb, stride_kt, stride_kh,
                           H, GROUP, SEQ, q_rb, q_rh, q_ch, o_rb, o_rh, o_ch, kv_rb, kv_rh,
                           kv_ch, qk_scale, sm_scale, IS_CAUSAL: gl.constexpr,
                           DQ_MODE: gl.constexpr,
                           num_warps: gl.constexpr):
    """Program (key block, batch * KV head). The descriptors view q, k, v and dO as 2-D token
    rows (launch._token_rows: head h of batch b starts at row b * rb + h * rh, column h * ch);
    dq_desc views the fp32 dQ buffer (B, H, SEQ, D) as (B * H * SEQ) x D. dK and dV (strides
    stride_k*) take k's layout."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    dkv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, num_warps // 4],
        instr_shape=[16, HEAD_DIM // (num_warps // 4), 16])
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)

    n = gl.program_id(0)
    off_b = gl.program_id(1) // (H // GROUP)
    off_hk = gl.program_id(1) % (H // GROUP)
    h0 = off_hk * GROUP
    # Query blocks: from the key block's diagonal (causal) to the end, for each query head.
    m_lo, cnt, n_masked = _walk_bounds(n, SEQ, BLOCK_M, BLOCK_N, IS_CAUSAL)
    total = GROUP * cnt

    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    if DQ_MODE == 2:  # two staging tiles: a reduction has a whole block's time to finish
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], dq_desc.layout)
        dq_smem.index(1).store(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout))
    else:
        dq_smem = ds_smem  # unused
    kv_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_full, count=1)
    mbarrier.init(full.index(0), count=1)
    mbarrier.init(full.index(1), count=1)
    fence_async_shared()

    kv_row = off_b * kv_rb + off_hk * kv_rh + n * BLOCK_N
    mbarrier.expect(kv_full, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row, off_hk * kv_ch], kv_full, k_smem)
    tma.async_copy_global_to_shared(v_desc, [kv_row, off_hk * kv_ch], kv_full, v_smem)
    walk = (cnt, m_lo, h0, q_rb, q_rh, q_ch, o_rb, o_rh, o_ch, off_b)
    _request(q_desc, do_desc, q_smem, do_smem, full, 0, total, walk, BLOCK_M)

    keys = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=dkv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=dkv_layout)
    mbarrier.wait(kv_full, 0)
    for g in range(GROUP):
        for t in range(g * cnt, g * cnt + n_masked):
            dk, dv = _step(t, total, walk, q_desc, do_desc, dq_desc, q_smem, do_smem, k_smem,
                           v_smem, ds_smem, dq_smem, full, dk, dv, LSE, DELTA, DQ, stride_lb,
                           stride_lh, stride_dqh, H, keys, SEQ, qk_scale, sm_scale, st_layout,
                           dq_layout, dkv_layout, IS_CAUSAL, True, DQ_MODE)
        for t in range(g * cnt + n_masked, (g + 1) * cnt):
            dk, dv = _step(t, total, walk, q_desc, do_desc, dq_desc, q_smem, do_smem, k_smem,
                           v_smem, ds_smem, dq_smem, full, dk, dv, LSE, DELTA, DQ, stride_lb,
                           stride_lh, stride_dqh, H, keys, SEQ, qk_scale, sm_scale, st_layout,
                           dq_layout, dkv_layout, IS_CAUSAL, False, DQ_MODE)
    if DQ_MODE == 2:  # the last block's dQ
        tma.store_wait(0)
        gl.thread_barrier()
        _, _, _, _, h_p, m_p = _block_coords(total - 1, walk, BLOCK_M)
        _tma_reduce_add(dq_desc, [(off_b * H + h_p) * SEQ + m_p * BLOCK_M, 0],
                        dq_smem.index((total - 1) % 2))
        tma.store_wait(0)

    # dK (times the softmax scale) and dV in k's layout; keys past SEQ are not stored.
    rows = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dkv_layout))
    dcols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dkv_layout))
    offs = (off_b * stride_kb + off_hk * stride_kh + rows[:, None] * stride_kt
            + dcols[None, :])
    keep = rows[:, None] < SEQ
    gl.store(DK + offs, (dk * sm_scale).to(dtype), mask=keep)
    gl.store(DV + offs, dv.to(dtype), mask=keep)


# The warp-specialized form (FlashAttention-3's): two consumer warpgroups own 64 keys of the
# block each (S^T, dP^T, dK, dV of their keys; dQ's columns of their half of the head dim,
# from both groups' dS^T, exchanged through shared memory and the ds_ready barrier), and a
# producer partition streams Q and dO into the ring and adds the staged dQ tiles by TMA
# reductions, so the tensor-core warps never wait for a reduction.
WS_OPTIONS = dict(num_warps=4, CONSUMER_REGS=240, PRODUCER_REGS=24)


@gluon.jit
def _ws_step(t, walk, q_smem, do_smem, k_w, v_w, k_cols, ds_smem, dq_w, full, empty, ds_ready,
             dq_full, dq_empty, dk, dv, LSE, DELTA, stride_lb, stride_lh, keys, SEQ, qk_scale,
             sm_scale, W: gl.constexpr, IS_CAUSAL: gl.constexpr, MASK: gl.constexpr):
    """Query block t for consumer W (keys `keys`): returns dK, dV of its keys."""
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    KEYS: gl.constexpr = k_w.shape[0]
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    dkv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM // 2, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dkv_layout, k_width=2)
    off_b = walk[9]
    _, _, _, _, h, m = _block_coords(t, walk, BLOCK_M)
    slot = t % 2
    phase = (t // 2) & 1
    q_s = q_smem.index(slot)
    do_s = do_smem.index(slot)
    cols, lse2, delta = _row_stats(LSE, DELTA, off_b * stride_lb + h * stride_lh, m, SEQ,
                                   BLOCK_M, st_layout)
    mbarrier.wait(full.index(slot), phase)
    dst, dk, dv = _dkdv_products(k_w, v_w, q_s, do_s, dk, dv, lse2, delta, keys, cols, SEQ,
                                 qk_scale, st_layout, a_layout, IS_CAUSAL, MASK)
    # This group's rows of dS^T; dQ's product needs the other group's too.
    ds_s = ds_smem.index(slot)
    ds_s.slice(W * KEYS, KEYS, dim=0).store(dst)
    fence_async_shared()
    gl.thread_barrier()  # (this partition's warps)
    mbarrier.arrive(ds_ready.index(slot), count=1)
    mbarrier.wait(ds_ready.index(slot), phase)
    dq = gl.zeros([BLOCK_M, HEAD_DIM // 2], gl.float32, layout=dq_layout)
    dq = warpgroup_mma(ds_s.permute((1, 0)), k_cols, dq, use_acc=False, is_async=True)
    dq, dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dv, dk))
    mbarrier.arrive(empty.index(slot), count=1)  # Q, dO and dS^T of this slot: read
    # Stage this group's dQ columns for the producer's reduction.
    mbarrier.wait(dq_empty.index(W * 2 + slot), phase)
    dq_w.index(W * 2 + slot).store(dq * sm_scale)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(dq_full.index(W * 2 + slot), count=1)
    return dk, dv


@gluon.jit
def _ws_consume(walk, total, n_masked, q_smem, do_smem, k_w, v_w, k_cols, ds_smem, dq_w, kv_full,
                full, empty, ds_ready, dq_full, dq_empty, LSE, DELTA, DK, DV, stride_lb,
                stride_lh, stride_kb, stride_kt, stride_kh, key0, off_hk, SEQ, qk_scale,
                sm_scale, W: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Consumer W: keys key0 .. key0 + 63 over every step; stores their dK and dV."""
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    KEYS: gl.constexpr = k_w.shape[0]
    dtype: gl.constexpr = k_w.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, q_smem.shape[1], 16])
    dkv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    cnt = walk[0]
    keys = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=dkv_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=dkv_layout)
    mbarrier.wait(kv_full, 0)
    for g in range(total // cnt):
        for t in range(g * cnt, g * cnt + n_masked):
            dk, dv = _ws_step(t, walk, q_smem, do_smem, k_w, v_w, k_cols, ds_smem, dq_w, full,
                              empty, ds_ready, dq_full, dq_empty, dk, dv, LSE, DELTA, stride_lb,
                              stride_lh, keys, SEQ, qk_scale, sm_scale, W, IS_CAUSAL, True)
        for t in range(g * cnt + n_masked, (g + 1) * cnt):
            dk, dv = _ws_step(t, walk, q_smem, do_smem, k_w, v_w, k_cols, ds_smem, dq_w, full,
                              empty, ds_ready, dq_full, dq_empty, dk, dv, LSE, DELTA, stride_lb,
                              stride_lh, keys, SEQ, qk_scale, sm_scale, W, IS_CAUSAL, False)
    rows = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, dkv_layout))
    dcols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dkv_layout))
    offs = (walk[9] * stride_kb + off_hk * stride_kh + rows[:, None] * stride_kt
            + dcols[None, :])
    keep = rows[:, None] < SEQ
    gl.store(DK + offs, (dk * sm_scale).to(dtype), mask=keep)
    gl.store(DV + offs, dv.to(dtype), mask=keep)


@gluon.jit
def _ws_reduce(dq_desc, dq_smem, dq_full, t, walk, H, SEQ, DQ_MODE: gl.constexpr):
    """Step t's dQ: both groups' staged column halves, each by one TMA reduction."""
    BLOCK_M: gl.constexpr = dq_desc.block_type.shape[0]
    HALF_D: gl.constexpr = dq_desc.block_type.shape[1]
    _, _, _, _, h, m = _block_coords(t, walk, BLOCK_M)
    row = (walk[9] * H + h) * SEQ + m * BLOCK_M
    for w in gl.static_range(2):
        mbarrier.wait(dq_full.index(w * 2 + t % 2), (t // 2) & 1)
        if DQ_MODE == 2:
            _tma_reduce_add(dq_desc, [row, w * HALF_D], dq_smem.index(w * 2 + t % 2))


@gluon.jit
def _ws_produce(q_desc, do_desc, dq_desc, q_smem, do_smem, dq_smem, full, empty, dq_full,
                dq_empty, walk, total, H, SEQ, DQ_MODE: gl.constexpr):
    """The producer: step t's Q and dO once both consumers have released the slot (step t -
    2), then step t - 1's dQ reductions; a staging slot is released once its reductions
    have read it (tma.store_wait)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    for t in range(total + 1):
        if t < total:
            mbarrier.wait(empty.index(t % 2), (t // 2) & 1)
            _request(q_desc, do_desc, q_smem, do_smem, full, t, total, walk, BLOCK_M)
        if t >= 1:
            _ws_reduce(dq_desc, dq_smem, dq_full, t - 1, walk, H, SEQ, DQ_MODE)
            if t >= 2:
                tma.store_wait(2)  # step t - 2's reductions are done: free its staging slots
                for w in gl.static_range(2):
                    mbarrier.arrive(dq_empty.index(w * 2 + t % 2), count=1)
    tma.store_wait(0)


@gluon.jit
def _attn_bwd_gluon_ws_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, DK, DV,
                              stride_lb, stride_lh, stride_kb, stride_kt, stride_kh, H, GROUP,
                              SEQ, q_rb, q_rh, q_ch, o_rb, o_rh, o_ch, kv_rb, kv_rh, kv_ch,
                              qk_scale, sm_scale, IS_CAUSAL: gl.constexpr,
                              DQ_MODE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """The warp-specialized backward: program (key block of 128, batch * KV head), the same
    walk and arguments as _attn_bwd_gluon_kernel; dq_desc's blocks are 64 x HEAD_DIM / 2
    (one per consumer). num_warps (4) is consumer 0; consumer 1 and the producer are worker
    partitions of 4 warps."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    KEYS: gl.constexpr = BLOCK_N // 2
    dtype: gl.constexpr = q_desc.dtype
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)

    n = gl.program_id(0)
    off_b = gl.program_id(1) // (H // GROUP)
    off_hk = gl.program_id(1) % (H // GROUP)
    m_lo, cnt, n_masked = _walk_bounds(n, SEQ, BLOCK_M, BLOCK_N, IS_CAUSAL)
    total = GROUP * cnt
    walk = (cnt, m_lo, off_hk * GROUP, q_rb, q_rh, q_ch, o_rb, o_rh, o_ch, off_b)

    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    # staging: (consumer, slot) -> 64 x HEAD_DIM / 2 fp32
    dq_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M, HEAD_DIM // 2],
                                        dq_desc.layout)
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
    tma.async_copy_global_to_shared(k_desc, [kv_row, off_hk * kv_ch], kv_full, k_smem)
    tma.async_copy_global_to_shared(v_desc, [kv_row, off_hk * kv_ch], kv_full, v_smem)

    gl.warp_specialize(
        [(_ws_consume, (walk, total, n_masked, q_smem, do_smem, k_smem.slice(0, KEYS, dim=0),
                        v_smem.slice(0, KEYS, dim=0), k_smem.slice(0, HEAD_DIM // 2, dim=1),
                        ds_smem, dq_smem, kv_full, full, empty, ds_ready,
                        dq_full, dq_empty, LSE, DELTA,
                        DK, DV, stride_lb, stride_lh, stride_kb, stride_kt, stride_kh,
                        n * BLOCK_N, off_hk, SEQ, qk_scale, sm_scale, 0, IS_CAUSAL)),
         (_ws_consume, (walk, total, n_masked, q_smem, do_smem, k_smem.slice(KEYS, KEYS, dim=0),
                        v_smem.slice(KEYS, KEYS, dim=0),
                        k_smem.slice(HEAD_DIM // 2, HEAD_DIM // 2, dim=1), ds_smem,
                        dq_smem, kv_full, full, empty, ds_ready,
                        dq_full, dq_empty, LSE, DELTA,
                        DK, DV, stride_lb, stride_lh, stride_kb, stride_kt, stride_kh,
                        n * BLOCK_N + KEYS, off_hk, SEQ, qk_scale, sm_scale, 1, IS_CAUSAL)),
         (_ws_produce, (q_desc, do_desc, dq_desc, q_smem, do_smem, dq_smem, full, empty,
                        dq_full, dq_empty, walk, total, H, SEQ, DQ_MODE))],
        [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
