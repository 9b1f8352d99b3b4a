"""What a call computes and the arguments every kernel family shares: ``Variant`` (the
options), ``Varlen`` (packed sequences), the registry of user modifiers, and the shared
constexpr / runtime arguments with the tuning key (``_common``)."""

import functools
import math
from typing import NamedTuple, Optional

import torch

from .. import _env, configs, runtime
from ..runtime import call_signature

LOG2E = math.log2(math.e)
_KEY = ["SQ_BUCKET", "SK_BUCKET", "HEAD_DIM", "HEAD_DIM_V", "IS_VARLEN", "HAS_LOWER", "HAS_UPPER", "HAS_SOFTCAP",
        "HAS_ALIBI", "MASK_KIND", "HAS_DROPOUT", "HAS_BLOCK_MASK", "SPARSE"]


_DECODE_KEY = ["SPLIT_BUCKET", "WAVES", "BLOCK_M", "BLOCK_D", "PAGED", "HAS_LOWER", "HAS_UPPER",
               "HAS_SOFTCAP", "HAS_ALIBI", "HAS_BATCH_IDX", "HAS_LEFTPAD", "FP8"]


class AttentionOutput(NamedTuple):
    """What every attention entry point returns with its LSE (the API re-exports it)."""
    out: torch.Tensor  # (batch, seqlen_q, nheads, headdim), dtype of q
    lse: torch.Tensor  # (batch, nheads, seqlen_q) float32, natural log; -inf for rows with no key


class Variant(NamedTuple):
    """What one call computes, beyond q, k, v (the arguments of every kernel)."""
    softmax_scale: float
    causal: bool = False
    window_left: int = -1       # -1: unbounded
    window_right: int = -1      # -1: unbounded (causal forces 0)
    softcap: float = 0.0        # 0: off
    alibi_slopes: Optional[torch.Tensor] = None  # (H,) or (B, H) float32
    attn_mask: Optional[torch.Tensor] = None     # (B, H, SQ, SK) view (any strides): bool or float
    dropout_p: float = 0.0
    seed: int = 0                                # Philox key of the dropout mask
    score_mod: Optional[object] = None           # @triton.jit (score, b, h, q_idx, kv_idx) -> score
    score_mod_grad: Optional[object] = None      # @triton.jit d score_mod / d score, same arguments
    mask_mod: Optional[object] = None            # @triton.jit (b, h, q_idx, kv_idx) -> bool
    kv_blocks: Optional[torch.Tensor] = None     # BlockMask lists (flashtriton.block_mask)
    q_blocks: Optional[torch.Tensor] = None
    block_size: int = 128
    diag_offset: int = 0                         # shifts the window's diagonal (ring attention)
    deterministic: bool = False                  # a bitwise-repeatable backward (no atomics)
    sinks: Optional[torch.Tensor] = None         # (H,) one sink logit a query head (float)
    batch_invariant: bool = False                # the forward: one fixed tile, every key tile
    #   through the masked softmax (a row's bits do not depend on the batch, its query block
    #   or seqlen_q: launch.triton_forward)

    @property
    def right_bound(self) -> int:
        """The window's right bound as the kernels take it: 0 under causal, -1 unbounded."""
        return 0 if self.causal else self.window_right

    def with_block_mask(self, block_mask) -> "Variant":
        """This variant under a ``flashtriton.block_mask.BlockMask`` (its mask_mod, lists and
        block size)."""
        return self._replace(mask_mod=block_mask.mask_mod, kv_blocks=block_mask.kv_blocks,
                             q_blocks=block_mask.q_blocks, block_size=block_mask.block_size)


# The @triton.jit modifiers cannot travel through torch.library schemas: the ops carry an
# integer key into this table instead (a constant in a compiled graph).
_MODS = {0: (None, None, None)}


def register_mods(score_mod, score_mod_grad, mask_mod) -> int:
    """Key of the (score_mod, score_mod_grad, mask_mod) triple, registered once."""
    mods = (score_mod, score_mod_grad, mask_mod)
    for key, value in _MODS.items():
        if value == mods:
            return key
    _MODS[len(_MODS)] = mods
    return len(_MODS) - 1


def lookup_mods(key: int):
    return _MODS[key]


