"""Launchers: allocate outputs, pick the config, compute the grid, launch.

Plain Python over the ``@triton.jit`` kernels of ``flashtriton.kernels``; no
autograd and no input validation here (``flashtriton.api`` validates). Every
tensor is (B, T, H, D) with a unit stride on D; everything else may be strided.
"""

import functools
import logging
import math
import operator
from typing import NamedTuple, Optional, Tuple

import torch
import triton
from triton import knobs
from triton.runtime import _allocation, driver

from . import _env, configs
from .kernels.attn_bwd import (_attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_prep_kernel,
                               _varlen_spans_kernel)
from .kernels.attn_fwd import _attn_fwd_kernel
from .kernels.decode import _attn_decode_kernel

LOG2E = math.log2(math.e)
_KEY = ["SQ_BUCKET", "SK_BUCKET", "HEAD_DIM", "IS_VARLEN", "HAS_LOWER", "HAS_UPPER", "HAS_SOFTCAP",
        "HAS_ALIBI", "MASK_KIND", "HAS_DROPOUT", "HAS_BLOCK_MASK", "SPARSE"]


_DECODE_KEY = ["SPLIT_BUCKET", "WAVES", "BLOCK_M", "BLOCK_D", "PAGED", "HAS_LOWER", "HAS_UPPER",
               "HAS_SOFTCAP", "HAS_ALIBI", "HAS_BATCH_IDX", "HAS_LEFTPAD"]


def flush_l2(cache: torch.Tensor) -> None:
    """Evict the L2 and leave it clean, before a timed call: read ``cache`` (256 MB, Triton's
    benchmark buffer). do_bench's flush zeroes it instead, which leaves the L2 full of dirty
    lines; the timed kernel's reads evict them, so the DRAM also writes up to the L2's 50 MB
    during it. On the H200 that took 13% of a 268 MB decoding step's time (B=8 8K: 3446 GB/s
    after the zeroing, 3902 after this read; SDPA 3462 and 3927; scripts/probe_decode_flush.py,
    docs/perf.md session 26), a cost of the flush, not of the step."""
    cache.view(torch.int32).sum()


def gpu_time_ms(fn, quantiles=(0.5, 0.2, 0.8), reps: int = 40):
    """Quantiles of fn's GPU time in ms, each call after a clean L2 flush, with the host's time
    kept out: the GPU first sleeps while the host queues every call, so no call waits for its
    launch. The decoding tuner's benchmarker: its candidates run 5-25 us, while each tuning
    call goes through Triton's JITFunction.run (~60 us of host time on the H200's host, more
    than do_bench's flush hides), so do_bench timed the host and picked tiles at random
    (session 25: B=1 8K took a 128-key tile 13% slower in a graph than the 64-key one)."""
    import time
    cache = driver.active.get_empty_cache_for_benchmark()
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        flush_l2(cache)
        fn()
    host = (time.perf_counter() - t) / 3  # seconds of host time a call, flush included
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    torch.cuda._sleep(int(2 * reps * host * 2e9))  # cycles (<= 2 GHz): twice the host's time
    for start, end in events:
        flush_l2(cache)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = torch.tensor([start.elapsed_time(end) for start, end in events])
    return [float(torch.quantile(times, q)) for q in quantiles]


def _autotuned(kind: str, kernel, key=(*_KEY, "USE_TMA")):
    cands = configs.candidates(kind)

    def early_prune(cfgs, named_args, **kwargs):
        max_block = kwargs["SPARSE"] if kwargs.get("HAS_BLOCK_MASK") else 1 << 30
        keep = configs.prune(kind, [_cfg_tuple(c) for c in cfgs], kwargs["BLOCK_D"],
                             named_args["Q"].element_size(), max_block)
        return [c for c in cfgs if _cfg_tuple(c) in keep]

    return triton.autotune(
        configs=[triton.Config(configs.as_kwargs(c), num_warps=c[2], num_stages=c[3])
                 for c in cands],
        key=key,
        prune_configs_by={"early_config_prune": early_prune},
        cache_results=True,
        do_bench=gpu_time_ms if kind == "decode" else None,
    )(kernel)


# (kernel, dtype, tuning key) -> its tuned triton.Config. Triton's Autotuner.run rebuilds its
# key from every argument on every call (~100 us of host time for these kernels): after the
# first call for a key, launch the JIT function with the tuned config directly.
_TUNED = {}
# Triton's JITFunction.run binds and specialises all ~75 arguments on every call (~60 us of
# host time on the H200's host). A call whose kernel, tuning key, device, tensor dtypes and
# every non-tensor argument equal an earlier call's, with 16-byte aligned tensors (what Triton
# specialises pointers on), replays that call's compiled kernel: only the pointers are new.
# The dropout seed is left out of the match: the kernels do not specialise on it.
_COMPILED = {}
_COMPILED_MAX = 512
_PLANS = {}  # (id(kernel), positional count) -> (leading tensor arguments, getter of the rest)
FAST_LAUNCHES = 0  # how many launches took a cached path (tests read it)


class Replay(NamedTuple):
    """A compiled kernel with its grid and every argument after the leading tensors: calling
    it with new leading tensors (same dtypes, 16-byte aligned) launches it on the current
    stream, as Triton's JITFunction.run would after binding the same arguments."""
    compiled: object
    grid: Tuple[int, int, int]
    lead: int       # how many leading (tensor or None) arguments the kernel takes
    tail: tuple     # the arguments after them, in the kernel's order
    device: int
    scratch: bool   # the kernel builds tensor descriptors in global scratch memory

    def __call__(self, *pointers) -> None:
        """Launch with the leading arguments ``pointers`` (``pointers(...)`` of the new
        tensors, or the tensors themselves; padded with None to ``lead``)."""
        global FAST_LAUNCHES
        full = (*pointers, *(None,) * (self.lead - len(pointers)), *self.tail)
        if self.scratch:
            _ensure_allocator()
        c, grid = self.compiled, self.grid
        stream = driver.active.get_current_stream(self.device)
        enter_hook = _live(knobs.runtime.launch_enter_hook)
        exit_hook = _live(knobs.runtime.launch_exit_hook)
        meta = c.launch_metadata(grid, stream, *full) if enter_hook or exit_hook else None
        c.run(*grid, stream, c.function, c.packed_metadata, meta, enter_hook, exit_hook, *full)
        FAST_LAUNCHES += 1


