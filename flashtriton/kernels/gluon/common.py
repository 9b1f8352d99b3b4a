"""What the Gluon forward and backward share: the slots of the tuples both pass to their
helpers, the programs' order over the grid, the TMA loads of token rows and the stores of a
shared-memory tile.

Triton 3.6 turns the elements of a tuple built inside a kernel into tensors (a NamedTuple's
too), so the kernels hand their scalars around in plain tuples, indexed by the constexpr
slot names below (module-level constexprs are valid indices): ``var[VAR_LOWER]``, the same
slot in both kernels.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# `var`: the scalars of the scores and the mask, one layout in both kernels (the forward's
# tile[2]; the backward's per step, built in _step).
VAR_KEY0 = gl.constexpr(0)  # the first key: forward, of ring block 0 (a window's first
# visible block); backward, of the program's key block (one-sided ALiBi's anchor)
VAR_LOWER = gl.constexpr(1)  # the window's bounds: query i sees keys i + LOWER .. i + UPPER
VAR_UPPER = gl.constexpr(2)
VAR_CAP2 = gl.constexpr(3)  # softcap * log2(e)
VAR_SLOPE2 = gl.constexpr(4)  # ALiBi's slope * log2(e)
VAR_BATCH = gl.constexpr(5)  # b and h of MASK_MOD(b, h, i, j)
VAR_HEAD = gl.constexpr(6)
VAR_QUERY0 = gl.constexpr(7)  # the first query: forward, of the program's query block (one-
# sided ALiBi's anchor); backward, of the step (the base of the mask's lane split)
VAR_SINK2 = gl.constexpr(8)  # forward: the head's sink logit * log2(e) (0.0 without sinks)
# `lst`: a block mask's lists (flashtriton.block_mask), one row per query block (forward) or
# key block (backward, the transposed lists): [n_partial, n_full, partial blocks .. (BM_N
# entries), full blocks ..].
LST_ROW = gl.constexpr(0)  # the block's row (a pointer)
LST_FULL = gl.constexpr(1)  # its n_full
LST_WIDTH = gl.constexpr(2)  # BM_N: where its full blocks start after the partial ones
# The block masks the kernels take: blocks of LIST_BLOCK queries and keys (the forward's
# BLOCK_N, the backward's BLOCK_N; the backward's 64-row query blocks are its halves).
LIST_BLOCK = gl.constexpr(128)


@gluon.constexpr_function
def tile_shape(desc_type):
    """The 2-D tile (rows, width) of a descriptor's blocks: a 3-D descriptor's (rows, 1,
    width) without its heads' axis."""
    return [desc_type.block_type.shape[0], desc_type.block_type.shape[-1]]


@gluon.constexpr_function
def tile_layout(layout):
    """The 2-D shared layout of a descriptor's tiles: a 3-D descriptor's (load_rows) with its
    rank dropped, the same bytes (its heads' axis is 1)."""
    return gl.NVMMASharedLayout(layout.swizzle_byte_width, layout.element_bitwidth, 2,
                                layout.transposed)


@gluon.jit
def load_rows(desc, row, col, bar, smem):
    """TMA of desc's block of token rows (launch._token_rows) from row, col into the 2-D tile
    smem, completing on bar. A 3-D descriptor (rows, heads, head dim) views a head dim under
    the tile's width (launch.gluon_descriptor): col is then the head's index, and TMA fills
    the columns past the head dim with zeros, so they add nothing to the products."""
    shape: gl.constexpr = desc.block_type.shape
    if len(shape) == 3:
        tma.async_copy_global_to_shared(desc, [row, col, 0], bar,
                                        smem._reinterpret(smem.dtype, shape, desc.layout))
    else:
        tma.async_copy_global_to_shared(desc, [row, col], bar, smem)


@gluon.jit
def store_rows(tile, ptr, off, row0, stride_t, SEQ, COLS: gl.constexpr):
    """A ROWS x D tile of shared memory into global rows row0 .. row0 + ROWS - 1 (row r at
    ptr + off + r * stride_t, its first COLS (<= D) columns contiguous), rows < SEQ only; 4
    warps, 16 bytes a thread, so a warp's store writes whole rows (the products' layout
    writes 16 bytes of each of 8 rows a store: slower)."""
    ROWS: gl.constexpr = tile.shape[0]
    D: gl.constexpr = tile.shape[1]
    gl.static_assert((256 // D) * (D // 8) == 32, "store_rows: a warp's 32 threads span whole "
                     "rows of 16 bytes each (D a power of two, 8 .. 256)")
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [4, 1], [1, 0])
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    keep = rows[:, None] < SEQ
    if COLS < D:  # (a head dim under the tile's width)
        keep = keep & (cols[None, :] < COLS)
    gl.store(ptr + (off + rows[:, None] * stride_t + cols[None, :]), tile.load(layout),
             mask=keep)


@gluon.jit
def grid_order(whole, ORDER: gl.constexpr):
    """The grid's (block, batch * head) that this program takes, in launch order
    (program_id(0) fastest) and ORDER: 0 as the grid lays them out, a head's blocks in turn;
    1 blocks 0 .. whole - 1 of each head head by head, then the other blocks of every head,
    block by block (the walks that run whole first: the grid's tail holds the short ones);
    G >= 2 groups of G heads, the group's block i before its block i + 1 (walks that shorten
    with i: each group's longest start together, and the tail holds the last group's short
    ones, as the longest-first rule would: tools/simulate_schedule.py)."""
    nb = gl.num_programs(0)
    P = gl.num_programs(1)
    if ORDER == 0:
        i = gl.program_id(0)
        bh = gl.program_id(1)
    else:
        L = gl.program_id(1) * nb + gl.program_id(0)
        if ORDER == 1:
            first = L < P * whole
            r = L - P * whole
            i = gl.where(first, L % gl.maximum(whole, 1), whole + r // P)
            bh = gl.where(first, L // gl.maximum(whole, 1), r % P)
        else:
            g = L // (ORDER * nb)
            r = L % (ORDER * nb)
            width = gl.minimum(P - ORDER * g, ORDER)  # (the last group: what is left)
            i = r // width
            bh = ORDER * g + r % width
    return i, bh
