"""Input checks of every public entry point: one module, raising TypeError / ValueError that
name the argument and show shapes and dtypes.

``supported(q, k, v, **options)`` answers whether the kernels can run a call, and if not why
(a ``Reason`` naming the argument): dtypes, devices, dims, head dims, GQA heads, strides and
the options. ``check_qkv`` raises with the same rules; the drop-ins that fall back to torch
for what the kernels cannot do (``sdpa.sdpa_misfit``, ``integrations.comfyui.misfit``, the
transformers integration) are adapters over ``supported`` that translate their own layouts
and conventions, and log the reason at debug level.

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
"""

import math
import numbers
import operator
from typing import Optional, Tuple

import torch

from . import _env

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# What a KV cache may also hold, with its descale factors: value / descale in fp8
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

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


class Reason(str):
    """Why the kernels cannot run a call: the message, which names the argument, and in
    ``error`` the exception class (TypeError or ValueError) that ``check_qkv`` and the option
    checks raise with it."""

    error: type

    def __new__(cls, message: str, error: type = ValueError) -> "Reason":
        reason = super().__new__(cls, message)
        reason.error = error
        return reason


# The layouts of q, k, v that ``supported`` reads: the axis of the heads, and the 4-D shape's
# description. headdim is always last, batch first.
_LAYOUTS = {"bshd": (2, "(batch, seqlen, nheads, headdim)"),
            "bhsd": (1, "(batch, nheads, seqlen, headdim)")}


def _fits(q, k, v, same_batch: bool, h: int, own_v_dim: bool = False, kv_dtype=None) -> bool:
    """The one combined test for valid q, k, v (heads on axis h): reads each attribute once.
    False: ``_qkv_reason`` names the problem."""
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        qs, ks, vs, dtype = q.shape, k.shape, v.shape, q.dtype
        kv = dtype if kv_dtype is None else kv_dtype
        if (len(qs) == 4 and len(ks) == 4 and (ks == vs or own_v_dim and len(vs) == 4
                                                and ks[:3] == vs[:3] and 1 <= vs[3] <= MAX_HEAD_DIM)
                and dtype in SUPPORTED_DTYPES
                and k.dtype == kv and v.dtype == kv and 1 <= qs[3] <= MAX_HEAD_DIM
                and ks[3] == qs[3] and (ks[0] == qs[0] or not same_batch)
                and ks[h] > 0 and qs[h] % ks[h] == 0):
            device = q.device  # each .device builds a torch.device: read once per tensor
            return (k.device == device and v.device == device
                    and (device.type == "cuda" or (device.type == "cpu" and _env.INTERPRET)))
    return False