def _live(hook):
    """A launch hook, or None where it would do nothing: Triton (3.5 on) keeps an empty
    HookChain where no hook is set, which its launcher calls, with metadata built for it,
    on every launch."""
    return hook if getattr(hook, "calls", hook) else None


def pointers(*tensors) -> Optional[list]:
    """The tensors' data pointers as ints (None stays None), or None where one is not 16-byte
    aligned (what Triton specialises pointers on). Replays hand these to the compiled kernel:
    for an int, Triton's launcher skips the data_ptr() call and the cuPointerGetAttribute
    check it makes for each tensor (the tensors passed the check on the call that compiled)."""
    ptrs = [None if t is None else t.data_ptr() for t in tensors]  # a list: ~0.2 us less
    bits = 0
    for p in ptrs:
        if p:
            bits |= p
    return None if bits & 15 else ptrs


def _plan(fn, args):
    """The kernels take their tensors (or None) first, then scalars; the getter picks the
    arguments after the positional ones, by name, in the kernel's order."""
    plan = _PLANS.get((id(fn), len(args)))
    if plan is None:
        n = 0
        while n < len(args) and (args[n] is None or isinstance(args[n], torch.Tensor)):
            n += 1
        names = fn.arg_names[len(args):]
        get = (operator.itemgetter(*names) if len(names) > 1
               else lambda m: tuple(map(m.get, names)))
        plan = _PLANS[(id(fn), len(args))] = (n, get)
    return plan


def launch_jit(fn, grid, *args, _cfg=None, **kwargs) -> Optional[Replay]:
    """Launch the @triton.jit function ``fn`` (with the tuned config ``_cfg``, if any): through
    Triton's JITFunction.run, or the compiled kernel of an earlier call with the same
    arguments but the pointers and the seed (see _COMPILED). Returns the launch's Replay when
    it can be replayed (fast launches on, aligned tensors, an int32 seed)."""
    if not _env.FAST_LAUNCH or _env.INTERPRET:
        fn[grid](*args, **kwargs, **(_cfg.all_kwargs() if _cfg is not None else {}))
        return None
    meta = {**kwargs, **_cfg.kwargs} if _cfg is not None else dict(kwargs)
    n, rest = _plan(fn, args)
    seed = meta.pop("seed", 0)  # not part of the match (the kernels do not specialise on it)
    device = driver.active.get_current_device()
    key = (id(fn), id(_cfg), device, *[None if t is None else t.dtype for t in args[:n]],
           *args[n:], *meta.values())
    if "seed" in kwargs:
        meta["seed"] = seed
    ptrs = pointers(*args[:n])
    if not (ptrs is not None and 0 <= seed < 2**31):  # as the cached kernels were compiled
        fn[grid](*args, **kwargs, **(_cfg.all_kwargs() if _cfg is not None else {}))
        return None
    shown = tuple(grid(meta) if callable(grid) else grid)
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = fn[grid](*args, **kwargs, **(_cfg.all_kwargs() if _cfg is not None else {}))
        if not hasattr(compiled, "packed_metadata"):
            return None
        if len(_COMPILED) >= _COMPILED_MAX:
            _COMPILED.clear()
        _COMPILED[key] = (compiled, _cfg)  # holds _cfg: its id stays its own
    else:
        compiled = entry[0]
    replay = Replay(compiled, (*shown, *(1,) * (3 - len(shown))), n, (*args[n:], *rest(meta)),
                    device, compiled.metadata.global_scratch_size > 0)
    if entry is not None:
        replay(*ptrs)
    return replay


def _launch(kernel, grid, tuning_key, *args, **kwargs) -> Optional[Replay]:
    """Launch an autotuned kernel; at debug level, log its config, grid and new tunings.
    Returns the launch's Replay, if it has one (not on the call that tunes)."""
    cfg = _TUNED.get((id(kernel), tuning_key))
    replay = None
    if cfg is None:
        known = len(kernel.cache)
        kernel[grid](*args, **kwargs)
        cfg = _TUNED[(id(kernel), tuning_key)] = kernel.best_config
        if len(kernel.cache) > known:
            _env.logger.debug("autotuned %s for key %s: %s", kernel.fn.__name__,
                              list(kernel.cache)[-1], cfg)
    else:
        replay = launch_jit(kernel.fn, grid, *args, _cfg=cfg, **kwargs)
    if _env.logger.isEnabledFor(logging.DEBUG):
        meta = dict(kwargs, **cfg.kwargs)
        shown = grid(meta) if callable(grid) else grid
        _env.logger.debug("launch %s grid=%s BLOCK_M=%s BLOCK_N=%s num_warps=%s num_stages=%s",
                          kernel.fn.__name__, tuple(shown), meta.get("BLOCK_M"),
                          meta.get("BLOCK_N"), cfg.num_warps, cfg.num_stages)
    return replay


# Whole calls replayed: (call site, signature) -> the Replays of its launches. A signature
# holds everything but the data pointers that decides a call's kernels, configs, grids and
# scalar arguments (shapes, strides, dtypes and devices, the variant, the switches), so a
# call that matches one skips the launchers' Python altogether: it allocates its outputs and
# replays. (The launchers run on their first tensor's device, on_device_of: its device is
# the current one.) Calls with tensors in the variant, packed sequences or dropout (a new
# seed per call) take the launchers' path every time.
_CALLS = {}
_CALLS_MAX = 512


def call_signature(site: str, scalars, *tensors, gluon: bool = True) -> Optional[tuple]:
    """The signature of a call at ``site`` (None: do not replay): its Python scalars (hashable),
    the switches and (gluon: a site that may run a Gluon kernel) the Gluon kernel options that
    choose its kernels, and the shape, strides, dtype and device index of each tensor argument
    (None where absent)."""
    if not _env.FAST_LAUNCH or _env.INTERPRET:
        return None
    options = ()
    if gluon:
        from .kernels import gluon_bwd, gluon_fwd
        options = (GLUON_VARIANTS, GLUON_ALIBI_ONE_SIDED, tuple(gluon_fwd.OPTIONS.items()),
                   tuple(gluon_bwd.OPTIONS.items()))
    return (site, scalars, _env.TMA, _env.AUTOTUNE, _env.PDL, _env.GLUON, *options,
            *[None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())
              for t in tensors])


