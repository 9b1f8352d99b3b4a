"""Block sizes, warps and stages: pure functions of shape, dtype and mode.

Nothing here touches a GPU, so every function is unit-testable on the CPU.
Each Triton kernel's tiles are ``candidates(kind)``; ``prune`` narrows the list to what
fits the head dim and dtype of the call, best first, and ``bucket`` turns sequence lengths
into the tuning key (one entry per power-of-two bucket, not one per length). The tuning
tables (flashtriton.tuning) choose among the pruned tiles, or the autotuner searches them
(FLASHTRITON_AUTOTUNE=1).

Tile names (used everywhere): BLOCK_M query rows, BLOCK_N key rows, BLOCK_D the
head dim padded to a power of two (at least 16, the smallest ``tl.dot`` K).
"""

import sys
import types
from typing import Dict, List, Tuple

from . import _env

# (BLOCK_M, BLOCK_N, num_warps, num_stages). The first entry of each list is the
# default where no tuning table holds an entry for the call: the autotuner's most frequent
# choice over the shapes of flashtriton/tuned/sm90.json (at D=128 only short
# sequences and generation run these kernels there; the Gluon kernels run the rest). The
# forward splits BLOCK_M into two halves that overlap each other's softmax with the tensor
# cores: its halves want >= 64 rows per warpgroup (256 rows at 8 warps, 128 at 4) for
# Hopper's wgmma without cross-warpgroup row reductions. Block masks cap tiles at their block
# size (128): there (128, 64, 4, 2) leaves 96 KB of shared memory per program, two programs
# per SM. Short key lists (diffusion cross-attention over 77 keys: two key blocks) gain nothing
# from a third stage, which costs programs per SM (offline sm_90, shared memory at D=128 /
# 64: (128, 64, 4, 3) 128 / 64 KB, (128, 64, 4, 2) 96 / 48, (64, 64, 4, 2) 52 / 28): the
# two-stage tiles are there for the autotuner's cross suite.
_GPU = {
    "fwd": {
        64: [(128, 64, 4, 3), (256, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 128, 8, 4),
             (64, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2)],
        128: [(256, 64, 8, 3), (256, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3),
              (128, 64, 8, 4), (64, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2)],
        256: [(64, 32, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2)],
    },
    "dkdv": {
        64: [(32, 128, 4, 3), (64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2)],
        128: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 2), (32, 64, 4, 2)],
        256: [(32, 64, 8, 2), (32, 32, 4, 2), (64, 32, 4, 2), (16, 64, 4, 2)],
    },
    "dq": {
        64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 2)],
        128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 32, 4, 2), (128, 32, 4, 3)],
        256: [(128, 32, 8, 2), (64, 32, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2)],
    },
    # Decoding tiles: BLOCK_M is 0 here, it follows from the packed query rows of the call.
    "decode": {
        64: [(0, 64, 4, 3), (0, 128, 4, 3), (0, 64, 4, 4), (0, 128, 8, 3), (0, 32, 4, 4)],
        128: [(0, 64, 4, 3), (0, 64, 4, 4), (0, 128, 4, 2), (0, 128, 8, 2), (0, 32, 4, 4)],
        256: [(0, 32, 4, 3), (0, 64, 4, 2), (0, 32, 4, 4), (0, 64, 8, 2)],
    },
}
# fp32 tiles hold twice the bytes: small tiles only. fp32 runs its products on the FMA units
# (no tf32), which the compiler unrolls: from BLOCK_D 128 up only 32 x 32 tiles (ptxas on the
# dK/dV kernel with 64 x 32 tiles: 86 s at BLOCK_D 128, 276 s at 256; with 32 x 32: 24 s, 84 s).
_FP32 = [(64, 32, 4, 2), (32, 32, 4, 2), (64, 64, 8, 2)]
_FP32_WIDE = [(32, 32, 4, 2)]
_FP32_DECODE = [(0, 32, 4, 2)]
# Decoding over fp8 caches at head dims 65-128: a tile holds half the bytes, so twice the
# bf16 default's keys a tile read closer to the copy bandwidth (docs/perf.md).
_FP8_DECODE = [(0, 128, 4, 3), (0, 64, 4, 4), (0, 128, 4, 2), (0, 64, 4, 3)]
# The interpreter runs one config (Triton's autotuner cannot run several there);
# 16x16 tiles make even tiny test shapes span several blocks.
_INTERPRET = (16, 16, 4, 1)
_INTERPRET_DECODE = (0, 16, 4, 1)