def _qkv_reason(q, k, v, names, same_batch: bool, layout: str,
                own_v_dim: bool = False, kv_dtype=None) -> Optional[Reason]:
    """The checks of ``_fits`` one by one: the first problem, named."""
    for name, x in zip(names, (q, k, v)):
        if not isinstance(x, torch.Tensor):
            return Reason(f"{name} must be a torch.Tensor, got {type(x).__name__}", TypeError)
    h, dims = _LAYOUTS[layout]
    nq, nk, nv = names
    for name, x in zip(names, (q, k, v)):
        if x.dim() != 4:
            return Reason(f"{name} must be 4-D {dims}; got {describe(x)}")
        if x.dtype not in SUPPORTED_DTYPES and (x is q or x.dtype != kv_dtype):
            return Reason(f"{name} has unsupported dtype {x.dtype}; flashtriton computes in "
                          f"float16, bfloat16 or float32 ({describe(x)})", TypeError)
    if kv_dtype is not None and not (k.dtype == v.dtype == kv_dtype):
        return Reason(f"{nk} and {nv} must both be {kv_dtype}; got {k.dtype}, {v.dtype}",
                      TypeError)
    if kv_dtype is None and not (q.dtype == k.dtype == v.dtype):
        return Reason(f"{nq}, {nk}, {nv} must share one dtype; got {q.dtype}, {k.dtype}, "
                      f"{v.dtype}", TypeError)
    device = q.device
    if k.device != device or v.device != device:
        return Reason(f"{nq}, {nk}, {nv} must be on one device; got {device}, {k.device}, "
                      f"{v.device}")
    if device.type == "cpu" and not _env.INTERPRET:
        return Reason(f"{nq} is a CPU tensor ({describe(q)}); flashtriton runs on a GPU, or on "
                      "the CPU through Triton's interpreter: set TRITON_INTERPRET=1 in the "
                      "environment before importing flashtriton")
    if device.type not in ("cpu", "cuda"):
        return Reason(f"{nq} is on device {device}; flashtriton supports CUDA/ROCm GPUs "
                      "(and the CPU with TRITON_INTERPRET=1)")
    if k.shape[:3] != v.shape[:3] or (k.shape != v.shape and not own_v_dim):
        other = (" (a head dim of its own for v, as MLA's: the forward and backward of "
                 "flash_attention and its varlen form, not the KV cache)"
                 if k.shape[:3] == v.shape[:3] else " but for the head dim")
        return Reason(f"{nk} and {nv} must have the same shape{other}; got {nk} {describe(k)} "
                      f"and {nv} {describe(v)}")
    if same_batch and k.shape[0] != q.shape[0]:
        return Reason(f"batch mismatch: {nq} {describe(q)}, {nk} {describe(k)}")
    D = q.shape[3]  # head dims: q's first, then k's against it, then v's
    if not 1 <= D <= MAX_HEAD_DIM:
        return Reason(f"{nq}'s headdim must be in 1..{MAX_HEAD_DIM}; got {D} "
                      f"({nq} {describe(q)})")
    if k.shape[3] != D:
        return Reason(f"headdim mismatch: {nq} {describe(q)}, {nk} {describe(k)}")
    if not 1 <= v.shape[3] <= MAX_HEAD_DIM:
        return Reason(f"{nv}'s headdim must be in 1..{MAX_HEAD_DIM}; got {v.shape[3]} "
                      f"({nv} {describe(v)})")
    H, HKV = q.shape[h], k.shape[h]
    if HKV == 0 and H:
        return Reason(f"{nk} has no heads (nheads_k = 0) for the {H} heads of {nq}; "
                      f"{nq} {describe(q)}, {nk} {describe(k)}")
    if HKV and H % HKV != 0:
        return Reason(f"nheads of {nq} ({H}) must be a multiple of nheads of {nk} ({HKV}); "
                      f"{nq} {describe(q)}, {nk} {describe(k)}")
    return None  # (no heads in q and k: empty results)


def _mask_reason(mask, name: str, target: tuple, device) -> Optional[Reason]:
    """Why the kernels cannot read ``mask`` tile by tile in place as a (B, H, SQ, SK) view."""
    if not isinstance(mask, torch.Tensor):
        return Reason(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}",
                      TypeError)
    if mask.requires_grad:
        return Reason(f"{name} requires grad: the kernels give no mask gradient "
                      f"({describe(mask)})")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return Reason(f"{name} has dtype {mask.dtype}; the kernels read a boolean mask (True = "
                      f"attend) or an additive float one ({describe(mask)})", TypeError)
    if mask.device != device:
        return Reason(f"{name} must be on the device of the queries ({device}); got "
                      f"{describe(mask)}")
    shape = tuple(mask.shape)
    if not 1 <= len(shape) <= 4 or any(s != 1 and s != t
                                        for s, t in zip(shape[::-1], target[::-1])):
        return Reason(f"{name} of shape {shape} does not broadcast to (batch, nheads, seqlen_q, "
                      f"seqlen_k) = {target}")
    return None


def _option_reason(check, *args) -> Optional[Reason]:
    """The problem an option check raises, as a Reason (None: the option is valid)."""
    try:
        check(*args)
    except (TypeError, ValueError) as e:
        return Reason(str(e), type(e))
    return None


