"""Host machinery with no attention semantics: GPU timing, autotuned launches, replays of
compiled kernels and of whole calls, the device guard, output allocation and the scratch,
TMA and PDL settings. The launchers (flashtriton.launch) build on it."""

import functools
import inspect
import logging
import operator
from typing import NamedTuple, Optional, Tuple

import torch
import triton
from triton import knobs
from triton.runtime import _allocation, driver
from triton.runtime.errors import OutOfResources

from . import _env, configs, tuning


def flush_l2(cache: torch.Tensor) -> None:
    """Evict the L2 and leave it clean, before a timed call: read ``cache`` (256 MB, Triton's
    benchmark buffer). do_bench's flush zeroes it instead, which leaves the L2 full of dirty
    lines; the timed kernel's reads evict them, so the DRAM also writes the L2 back during
    it, a cost of the flush that memory-bound timings would charge to the step."""
    cache.view(torch.int32).sum()


def gpu_time_ms(fn, quantiles=(0.5, 0.2, 0.8), reps: int = 40):
    """Quantiles of fn's GPU time in ms, each call after a clean L2 flush, with the host's time
    kept out: the GPU first sleeps while the host queues every call, so no call waits for its
    launch. The decoding tuner's benchmarker: its candidates run shorter than the host time of
    a tuning call through Triton's JITFunction.run, so do_bench would time the host and pick
    tiles at random."""
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


def autotuned(kind: str, kernel, key):
    """``kernel`` autotuned over configs.candidates(kind), pruned by configs.prune, on ``key``
    (where FLASHTRITON_AUTOTUNE=1; else _launch takes its tiles from the tuning tables). Its
    ``kind``, ``allowed(named_args, kwargs)`` (the tiles that suit a call, best first) and
    ``by_tile`` (tile -> triton.Config) serve both ways."""
    cands = configs.candidates(kind)

    def allowed(named_args, kwargs):
        max_block = kwargs["SPARSE"] if kwargs.get("HAS_BLOCK_MASK") else 1 << 30
        widest = max(kwargs["BLOCK_D"], kwargs.get("BLOCK_DV", 0))  # (MLA: v's head dim)
        return configs.prune(kind, cands, widest, named_args["Q"].element_size(), max_block,
                             bool(kwargs.get("FP8")))

    def early_prune(cfgs, named_args, **kwargs):
        keep = allowed(named_args, kwargs)
        return [c for c in cfgs if _cfg_tuple(c) in keep]

    tuner = triton.autotune(
        configs=[triton.Config(configs.as_kwargs(c), num_warps=c[2], num_stages=c[3])
                 for c in cands],
        key=key,
        prune_configs_by={"early_config_prune": early_prune},
        cache_results=True,
        do_bench=gpu_time_ms if kind == "decode" else None,
    )(kernel)
    tuner.kind, tuner.allowed = kind, allowed
    tuner.by_tile = {_cfg_tuple(c): c for c in tuner.configs}
    return tuner


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> Tuple[int, int]:
    """The compute capability of a tensor's device ((0, 0) for the CPU: the interpreter)."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else (0, 0)


def _tuning_key(kernel, args, kwargs):
    """The table key of a launch of an autotuned kernel: its query tensor's dtype name, its
    tuning key as ((name, value), ...), its device's compute capability, its named args."""
    named = dict(zip(kernel.fn.arg_names, args))
    named.update(kwargs)
    q = named["Q"]
    key = tuple((n, named[n]) for n in kernel.keys if n in named)
    return str(q.dtype).rsplit(".", 1)[-1], key, _capability(q.device), named


def _from_tables(kernel, grid, args, kwargs):
    """Launch with the tile the tuning tables choose for this call; where it does not fit
    the GPU (Triton's OutOfResources: a GPU with less shared memory than the one the table
    was tuned on), the next tile that suits the call. Returns (its Config, the Replay)."""
    dtype, key, cap, named = _tuning_key(kernel, args, kwargs)
    allowed = kernel.allowed(named, kwargs)
    first = tuning.choose(kernel.kind, dtype, key, allowed, cap)
    for tile in [first] + [t for t in allowed if t != first]:
        cfg = kernel.by_tile[tile]
        try:
            return cfg, launch_jit(kernel.fn, grid, *args, _cfg=cfg, **kwargs)
        except OutOfResources as e:
            _env.logger.info("%s: tile %s does not fit this GPU (%s); trying the next",
                             kernel.fn.__name__, tile, e)
            error = e
    raise error


