"""Input checks of every public entry point: one module, raising TypeError / ValueError that
name the argument and show shapes and dtypes.

Two kinds of check:

- Arguments (types, shapes, dtypes, devices, option values): always. They read tensor
  metadata only, so they never synchronise with the device.
- Index contents (``cu_seqlens_*``, ``cache_seqlens``, ``block_table``, ``cache_batch_idx``,
  ``cache_leftpad``): whether every entry lies inside the tensors it indexes. Reading a device
  tensor's entries synchronises, so for GPU tensors these run only in validation mode
  (``FLASHTRITON_VALIDATE=1``, or ``set_validation(True)``); index tensors that live on the
  CPU (Triton's interpreter) are always checked. Without the checks the kernels still never
  read or write outside their tensors: a sequence whose indices are out of range sees no
  keys and writes nothing of others' (its output rows are 0, its LSE -inf).

The drop-ins that fall back to torch for what the kernels cannot do (``sdpa.sdpa_misfit``,
``integrations.comfyui.misfit``, the transformers integration) log the reason at debug level.
"""

import math
import numbers
import operator
from typing import Optional, Tuple

import torch

from . import _env

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_VALIDATE = _env.VALIDATE


def set_validation(enabled: bool) -> None:
    """Validation mode on or off for this process (its default: ``FLASHTRITON_VALIDATE``):
    on, every call also checks the contents of its index tensors on the host (one device
    synchronisation per call) and raises ValueError naming the argument and the entry."""
    global _VALIDATE
    _VALIDATE = bool(enabled)


def validating() -> bool:
    return _VALIDATE


def describe(x: torch.Tensor) -> str:
    return f"shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"


def check_qkv(q, k, v, names=("q", "k", "v"), same_batch: bool = True) -> None:
    """Raise TypeError/ValueError naming the argument for input the kernels cannot take.
    same_batch=False: k and v may have another batch size than q (KV caches).

    Every call pays for this (host time): valid input passes one combined test, reading
    each attribute once; anything else goes through the checks one by one, which name
    the problem."""
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        qs, ks, dtype = q.shape, k.shape, q.dtype
        if (len(qs) == 4 and len(ks) == 4 and ks == v.shape and dtype in SUPPORTED_DTYPES
                and k.dtype == dtype and v.dtype == dtype and 1 <= qs[3] <= MAX_HEAD_DIM
                and ks[3] == qs[3] and (ks[0] == qs[0] or not same_batch)
                and ks[2] > 0 and qs[2] % ks[2] == 0):
            device = q.device
            if (k.device == device and v.device == device
                    and (device.type == "cuda" or (device.type == "cpu" and _env.INTERPRET))):
                return
    _diagnose_qkv(q, k, v, names, same_batch)