def supported(q, k, v, *, names: Tuple[str, str, str] = ("q", "k", "v"), layout: str = "bshd",
              same_batch: bool = True, own_v_dim: bool = True, unit_stride: bool = False,
              attn_mask=None,
              mask_name: str = "attn_mask", dropout_p=None, softmax_scale=None, window_size=None,
              softcap=None, alibi_slopes=None, causal=None, deterministic=None,
              batch_invariant=None, sinks=None, score_mod=None, score_mod_grad=None,
              mask_mod=None, block_mask=None) -> Optional[Reason]:
    """Whether the kernels can run this call: None, or why not -- a ``Reason`` (a str naming
    the argument, with the exception class ``check_qkv`` raises in ``reason.error``). Reads
    tensor metadata only (a tensor-valued scalar option is read on the host).

    q, k, v: 4-D tensors in ``layout`` ("bshd": (batch, seqlen, nheads, headdim), the native
    API's; "bhsd": (batch, nheads, seqlen, headdim), torch SDPA's), float16 / bfloat16 /
    float32 of one dtype, on one CUDA device (or the CPU under TRITON_INTERPRET=1); k and v
    of one shape but v's head dim, which may differ (as MLA's, 1..MAX_HEAD_DIM: flash_attention
    takes it; ``own_v_dim=False``: v's as k's), with q's head dim (1..MAX_HEAD_DIM) and batch
    (any batch with ``same_batch=False``: KV caches); q's heads a multiple of k's (GQA/MQA). ``names``: the arguments' names
    in the messages.

    Any strides: the entry points copy a tensor whose stride on headdim is not 1
    (``unit_last``). ``unit_stride=True`` refuses such tensors instead (for tensors the
    kernels write in place, which a copy would detach).

    Options, checked when given (None: not given):
      attn_mask (named ``mask_name``): a mask the kernels read in place through a
        (batch, nheads, seqlen_q, seqlen_k) broadcast view: a tensor, bool or floating, on
        q's device, 1..4 dims broadcastable to that shape, not requiring grad.
      dropout_p: a real number in [0, 1).
      softmax_scale, window_size, softcap, alibi_slopes, sinks: as ``check_scale``,
        ``check_window``, ``check_softcap``, ``check_alibi`` and ``check_sinks`` accept them.
      causal, deterministic, batch_invariant: flags (``check_flag``).
      score_mod, score_mod_grad, mask_mod, block_mask: as ``check_mods`` accepts them with
        the other options.
    Every keyword option of ``flash_attention`` is one of these.

    The drop-ins add their own conventions on top (``sdpa.sdpa_misfit``:
    ``enable_gqa``, a mask in query's dtype, no mask with ``is_causal``;
    ``integrations.comfyui.misfit``: (batch, seqlen, heads * headdim) inputs)."""
    try:
        h = _LAYOUTS[layout][0]
    except KeyError:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}") from None
    if not _fits(q, k, v, same_batch, h, own_v_dim):
        reason = _qkv_reason(q, k, v, names, same_batch, layout, own_v_dim)
        if reason is not None:
            return reason
    if unit_stride:
        for name, x in zip(names, (q, k, v)):
            reason = _stride_reason(name, x)
            if reason is not None:
                return reason
    if attn_mask is not None:
        seq = 3 - h  # the seqlen axis
        target = (q.shape[0], q.shape[h], q.shape[seq], k.shape[seq])
        reason = _mask_reason(attn_mask, mask_name, target, q.device)
        if reason is not None:
            return reason
    if dropout_p is not None and not (type(dropout_p) in (float, int) and 0 <= dropout_p < 1):
        reason = _option_reason(_dropout_p, dropout_p)
        if reason is not None:
            return reason
    mods = (score_mod, score_mod_grad, mask_mod, block_mask)
    has_mods = any(m is not None for m in mods)
    if softmax_scale is None and window_size is None and softcap is None \
            and alibi_slopes is None and causal is None and deterministic is None \
            and batch_invariant is None and sinks is None and not has_mods:
        return None
    for name, flag in (("causal", causal), ("deterministic", deterministic),
                       ("batch_invariant", batch_invariant)):
        if flag is not None:
            reason = _option_reason(check_flag, name, flag)
            if reason is not None:
                return reason
    for check, args in ((check_scale, (softmax_scale, q.shape[3])),
                        (check_window, (window_size,)), (check_softcap, (softcap,)),
                        (check_alibi, (alibi_slopes, q.shape[0], q.shape[h], q.device)),
                        (check_sinks, (sinks, q.shape[h], q.device))):
        if args[0] is not None:
            reason = _option_reason(check, *args)
            if reason is not None:
                return reason
    if has_mods:  # (every other option is valid here)
        seq = 3 - h
        dims = (q.shape[0], q.shape[h], q.shape[seq], k.shape[seq])
        return _option_reason(
            check_mods, q, k, dims, causal is not None and check_flag("causal", causal),
            (-1, -1) if window_size is None else check_window(window_size),
            0.0 if softcap is None else check_softcap(softcap), alibi_slopes, attn_mask,
            0.0 if dropout_p is None else _dropout_p(dropout_p), *mods)
    return None


