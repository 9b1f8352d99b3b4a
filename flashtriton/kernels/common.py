"""Shared ``@triton.jit`` helpers for the attention kernels.

Conventions (every kernel of the package):
  B batch, T sequence, H query heads, HKV key/value heads, GROUP = H // HKV,
  D head dim. Tensors are (B, T, H, D) with arbitrary strides except a unit
  stride on D. Tiles: BLOCK_M query rows, BLOCK_N key rows, BLOCK_D = D padded.
  Scores live in the log2 domain: s2 = (q . k) * softmax_scale * log2(e).
  Causal alignment: query i sees key j iff j <= i + DIAG, with DIAG = SK - SQ
  (bottom-right, flash-attn's convention).
Who sees whom (the causal / window rule, per score and per block): kernels/mask.py.
The online softmax (row state, its update, sinks, the epilogue): kernels/softmax.py.
The training and split-KV decoding kernels take each tensor's strides as one tuple (the
launcher's); the training kernels' loops take named groups that the kernel builds
(``aggregate``: Seq, Scores, Variant, KV).
"""

import triton
import triton.language as tl
# Triton 3.6's aggregate classes (the Gluon tutorials' @aggregate) have no public name: this
# module is the one place that imports it. If it moves or goes, only ``aggregate`` below
# changes (a later Triton's public name, or plain argument lists again).
from triton.language.core import _aggregate

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.constexpr_function
def _init_members(self, *args, **kwargs):
    """An aggregate's constructor: its members in declaration order, by position or name.
    Compiling, a plain Python value (a constexpr, unwrapped by constexpr_function) becomes a
    constexpr member again; the interpreter keeps plain values (it has no constexprs)."""
    names = type(self).MEMBERS
    values = dict(zip(names, args), **kwargs)
    for name in names:
        value = values[name]
        if not triton.knobs.runtime.interpret and not isinstance(value, tl.core.base_value):
            value = tl.constexpr(value)
        setattr(self, name, value)


def aggregate(cls):
    """A class of named values that @triton.jit functions take and pass as one argument: its
    annotations declare the members (tl.tensor, tl.constexpr or either), built by position or
    name (``Seq(SQ, SK, ...)``); a kernel builds them (the launcher passes no aggregate).
    Constexpr members specialise the functions that take them, as constexpr arguments do.
    Under TRITON_INTERPRET the members' types go unchecked (the interpreter passes constexprs
    and literals as plain Python values)."""
    if triton.knobs.runtime.interpret:
        cls.__annotations__ = {name: object for name in cls.__annotations__}
    cls.__init__ = _init_members
    value_cls = _aggregate(cls)
    value_cls.MEMBERS = tuple(cls.__annotations__)
    return value_cls


SCALAR = tl.tensor | tl.constexpr  # a member that a kernel may specialise to a constant


@aggregate
class Seq:
    """One batch element's sequences (seq_bounds): SQ queries, SK keys; query i sees key j iff
    i + LOWER <= j <= i + UPPER (each bound where checked), DIAG = SK - SQ."""
    SQ: SCALAR
    SK: SCALAR
    LOWER: SCALAR
    UPPER: SCALAR
    DIAG: SCALAR


@aggregate
class Scores:
    """What the scores of one (batch, head) take beyond q k^T (common.scores, the masks,
    dropout): the scales (qk_scale, softcap's cap2, ALiBi's slope2 in log2 units and the
    diagonal or anchor alibi_at it measures from), the attn_mask tile's base and strides, the
    dropout seed, counter and rate, and the batch and head a score_mod / mask_mod sees."""
    qk_scale: SCALAR
    cap2: SCALAR
    slope2: SCALAR
    alibi_at: SCALAR
    mask_base: SCALAR
    stride_mm: SCALAR
    stride_mn: SCALAR
    seed: SCALAR
    rng_bh: SCALAR
    dropout_p: SCALAR
    off_b: SCALAR
    off_h: SCALAR