def _signature(site: str, variant: "Variant", varlen, *tensors) -> Optional[tuple]:
    if (varlen is not None or variant.dropout_p or variant.alibi_slopes is not None
            or variant.attn_mask is not None or variant.kv_blocks is not None
            or variant.q_blocks is not None):
        return None
    return call_signature(site, variant, *tensors)


def recall(signature) -> Optional[tuple]:
    """What ``remember`` recorded under ``signature``, or None."""
    return _CALLS.get(signature)


def remember(signature, *entries) -> None:
    """Record a call's Replays (and whatever else its replay needs) under its signature, if
    every launch of the call could be replayed."""
    if signature is not None and all(e is not None for e in entries):
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[signature] = entries


def on_device_of(fn):
    """``fn`` run with the current CUDA device set to its first argument's: Triton launches on
    the current device, while flash-attn and SDPA run on their inputs' device whatever is
    current (a guard, as flash-attn's CUDAGuard)."""
    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        get_device = getattr(x, "get_device", None)  # not a tensor: fn's checks raise
        index = get_device() if get_device is not None else -1  # -1: CPU (interpreter)
        if index >= 0 and index != torch.cuda.current_device():
            with torch.cuda.device(index):
                return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)
    return run


def _cfg_tuple(cfg) -> Tuple[int, int, int, int]:
    return (cfg.kwargs.get("BLOCK_M", 0), cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages)


_fwd = _autotuned("fwd", _attn_fwd_kernel)
_dkdv = _autotuned("dkdv", _attn_bwd_dkdv_kernel)
_dq = _autotuned("dq", _attn_bwd_dq_kernel)
_decode = _autotuned("decode", _attn_decode_kernel, _DECODE_KEY)


def output_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of x's shape and dtype, in x's memory layout when x is dense
    (an output or gradient then has the layout of its input: SDPA's (B, H, N, D) tensors get
    (B, H, N, D) gradients, which autograd accumulates without a copy), else contiguous.
    The custom ops' fake implementations use it too, so traced strides match real ones."""
    out = torch.empty_like(x)
    if out.stride(-1) != 1:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    """Every output buffer comes from here (tests poison it with NaN)."""
    return output_like(x)