def check_qkv(q, k, v, names=("q", "k", "v"), same_batch: bool = True,
              own_v_dim: bool = False, kv_dtype: Optional[torch.dtype] = None) -> None:
    """Raise TypeError/ValueError naming the argument for input the kernels cannot take
    (``supported``'s rules for (batch, seqlen, nheads, headdim) q, k, v).
    same_batch=False: k and v may have another batch size than q (KV caches); own_v_dim:
    v's head dim may differ from q's and k's (MLA); kv_dtype: the dtype k and v hold instead
    of q's (an fp8 KV cache).

    Every call pays for this (host time): valid input passes one combined test, reading
    each attribute once; anything else goes through the checks one by one, which name
    the problem."""
    if _fits(q, k, v, same_batch, 2, own_v_dim, kv_dtype):
        return
    reason = _qkv_reason(q, k, v, names, same_batch, "bshd", own_v_dim, kv_dtype)
    if reason is not None:
        raise reason.error(str(reason))


def check_deterministic(deterministic) -> bool:
    """A bitwise-repeatable backward: asked for (a flag, ``check_flag``), or
    torch.use_deterministic_algorithms(True)."""
    return check_flag("deterministic", deterministic) \
        or torch.are_deterministic_algorithms_enabled()


def check_flag(name: str, value) -> bool:
    """A switch: a bool, a numpy bool or a 0-d bool tensor on the CPU; anything else (None,
    strings, numbers, a tensor on a GPU, whose value would cost a device sync) a TypeError
    naming it. Reads types only, but for the CPU tensor's one element."""
    if value is True or value is False:
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool and value.dim() == 0 and value.device.type == "cpu":
            return bool(value)
        raise TypeError(f"{name} must be a bool (or a 0-d bool tensor on the CPU); got a tensor "
                        f"of {describe(value)}")
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise TypeError(f"{name} must be a bool, got {kind.__name__} {shown}")


def _stride_reason(name: str, x: torch.Tensor) -> Optional[Reason]:
    """Why the kernels cannot read or write x in place: a stride on headdim other than 1
    (they load and store a head's elements as one vector)."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return Reason(f"{name} must have a unit stride on headdim; got strides {x.stride()} "
                      f"({describe(x)})")
    return None


def check_unit_stride(name: str, x: torch.Tensor) -> None:
    """ValueError naming x and its strides where its stride on headdim is not 1: for tensors
    the kernels write or read in place (KV caches), which a copy would detach."""
    reason = _stride_reason(name, x)
    if reason is not None:
        raise ValueError(f"{reason}: the kernels read and write it in place")


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy where its stride on headdim is not 1 (what the kernels need).
    An empty x (zero heads, say) counts as contiguous whatever its strides, and contiguous()
    returns it as it is: a new empty tensor then (it has no elements to copy)."""
    if x.stride(-1) == 1:
        return x
    return x.new_empty(x.shape) if x.numel() == 0 else x.contiguous()


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
    """ALiBi slopes: None, or float32 (nheads,) or (batch, nheads) on q's device (returned
    contiguous: a view's strides never reach the kernels)."""
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
    return alibi_slopes.contiguous()