def _diagnose_qkv(q, k, v, names, same_batch: bool) -> None:
    """check_qkv's checks one by one: raises naming the first problem."""
    for name, x in zip(names, (q, k, v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    nq, nk, nv = names
    for name, x in zip(names, (q, k, v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, nheads, headdim); got {describe(x)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {x.dtype}; flashtriton computes in "
                            f"float16, bfloat16 or float32 ({describe(x)})")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{nq}, {nk}, {nv} must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device  # each .device builds a torch.device: read once per tensor
    if k.device != device or v.device != device:
        raise ValueError(f"{nq}, {nk}, {nv} must be on one device; got {device}, {k.device}, {v.device}")
    if device.type == "cpu" and not _env.INTERPRET:
        raise ValueError(f"{nq} is a CPU tensor ({describe(q)}); flashtriton runs on a GPU, or on "
                         "the CPU through Triton's interpreter: set TRITON_INTERPRET=1 in the "
                         "environment before importing flashtriton")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{nq} is on device {device}; flashtriton supports CUDA/ROCm GPUs "
                         "(and the CPU with TRITON_INTERPRET=1)")
    B, SQ, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{nk} and {nv} must have the same shape; got {nk} {describe(k)} and "
                         f"{nv} {describe(v)}")
    if same_batch and k.shape[0] != B:
        raise ValueError(f"batch mismatch: {nq} {describe(q)}, {nk} {describe(k)}")
    if k.shape[3] != D:
        raise ValueError(f"headdim mismatch: {nq} {describe(q)}, {nk} {describe(k)}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"headdim must be in 1..{MAX_HEAD_DIM}; got {D} ({nq} {describe(q)})")
    HKV = k.shape[2]
    if HKV == 0 or H % HKV != 0:
        raise ValueError(f"nheads of {nq} ({H}) must be a multiple of nheads of {nk} ({HKV}); "
                         f"{nq} {describe(q)}, {nk} {describe(k)}")


def _real(name: str, value) -> float:
    """A float from any real number: Python, numpy or a one-element tensor (flash-attn's
    binding takes them all); bools are refused. A CUDA tensor costs a host sync."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number; got a tensor of {describe(value)}")
        value = value.item()
    if isinstance(value, bool) or type(value).__name__ == "bool_" \
            or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_scale(softmax_scale, head_dim: int) -> float:
    """softmax_scale as a float (None: 1 / sqrt(head_dim)); finite."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _finite("softmax_scale", _real("softmax_scale", softmax_scale))


def _index(name: str, value, window_size) -> int:
    if isinstance(value, bool) or type(value).__name__ == "bool_" or (
            isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be a pair (left, right) of ints, got {window_size!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a pair (left, right) of ints, got {window_size!r}") \
            from None


def check_window(window_size) -> Tuple[int, int]:
    """(left, right) from any pair of int-likes (tuple, list, 2-element tensor or array);
    -1 leaves a side unbounded."""
    if type(window_size) is tuple and len(window_size) == 2 \
            and type(window_size[0]) is int and type(window_size[1]) is int:
        left, right = window_size  # the common case, without the generic path's calls
    else:
        if isinstance(window_size, torch.Tensor) and window_size.numel() == 2:
            window_size = window_size.reshape(2).tolist()
        try:
            left, right = window_size
        except (TypeError, ValueError):
            raise TypeError(f"window_size must be a pair (left, right) of ints, got "
                            f"{window_size!r}") from None
        left = _index("window_size", left, window_size)
        right = _index("window_size", right, window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got "
                         f"{(left, right)!r}")
    return left, right


def check_softcap(softcap) -> float:
    value = _finite("softcap", _real("softcap", softcap))
    if value < 0.0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {value}")
    return value


def check_alibi(alibi_slopes, B: int, H: int, device) -> Optional[torch.Tensor]:
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got "
                        f"{type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {describe(alibi_slopes)}")
    if tuple(alibi_slopes.shape) not in ((H,), (B, H)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({H},) or (batch, nheads) = "
                         f"({B}, {H}); got {describe(alibi_slopes)}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on q's device {device}; got {describe(alibi_slopes)}")
    return alibi_slopes


def check_dropout(dropout_p) -> Tuple[float, Optional[torch.Tensor]]:
    """(p, seed): the seed is drawn from torch's default CPU generator, so
    torch.manual_seed makes dropout reproducible; a CPU tensor, so no device sync."""
    p = _real("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    if p == 0.0:
        return 0.0, None
    return p, torch.randint(0, 2**31 - 1, (), dtype=torch.int64)


def check_max_seqlen(name, value) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point:
            raise TypeError(f"{name} must be an int or a 0-d integer tensor; got "
                            f"{describe(value)}")
        value = int(value)  # a CUDA tensor costs a host sync here; pass an int to avoid it
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise TypeError(f"{name} must be a non-negative int; got {value!r}")
    return int(value)


def check_index_tensor(name: str, x, device, shape: Optional[tuple] = None, dims: int = 1,
                       what: str = "") -> torch.Tensor:
    """An int32 index tensor on ``device`` (of ``shape`` if given, else ``dims``-D)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32 or (shape is not None and tuple(x.shape) != tuple(shape)) \
            or (shape is None and x.dim() != dims):
        want = f"shape {tuple(shape)}" if shape is not None else f"{dims}-D"
        raise ValueError(f"{name} must be an int32 tensor of {want}{what}; got {describe(x)}")
    if x.device != device:
        raise ValueError(f"{name} must be on q's device {device}; got {describe(x)}")
    return x


def check_cu_seqlens(name, cu, device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype != torch.int32:
        raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 cumulative lengths; "
                         f"got {describe(cu)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}); got {describe(cu)}")
    return cu.contiguous()


def _contents(*tensors) -> bool:
    """Whether to check these index tensors' entries: validation mode, or all on the CPU."""
    present = [t for t in tensors if t is not None]
    return bool(present) and (_VALIDATE or all(t.device.type == "cpu" for t in present))


def check_varlen_indices(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int,
                         max_q: int, max_k: int) -> None:
    """cu_seqlens_q / _k start at 0, never decrease, end within the packed tensors, and no
    sequence is longer than its max_seqlen (validation mode or CPU tensors)."""
    if not _contents(cu_q, cu_k):
        return
    for name, cu, total, longest, side in (("cu_seqlens_q", cu_q, total_q, max_q, "q"),
                                           ("cu_seqlens_k", cu_k, total_k, max_k, "k")):
        entries = cu.tolist()
        if entries[0] != 0:
            raise ValueError(f"{name}[0] = {entries[0]}: cumulative lengths start at 0")
        if entries[-1] > total:
            raise ValueError(f"{name}[{len(entries) - 1}] = {entries[-1]} exceeds the {total} "
                             f"packed tokens of {side}")
        for b in range(1, len(entries)):
            if entries[b] < entries[b - 1]:
                raise ValueError(f"{name}[{b}] = {entries[b]} < {name}[{b - 1}] = "
                                 f"{entries[b - 1]}: cumulative lengths never decrease")
            if entries[b] - entries[b - 1] > longest:
                raise ValueError(f"sequence {b - 1} has {entries[b] - entries[b - 1]} tokens "
                                 f"({name}[{b}] - {name}[{b - 1}]), more than max_seqlen_{side} "
                                 f"= {longest}")


def check_cache_indices(cache_seqlens: torch.Tensor, s_new: int, capacity: int, rows: int,
                        block_table: Optional[torch.Tensor], page_size: int,
                        cache_batch_idx: Optional[torch.Tensor],
                        cache_leftpad: Optional[torch.Tensor],
                        rotary_len: Optional[Tuple[int, int]] = None) -> None:
    """Every sequence's keys (cache_seqlens[b] + s_new, the appended ones included) fit its
    cache: ``capacity`` positions (a contiguous cache's length, or block_table's pages times
    page_size), its row (cache_batch_idx) or pages (block_table) lie in the ``rows`` rows or
    pages of the cache, its left padding lies in [0, cache_seqlens[b]], and rotary_len
    (seqlen_ro, positions past cache_seqlens[b] taken) covers its rotary positions
    (validation mode or CPU tensors)."""
    if not _contents(cache_seqlens, block_table, cache_batch_idx, cache_leftpad):
        return
    lens = cache_seqlens.tolist()
    for b, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] = {n} is negative")
        if n + s_new > capacity:
            where = (f"the {block_table.shape[1]} pages of {page_size} tokens in "
                     f"block_table[{b}]" if block_table is not None
                     else f"the cache's {capacity} positions (k_cache.shape[1])")
            new = f" + {s_new} new keys" if s_new else ""
            raise ValueError(f"cache_seqlens[{b}] = {n}{new} exceeds {where}")
        if rotary_len is not None and n + rotary_len[1] > rotary_len[0]:
            raise ValueError(f"cache_seqlens[{b}] = {n}: rotary positions up to "
                             f"{n + rotary_len[1] - 1} need rotary_cos / rotary_sin of at least "
                             f"{n + rotary_len[1]} rows, got {rotary_len[0]}")
    if cache_batch_idx is not None:
        for b, row in enumerate(cache_batch_idx.tolist()):
            if not 0 <= row < rows:
                raise ValueError(f"cache_batch_idx[{b}] = {row} is outside the cache's {rows} "
                                 f"rows (k_cache.shape[0])")
    if cache_leftpad is not None:
        for b, pad in enumerate(cache_leftpad.tolist()):
            if not 0 <= pad <= lens[b]:
                raise ValueError(f"cache_leftpad[{b}] = {pad} is outside [0, cache_seqlens[{b}] "
                                 f"= {lens[b]}]")
    if block_table is not None:
        table = block_table.tolist()
        for b, n in enumerate(lens):
            for j in range(-(-(n + s_new) // page_size)):  # the pages sequence b uses
                if not 0 <= table[b][j] < rows:
                    raise ValueError(f"block_table[{b}, {j}] = {table[b][j]} is outside the "
                                     f"pool's {rows} pages (k_cache.shape[0])")