def _empty(shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _strides(x: torch.Tensor):
    """(batch, token, head) strides of a (B, T, H, D) tensor or a packed (T, H, D) one."""
    s = x.stride()
    assert s[-1] == 1, "launchers expect a unit stride on the head dim"
    return (0, s[0], s[1]) if len(s) == 3 else s[:3]


# The global memory in which the kernels build their tensor descriptors (TMA): a fresh block
# from torch's caching allocator per launch, on the current device (the launchers set it to
# the inputs'), freed when the launch returns; later kernels on the stream reuse it in stream
# order. Not cached per stream: the legacy default stream has the same handle on every
# device, and torch.compile's CUDA-graph warmup allocates from the graph's pool, where a
# buffer kept alive across calls breaks its check that every live tensor is an output.
_SCRATCH_DEVICE = "cpu" if _env.INTERPRET else "cuda"


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator: ``size`` bytes (torch's blocks are 512-byte aligned)."""
    return torch.empty(size, dtype=torch.int8, device=_SCRATCH_DEVICE)


@functools.lru_cache(maxsize=None)
def _tma_capable(device: torch.device) -> bool:
    """Whether ``device`` has TMA (the Tensor Memory Accelerator): Hopper and newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and newer): a kernel launched so may start while
    the one before it on the stream runs, and waits for it in its code (griddepcontrol.wait)."""
    return _env.PDL and not _env.INTERPRET and _tma_capable(device)


def pdl_option(pdl: bool) -> dict:
    """The launch option for a kernel taking PDL (none without: the interpreter has none)."""
    return {"launch_pdl": True} if pdl else {}


def _use_tma(*tensors: torch.Tensor) -> bool:
    """Tensor-descriptor loads of these (B, T, H, D) or (T, H, D) tensors: a TMA device,
    16-byte aligned data and strides that are 16-byte multiples (TMA's rules): the token
    stride always (it is the descriptor's row stride), the batch and head strides where
    their dim has more than one entry (else they never move the base). Sets Triton's
    allocator where none is set (the kernels build their descriptors in global scratch
    memory; the setting is per thread, and autograd runs the backward on its own)."""
    if not (_env.TMA and _tma_capable(tensors[0].device)):
        return False
    for t in tensors:
        size = t.element_size()
        if (t.data_ptr() % 16 or t.stride(-3) <= 0 or t.stride(-3) * size % 16
                or any(s * size % 16 for s, n in zip(t.stride()[:-1], t.shape) if n > 1)):
            return False
    _ensure_allocator()
    return True


def _ensure_allocator() -> None:
    """Triton's allocator for the kernels' descriptor scratch memory, where this thread has
    none (the setting is per thread)."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


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
    cu_seqlens_k[b] on (the forward only)."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_k: Optional[torch.Tensor] = None


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
        lse = _empty((B, H, SQ), torch.float32, q.device)
        return lse, lse.stride(0), lse.stride(1)
    lse = _empty((q.shape[1], q.shape[0]), torch.float32, q.device)
    return lse, 0, lse.stride(0)


def _common(q, varlen: Optional[Varlen], SQ: int, SK: int, variant: Variant):
    """Constexpr and runtime arguments shared by every kernel of one call, and the tuning key
    (dtype and the autotuner's key values). Computed once per distinct call signature.

    The mask: query i sees key j iff i + d - left <= j <= i + d + right, with
    d = SK - SQ of the sequence (bottom-right alignment, flash-attn's rule) plus
    ``variant.diag_offset``; a bound of -1 is absent. The kernels take the bounds
    relative to SK - SQ (WIN_LEFT, WIN_RIGHT), so the offset moves into them.
    """
    v = variant
    common, key = _common_cached(
        q.shape[-1], q.dtype, varlen is not None, configs.bucket(SQ), configs.bucket(SK),
        v.softmax_scale, v.causal, v.window_left, v.window_right, v.diag_offset, v.softcap,
        v.alibi_slopes is not None, _mask_args(v)[1], v.dropout_p, v.score_mod,
        v.score_mod_grad, v.mask_mod, v.kv_blocks is not None, v.block_size)
    if v.seed:
        common = dict(common, seed=v.seed)
    return common, key


@functools.lru_cache(maxsize=1024)
def _common_cached(head_dim, dtype, is_varlen, sq_bucket, sk_bucket, softmax_scale, causal,
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
        HAS_LOWER=window_left >= 0,
        HAS_UPPER=right >= 0,
        HAS_SOFTCAP=has_softcap,
        # 2: one-sided ALiBi (every visible key at or left of the diagonal: causal, or a window
        # that ends there): the backward kernels' cheaper form (kernels.common.alibi_part); the
        # forward takes the general form 1 (attention_forward: 2 measured 1-3% slower there)
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


def _bounded_spans(q, k, varlen: Varlen) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's (start, end) rows of the packed q and of k, 2B int32s each, with the
    rows of a sequence outside the tensors made empty (kernels.attn_bwd._varlen_spans_kernel):
    the backward kernels' CU_Q / CU_K under IS_VARLEN 2 (kernels.common.seq_bounds)."""
    if varlen.seqused_k is not None:
        raise ValueError("seqused_k is for the forward only")
    B = varlen.cu_seqlens_q.numel() - 1
    k_at = configs.cdiv(2 * B, 4) * 4  # the key pairs start 16-byte aligned
    spans = torch.empty(k_at + 2 * B, dtype=torch.int32, device=q.device)
    launch_jit(_varlen_spans_kernel, (configs.cdiv(B, 256),), varlen.cu_seqlens_q,
               varlen.cu_seqlens_k, spans, B, q.shape[0], k.shape[0], k_at, BLOCK_B=256)
    return spans[:2 * B], spans[k_at:]


def _sizes(q, k, varlen: Optional[Varlen], SQ: int, SK: int):
    """The kernels' SQ, SK, TOTAL_Q, TOTAL_K: varlen's rows of the packed q and k bound
    every offset the kernels read from CU_Q / CU_K (kernels.common.seq_bounds)."""
    if varlen is None:
        return SQ, SK, SQ, SK
    return SQ, SK, q.shape[0], k.shape[0]


# Whether attention_forward also runs windows, softcap, ALiBi and block masks on the Gluon
# forward (H200, 8K, D=128: 1.02-1.34x the Triton forward; docs/perf.md, session 14).
GLUON_VARIANTS = True


@on_device_of
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant,
                      varlen: Optional[Varlen] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """O in q's shape and dtype; LSE fp32 in natural log, (B, H, SQ) or (H, total_q)."""
    B, SQ, SK, H, HKV, D = _dims(q, k, varlen)
    out = _empty_like(q)
    lse, stride_lb, stride_lh = _lse_buffer(q, varlen)
    if out.numel() == 0:
        return out, lse
    if SK == 0 or k.numel() == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    signature = _signature("fwd", variant, varlen, q, k, v)
    if signature is None and varlen is None:  # ALiBi or a block mask: the Gluon forward's
        signature = _gluon_signature("gluon_fwd", variant, variant.kv_blocks, q, k, v)
    replays = recall(signature)
    ptrs = (pointers(q, k, v, out, lse, variant.alibi_slopes, variant.kv_blocks)
            if replays is not None else None)
    if ptrs is not None:
        replays[0](*ptrs)
        return out, lse

    # The Gluon forward at D=128 (H200: 1.1-1.3x the Triton kernel from 1K tokens, at 512 causal
    # tokens 0.95x; at D=64 0.9-0.99x: docs/perf.md, session 12).
    if (_env.GLUON and D == 128 and (SQ > 512 or not variant.causal)
            and gluon_misfit(q, k, v, variant, varlen, variants=GLUON_VARIANTS) is None):
        remember(signature, _gluon_forward(q, k, v, out, lse, variant))
        return out, lse
    if signature is not None and signature[0] == "gluon_fwd":
        signature = None  # (the Triton forward's replays take other leading tensors)
    remember(signature, triton_forward(q, k, v, out, lse, stride_lb, stride_lh, variant, varlen))
    return out, lse


def triton_forward(q, k, v, out, lse, stride_lb: int, stride_lh: int, variant: Variant,
                   varlen: Optional[Varlen] = None) -> Optional[Replay]:
    """The Triton forward kernel into ``out`` and ``lse`` (LSE row i of batch b, head h at
    b * stride_lb + h * stride_lh + i, i counted from the sequence's first row in the packed
    tensors under varlen). Returns the launch's Replay, if any: its leading arguments are
    q, k, v, out, lse, ALiBi, the score mask, CU_Q, CU_K, SEQUSED_K, the block mask."""
    B, SQ, SK, H, HKV, D = _dims(q, k, varlen)
    alibi, stride_ab, stride_ah = _alibi_args(variant)
    (mask, *mask_strides), _ = _mask_args(variant)
    common, key = _common(q, varlen, SQ, SK, variant)
    if common["HAS_ALIBI"] == 2:  # the forward kernel has the general form only
        common = dict(common, HAS_ALIBI=1)
    use_tma = _use_tma(k, v)
    return _launch(
        _fwd, lambda meta: (configs.cdiv(SQ, meta["BLOCK_M"]), B * H), (*key, use_tma),
        q, k, v, out, lse, alibi, mask, *_cu(varlen), *_block_args(variant.kv_blocks)[:1],
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        stride_lb, stride_lh, stride_ab, stride_ah, *mask_strides,
        *_block_args(variant.kv_blocks)[1:],
        H, H // HKV, *_sizes(q, k, varlen, SQ, SK),
        USE_TMA=use_tma, **common,
    )


class _Addr(int):
    """A data pointer where Triton's launcher reads a descriptor's base (it calls data_ptr())."""

    def data_ptr(self) -> int:
        return int(self)


class _TmaView(NamedTuple):
    """What Triton's launcher reads of a host TensorDescriptor (make_tensordesc_arg in its
    NVIDIA driver): a replay builds these instead (no validation: the call that compiled
    validated the same shapes and strides)."""
    base: object
    shape: list
    strides: list
    padding: str = "zero"


class GluonReplay(NamedTuple):
    """A compiled Gluon forward and its launch: called with the data pointers of q, k, v, out,
    lse and (where the call has them) ALiBi's slopes and the block mask's lists (as a
    Replay), it builds q's, k's and v's descriptors over the new pointers."""
    replay: Replay
    views: tuple  # (shape, strides) of q's, k's and v's 2-D views

    def __call__(self, q, k, v, out, lse, alibi=None, bmask=None) -> None:
        self.replay(*[_TmaView(_Addr(p), *view) for p, view in zip((q, k, v), self.views)],
                    out, lse, alibi, bmask)


def _gluon_signature(site: str, variant: Variant, blocks, *tensors) -> Optional[tuple]:
    """The signature (call_signature) of a Gluon kernel's call, ALiBi and block masks
    included: its replay takes the slopes and the lists (blocks: the forward's kv_blocks, the
    backward's q_blocks) by pointer, so the signature holds their shapes, strides and dtypes
    as the tensors'; None for what the Gluon kernels do not run (an SDPA mask, dropout, a
    score_mod)."""
    if variant.attn_mask is not None or variant.dropout_p or variant.score_mod is not None:
        return None
    scalars = variant._replace(alibi_slopes=None, kv_blocks=None, q_blocks=None)
    return call_signature(site, scalars, *tensors, variant.alibi_slopes, blocks)


def _token_rows(t: torch.Tensor):
    """A (B, N, Ht, D) tensor as TMA's 2-D view of its token rows: (rb, rh, ch, rows, width),
    head h of batch b starting at row b * rb + h * rh, column h * ch; None where the layout
    is neither tokens-major (heads side by side in a row) nor heads-major (a head's rows
    together), or where TMA cannot address it (16-byte aligned base and row stride)."""
    B, N, Ht, D = t.shape
    sb, st, sh, sd = t.stride()
    if sd != 1 or t.data_ptr() % 16 or st * t.element_size() % 16:
        return None
    if (Ht == 1 or sh == D) and st >= Ht * D and (B == 1 or sb == N * st):
        return N, 0, D, B * N, Ht * D
    if st == D and (Ht == 1 or sh == N * D) and (B == 1 or sb == Ht * N * D):
        return Ht * N, N, 0, B * Ht * N, D
    return None


def _windowed(variant: Variant) -> bool:
    """Whether a call has a sliding window beyond the causal mask."""
    return variant.window_left != -1 or (variant.window_right != -1 and not variant.causal)


def gluon_misfit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant,
                 varlen: Optional[Varlen] = None, head_dims=(64, 128),
                 variants: bool = False) -> Optional[str]:
    """Why the Gluon forward (kernels.gluon_fwd) cannot run this call, or None: it takes a
    Hopper GPU, bf16 / fp16, dense batches with SQ == SK, plain or causal attention with a
    positive scale (variants: also windows, softcap, ALiBi and block masks of 128-blocks), and
    q, k, v in a layout of _token_rows (k and v alike)."""
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype:
        return f"the Gluon forward takes bf16 or fp16, got {q.dtype}, {k.dtype}, {v.dtype}"
    if varlen is not None or q.dim() != 4 or q.shape[1] != k.shape[1]:
        return "the Gluon forward takes dense batches with as many queries as keys"
    if q.shape[-1] not in head_dims:
        return f"the Gluon forward takes head dims {head_dims}, got {q.shape[-1]}"
    w = variant
    windowed = _windowed(w)
    listed = (w.kv_blocks is not None and w.block_size == 128 and w.mask_mod is not None
              and not w.causal and not windowed)
    if (w.attn_mask is not None or w.dropout_p or w.score_mod is not None
            or (w.mask_mod is not None or w.kv_blocks is not None) and not listed
            or w.diag_offset or not w.softmax_scale > 0
            or (not variants and (windowed or w.softcap or w.alibi_slopes is not None
                                  or listed))):
        return ("the Gluon forward takes plain or causal attention with softmax_scale > 0"
                + (", windows, softcap, ALiBi and block masks of 128" if variants else ""))
    if k.stride() != v.stride() or _token_rows(q) is None or _token_rows(k) is None:
        return ("the Gluon forward takes q, k, v tokens-major or heads-major, 16-byte "
                "aligned, k and v alike")
    if _env.INTERPRET or not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the Gluon forward needs a Hopper GPU (sm_90)"
    return gluon_triton_misfit()


# The Triton releases whose Gluon the kernels of kernels/gluon_*.py are written for: Gluon's
# API changes between releases (3.5's warp_specialize takes other arguments; 3.7 has no
# gl.thread_barrier), so on any other release the Triton kernels run every call.
GLUON_TRITONS = ((3, 6),)


@functools.lru_cache(maxsize=None)
def gluon_triton_misfit() -> Optional[str]:
    """Why this Triton cannot run the Gluon kernels, or None."""
    release = tuple(int(x) for x in triton.__version__.split(".")[:2])
    if release not in GLUON_TRITONS:
        return (f"the Gluon kernels are written for Triton "
                f"{', '.join('%d.%d' % r for r in GLUON_TRITONS)}; this is Triton "
                f"{triton.__version__}")
    return None


# Whether the Gluon kernels take one-sided ALiBi (the keys' part of the bias in the scores,
# the rows' part in the LSE: one FMA a score) where every visible key is at or left of the
# diagonal (causal), instead of the general |i - j| form (measured on the H200, causal 8K:
# forward 447 -> 462 TFLOP/s, the Gluon backward 320 -> 332; docs/perf.md, session 15).
GLUON_ALIBI_ONE_SIDED = True


def _gluon_alibi(common, alibi) -> int:
    """The Gluon kernels' HAS_ALIBI: 0 none, 1 the general form, 2 one-sided."""
    if alibi is None:
        return 0
    return 2 if GLUON_ALIBI_ONE_SIDED and common["HAS_ALIBI"] == 2 else 1


def _gluon_forward(q, k, v, out, lse, variant: Variant) -> GluonReplay:
    """Launch kernels.gluon_fwd on tensors that gluon_misfit passed. The variant's window,
    softcap and ALiBi arguments come from _common (the Triton kernels' definitions)."""
    from .kernels import gluon_fwd
    B, N, H, D = q.shape
    descs, rows = zip(*(_gluon_descriptor(t, [128, D]) for t in (q, k, v)))
    views = tuple((list(d.shape), list(d.strides)) for d in descs)
    common, _ = _common(q, None, N, N, variant)
    alibi, stride_ab, stride_ah = _alibi_args(variant)
    # Causal attention without a window keeps its own constexpr path (IS_CAUSAL); with a
    # window the causal bound is the window's upper bound (UPPER 0).
    windowed = _windowed(variant)
    bmask, *bmask_args = _block_args(variant.kv_blocks)
    args = (out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            stride_ab, stride_ah, *bmask_args, H, H // k.shape[2], N, *rows[0], *rows[1],
            common["qk_scale"], common["cap2"], -common["WIN_LEFT"],
            common["WIN_RIGHT"])
    consts = dict(IS_CAUSAL=bool(variant.causal) and not windowed, NUM_STAGES=2,
                  HAS_LOWER=common["HAS_LOWER"], HAS_UPPER=windowed and common["HAS_UPPER"],
                  HAS_SOFTCAP=common["HAS_SOFTCAP"], HAS_ALIBI=_gluon_alibi(common, alibi),
                  LISTED=bmask is not None, MASK_MOD=variant.mask_mod,
                  **gluon_fwd.options(common["HAS_LOWER"]))
    grid = (configs.cdiv(N, 128), B * H, 1)
    kernel = gluon_fwd._attn_fwd_gluon_kernel
    compiled = kernel[grid](*descs, out, lse, alibi, bmask, *args, **consts)
    tail = (*args, *[consts[n] for n in kernel.arg_names[7 + len(args):]])
    replay = Replay(compiled, grid, 7, tail, q.get_device(),
                    compiled.metadata.global_scratch_size > 0)
    return GluonReplay(replay, views)


def _gluon_variant(q, causal, softmax_scale, window_size, softcap, alibi_slopes, block_mask):
    """The Variant of attention_forward_gluon's and attention_backward_gluon's options."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    variant = Variant(scale, causal, window_size[0], window_size[1], softcap, alibi_slopes)
    if block_mask is not None:
        variant = variant._replace(mask_mod=block_mask.mask_mod, kv_blocks=block_mask.kv_blocks,
                                   q_blocks=block_mask.q_blocks,
                                   block_size=block_mask.block_size)
    return variant


@on_device_of
def attention_forward_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            causal: bool = False, softmax_scale: Optional[float] = None,
                            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            alibi_slopes: Optional[torch.Tensor] = None, block_mask=None
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The Gluon forward alone (tests and benchmarks; attention_forward chooses it where it
    fits at D=128, its variants while GLUON_VARIANTS is on): O in q's layout and the
    natural-log LSE (B, H, N); head dim 64 or 128; flash-attn's window_size, softcap and
    alibi_slopes, or a block_mask of 128-blocks (flashtriton.block_mask). Raises ValueError
    where gluon_misfit names a reason."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"attention_forward_gluon takes (B, N, H, D) q, k, v, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    variant = _gluon_variant(q, causal, softmax_scale, window_size, softcap, alibi_slopes,
                             block_mask)
    reason = gluon_misfit(q, k, v, variant, variants=True)
    if reason is not None:
        raise ValueError(reason)
    out = _empty_like(q)
    lse, _, _ = _lse_buffer(q, None)
    _gluon_forward(q, k, v, out, lse, variant)
    return out, lse


def _gluon_descriptor(t: torch.Tensor, block):
    """A host TensorDescriptor over t's 2-D token-row view (_token_rows)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    el = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
    rows = _token_rows(t)
    layout = gl.NVMMASharedLayout.get_default_for(block, el[t.dtype])
    return TensorDescriptor(t, [rows[3], rows[4]], [t.stride(1), 1], block, layout), rows[:3]


def _gluon_flat_descriptor(t: torch.Tensor, block: int):
    """A host TensorDescriptor over a fresh (contiguous, aligned) fp32 buffer t as one row of
    t.numel() values, `block` at a time (kernels.gluon_bwd's LSE and delta tiles)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor(t, [t.numel()], [1], [block],
                            gl.NVMMASharedLayout.get_default_for([block], gl.float32))


def gluon_backward_misfit(dout: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, variant: Variant, dq_mode: int = 2) -> Optional[str]:
    """Why the Gluon backward (kernels.gluon_bwd) cannot run this call, or None: what
    gluon_misfit asks of the forward with its variants, head dim 128, a block mask shared by
    the query heads of a KV head, dout (unless None) in q's dtype and in a layout of
    _token_rows, dq_mode 2 or 1."""
    reason = gluon_misfit(q, k, v, variant, head_dims=(128, ), variants=True)
    blocks = variant.q_blocks
    if reason is None and blocks is not None and blocks.shape[1] > 1 and q.shape[2] > k.shape[2]:
        reason = "the Gluon backward takes GQA with a block mask shared by the heads (H=None)"
    if reason is None and dout is not None and (
            dout.shape != q.shape or dout.dtype != q.dtype or _token_rows(dout) is None):
        reason = "the Gluon backward takes dout in q's dtype, tokens-major or heads-major"
    if reason is None and dq_mode not in (1, 2):
        reason = f"the Gluon backward takes _dq_mode 2 or 1, got {dq_mode}"
    return reason


class GluonBwdReplay(NamedTuple):
    """A Gluon backward's two launches, the prep kernel's and the kernel's (Replays): called
    with the data pointers of out, dout, lse, the prep kernel's outputs (log2 LSE, delta, the
    fp32 dQ buffer), q, k, v, dk, dv, ALiBi's slopes and the block mask, it builds the
    kernel's descriptors over the new pointers (as GluonReplay)."""
    prep: Replay
    kernel: Replay
    views: tuple  # (shape, strides) of the descriptors of q, k, v, dout, dQ's buffer, lse2, delta

    def __call__(self, out, dout, lse, lse2, delta, dq_acc, q, k, v, dk, dv, alibi,
                 bmask) -> None:
        self.prep(out, dout, lse, lse2, delta, dq_acc)
        bases = (q, k, v, dout, dq_acc, lse2, delta)
        self.kernel(*[_TmaView(_Addr(p), *view) for p, view in zip(bases, self.views)],
                    dk, dv, alibi, bmask)


def _gluon_backward(dout, q, k, v, out, lse, variant: Variant, dq_mode: int = 2,
                    timeline=None):
    """Launch kernels.gluon_bwd on tensors that gluon_backward_misfit passed: the prep kernel
    (the log2 LSE and delta, each head's rows padded to a multiple of 128, and a zeroed fp32
    dQ buffer), the backward, and dQ's copy into q's layout; a call whose signature
    (_gluon_signature; none for timing runs) was seen replays the first two
    (GluonBwdReplay). The variant's window, softcap and ALiBi arguments come from _common
    (as the forward's). timeline: None, or (timing only) an int64 tensor of gluon_bwd.TL_ROW
    per program (gluon_bwd._mark, _mark_step)."""
    B, N, H, D = q.shape
    signature = None
    if timeline is None and dq_mode == 2:
        signature = _gluon_signature("gluon_bwd", variant, variant.q_blocks, dout, q, k, v, out,
                                     lse)
    replays = recall(signature)
    dk, dv = _empty_like(k), _empty_like(v)
    dq_acc = _dq_buffer(q)
    # (128: a block mask's walk reads both 64-row halves of its last query block)
    pad = configs.cdiv(N, 128) * 128
    lse2, delta = _empty((2, B * H * pad), torch.float32, q.device)
    lse = lse.contiguous()
    alibi, bmask = variant.alibi_slopes, variant.q_blocks
    tensors = (out, dout, lse, lse2, delta, dq_acc, q, k, v, dk, dv, alibi, bmask)
    ptrs = pointers(*tensors) if replays is not None else None
    if ptrs is not None:
        replays[0](*ptrs)
    else:
        replay = _gluon_bwd_launch(*tensors, variant, dq_mode, timeline)
        if pointers(*tensors) is not None:  # as a replay's tensors must be
            remember(signature, replay)
    dq = _empty_like(q)
    dq.copy_(dq_acc)
    return dq, dk, dv


def _dq_buffer(q: torch.Tensor) -> torch.Tensor:
    """The Gluon backward's fp32 dQ buffer, (B, N, H, D) in q's layout (_token_rows: its
    rows and columns are q's, so the kernel's reductions use q's coordinates): tokens-major
    or heads-major memory, dense. dQ's copy out of it into a gradient of q's layout then
    keeps the order of memory (a transposing copy ran at half the rate: docs/perf.md,
    session 23)."""
    B, N, H, D = q.shape
    if _token_rows(q)[1] == 0:  # tokens-major (rh 0)
        return _empty((B, N, H, D), torch.float32, q.device)
    return _empty((B, H, N, D), torch.float32, q.device).transpose(1, 2)


def _gluon_bwd_launch(out, dout, lse, lse2, delta, dq_acc, q, k, v, dk, dv, alibi, bmask,
                      variant: Variant, dq_mode, timeline) -> Optional[GluonBwdReplay]:
    """_gluon_backward's launches through Triton's launchers; their GluonBwdReplay where both
    can be replayed."""
    from .kernels import gluon_bwd
    B, N, H, D = q.shape
    common, _ = _common(q, None, N, N, variant)
    _, stride_ab, stride_ah = _alibi_args(variant)  # (alibi, bmask: the variant's, given)
    _, *bmask_args = _block_args(variant.q_blocks)
    pad = lse2.numel() // (B * H)
    prep = launch_jit(
        _attn_bwd_prep_kernel, (pad // 64, B * H), out, dout, lse, lse2, delta, dq_acc,
        out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1),
        dout.stride(2), lse.stride(0), lse.stride(1), dq_acc.stride(0), dq_acc.stride(1),
        dq_acc.stride(2), H, N, pad, HEAD_DIM=D, BLOCK_M=64, num_warps=4)
    q_desc, q_rows = _gluon_descriptor(q, [64, D])
    do_desc, do_rows = _gluon_descriptor(dout, [64, D])
    k_desc, kv_rows = _gluon_descriptor(k, [128, D])
    v_desc, _ = _gluon_descriptor(v, [128, D])
    # Each of the kernel's two consumers reduces half the head dim.
    dq_desc, _ = _gluon_descriptor(dq_acc, [64, D // 2])
    descs = (q_desc, k_desc, v_desc, do_desc, dq_desc, _gluon_flat_descriptor(lse2, 64),
             _gluon_flat_descriptor(delta, 64))
    args = (dk.stride(0), dk.stride(1), dk.stride(2), stride_ab, stride_ah, *bmask_args, H,
            H // k.shape[2], N, *q_rows, *do_rows, *kv_rows, common["qk_scale"],
            variant.softmax_scale, common["cap2"], -common["WIN_LEFT"], common["WIN_RIGHT"],
            timeline)
    consts = dict(DQ_MODE=dq_mode, HAS_LOWER=common["HAS_LOWER"],
                  HAS_UPPER=common["HAS_UPPER"], HAS_SOFTCAP=common["HAS_SOFTCAP"],
                  HAS_ALIBI=_gluon_alibi(common, alibi), LISTED=bmask is not None,
                  MASK_MOD=variant.mask_mod,
                  **gluon_bwd.options(common["HAS_UPPER"], common["HAS_LOWER"], alibi is not None))
    grid = (configs.cdiv(N, 128), B * k.shape[2], 1)
    kernel = gluon_bwd._attn_bwd_gluon_kernel
    compiled = kernel[grid](*descs, dk, dv, alibi, bmask, *args, **consts)
    if prep is None or not hasattr(compiled, "packed_metadata"):
        return None
    lead = len(descs) + 4
    tail = (*args, *[consts[n] for n in kernel.arg_names[lead + len(args):]])
    views = tuple((list(d.shape), list(d.strides)) for d in descs)
    return GluonBwdReplay(prep, Replay(compiled, grid, lead, tail, q.get_device(),
                                       compiled.metadata.global_scratch_size > 0), views)


@on_device_of
def attention_backward_gluon(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             causal: bool = False, softmax_scale: Optional[float] = None,
                             window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[torch.Tensor] = None, block_mask=None,
                             _dq_mode: int = 2, _timeline: Optional[torch.Tensor] = None
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gluon backward (kernels.gluon_bwd) alone (tests and benchmarks; attention_backward
    chooses it where it fits): dQ, dK, dV in the layouts of q, k, v from the forward's out and
    natural-log lse (B, H, N); the options as attention_forward_gluon's. dQ is summed in an
    order that varies from run to run (not bitwise repeatable). _dq_mode: 2 TMA reductions, 1
    dQ not added (timing only); _timeline: gluon_bwd._mark's rows (timing only; programs x
    gluon_bwd.TL_ROW int64). Raises ValueError where gluon_backward_misfit names a reason."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or dout.shape != q.shape:
        raise ValueError(f"attention_backward_gluon takes (B, N, H, D) dout, q, k, v, got "
                         f"{tuple(dout.shape)}, {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if _timeline is not None:
        from .kernels import gluon_bwd
        rows = (configs.cdiv(q.shape[1], 128) * q.shape[0] * k.shape[2], gluon_bwd.TL_ROW.value)
        if (tuple(_timeline.shape) != rows or _timeline.dtype != torch.int64
                or not _timeline.is_contiguous()):
            raise ValueError(f"_timeline must be a contiguous int64 tensor of shape {rows}, got "
                             f"{_timeline.dtype} {tuple(_timeline.shape)}")
    variant = _gluon_variant(q, causal, softmax_scale, window_size, softcap, alibi_slopes,
                             block_mask)
    reason = gluon_backward_misfit(dout, q, k, v, variant, _dq_mode)
    if reason is not None:
        raise ValueError(reason)
    return _gluon_backward(dout, q, k, v, out, lse, variant, _dq_mode, _timeline)


# The shortest sequence attention_backward runs on the Gluon backward (where it fits and no
# deterministic backward is asked for; H200, session 16, B x N = 16K: 1.18x / 1.05x the
# Triton backward at 1K plain / causal, 1.24x / 1.10x at 2K, 1.18x / 1.24x at 4K), and
# whether it also takes windows, softcap and ALiBi there (on since its EARLY_S walk, session
# 15: causal at 8K, window 315, softcap 387, ALiBi 382 TFLOP/s against the Triton backward's
# 304, 297, 393; block masks always, 1.18-1.21x; docs/perf.md).
GLUON_BWD_MIN_SEQLEN = 1024
GLUON_BWD_VARIANTS = True


def _runs_gluon_backward(q, k, v, variant: Variant, varlen) -> bool:
    if (not _env.GLUON or variant.deterministic or varlen is not None
            or q.shape[1] < GLUON_BWD_MIN_SEQLEN
            or gluon_backward_misfit(None, q, k, v, variant) is not None):
        return False
    return GLUON_BWD_VARIANTS or not (_windowed(variant) or variant.softcap
                                      or variant.alibi_slopes is not None)


@on_device_of
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, variant: Variant,
                       varlen: Optional[Varlen] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV in the dtypes, shapes and (dense) layouts of q, k, v."""
    B, SQ, SK, H, HKV, D = _dims(q, k, varlen)
    if q.numel() == 0 or k.numel() == 0 or SK == 0:
        return _empty_like(q).zero_(), _empty_like(k).zero_(), _empty_like(v).zero_()
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    # The warp-specialized Gluon backward where it fits (H200, 8K-16K tokens: 1.08-1.16x the
    # two Triton kernels; docs/perf.md, session 14); its dQ sums vary in order from run to run.
    if _runs_gluon_backward(q, k, v, variant, varlen):
        if _token_rows(dout) is None:
            dout = dout.contiguous()  # e.g. the expanded gradient of a sum
        return _gluon_backward(dout, q, k, v, out, lse, variant)
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    lse = lse.contiguous()  # delta below shares its strides
    # The dQ kernel also computes delta = rowsum(dO * O) of its rows for the dK/dV kernel
    # (launched after it on the same stream).
    delta = _empty(lse.shape, torch.float32, lse.device)
    signature = _signature("bwd", variant, varlen, q, k, v, out, dout)
    replays = recall(signature)
    ptrs = pointers(q, k, v, out, dout, lse, delta, dq, dk, dv) if replays is not None else None
    if ptrs is not None:
        q_, k_, v_, out_, dout_, lse_, delta_, dq_, dk_, dv_ = ptrs
        replays[0](q_, k_, v_, out_, dout_, lse_, delta_, dq_)
        replays[1](q_, k_, v_, dout_, lse_, delta_, dk_, dv_)
        return dq, dk, dv
    common, key = _common(q, varlen, SQ, SK, variant)
    cu = _cu(varlen)
    if varlen is not None:  # the sequences' rows bounded once, not in each program
        cu = (*_bounded_spans(q, k, varlen), None)
        common = dict(common, IS_VARLEN=2)
    alibi, stride_ab, stride_ah = _alibi_args(variant)
    (mask, *mask_strides), _ = _mask_args(variant)
    stride_lb, stride_lh = (lse.stride(0), lse.stride(1)) if varlen is None else (0, lse.stride(0))
    use_tma = _use_tma(q, k, v, dout)  # dQ reads K and V by TMA, dK/dV reads Q and dO
    key = (*key, use_tma)
    replay_dq = _launch(
        _dq, lambda meta: (configs.cdiv(SQ, meta["BLOCK_M"]), B * H), key,
        q, k, v, out, dout, lse, delta, dq, alibi, mask, *cu,
        *_block_args(variant.kv_blocks)[:1],
        *_strides(q), *_strides(k), *_strides(v), *_strides(out), *_strides(dout),
        *_strides(dq),
        stride_lb, stride_lh, stride_ab, stride_ah, *mask_strides,
        *_block_args(variant.kv_blocks)[1:],
        H, H // HKV, *_sizes(q, k, varlen, SQ, SK),
        USE_TMA=use_tma, **common,
    )
    # dK/dV reads each query block's LSE and delta by TMA too where their rows start 16-byte
    # aligned (delta is allocated like lse): no varlen offsets, SQ a multiple of 4.
    stats_tma = (use_tma and varlen is None and lse.data_ptr() % 16 == 0
                 and stride_lb % 4 == 0 and stride_lh % 4 == 0)
    replay_dkdv = _launch(
        _dkdv, lambda meta: (configs.cdiv(SK, meta["BLOCK_N"]), B * HKV), (*key, stats_tma),
        q, k, v, dout, lse, delta, dk, dv, alibi, mask, *cu,
        *_block_args(variant.q_blocks)[:1],
        *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dk), *_strides(dv),
        stride_lb, stride_lh, stride_ab, stride_ah, *mask_strides,
        *_block_args(variant.q_blocks)[1:],
        HKV, H // HKV, *_sizes(q, k, varlen, SQ, SK),
        USE_TMA=use_tma, STATS_TMA=stats_tma, **common,
    )
    remember(signature, replay_dq, replay_dkdv)
    return dq, dk, dv