def check_sinks(sinks, H: int, device, name: str = "sinks") -> Optional[torch.Tensor]:
    """Attention sinks: None, or one float logit a query head, (nheads,) on q's device
    (returned with a unit stride, which the kernels read)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name} must be float16, bfloat16 or float32 (one logit a query head); "
                        f"got {describe(sinks)}")
    if tuple(sinks.shape) != (H,):
        raise ValueError(f"{name} must have shape (nheads,) = ({H},), one logit a query head; "
                         f"got {describe(sinks)}")
    if sinks.device != device:
        raise ValueError(f"{name} must be on q's device {device}; got {describe(sinks)}")
    return sinks.contiguous()


def check_mods(q, k, dims: Tuple[int, int, int, int], causal, window, softcap, alibi_slopes,
               attn_mask, dropout_p, score_mod, score_mod_grad, mask_mod, block_mask) -> None:
    """The user's modifiers, given at least one of score_mod / mask_mod / block_mask (or
    score_mod_grad, which needs score_mod): alone
    (not with causal, a window, softcap, ALiBi, a mask or dropout: those go into the mods),
    score_mod with score_mod_grad where a gradient flows, and a ``BlockMask`` made for
    (batch, nheads, seqlen_q, seqlen_k) = ``dims`` (or 1 for batch / nheads) on q's device
    whose mask_mod is mask_mod's. The other options as checked values."""
    if score_mod is None and score_mod_grad is not None:
        raise ValueError("score_mod_grad was given without score_mod")
    others = dict(causal=causal, window_size=window != (-1, -1), softcap=softcap > 0,
                  alibi_slopes=alibi_slopes is not None, attn_mask=attn_mask is not None,
                  dropout_p=dropout_p > 0)
    clash = [name for name, used in others.items() if used]
    if clash:
        raise ValueError(f"score_mod / mask_mod / block_mask cannot be combined with {clash}; "
                         "express them in the mods (e.g. causal as a mask_mod)")
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if score_mod is not None and score_mod_grad is None and needs_grad:
        raise ValueError("score_mod needs score_mod_grad (its derivative with respect to the "
                         "score, same arguments) for the backward")
    if block_mask is None:
        return
    from .block_mask import BlockMask
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask (create_block_mask), got "
                        f"{type(block_mask).__name__}")
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError("mask_mod differs from block_mask.mask_mod; pass one of them")
    B, H, SQ, SK = dims
    Bm, Hm = block_mask.kv_blocks.shape[:2]
    if (block_mask.seqlen_q, block_mask.seqlen_k) != (SQ, SK) or Bm not in (1, B) \
            or Hm not in (1, H):
        raise ValueError(f"block_mask was made for (B, H, seqlen_q, seqlen_k) = ({Bm}, {Hm}, "
                         f"{block_mask.seqlen_q}, {block_mask.seqlen_k}); q {describe(q)}, "
                         f"k {describe(k)}")
    if block_mask.kv_blocks.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.kv_blocks.device}, q on {q.device}")


def check_descale(name: str, d, B: int, HKV: int, device) -> torch.Tensor:
    """fp8 dequantisation factors (value = stored x descale): a float32 tensor on q's device,
    (batch, nheads_k) as FlashAttention-3's or (nheads_k,), returned as a (batch, nheads_k)
    view."""
    if not isinstance(d, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(d).__name__}")
    if d.dtype != torch.float32:
        raise TypeError(f"{name} must be float32; got {describe(d)}")
    if d.device != device:
        raise ValueError(f"{name} must be on q's device {device}; got {describe(d)}")
    if tuple(d.shape) not in ((B, HKV), (HKV,)):
        raise ValueError(f"{name} must have shape (batch, nheads_k) = ({B}, {HKV}) or "
                         f"(nheads_k,) = ({HKV},), one factor a KV head; got {describe(d)}")
    return d.expand(B, HKV)