@aggregate
class Variant:
    """A training kernel's constexpr variant as its loops see it (the kernels' docstrings
    give each flag; the bounds a walk checks, its mask_mod and list come per walk): scores
    (HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, HAS_DROPOUT, SCORE_MOD, SCORE_GRAD), head dims
    (EVEN_D, EVEN_DV), products (DOT_PREC, UPCAST), loads (USE_TMA: the walked rows by
    descriptor, PAGE_SIZE, STATS_TMA), tiles (SPARSE, BLOCK_M, BLOCK_N)."""
    HAS_SOFTCAP: tl.constexpr
    HAS_ALIBI: tl.constexpr
    MASK_KIND: tl.constexpr
    HAS_DROPOUT: tl.constexpr
    SCORE_MOD: tl.constexpr
    SCORE_GRAD: tl.constexpr
    EVEN_D: tl.constexpr
    EVEN_DV: tl.constexpr
    DOT_PREC: tl.constexpr
    UPCAST: tl.constexpr
    USE_TMA: tl.constexpr
    PAGE_SIZE: tl.constexpr
    STATS_TMA: tl.constexpr
    SPARSE: tl.constexpr
    BLOCK_M: tl.constexpr
    BLOCK_N: tl.constexpr


@aggregate
class KV:
    """The key and value rows a query block walks: row sources k and v (row_source: pointers
    or descriptors) with row strides stride_kt / stride_vt; paged (Variant.PAGE_SIZE > 0),
    pages stride_kp / stride_vp apart, NUM_PAGES of them; the tile's row offsets offs_n and
    column offsets offs_d / offs_dv of head dims HEAD_DIM (k) and HEAD_DIM_V (v)."""
    k: tl.tensor | tl.core.tensor_descriptor_base
    v: tl.tensor | tl.core.tensor_descriptor_base
    stride_kt: SCALAR
    stride_vt: SCALAR
    stride_kp: SCALAR
    stride_vp: SCALAR
    NUM_PAGES: SCALAR
    offs_n: tl.tensor
    offs_d: tl.tensor
    offs_dv: tl.tensor
    HEAD_DIM: SCALAR
    HEAD_DIM_V: SCALAR