KINDS = ("fwd", "dkdv", "dq", "decode")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code (``triton.cdiv`` is a constexpr function: ~3 us a call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two, at least 16."""
    return max(16, 1 << (int(head_dim) - 1).bit_length())


def bucket(n: int) -> int:
    """Autotuning bucket of a sequence length: the next power of two, at least 64."""
    return max(64, 1 << (max(int(n), 1) - 1).bit_length())


def _dim_class(bd: int) -> int:
    return 64 if bd <= 64 else (128 if bd <= 128 else 256)


def candidates(kind: str, interpret: bool = None) -> List[Tuple[int, int, int, int]]:
    """Every (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner may try for ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")
    if interpret is None:
        interpret = _env.INTERPRET
    if interpret:
        return [_INTERPRET_DECODE if kind == "decode" else _INTERPRET]
    fp32 = _FP32_DECODE if kind == "decode" else _FP32
    lists = list(_GPU[kind].values()) + ([_FP8_DECODE] if kind == "decode" else [])
    seen, out = set(), []
    for cfgs in lists:
        for c in cfgs + fp32:
            if c not in seen:
                seen.add(c)
                out.append(c)
    return out


# Query rows (query heads of a KV head x query tokens) that one decoding program packs: more
# take several row blocks (a tile of 512 rows asked for 360 KB of shared memory at head dim
# 128). Head dim 256 holds half as many.
DECODE_MAX_ROWS = 128
# From this many packed query rows (query heads a KV head x query tokens) a KV-cache call
# runs the prefill forward kernel (over pages too, without left padding) (its tiles and pipelining; each
# query head reads K/V itself) instead of the split kernel (every K/V byte read once per row
# block of DECODE_MAX_ROWS): past about a thousand rows the split kernel's row blocks cost
# more than the prefill route's repeated reads (tools/bench_edges.py prefill; docs/perf.md).
KVCACHE_PREFILL_MIN_ROWS = 1024


def decode_rows(group: int, sq: int, head_dim: int) -> Tuple[int, int]:
    """(BLOCK_M, row blocks) of a decoding call: its group * sq packed query rows in tiles
    of at most DECODE_MAX_ROWS (half at head dims over 128), at least 16 rows."""
    cap = DECODE_MAX_ROWS if block_d(head_dim) <= 128 else DECODE_MAX_ROWS // 2
    block_m = max(16, min(next_pow2(group * sq), cap))
    return block_m, cdiv(group * sq, block_m)


# Dense calls (no packed sequences) of few query rows over at least DENSE_SPLIT_MIN_KEYS keys
# run the split-KV kernel over k and v as a full cache (what a KV-cache call with as many
# query rows runs, kvcache_prefill): transformers' and SDPA users' decoding steps, which hand
# flash_attention one query token and the whole cache. The forward reads every key once a
# query head in B x H programs of BLOCK_M rows (one of them a query's); the split kernel reads
# it once a KV head, split over the SMs. The keys' floor: where the split route stops losing
# to the forward at any batch (docs/perf.md's decisions).
DENSE_SPLIT_MIN_KEYS = 4096


def dense_split(group: int, sq: int, sk: int) -> bool:
    """Whether a dense call with sq query tokens over sk keys, group query heads a KV head,
    runs the split-KV kernel."""
    return sq < sk and sk >= DENSE_SPLIT_MIN_KEYS and not kvcache_prefill(group, sq)


def kvcache_prefill(group: int, sq: int) -> bool:
    """Whether a KV-cache call with sq query tokens and group query heads a KV head runs the
    prefill forward kernel."""
    return group * sq >= KVCACHE_PREFILL_MIN_ROWS


def paged_singles(batch: int, total_q: int, max_seqlen_q: int) -> bool:
    """Whether a paged varlen call computes its one-query sequences (decoding rows beside
    prefill ones: vLLM's mixed batches) on the split-KV kernel, the rest on the forward: where
    some of several sequences hold fewer than max_seqlen_q queries (known without reading the
    offsets). The forward reads a sequence's keys once per query head and the split kernel
    once per KV head (docs/perf.md's decisions). Each kernel's programs for the other's
    sequences exit at once."""
    return batch >= 2 and max_seqlen_q > 1 and total_q < batch * max_seqlen_q


def decode_split_granule(interpret: bool = None) -> int:
    """Decoding splits are multiples of every candidate BLOCK_N."""
    return max(c[1] for c in candidates("decode", interpret))


def decode_splits(num_splits: int, batch: int, kv_heads: int, capacity: int, block_n: int,
                  sms: int, paged: bool = False, fp8: bool = False) -> int:
    """KV splits per sequence of a decoding call over ``capacity`` keys, ``batch`` x
    ``kv_heads`` programs a split, on a GPU of ``sms`` SMs: ``num_splits`` where given; else
    one program per SM (one wave) where that makes >= 8 splits of >= 256 keys each of a
    contiguous cache, else at most two programs per SM (the decode tiles fit two per SM); at
    most 128 splits, and at least one tile of ``block_n`` keys per split. Batch x KV heads >=
    SMs: one split, and no merge runs. Why (measured: docs/journal/perf-journal.md's decode
    split entries):
    - one wave beats two programs per SM over long caches, and over short ones from 256 keys
      a split (not at 128);
    - one wave only from 8 splits: with fewer, longer splits the tuner's tile was not stable;
    - paged and fp8 caches ran behind contiguous ones with one wave: they keep two per SM;
    - rounding up past two programs per SM leaves a nearly empty second wave;
    - short caches split too: one program per (sequence, KV head) leaves most SMs idle."""
    max_splits = max(1, cdiv(capacity, block_n))
    if num_splits > 0:
        return min(num_splits, max_splits)
    one_wave = sms // (batch * kv_heads)
    if not (paged or fp8) and one_wave >= 8 and capacity >= 256 * one_wave:
        return min(max_splits, one_wave, 128)
    return max(1, min(max_splits, (2 * sms) // (batch * kv_heads), 128))


def prune(kind: str, configs: List[Tuple[int, int, int, int]], head_dim_padded: int,
          elem_bytes: int, max_block: int = 1 << 30,
          fp8: bool = False) -> List[Tuple[int, int, int, int]]:
    """The candidates that suit a call: its head-dim class, small tiles for fp32, fp8
    decoding's own, and tiles no larger than a block mask's blocks (``max_block``)."""
    if len(configs) <= 1:
        return configs[:1]
    if elem_bytes >= 4 and kind == "decode":
        wanted = _FP32_DECODE
    elif fp8 and kind == "decode" and _dim_class(head_dim_padded) == 128:
        wanted = _FP8_DECODE
    elif elem_bytes >= 4:
        wanted = _FP32_WIDE if head_dim_padded >= 128 else _FP32
    else:
        wanted = _GPU[kind][_dim_class(head_dim_padded)]
    wanted = [c for c in wanted if max(c[0], c[1]) <= max_block]
    kept = [c for c in wanted if c in configs]  # in order of preference
    return kept or [c for c in configs if max(c[0], c[1]) <= max_block][:1] or configs[:1]


def invariant_tile(head_dim_padded: int, elem_bytes: int) -> Tuple[int, int, int, int]:
    """The forward's one tile under batch_invariant (no autotuning: every call of a head-dim
    class and element size runs it, whatever its batch, lengths or grid)."""
    if _env.INTERPRET:
        return _INTERPRET
    if elem_bytes >= 4:
        return (_FP32_WIDE if head_dim_padded >= 128 else _FP32)[0]
    return _GPU["fwd"][_dim_class(head_dim_padded)][0]


def as_kwargs(cfg: Tuple[int, int, int, int]) -> Dict[str, int]:
    """The tile sizes of a config (decoding configs have no BLOCK_M: the call sets it)."""
    bm, bn, _, _ = cfg
    return {"BLOCK_N": bn} if bm == 0 else {"BLOCK_M": bm, "BLOCK_N": bn}


# Which kernel family runs a call (flashtriton.launch.route reads these; every call signature
# holds snapshot(), so a call replayed never crosses a change of them). Each value is where
# a measurement put it: docs/perf.md's decisions table.
# The Triton releases whose Gluon the kernels of kernels/gluon/ are written for: Gluon's
# API changes between releases (3.5's warp_specialize takes other arguments; 3.7 has no
# gl.thread_barrier), so on any other release the Triton kernels run every call.
GLUON_TRITONS = ((3, 6),)
# The head dims of the Gluon forward in attention_forward, where it passes the Triton forward
# (D=64 from a length: GLUON_FWD_MIN_SEQLEN), and the longest causal sequence that stays on
# the Triton forward (short causal walks leave the Gluon kernel's pipeline half empty).
GLUON_FWD_HEAD_DIMS = (128, 256)
GLUON_FWD_CAUSAL_MAX_TRITON = 512
# Whether the Gluon forward also runs windows, softcap, ALiBi and block masks (faster than the
# Triton forward at each).
GLUON_VARIANTS = True
# Whether the Gluon kernels take one-sided ALiBi (the keys' part of the bias in the scores,
# the rows' part in the LSE: one FMA a score) where every visible key is at or left of the
# diagonal, instead of the general |i - j| form (fewer instructions a score).
GLUON_ALIBI_ONE_SIDED = True
# The head dims of the Gluon backward in attention_backward (D=256 with the Triton dQ kernel).
GLUON_BWD_HEAD_DIMS = (64, 128, 256)
# The shortest sequence that runs the Gluon backward (from there it passes the Triton
# backward), and whether windows, softcap and ALiBi take it too.
GLUON_BWD_MIN_SEQLEN = 1024
GLUON_BWD_VARIANTS = True
# The Gluon kernels' tiles: what kernels/gluon/fwd.py and bwd.py are written for (each
# static_asserts them), not candidates to tune. The forward's program takes
# GLUON_FWD_BLOCK_M query rows (two consumer warpgroups of 64) over key blocks of
# GLUON_FWD_BLOCK_N in a ring of GLUON_FWD_STAGES slots; the backward's takes
# GLUON_BWD_BLOCK_N keys (two consumers of 64) over query blocks of GLUON_BWD_BLOCK_M, and its
# prep kernel pads each head's LSE and delta rows to a multiple of GLUON_BWD_BLOCK_N (a block
# mask's walk reads both halves of its last 128-row query block). Block masks run them with
# blocks of GLUON_FWD_BLOCK_N only. The head dims each kernel takes (launch.gluon_misfit);
# GLUON_FWD_HEAD_DIMS above is where attention_forward routes to the forward.
GLUON_FWD_BLOCK_M = 128
# At head dim 64 (without a block mask) the forward's programs take GLUON_FWD_NARROW_BLOCK_M
# query rows: three consumers of 64 over key blocks of GLUON_FWD_NARROW_BLOCK_N, with
# GLUON_FWD_NARROW_REGS (consumer, producer) registers a thread (4 x 128 threads: 3 x 160 + 32 =
# the 512 a thread's share of the register file allows; offline sm_90, 128-key blocks spill
# 135-862 words at 160-176 registers, 64-key blocks none).
GLUON_FWD_NARROW_BLOCK_M = 192
GLUON_FWD_NARROW_BLOCK_N = 64
GLUON_FWD_NARROW_REGS = (160, 32)
GLUON_FWD_BLOCK_N = 128
GLUON_FWD_STAGES = 2
GLUON_FWD_KERNEL_HEAD_DIMS = (64, 128, 256)
# At head dim 256 the forward's key blocks are GLUON_FWD_WIDE_BLOCK_N: a consumer's S (64 x 64
# fp32) beside its O (64 x 256) in its registers, and two slots of K and V (197 KB of shared
# memory with Q, offline sm_90: no spills); no block masks there (their blocks are 128).
GLUON_FWD_WIDE_BLOCK_N = 64
GLUON_BWD_BLOCK_M = 64
GLUON_BWD_BLOCK_N = 128
GLUON_BWD_KERNEL_HEAD_DIMS = (64, 128, 256)
# At head dim 256 the backward's programs take GLUON_BWD_WIDE_BLOCK_N keys, and both consumers
# all of them, each with half the head dim and half the step's rows: a consumer's dK and dV
# (64 x 128 fp32 each) beside S^T and dP^T (64 x 32) in its registers; K, V, two slots of Q
# and dO and both consumers' P^T and dS^T (225 KB of shared memory with the rows' LSE and
# delta); dQ comes from the Triton dQ kernel; no block masks there (their blocks are 128).
GLUON_BWD_WIDE_BLOCK_N = 64
# The head dims that the Gluon kernels run in the tiles of the kernel head dim gluon_head_dim
# gives, TMA filling the columns past the head dim with zeros (launch.gluon_attn._gluon_descriptor):
# zero columns add nothing to Q K^T, and O, dQ, dK and dV are stored at the head dim (the Triton
# kernels' tiles are padded to a power of two as well: D=96 runs 128-wide tiles).
GLUON_PADDED_HEAD_DIMS = (80, 96, 112, 192)


class OptionTable(dict):
    """A table of launch constants (a dict) whose every change drops the policy snapshot."""
    __slots__ = ()

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        _drop_snapshot()

    def __delitem__(self, key):
        super().__delitem__(key)
        _drop_snapshot()

    def __ior__(self, other):
        result = super().__ior__(other)
        _drop_snapshot()
        return result

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        _drop_snapshot()

    def setdefault(self, key, default=None):
        result = super().setdefault(key, default)
        _drop_snapshot()
        return result

    def pop(self, *args):
        result = super().pop(*args)
        _drop_snapshot()
        return result

    def popitem(self):
        result = super().popitem()
        _drop_snapshot()
        return result

    def clear(self):
        super().clear()
        _drop_snapshot()


# The Gluon forward's launch constants (constexprs of kernels/gluon/fwd.py): the first
# consumer's 4 warps, and the registers of the second consumer and of the producer
# (setmaxnreg; 4 warps each). HEAVY_FIRST: under a causal bound (no lower one) the programs
# of a head take its query blocks last first, so the blocks that see the most keys start
# first and the grid's tail holds the light ones (as the Triton kernels' common.heavy_first).
# ORDER: the programs' order over the grid's query blocks and heads (gluon/common.grid_order:
# 0 the grid's, 1 whole windows first, G >= 2 groups of G heads block by block); None: as
# gluon_fwd_options chooses. tools/bench_gluon.py --ab and bench.variants --ab A/B them.
GLUON_FWD_OPTIONS = OptionTable(num_warps=4, CONSUMER_REGS=232, PRODUCER_REGS=40,
                                HEAVY_FIRST=True, ORDER=None)
# The Gluon backward's (kernels/gluon/bwd.py): the first consumer's 4 warps, and the registers
# of the consumers and of the producer (setmaxnreg; 4 warps each). EARLY_S: each step issues
# the next step's S^T before it stages dQ; ONE_LOOP: the walk in one loop, every step masked,
# rather than masked, unmasked and masked loops; SKIP_EMPTY: in walks in one loop with a
# bound, a group's steps whose queries see none of its keys issue none of its products but
# dQ's; ORDER: as the forward's (1: whole walks first). None: as gluon_bwd_options chooses.
GLUON_BWD_OPTIONS = OptionTable(num_warps=4, CONSUMER_REGS=240, PRODUCER_REGS=24, EARLY_S=None,
                                ONE_LOOP=None, SKIP_EMPTY=None, ORDER=None)
# Decoding: eager steps that read at most DECODE_MERGE_MAX_BYTES of cache, with splits that the
# merge loads at once, merge in the split kernel (flashtriton.decode); DECODE_MERGE_IN_KERNEL
# off: never.
DECODE_MERGE_IN_KERNEL = True
DECODE_MERGE_MAX_BYTES = 40 << 20
# Where the routes take head dims outside GLUON_FWD_HEAD_DIMS / GLUON_BWD_HEAD_DIMS: head dim ->
# the shortest sequence for the Gluon forward / backward (gluon_forward_first,
# launch.backward_route); a head dim without an entry runs the Triton kernels. Head dim 64's
# forward (GLUON_FWD_NARROW_BLOCK_M rows a program) from 2K tokens, where it passes the Triton
# forward; the head dims under the tiles' width (GLUON_PADDED_HEAD_DIMS, read in place) from
# 1K in the forward, whose Gluon kernel passes the Triton one there, while their backward
# stays on the Triton kernels, which match or pass the Gluon backward at these widths
# (docs/perf.md).
GLUON_FWD_MIN_SEQLEN = OptionTable({64: 2048, 80: 1024, 96: 1024, 112: 1024, 192: 1024})
GLUON_PADDED_BWD_MIN_SEQLEN = OptionTable({})


def gluon_head_dim(head_dim: int) -> int:
    """The head dim the Gluon kernels run a call of this head dim at: the next kernel head dim
    for GLUON_PADDED_HEAD_DIMS, its own otherwise."""
    if head_dim in GLUON_PADDED_HEAD_DIMS:
        return 128 if head_dim <= 128 else 256
    return head_dim


def gluon_fwd_block_m(head_dim: int, listed: bool = False) -> int:
    """The Gluon forward's query block at a head dim (listed: with a block mask's lists)."""
    return GLUON_FWD_NARROW_BLOCK_M if head_dim == 64 and not listed else GLUON_FWD_BLOCK_M


def gluon_fwd_q_block(block_m: int) -> int:
    """The rows of Q's descriptor blocks for a query block (TMA's boxes are powers of two: a
    192-row block loads in three of 64)."""
    return block_m if block_m & (block_m - 1) == 0 else 64


def gluon_fwd_block_n(head_dim: int, block_m: int = GLUON_FWD_BLOCK_M) -> int:
    """The Gluon forward's key block at a head dim and query block."""
    if block_m == GLUON_FWD_NARROW_BLOCK_M != GLUON_FWD_BLOCK_M:
        return GLUON_FWD_NARROW_BLOCK_N
    return GLUON_FWD_WIDE_BLOCK_N if head_dim > 128 else GLUON_FWD_BLOCK_N


def gluon_bwd_split(head_dim: int) -> bool:
    """Whether the Gluon backward splits the head dim between its consumers (kernels/gluon/
    bwd.py SPLIT_DIM): programs of GLUON_BWD_WIDE_BLOCK_N keys, dK and dV only."""
    return head_dim > 128


def gluon_bwd_block_n(head_dim: int) -> int:
    """The Gluon backward's key block (a program's keys) at a head dim."""
    return GLUON_BWD_WIDE_BLOCK_N if gluon_bwd_split(head_dim) else GLUON_BWD_BLOCK_N


def gluon_forward_first(head_dim: int, seqlen: int, causal: bool) -> bool:
    """Whether attention_forward tries the Gluon forward for this head dim and length (head
    dim 64 and the padded head dims from their GLUON_FWD_MIN_SEQLEN)."""
    if head_dim in GLUON_PADDED_HEAD_DIMS or head_dim in GLUON_FWD_MIN_SEQLEN:
        return seqlen >= GLUON_FWD_MIN_SEQLEN.get(head_dim, float("inf"))
    return head_dim in GLUON_FWD_HEAD_DIMS and (seqlen > GLUON_FWD_CAUSAL_MAX_TRITON or not causal)


def gluon_fwd_options(has_lower: bool, block_m: int = GLUON_FWD_BLOCK_M) -> dict:
    """The Gluon forward's launch constants for a walk with or without a lower bound:
    GLUON_FWD_OPTIONS with ORDER chosen where it is None: 1 (whole windows first) with a lower
    bound, else 0 (windows' whole walks first shorten the grid's tail; causal and dense walks
    gain nothing: docs/journal/perf-journal.md)."""
    opts = dict(GLUON_FWD_OPTIONS)
    if opts["ORDER"] is None:
        opts["ORDER"] = 1 if has_lower else 0
    if block_m == GLUON_FWD_NARROW_BLOCK_M != GLUON_FWD_BLOCK_M:
        opts["CONSUMER_REGS"], opts["PRODUCER_REGS"] = GLUON_FWD_NARROW_REGS
    return opts


def gluon_bwd_options(has_upper: bool, has_lower: bool = False, alibi: bool = False,
                      head_dim: int = 128) -> dict:
    """The Gluon backward's launch constants for a walk with or without an upper bound, a
    lower bound and ALiBi, at a head dim: GLUON_BWD_OPTIONS with each None chosen: SKIP_EMPTY
    with a lower bound; ORDER 1 with a lower bound, else 0; ONE_LOOP with a lower bound or
    ALiBi; EARLY_S with an upper bound and three loops (causal, softcap) where dQ is staged
    (not at a split head dim: no staging for S^T to overlap, and it measured slower there).
    Each choice is the faster side of its A/B (docs/journal/perf-journal.md): EARLY_S helps
    causal walks and costs walks without a bound; ONE_LOOP (about half the instructions a
    step, no spills) helps ALiBi and windows but not softcap or block masks; SKIP_EMPTY and
    ORDER 1 help windows, ORDER 1 costs causal walks."""
    opts = dict(GLUON_BWD_OPTIONS)
    if opts["SKIP_EMPTY"] is None:
        opts["SKIP_EMPTY"] = bool(has_lower)
    if opts["ORDER"] is None:
        opts["ORDER"] = 1 if has_lower else 0
    if opts["ONE_LOOP"] is None:
        opts["ONE_LOOP"] = bool(has_lower or alibi)
    if opts["EARLY_S"] is None:
        opts["EARLY_S"] = (bool(has_upper) and not opts["ONE_LOOP"]
                           and not gluon_bwd_split(head_dim))
    return opts


class _Snapshot(tuple):
    """The policy tuple with its hash computed once (every call signature hashes it)."""

    def __new__(cls, values):
        self = super().__new__(cls, values)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self):
        return self._hash


_SNAPSHOT = None


def _drop_snapshot() -> None:
    globals()["_SNAPSHOT"] = None


def snapshot() -> tuple:
    """Every policy value that chooses kernels, as one hashable tuple (call signatures): the
    switches and thresholds, the Gluon kernels' tiles and their launch constants (the option
    tables as they are now). Built once and kept until a value here changes (an assignment
    to this module's attributes or a change to an option table), which gives every call a
    new signature."""
    if _SNAPSHOT is None:
        globals()["_SNAPSHOT"] = _Snapshot((
            GLUON_TRITONS, GLUON_FWD_HEAD_DIMS, GLUON_FWD_CAUSAL_MAX_TRITON, GLUON_VARIANTS,
            GLUON_ALIBI_ONE_SIDED, GLUON_BWD_HEAD_DIMS, GLUON_BWD_MIN_SEQLEN, GLUON_BWD_VARIANTS,
            GLUON_FWD_BLOCK_M, GLUON_FWD_NARROW_BLOCK_M, GLUON_FWD_NARROW_BLOCK_N,
            GLUON_FWD_NARROW_REGS,
            GLUON_FWD_BLOCK_N, GLUON_FWD_STAGES, GLUON_FWD_KERNEL_HEAD_DIMS,
            GLUON_FWD_WIDE_BLOCK_N, GLUON_BWD_BLOCK_M, GLUON_BWD_BLOCK_N,
            GLUON_BWD_KERNEL_HEAD_DIMS, GLUON_BWD_WIDE_BLOCK_N, GLUON_PADDED_HEAD_DIMS,
            tuple(GLUON_FWD_MIN_SEQLEN.items()), tuple(GLUON_PADDED_BWD_MIN_SEQLEN.items()),
            tuple(GLUON_FWD_OPTIONS.items()), tuple(GLUON_BWD_OPTIONS.items()),
            DECODE_MERGE_IN_KERNEL, DECODE_MERGE_MAX_BYTES, DECODE_MAX_ROWS,
            KVCACHE_PREFILL_MIN_ROWS, DENSE_SPLIT_MIN_KEYS))
    return _SNAPSHOT


class _Policy(types.ModuleType):
    """This module's type: setting one of its attributes (configs.X = ..., monkeypatch)
    drops the snapshot."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name != "_SNAPSHOT":
            _drop_snapshot()

    def __delattr__(self, name):
        super().__delattr__(name)
        _drop_snapshot()


sys.modules[__name__].__class__ = _Policy