# (id(kernel), tuning key) -> (kernel name, its tuned triton.Config). Triton's Autotuner.run
# rebuilds its key from every argument on every call, a host cost of its own: after the first
# call for a key, launch the JIT function with the tuned config directly.
_TUNED = {}
# Triton's JITFunction.run binds and specialises every argument on every call, more host time
# than many kernels take on the GPU. A call whose kernel, tuning key, device, tensor dtypes and
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
    ptrs = [None if t is None else t.data_ptr() for t in tensors]  # a list: faster than a genexpr
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
    """Launch an autotuned kernel (runtime.autotuned) with its tile for ``tuning_key``: on the
    key's first call the tuning tables' (_from_tables), or the autotuner's under
    FLASHTRITON_AUTOTUNE=1 (recorded for tuning.save); later calls launch the JIT function
    with it directly. At debug level, log its config, grid and new tunings. Returns the
    launch's Replay, if it has one (not on the call that autotunes)."""
    tuned = _TUNED.get((id(kernel), tuning_key))
    replay = None
    if tuned is None and _env.AUTOTUNE:
        known = len(kernel.cache)
        kernel[grid](*args, **kwargs)
        cfg = kernel.best_config
        _TUNED[(id(kernel), tuning_key)] = (kernel.fn.__name__, cfg)
        if len(kernel.cache) > known:
            _env.logger.debug("autotuned %s for key %s: %s", kernel.fn.__name__,
                              list(kernel.cache)[-1], cfg)
        dtype, key, cap, _ = _tuning_key(kernel, args, kwargs)
        tuning.record(kernel.kind, dtype, key, _cfg_tuple(cfg), cap)
    elif tuned is None:
        cfg, replay = _from_tables(kernel, grid, args, kwargs)
        _TUNED[(id(kernel), tuning_key)] = (kernel.fn.__name__, cfg)
        _env.logger.debug("tile of %s for key %s from the tuning tables: %s",
                          kernel.fn.__name__, tuning_key, cfg)
    else:
        cfg = tuned[1]
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


def _forget() -> None:
    """Drop the tiles and launches chosen under the tuning tables (tuning.on_change)."""
    _TUNED.clear()
    _CALLS.clear()


tuning.on_change(_forget)


def call_signature(site: str, scalars, *tensors) -> Optional[tuple]:
    """The signature of a call at ``site`` (None: do not replay): its Python scalars (hashable),
    the switches, the policy (configs.snapshot(): every tile, threshold and kernel option that
    chooses kernels, the Gluon kernels' launch constants included), and the shape, strides,
    dtype and device index of each tensor argument (None where absent)."""
    if not _env.FAST_LAUNCH or _env.INTERPRET:
        return None
    return (site, scalars, _env.TMA, _env.AUTOTUNE, _env.PDL, _env.GLUON, configs.snapshot(),
            *[None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())
              for t in tensors])


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
    current (a guard, as flash-attn's CUDAGuard). The first argument may come by its keyword
    (``q=...``)."""
    first = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def run(x=_BY_KEYWORD, *args, **kwargs):
        if x is _BY_KEYWORD:  # the first argument by its keyword (then args is empty)
            if first not in kwargs:
                return fn(*args, **kwargs)  # (fn raises: a missing argument)
            x = kwargs.pop(first)
        get_device = getattr(x, "get_device", None)  # not a tensor: fn's checks raise
        index = get_device() if get_device is not None else -1  # -1: CPU (interpreter)
        if index >= 0 and index != torch.cuda.current_device():
            with torch.cuda.device(index):
                return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)
    return run


_BY_KEYWORD = object()  # on_device_of's mark of a first argument given by keyword


def _cfg_tuple(cfg) -> Tuple[int, int, int, int]:
    return (cfg.kwargs.get("BLOCK_M", 0), cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages)


def tuned_tiles() -> list:
    """Every tuned config chosen so far, in choice order: (kernel name, tuning key,
    (BLOCK_M, BLOCK_N, num_warps, num_stages))."""
    return [(name, key, _cfg_tuple(cfg)) for (_, key), (name, cfg) in _TUNED.items()]


def output_like(x: torch.Tensor, head_dim: Optional[int] = None) -> torch.Tensor:
    """An uninitialised tensor of x's shape and dtype, in x's memory layout when x is dense
    (an output or gradient then has the layout of its input: SDPA's (B, H, N, D) tensors get
    (B, H, N, D) gradients, which autograd accumulates without a copy), else contiguous.
    head_dim: another size of the last dimension (the output of MLA's value head dim), the
    other dimensions in x's order in memory. The custom ops' fake implementations use it too,
    so traced strides match real ones."""
    if head_dim is None or head_dim == x.shape[-1]:
        out = torch.empty_like(x)
        if out.stride(-1) != 1:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        return out
    shape = (*x.shape[:-1], head_dim)
    order = _dense_order(x)
    if order is None:
        return x.new_empty(shape)
    buf = x.new_empty([shape[d] for d in order])
    return buf.permute([order.index(d) for d in range(x.dim())])


def _dense_order(x: torch.Tensor) -> Optional[list]:
    """x's dimensions from outermost to innermost in memory where x is dense with a unit
    stride on its last dimension (dimensions of size 1 in logical order), else None."""
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d) if x.shape[d] > 1 else 0, d))
    inner = [d for d in order if x.shape[d] > 1]
    if x.dim() == 0 or (inner and inner[-1] != x.dim() - 1):
        return None
    expected = 1
    for d in reversed(inner):
        if x.stride(d) != expected:
            return None
        expected *= x.shape[d]
    return [d for d in order if d != x.dim() - 1] + [x.dim() - 1]


def _empty_like(x: torch.Tensor, head_dim: Optional[int] = None) -> torch.Tensor:
    """Every output buffer comes from here (tests poison it with NaN)."""
    return output_like(x, head_dim)


def _empty(shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)



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