@triton.jit
def load_tile(ptrs, rows, n_rows, cols, N_COLS,
              CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a (rows x cols) tile, zero-filling rows >= n_rows and cols >= N_COLS."""
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=cols[None, :] < N_COLS, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def row_source(base, n_rows, stride, HEAD_DIM, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
               USE_TMA: tl.constexpr):
    """What ``load_rows`` reads (BLOCK_R, BLOCK_D) tiles of an (n_rows, HEAD_DIM) matrix from:
    a tensor descriptor (Hopper's TMA: one copy instruction per tile, zero fill past the
    matrix) or the base pointer itself."""
    if USE_TMA:  # (a TMA dimension is never empty: no load reads an empty matrix)
        src = tl.make_tensor_descriptor(base, shape=[tl.maximum(n_rows, 1), HEAD_DIM],
                                        strides=[stride, 1], block_shape=[BLOCK_R, BLOCK_D])
    else:
        src = base
    return src


@triton.jit
def load_rows(src, start, offs, stride, n_rows, cols, N_COLS, CHECK_ROWS: tl.constexpr,
              CHECK_COLS: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows start + offs of a ``row_source``, zero past n_rows and N_COLS."""
    if USE_TMA:
        x = src.load([start, 0])
    else:
        rows = start + offs
        x = load_tile(src + rows.to(tl.int64)[:, None] * stride + cols[None, :], rows, n_rows,
                      cols, N_COLS, CHECK_ROWS, CHECK_COLS)
    return x


@triton.jit
def load_kv(src, pages, chunk_lo, start, offs, stride, stride_page, n_rows, n_pages, cols, N_COLS,
            CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr, USE_TMA: tl.constexpr,
            PAGE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr):
    """``load_rows`` of key / value rows start + offs: contiguous (PAGE_SIZE 0), or paged: row r
    in page P(r) at r % PAGE_SIZE, pages ``stride_page`` apart from ``src``. TMA (a tile in one
    page, PAGE_SIZE >= BLOCK_R): ``pages`` is the block-table row, P(r) = pages[r // PAGE_SIZE]
    (int32), ``src`` a descriptor over every page's rows. Pointers: ``pages`` holds the pages
    of the keys from ``chunk_lo`` on (a register tensor, one entry a page), P(r) =
    pages[(r - chunk_lo) // PAGE_SIZE]. A page outside [0, n_pages) reads as zeros; no
    address outside the pool is formed."""
    if PAGE_SIZE == 0:
        x = load_rows(src, start, offs, stride, n_rows, cols, N_COLS, CHECK_ROWS, CHECK_COLS,
                      USE_TMA)
    elif USE_TMA:
        page = tl.load(pages + start // PAGE_SIZE)
        ok = page.to(tl.uint32) < n_pages  # (one unsigned compare: also page < 0)
        # past the pool's rows for a page outside it: TMA's zero fill
        x = src.load([tl.where(ok, page, n_pages) * PAGE_SIZE + start % PAGE_SIZE, 0])
    else:
        rows = start + offs
        # the index wrapped into the chunk's entries: the pipeliner computes the gather of a
        # tile past the chunk's end too (its loads masked off), and an index past the register
        # tensor read outside the gather's shared-memory scratch (an illegal address)
        n_entries: tl.constexpr = pages.shape[0]
        page = tl.gather(pages, ((rows - chunk_lo) // PAGE_SIZE) & (n_entries - 1), 0)
        ok = page.to(tl.uint32) < n_pages
        ptrs = (src + (tl.where(ok, page, 0).to(tl.int64) * stride_page
                       + (rows % PAGE_SIZE).to(tl.int64) * stride)[:, None] + cols[None, :])
        x = _masked_rows(ptrs, ok[:, None], rows, n_rows, cols, N_COLS, CHECK_ROWS, CHECK_COLS)
    return x


@triton.jit
def _masked_rows(ptrs, keep, rows, n_rows, cols, N_COLS, CHECK_ROWS: tl.constexpr,
                 CHECK_COLS: tl.constexpr):
    """A tile of rows where ``keep`` (a column of row flags), zero elsewhere and past n_rows
    and N_COLS where checked."""
    if CHECK_ROWS:
        keep = keep & (rows[:, None] < n_rows)
    if CHECK_COLS:
        keep = keep & (cols[None, :] < N_COLS)
    return tl.load(ptrs, mask=keep, other=0.0)


@triton.jit
def store_tile(ptrs, x, rows, n_rows, cols, N_COLS, CHECK_COLS: tl.constexpr):
    """Store a tile, skipping rows >= n_rows and cols >= N_COLS."""
    if CHECK_COLS:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS))
    else:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)


@triton.jit
def seq_bounds(CU_Q, CU_K, SEQUSED_K, off_b, SQ, SK, TOTAL_Q, TOTAL_K, WIN_LEFT, WIN_RIGHT,
               IS_VARLEN: tl.constexpr):
    """Row offsets, lengths and mask bounds of batch element ``off_b``.

    Dense: the sequences start at row 0 and are SQ / SK long. Varlen: they are
    packed and delimited by the cumulative lengths CU_Q / CU_K (int32, B + 1) in
    tensors of TOTAL_Q / TOTAL_K rows; SEQUSED_K (None, or int32 (B,)): sequence b
    has SEQUSED_K[b] keys from row CU_K[b] on (flash-attn's seqused_k), not
    CU_K[b + 1] - CU_K[b]. Whatever the offsets hold, no row outside the tensors is
    addressed: a sequence whose query rows fall outside [0, TOTAL_Q] has none (it
    writes nothing), one whose key rows fall outside [0, TOTAL_K] sees no keys.
    IS_VARLEN 2: CU_Q / CU_K hold each sequence's (start, end) rows, 2B int32s, bounded on
    the device beforehand (the backward's way: its kernels then run the unchecked code).
    IS_VARLEN 3: packed queries over paged keys: sequence b's SEQUSED_K[b] keys (or
    CU_K[b + 1] - CU_K[b]; CU_K may be None beside SEQUSED_K) start at position 0 of its pages
    (k_off 0), TOTAL_K the positions its block-table row holds: a longer sequence sees none
    (IS_VARLEN 4: the same bounds).
    Returns (q_off, k_off, SQ, SK, LOWER, UPPER, DIAG): query i sees key j iff
    i + LOWER <= j <= i + UPPER, with DIAG = SK - SQ (bottom-right alignment).
    """
    if IS_VARLEN == 2:  # CU_Q / CU_K: (start, end) pairs already bounded (_varlen_spans_kernel)
        q_start = tl.load(CU_Q + 2 * off_b)
        k_start = tl.load(CU_K + 2 * off_b)
        SQ = tl.load(CU_Q + 2 * off_b + 1) - q_start
        SK = tl.load(CU_K + 2 * off_b + 1) - k_start
        q_off = q_start.to(tl.int64)
        k_off = k_start.to(tl.int64)
    elif IS_VARLEN >= 3:
        q_start = tl.load(CU_Q + off_b)
        q_end = tl.load(CU_Q + off_b + 1)
        if SEQUSED_K is not None:
            SK = tl.load(SEQUSED_K + off_b)
        else:
            SK = tl.load(CU_K + off_b + 1) - tl.load(CU_K + off_b)
        q_ok = (q_start.to(tl.uint32) <= q_end.to(tl.uint32)) & (q_end.to(tl.uint32) <= TOTAL_Q)
        SQ = tl.where(q_ok, q_end - q_start, 0)
        SK = tl.where(SK.to(tl.uint32) <= TOTAL_K, SK, 0)
        q_off = q_start.to(tl.int64)
        k_off = 0
    elif IS_VARLEN:
        q_start = tl.load(CU_Q + off_b)
        q_end = tl.load(CU_Q + off_b + 1)
        k_start = tl.load(CU_K + off_b)
        if SEQUSED_K is not None:
            k_end = k_start + tl.load(SEQUSED_K + off_b)
        else:
            k_end = tl.load(CU_K + off_b + 1)
        # 0 <= start <= end <= TOTAL as two unsigned compares (TOTAL < 2**31). Offsets are
        # left as they are (an offset beside a length of 0 addresses no row: clamping it
        # costs the dK/dV kernel a register spill)
        q_ok = (q_start.to(tl.uint32) <= q_end.to(tl.uint32)) & (q_end.to(tl.uint32) <= TOTAL_Q)
        k_ok = (k_start.to(tl.uint32) <= k_end.to(tl.uint32)) & (k_end.to(tl.uint32) <= TOTAL_K)
        SQ = tl.where(q_ok, q_end - q_start, 0)
        SK = tl.where(k_ok, k_end - k_start, 0)
        q_off = q_start.to(tl.int64)
        k_off = k_start.to(tl.int64)
    else:
        q_off = 0
        k_off = 0
    DIAG = SK - SQ
    return q_off, k_off, SQ, SK, DIAG - WIN_LEFT, DIAG + WIN_RIGHT, DIAG


@triton.jit
def heavy_first(HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr):
    """Query-block index of this program. Under a causal mask the last query
    blocks see the most keys: launching them first shortens the grid's tail."""
    pid = tl.program_id(0)
    if HAS_UPPER:
        if not HAS_LOWER:
            pid = tl.num_programs(0) - 1 - pid
    return pid


@triton.jit
def tanh(x):
    """tanh through exp2 (portable: GPU and interpreter); exact limits at +-inf."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def scores(qk, rows, cols, qk_scale, cap2, slope2, DIAG,
           HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Scores in the log2 domain from the raw dot products qk.

    Plain: qk * scale * log2(e) (qk_scale carries the product). Softcap:
    softcap * tanh(qk * scale / softcap) * log2(e) (qk_scale = scale / softcap,
    cap2 = softcap * log2(e)). ALiBi adds -slope * log2(e) * |i + DIAG - j|.
    Returns (s2, t) with t the tanh (softcap only; else s2 again, unused).
    """
    if HAS_SOFTCAP:
        t = tanh(qk * qk_scale)
        s2 = t * cap2
    else:
        s2 = qk * qk_scale
        t = s2
    if HAS_ALIBI:
        s2 = s2 - slope2 * tl.abs(rows[:, None] + DIAG - cols[None, :]).to(tl.float32)
    return s2, t


@triton.jit
def alibi_part(positions, anchor, slope2):
    """One-sided ALiBi (HAS_ALIBI == 2: every visible key j at or left of the diagonal,
    j <= i + DIAG): its bias -slope2 * (i + DIAG - j) is the key part alibi_part(j) minus the
    row part alibi_part(i + DIAG), both relative to ``anchor``. The row part is one constant
    per row: it cancels in the softmax, so the kernels add only the key part to the scores
    (one FMA with the scale) and move the row part into each row's log-sum-exp. The anchor,
    a diagonal position of the block's rows, keeps both parts small (exact to fp32) wherever
    the softmax weights are not negligible."""
    return slope2 * (positions - anchor).to(tl.float32)


@triton.jit
def apply_attn_mask(s, mask_base, rows, cols, n_rows, n_cols, stride_r, stride_c,
                    MASK_KIND: tl.constexpr):
    """An SDPA attn_mask tile on log2-domain scores s (rows x cols), read in place.

    MASK_KIND 0: none; 1: boolean, True = attend; 2: additive float (natural log
    units, so it is scaled by log2(e)). Broadcast masks arrive with stride 0.
    """
    if MASK_KIND != 0:
        ptrs = (mask_base + rows.to(tl.int64)[:, None] * stride_r
                + cols.to(tl.int64)[None, :] * stride_c)
        inb = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        if MASK_KIND == 1:
            s = tl.where(tl.load(ptrs, mask=inb, other=0) != 0, s, float("-inf"))
        else:
            s = s + tl.load(ptrs, mask=inb, other=0.0).to(tl.float32) * LOG2E
    return s


@triton.jit
def dropout_keep(seed, rng_bh, rows, cols, dropout_p, TRANSPOSED: tl.constexpr):
    """Which (query, key) probabilities survive dropout: a [rows, cols] tile, or
    [cols, rows] when TRANSPOSED. Counter-based (Philox keyed by ``seed``, counters
    (key, query, batch * head)), so the backward regenerates the forward's mask."""
    if TRANSPOSED:
        r = rows[None, :] + 0 * cols[:, None]
        c = cols[:, None] + 0 * rows[None, :]
    else:
        r = rows[:, None] + 0 * cols[None, :]
        c = cols[None, :] + 0 * rows[:, None]
    r0, _, _, _ = tl.philox(seed, c, r, r * 0 + rng_bh, r * 0)
    return (r0 >> 8).to(tl.float32) * (1.0 / 16777216.0) >= dropout_p


TL_COLUMNS = tl.constexpr(5)  # a timeline row: start, wait or loop end, stores, end, SM


@triton.jit
def mark(TL, row, slot: tl.constexpr):
    """Timing only (TL not None; tools/timeline.py decode): %globaltimer (ns) now into
    TL[row, slot] of an int64 (programs, TL_COLUMNS) table; slot 4: the SM (%smid)."""
    if TL is not None:
        if slot == 4:
            t = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                          is_pure=False, pack=1).to(tl.int64)
        else:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                          is_pure=False, pack=1)
        tl.store(TL + row * TL_COLUMNS + slot, t)