class Varlen(NamedTuple):
    """Packed sequences: q (total_q, H, D), k/v (total_k, HKV, D), int32 offsets (B + 1);
    seqused_k (B,) int32 or None: sequence b's keys are the seqused_k[b] rows from
    cu_seqlens_k[b] on (the forward only). block_table (B, max_pages) int32 or None: k/v are
    pages (num_pages, page_size, HKV, D) and sequence b's keys (seqused_k[b], or
    cu_seqlens_k[b + 1] - cu_seqlens_k[b]; cu_seqlens_k may then be None) fill its pages
    block_table[b] from position 0 (the forward only). singles_elsewhere (paged): the forward
    leaves the sequences of one query to the split-KV kernel (IS_VARLEN 4)."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: Optional[torch.Tensor]
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_k: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    singles_elsewhere: bool = False


def key_counts(cu_seqlens_k: Optional[torch.Tensor],
               seqused_k: Optional[torch.Tensor]) -> torch.Tensor:
    """Each packed sequence's key count (int32 (B,)): seqused_k, or the differences of
    cu_seqlens_k."""
    if seqused_k is not None:
        return seqused_k
    return (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)


def _alibi_args(variant: Variant):
    a = variant.alibi_slopes
    if a is None:
        return None, 0, 0
    return (a, 0, a.stride(0)) if a.dim() == 1 else (a, a.stride(0), a.stride(1))


def _mask_args(variant: Variant):
    m = variant.attn_mask
    if m is None:
        return (None, 0, 0, 0, 0), 0
    return (m, *m.stride()), (1 if m.dtype == torch.bool else 2)


def _block_args(blocks: Optional[torch.Tensor]):
    """BMASK, its (b, h, block) strides (0 where shared) and the other dimension's block count."""
    if blocks is None:
        return None, 0, 0, 0, 0
    Bm, Hm, _, width = blocks.shape
    return (blocks, blocks.stride(0) if Bm > 1 else 0, blocks.stride(1) if Hm > 1 else 0,
            blocks.stride(2), (width - 2) // 2)


def _dims(q, k, varlen: Optional[Varlen]):
    """(B, SQ, SK, H, HKV, D); SQ/SK are the longest sequences under varlen."""
    H, D = q.shape[-2], q.shape[-1]
    HKV = k.shape[-2]
    if varlen is None:
        return q.shape[0], q.shape[1], k.shape[1], H, HKV, D
    return (varlen.cu_seqlens_q.numel() - 1, varlen.max_seqlen_q, varlen.max_seqlen_k, H, HKV, D)


def _lse_buffer(q, varlen: Optional[Varlen]):
    """LSE (B, H, SQ), or (H, total_q) under varlen; returns it with (stride_b, stride_h)."""
    if varlen is None:
        B, SQ, H, _ = q.shape
        lse = runtime._empty((B, H, SQ), torch.float32, q.device)
        return lse, lse.stride(0), lse.stride(1)
    lse = runtime._empty((q.shape[1], q.shape[0]), torch.float32, q.device)
    return lse, 0, lse.stride(0)


def _common(q, varlen: Optional[Varlen], SQ: int, SK: int, variant: Variant,
            head_dim_v: Optional[int] = None):
    """Constexpr and runtime arguments shared by every kernel of one call, and the tuning key
    (dtype and the autotuner's key values). Computed once per distinct call signature.
    head_dim_v: v's head dim where it differs from q's (MLA).

    The mask: query i sees key j iff i + d - left <= j <= i + d + right, with
    d = SK - SQ of the sequence (bottom-right alignment, flash-attn's rule) plus
    ``variant.diag_offset``; a bound of -1 is absent. The kernels take the bounds
    relative to SK - SQ (WIN_LEFT, WIN_RIGHT), so the offset moves into them.
    """
    v = variant
    common, key = _common_cached(
        q.shape[-1], q.shape[-1] if head_dim_v is None else head_dim_v, q.dtype,
        varlen is not None, configs.bucket(SQ), configs.bucket(SK),
        v.softmax_scale, v.causal, v.window_left, v.window_right, v.diag_offset, v.softcap,
        v.alibi_slopes is not None, _mask_args(v)[1], v.dropout_p, v.score_mod,
        v.score_mod_grad, v.mask_mod, v.kv_blocks is not None, v.block_size)
    if v.seed:
        common = dict(common, seed=v.seed)
    return common, key


@functools.lru_cache(maxsize=1024)
def _common_cached(head_dim, head_dim_v, dtype, is_varlen, sq_bucket, sk_bucket, softmax_scale, causal,
                   window_left, window_right, diag_offset, softcap, has_alibi, mask_kind,
                   dropout_p, score_mod, score_mod_grad, mask_mod, has_block_mask, block_size):
    right = 0 if causal else window_right
    has_softcap = softcap > 0.0
    if score_mod is not None:  # score_mod takes natural-log scores
        qk_scale = softmax_scale
    else:
        qk_scale = softmax_scale * (1.0 / softcap if has_softcap else LOG2E)
    common = dict(
        HEAD_DIM=head_dim,
        WIN_LEFT=window_left - diag_offset,
        WIN_RIGHT=right + diag_offset,
        qk_scale=float(qk_scale),
        sm_scale=float(softmax_scale),
        cap2=float(softcap * LOG2E),
        IS_VARLEN=is_varlen,
        BLOCK_D=configs.block_d(head_dim),
        EVEN_D=configs.block_d(head_dim) == head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_DV=configs.block_d(head_dim_v),
        EVEN_DV=configs.block_d(head_dim_v) == head_dim_v,
        HAS_LOWER=window_left >= 0,
        HAS_UPPER=right >= 0,
        HAS_SOFTCAP=has_softcap,
        # 2: one-sided ALiBi (every visible key at or left of the diagonal: causal, or a window
        # that ends there): the backward kernels' cheaper form (kernels.common.alibi_part); the
        # forward takes the general form 1 (attention_forward: 2 measured slower there)
        HAS_ALIBI=(2 if 0 <= right and right + diag_offset <= 0 else 1) if has_alibi else 0,
        MASK_KIND=mask_kind,
        HAS_DROPOUT=dropout_p > 0.0,
        dropout_p=float(dropout_p),
        seed=0,
        SCORE_MOD=score_mod,
        SCORE_GRAD=score_mod_grad,
        MASK_MOD=mask_mod,
        HAS_BLOCK_MASK=has_block_mask,
        SPARSE=block_size,
        DOT_PREC="ieee" if dtype == torch.float32 else "tf32",
        UPCAST=_env.INTERPRET and dtype == torch.bfloat16,
        SQ_BUCKET=sq_bucket,
        SK_BUCKET=sk_bucket,
    )
    return common, (dtype, *[common[k] for k in _KEY])


def _cu(varlen: Optional[Varlen]):
    """The kernels' CU_Q, CU_K, SEQUSED_K."""
    if varlen is None:
        return None, None, None
    return varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_k


def _sizes(q, k, varlen: Optional[Varlen], SQ: int, SK: int):
    """The kernels' SQ, SK, TOTAL_Q, TOTAL_K: varlen's rows of the packed q and k (or the
    positions of a block-table row) bound every offset and length the kernels read from
    CU_Q / CU_K / SEQUSED_K (kernels.common.seq_bounds)."""
    if varlen is None:
        return SQ, SK, SQ, SK
    if varlen.block_table is not None:  # the positions of a block-table row
        return SQ, SK, q.shape[0], varlen.block_table.shape[1] * k.shape[1]
    return SQ, SK, q.shape[0], k.shape[0]


# Whether attention_forward also runs windows, softcap, ALiBi and block masks on the Gluon

def _strides(x: torch.Tensor):
    """(batch, token, head) strides of a (B, T, H, D) tensor or a packed (T, H, D) one."""
    s = x.stride()
    assert s[-1] == 1, "launchers expect a unit stride on the head dim"
    return (0, s[0], s[1]) if len(s) == 3 else s[:3]


def _signature(site: str, variant: Variant, varlen, *tensors) -> Optional[tuple]:
    """A call's signature (runtime.call_signature), None for what is not replayed: packed
    sequences, dropout and tensors in the variant."""
    if (varlen is not None or variant.dropout_p or variant.alibi_slopes is not None
            or variant.attn_mask is not None or variant.kv_blocks is not None
            or variant.q_blocks is not None or variant.sinks is not None):
        return None
    return call_signature(site, variant, *tensors)


def _windowed(variant: Variant) -> bool:
    """Whether a call has a sliding window beyond the causal mask."""
    return variant.window_left != -1 or (variant.window_right != -1 and not variant.causal)