def check_descales(k_cache, v_cache, k_descale, v_descale, B: int,
                   device) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """An fp8 KV cache's factors (``check_descale``), as (batch, nheads_k) views; (None, None)
    for a cache in q's dtype, which takes none. Needs a GPU that converts fp8 (compute
    capability 8.9+) or the interpreter."""
    given = (("k_descale", k_descale), ("v_descale", v_descale))
    if k_cache.dtype not in FP8_DTYPES:
        for name, d in given:
            if d is not None:
                raise ValueError(f"{name} applies to fp8 KV caches ({_FP8_NAMES}); k_cache is "
                                 f"{k_cache.dtype}")
        return None, None
    if device.type == "cuda" and torch.version.hip is None \
            and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"an fp8 KV cache ({describe(k_cache)}) needs a GPU of compute "
                         f"capability 8.9 or later (Ada, Hopper, Blackwell); this one is "
                         f"{torch.cuda.get_device_capability(device)}")
    HKV = k_cache.shape[2]
    for name, d in given:
        if d is None:
            raise ValueError(f"{name} is needed with an fp8 KV cache ({describe(k_cache)}, "
                             f"holding value / descale): a float32 (batch, nheads_k) = ({B}, "
                             f"{HKV}) or (nheads_k,) tensor")
    return tuple(check_descale(name, d, B, HKV, device) for name, d in given)


_FP8_NAMES = "torch.float8_e4m3fn or torch.float8_e5m2"


def _dropout_p(dropout_p) -> float:
    p = _real("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    return p


def check_dropout(dropout_p, seed: Optional[torch.Tensor] = None
                  ) -> Tuple[float, Optional[torch.Tensor]]:
    """(p, seed): the seed is drawn from torch's default CPU generator, so
    torch.manual_seed makes dropout reproducible; a CPU tensor, so no device sync. A given
    ``seed`` (a 0-d int64 CPU tensor: a backward replaying a forward's mask) is used as is."""
    p = _dropout_p(dropout_p)
    if p == 0.0:
        return 0.0, None
    if seed is not None:
        return p, seed
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


def check_num_splits(num_splits) -> int:
    """KV splits a sequence: an int >= 0 (0: as many as fill the GPU); bools are refused."""
    if not (isinstance(num_splits, bool) or type(num_splits).__name__ == "bool_"):
        try:
            value = operator.index(num_splits)
        except TypeError:
            pass
        else:
            if value < 0:
                raise ValueError(f"num_splits must be >= 0 (0: as many as fill the GPU), got "
                                 f"{value}")
            return value
    shown = describe(num_splits) if isinstance(num_splits, torch.Tensor) else repr(num_splits)
    raise TypeError(f"num_splits must be an int >= 0 (0: as many as fill the GPU), got "
                    f"{type(num_splits).__name__} {shown:.80}")


def check_index_tensor(name: str, x, device, shape: Optional[tuple] = None, dims: int = 1,
                       what: str = "") -> torch.Tensor:
    """An int32 index tensor on ``device`` (of ``shape`` if given, else ``dims``-D), returned
    contiguous: the kernels index its storage as a dense array, so a strided view (``t[::2]``,
    a column, a transposed table) is copied (on its device: no synchronisation)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32 or (shape is not None and tuple(x.shape) != tuple(shape)) \
            or (shape is None and x.dim() != dims):
        want = f"shape {tuple(shape)}" if shape is not None else f"{dims}-D"
        raise ValueError(f"{name} must be an int32 tensor of {want}{what}; got {describe(x)}")
    if x.device != device:
        raise ValueError(f"{name} must be on q's device {device}; got {describe(x)}")
    return x.contiguous()


def check_cu_seqlens(name, cu, device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype != torch.int32:
        raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 cumulative lengths; "
                         f"got {describe(cu)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}); got {describe(cu)}")
    return cu.contiguous()


def check_out(out, q: torch.Tensor, head_dim: Optional[int] = None) -> torch.Tensor:
    """An output buffer (``out=``): q's shape (with v's head dim ``head_dim`` where given),
    dtype and device, a unit stride on headdim."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    shape = q.shape if head_dim is None else (*q.shape[:-1], head_dim)
    if out.shape != shape or out.dtype != q.dtype or out.device != q.device \
            or out.stride(-1) != 1:
        raise ValueError(f"out must have shape {tuple(shape)} (q's, with v's head dim), q's dtype "
                         f"and device ({describe(q)}) and a unit stride on headdim; got "
                         f"{describe(out)}")
    return out


def check_block_table(block_table, page_size: int, B: int, device) -> torch.Tensor:
    """A paged cache's block table: (batch, max_pages) int32 on q's device, pages of a power
    of two >= 8 tokens (k_cache.shape[1]); returned contiguous (``check_index_tensor``)."""
    if page_size < 8 or page_size & (page_size - 1):
        raise ValueError(f"page_size (k_cache.shape[1]) must be a power of two >= 8; got "
                         f"{page_size}")
    table = check_index_tensor("block_table", block_table, device, dims=2,
                               what=" (batch, max_blocks)")
    if table.shape[0] != B:
        raise ValueError(f"block_table must be (batch, max_blocks) int32 with batch {B}; "
                         f"got {describe(block_table)}")
    return table


def _contents(*tensors) -> bool:
    """Whether to check these index tensors' entries: validation mode, or all on the CPU."""
    present = [t for t in tensors if t is not None]
    return bool(present) and (_VALIDATE or all(t.device.type == "cpu" for t in present))


def check_varlen_indices(cu_q: torch.Tensor, cu_k: Optional[torch.Tensor], total_q: int,
                         total_k: Optional[int], max_q: int, max_k: int) -> None:
    """cu_seqlens_q / _k start at 0, never decrease, end within the packed tensors (total_k
    None: k is paged, cu_seqlens_k only gives lengths; cu_k None: none given), and no
    sequence is longer than its max_seqlen (validation mode or CPU tensors)."""
    if not _contents(cu_q, cu_k):
        return
    for name, cu, total, longest, side in (("cu_seqlens_q", cu_q, total_q, max_q, "q"),
                                           ("cu_seqlens_k", cu_k, total_k, max_k, "k")):
        if cu is None:
            continue
        entries = cu.tolist()
        if entries[0] != 0:
            raise ValueError(f"{name}[0] = {entries[0]}: cumulative lengths start at 0")
        if total is not None and entries[-1] > total:
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


def check_seqused_k(seqused_k: Optional[torch.Tensor], cu_k: Optional[torch.Tensor]) -> None:
    """Packed keys (no pages): sequence b uses seqused_k[b] of its cu_seqlens_k[b + 1] -
    cu_seqlens_k[b] keys, so 0 <= seqused_k[b] <= that length (validation mode or CPU
    tensors)."""
    if seqused_k is None or cu_k is None or not _contents(seqused_k, cu_k):
        return
    ends = cu_k.tolist()
    for b, n in enumerate(seqused_k.tolist()):
        if not 0 <= n <= ends[b + 1] - ends[b]:
            raise ValueError(f"seqused_k[{b}] = {n} is outside [0, {ends[b + 1] - ends[b]}], the "
                             f"keys of sequence {b} (cu_seqlens_k[{b + 1}] - cu_seqlens_k[{b}])")


def check_cache_indices(cache_seqlens: torch.Tensor, s_new: int, capacity: int, rows: int,
                        block_table: Optional[torch.Tensor], page_size: int,
                        cache_batch_idx: Optional[torch.Tensor],
                        cache_leftpad: Optional[torch.Tensor],
                        rotary_len: Optional[Tuple[int, int]] = None,
                        lengths_name: str = "cache_seqlens") -> None:
    """Every sequence's keys (cache_seqlens[b] + s_new, the appended ones included) fit its
    cache: ``capacity`` positions (a contiguous cache's length, or block_table's pages times
    page_size), its row (cache_batch_idx) or pages (block_table) lie in the ``rows`` rows or
    pages of the cache, its left padding lies in [0, cache_seqlens[b]], and rotary_len
    (seqlen_ro, positions past cache_seqlens[b] taken) covers its rotary positions
    (validation mode or CPU tensors). ``lengths_name``: what the errors call cache_seqlens
    (e.g. seqused_k)."""
    if not _contents(cache_seqlens, block_table, cache_batch_idx, cache_leftpad):
        return
    lens = cache_seqlens.tolist()
    for b, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"{lengths_name}[{b}] = {n} is negative")
        if n + s_new > capacity:
            where = (f"the {block_table.shape[1]} pages of {page_size} tokens in "
                     f"block_table[{b}]" if block_table is not None
                     else f"the cache's {capacity} positions (k_cache.shape[1])")
            new = f" + {s_new} new keys" if s_new else ""
            raise ValueError(f"{lengths_name}[{b}] = {n}{new} exceeds {where}")
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
