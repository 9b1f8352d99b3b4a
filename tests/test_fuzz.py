"""Property-based fuzzing of every public entry point (hypothesis, a fixed seed a test).

Two tests an entry point:

- valid calls: small random shapes (zero sizes, GQA, head dims 16-64, v's own head dim),
  dtypes, options (causal, windows, softcap, ALiBi, sinks, scale, flags as bools / numpy /
  0-d tensors), and every tensor -- index tensors included -- a strided or permuted view
  inside a larger buffer filled with NaN (floats) or garbage (int32). The result must match
  the float64 reference under tests/accuracy.py's rule (gradients too, for some calls), no
  buffer may change outside its view, inputs not at all, and a KV cache only in the appended
  positions, to the appended values (unused cache positions hold NaN or stale values, which
  must not be read);
- one-defect calls: such a valid call with exactly one defect (a dtype, a rank, a shape, a
  flag's type, an index out of range, a head-dim-strided cache, ...) must raise ValueError or
  TypeError whose message names the argument, and leave every buffer, cache, ``out=`` and
  PagedKVCache's page lists, lengths and free list (its order too) exactly as they were.
  The SDPA drop-in, which hands what its kernels cannot run to torch, must behave as
  torch's own function does on the same call.

ENTRIES also holds the routes that other code takes into the kernels:

- flash-attn's private wrappers ``_flash_attn_forward``, ``_flash_attn_backward``,
  ``_flash_attn_varlen_forward`` and ``_flash_attn_varlen_backward`` (flash-attn 2.8's
  signatures, called by keyword as ring-flash-attn calls them, or positionally): the forwards'
  out and LSE (flash-attn's: +inf for rows that see no key) against the reference; the
  backwards, given the reference's out and LSE, must write the reference's gradients into the
  given dq / dk / dv views (any strides; some may be None) and nothing outside them, and
  return flash-attn's softmax_d; a defect also must leave the gradient buffers unchanged;
- torch's ``scaled_dot_product_attention`` under its flash backend with flashtriton active in
  torch's flash-attention registry (torch >= 2.11; activated for the call and its backward
  and restored after each; on the CPU on the CPU dispatch key, reached through a route from
  torch's CPU flash operator, ``_cpu_flash_route``): the reference, or torch's own result
  where the registry falls back to torch's kernel; defects: as torch's own flash backend;
- ``flashtriton.patch_sdpa(module)``: a module calling torch's SDPA in its forward, patched
  for the call: as the SDPA drop-in (reference; defects as torch's SDPA), and torch's
  function and the module's hooks as before after each call.

Each test runs all its examples, counts their outcomes (ok, silent wrong result, NaN,
state changed by an error, wrong error type / unnamed argument, crash, timeout, valid call
refused, defect accepted), prints every failing call and fails with the counts and the first
failing calls, each as a readable description of the call.

FLASHTRITON_FUZZ_EXAMPLES=N sets the examples a test (default: VALID_EXAMPLES and
DEFECT_EXAMPLES below, a few minutes on two CPU cores through the interpreter).
"""

import contextlib
import inspect
import os
import re
import signal
import threading
import warnings
import zlib
from typing import NamedTuple, Optional, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from hypothesis import HealthCheck, Phase, assume, given, seed, settings
from hypothesis import strategies as st

import flashtriton
from accuracy import floor, max_err
from conftest import DEVICE, ON_GPU
from flashtriton import configs, validation
from flashtriton.compat import flash_attn as fa
from flashtriton.decode import PagedKVCache, attention_with_kvcache
from flashtriton.integrations import torch_registry
from flashtriton.reference import attention_reference

HAS_REGISTRY = hasattr(torch.nn.attention, "activate_flash_attention_impl")  # torch >= 2.11
if HAS_REGISTRY:
    from torch.nn.attention import (activate_flash_attention_impl, current_flash_attention_impl,
                                    register_flash_attention_impl, restore_flash_attention_impl)

_N = os.environ.get("FLASHTRITON_FUZZ_EXAMPLES")
VALID_EXAMPLES = int(_N) if _N else 12
DEFECT_EXAMPLES = int(_N) if _N else 30
CALL_TIMEOUT_S = 120  # a call (with its backward) that takes longer counts as a timeout

OK = "ok"
WRONG = "silent wrong result"
NAN = "NaN"
STATE = "state changed by an error"
NAMING = "wrong error type / unnamed argument"
CRASH = "crash (other exception)"
TIMEOUT = "timeout"
REFUSED = "valid call refused"
ACCEPTED = "defect accepted"
OUTCOMES = (OK, WRONG, NAN, STATE, NAMING, CRASH, TIMEOUT, REFUSED, ACCEPTED)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (16, 32, 40, 64)
SEQLENS = (0, 1, 2, 3, 5, 8, 13, 20)


def _settings(examples):
    return settings(max_examples=examples, database=None, deadline=None, print_blob=False,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=list(HealthCheck))


# -- tensors as views inside guard buffers ------------------------------------------------

class Layout(NamedTuple):
    """Where a tensor sits in its buffer: the storage order of its dims (outermost first),
    the view's step along each dim, and a guard band of ``pad`` elements on both sides of
    every dim."""
    perm: Tuple[int, ...]
    steps: Tuple[int, ...]
    pad: int

    def __repr__(self):
        parts = []
        if self.perm != tuple(range(len(self.perm))):
            parts.append("perm" + "".join(map(str, self.perm)))
        if any(s != 1 for s in self.steps):
            parts.append("step" + "".join(map(str, self.steps)))
        if self.pad:
            parts.append(f"pad{self.pad}")
        return "/".join(parts) or "dense"


def layouts(ndim: int, unit_last: bool = True):
    """Layouts of an ndim tensor; unit_last: its last dim innermost with step 1 (what caches
    and out= need)."""
    free = ndim - 1 if unit_last and ndim else ndim
    tail = (ndim - 1,) if free < ndim else ()
    perm = st.one_of(st.just(tuple(range(free))),
                     st.permutations(range(free)).map(tuple)).map(lambda p: p + tail)
    steps = st.tuples(*[st.sampled_from((1, 1, 2, 3)) for _ in range(free)]).map(
        lambda s: s + (1,) * len(tail))
    return st.builds(Layout, perm, steps, st.sampled_from((0, 1, 2)))


def qkv_layouts():
    """q / k / v: mostly a unit stride on headdim; else the entry points copy them."""
    return st.one_of(layouts(4), layouts(4), layouts(4, unit_last=False))


def embed(x: torch.Tensor, layout: Layout, fill) -> Tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): x copied into a view of a new buffer that holds ``fill`` elsewhere."""
    n = x.dim()
    perm = layout.perm if len(layout.perm) == n else tuple(range(n))
    steps = layout.steps if len(layout.steps) == n else (1,) * n
    pad = layout.pad
    size = [2 * pad + x.shape[d] * steps[d] for d in range(n)]
    buf = torch.full([size[d] for d in perm], fill, dtype=x.dtype, device=x.device)
    logical = buf.permute([perm.index(d) for d in range(n)])
    view = logical[tuple(slice(pad, pad + x.shape[d] * steps[d], steps[d]) for d in range(n))]
    view.copy_(x)
    return buf, view


_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as integers of the same width: equal iff bitwise equal (NaN too)."""
    t = t.detach()
    if t.is_floating_point() or t.dtype == torch.bool:
        return t.view(_INT_OF[t.element_size()])
    return t


class Placed:
    """A buffer and the views the call sees of it. role: "input" (must not change at all),
    "output" (must not change outside its views), "cache" (must equal ``expected``: its
    state before the call with the appended values written)."""

    def __init__(self, name, buf, views, role):
        self.name, self.buf, self.views, self.role = name, buf, list(views), role
        self.before = self.expected = None

    def twin(self, view, target):
        """The view of ``target`` (a tensor of buf's shape and strides) that ``view`` is of buf."""
        return target.as_strided(view.shape, view.stride(),
                                 view.storage_offset() - self.buf.storage_offset())

    def snapshot(self):
        self.before = self.buf.detach().clone()
        self.expected = self.before.clone()

    def inside(self):
        mask = torch.zeros(self.buf.shape, dtype=torch.bool, device=self.buf.device)
        for v in self.views:
            self.twin(v, mask).fill_(True)
        return mask

    def changes(self, expected, outside_only=False) -> Optional[str]:
        diff = bits(self.buf) != bits(expected)
        if not diff.any():
            return None
        inside = self.inside()
        n_out, n_in = int((diff & ~inside).sum()), int((diff & inside).sum())
        if outside_only and not n_out:
            return None
        where = [f"{n_out} outside its view (guard band)"] if n_out else []
        if n_in and not outside_only:
            where.append(f"{n_in} inside it")
        return f"{self.name}: {' and '.join(where)} changed"


# -- one call: its arguments, buffers and what it must do ---------------------------------

class Case:
    """A call of ``entry``: params (argument name -> value, the first ``positional`` passed
    positionally), the buffers they are views of, and what a valid call must give
    (``expect``: name -> (float64 reference, reference in the input dtype, factor, dtype))."""

    def __init__(self, entry, recipe):
        self.entry, self.r = entry, recipe
        self.gen = torch.Generator().manual_seed(recipe["seed"])
        self.placed = []
        self.params = {}
        self.positional = 0
        self.fn = None
        self.unpack = lambda res: (res, None)
        self.expect = None      # () -> {"out": (ref64, pt, factor, dtype), "lse": ...}
        self.backward = None    # (out) -> [(outcome, problem)] of the gradients
        self.writes = []        # (placed, view, index, value): the appends a call makes
        self.post_writes = None  # () -> such writes, known after the call (PagedKVCache)
        self.state = None       # () -> host state that a call may change (PagedKVCache)
        self.state_after = None  # (before, after) -> problem or None, for valid calls
        self.state_name = "PagedKVCache"  # what c.state() describes, in messages
        self.results = None     # (result) -> {name: tensor}: more results that expect() names
        self.torch_fn = None    # torch's own function, for the SDPA-like entries' defects
        self.scope = contextlib.nullcontext  # entered around a call and its backward
        self.patches = {}       # configs attributes set during the call
        self.names = {}         # canonical option name -> this entry's argument name
        self.values = {}        # logical input values (before placement)
        self.layouts = {}       # argument -> Layout
        self.out_view = None    # the out= view (varlen)

    def randn(self, *shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=self.gen) * scale).to(DEVICE, dtype)

    def randint(self, low, high, shape=()):
        return torch.randint(low, high, shape, generator=self.gen)

    def place(self, name, x, layout, role="input", grad=False):
        fill = (float("nan") if x.is_floating_point() else True if x.dtype == torch.bool
                else self.r.get("garbage", -7))
        buf, view = embed(x.to(DEVICE), layout, fill)
        placed = Placed(name, buf, [view], role)
        if grad:  # the view as a function of the buffer, for autograd
            buf.requires_grad_(True)
            placed.views = [placed.twin(view, buf)]
        self.placed.append(placed)
        self.layouts[name] = layout
        return placed.views[0]

    def pn(self, canonical):
        return self.names.get(canonical)

    def invoke(self, params=None):
        params = self.params if params is None else params
        names = list(params)
        args = [params[n] for n in names[:self.positional]]
        kwargs = {n: params[n] for n in names[self.positional:]}
        with _patched(self.patches):
            return self.fn(*args, **kwargs)

    def describe(self):
        r = self.r
        skip = {"seed", "layouts", "garbage"}
        parts = [f"{k}={_short(v)}" for k, v in r.items() if k not in skip]
        lay = ", ".join(f"{n}:{l!r}" for n, l in self.layouts.items() if repr(l) != "dense")
        return (f"{self.entry}({' '.join(parts)}" + (f"; layouts {lay}" if lay else "")
                + f"; garbage {r.get('garbage')}, seed {r['seed']})")


def _short(v):
    if isinstance(v, torch.dtype):
        return str(v).split(".")[-1]
    return repr(v)


@contextlib.contextmanager
def _patched(values):
    old = {n: getattr(configs, n) for n in values}
    for n, x in values.items():
        setattr(configs, n, x)
    try:
        yield
    finally:
        for n, x in old.items():
            setattr(configs, n, x)


class CallTimeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds):
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise CallTimeout(f"no answer in {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# -- options --------------------------------------------------------------------------------

def _form(value, kind, how):
    """An option as a caller may pass it: plain Python, numpy, or a tensor."""
    if how == "plain" or value is None:
        return value
    if kind == "flag":
        return np.bool_(value) if how == "numpy" else torch.tensor(bool(value))
    if kind == "scalar":
        return np.float32(value) if how == "numpy" else torch.tensor(float(value))
    return np.array(value) if how == "numpy" else torch.tensor(list(value))  # a pair


@st.composite
def option_recipe(draw, has, plain=False):
    """The options an entry takes (``has``: canonical names); plain: as Python values."""
    o = {}
    if "causal" in has:
        o["causal"] = draw(st.booleans())
    if "window" in has:
        o["window"] = draw(st.one_of(st.just((-1, -1)),
                                     st.tuples(st.integers(-1, 6), st.integers(-1, 6))))
    if "softcap" in has:
        o["softcap"] = draw(st.sampled_from((0.0, 0.0, 2.0, 30.0)))
    if "alibi" in has:
        o["alibi"] = draw(st.sampled_from((None, None, "(H,)", "(B, H)")))
    if "sinks" in has:
        o["sinks"] = draw(st.sampled_from((None, None, torch.float32, torch.bfloat16)))
    if "scale" in has:
        o["scale"] = draw(st.sampled_from((None, None, 0.08, 0.5)))
    for flag in ("deterministic", "batch_invariant"):
        if flag in has:
            o[flag] = draw(st.sampled_from((False, False, True)))
    o["forms"] = "plain" if plain else draw(st.sampled_from(("plain", "plain", "numpy",
                                                             "tensor")))
    return o


def _options(c, B, H):
    """Place the recipe's options into c.params under the entry's names; the reference's
    keyword arguments (B: alibi's rows)."""
    r, how, ref = c.r, c.r.get("forms", "plain"), {}
    if "causal" in r:
        c.params[c.pn("causal")] = _form(r["causal"], "flag", how)
        ref["causal"] = r["causal"]
    if "window" in r:
        c.params[c.pn("window")] = _form(r["window"], "pair", how)
        ref["window_size"] = r["window"]
    if "softcap" in r:
        c.params[c.pn("softcap")] = _form(r["softcap"], "scalar", how)
        ref["softcap"] = r["softcap"]
    if r.get("alibi"):
        shape = (H,) if r["alibi"] == "(H,)" else (B, H)
        slopes = torch.rand(shape, generator=c.gen).to(DEVICE) * 0.5
        c.values["alibi"] = slopes
        c.params[c.pn("alibi")] = c.place(c.pn("alibi"), slopes, r["layouts"]["alibi"])
        ref["alibi_slopes"] = slopes
    if r.get("sinks") is not None:
        sinks = c.randn(H, dtype=r["sinks"], scale=2.0)
        c.values["sinks"] = sinks
        c.params[c.pn("sinks")] = c.place(c.pn("sinks"), sinks, r["layouts"]["sinks"])
        ref["sinks"] = sinks
    if r.get("scale") is not None:
        formed = _form(r["scale"], "scalar", how)
        c.params[c.pn("scale")] = formed
        ref["softmax_scale"] = float(formed)
    for flag in ("deterministic", "batch_invariant"):
        if flag in r:
            c.params[c.pn(flag)] = _form(r[flag], "flag", how)
    return ref


def _option_layouts(draw, r):
    lay = {"alibi": draw(layouts(2 if r.get("alibi") == "(B, H)" else 1, unit_last=False)),
           "sinks": draw(layouts(1, unit_last=False))}
    return lay


def _index_layouts(draw, r, index_names, **more):
    """Layouts of q, k, v, the 1-D index tensors ``index_names``, the block table, the
    options' tensors, and ``more``."""
    lay = {n: draw(qkv_layouts()) for n in ("q", "k", "v")}
    for n in index_names:
        lay[n] = draw(layouts(1, unit_last=False))
    lay["block_table"] = draw(layouts(2, unit_last=False))
    lay.update(_option_layouts(draw, r), **more)
    return lay


@st.composite
def heads(draw, zero=True):
    hkv = draw(st.sampled_from((1, 2, 1, 2, 1, 2, 3) + ((0,) if zero else ())))
    return hkv * draw(st.sampled_from((1, 2, 3))), hkv


def _base(draw, defects, own_v_dim=True):
    """Sizes and dtype. The base of a one-defect call (``defects``) has heads and its options
    in plain Python values, and takes no gradient: the valid calls test those."""
    r = {"seed": draw(st.integers(0, 2**31 - 1))}
    r["H"], r["HKV"] = draw(heads(zero=not defects))
    r["D"] = draw(st.sampled_from(HEAD_DIMS))
    if own_v_dim:
        r["DV"] = draw(st.sampled_from((r["D"],) * 5 + (16, 32)))
    r["dtype"] = draw(st.sampled_from(DTYPES))
    r["garbage"] = draw(st.sampled_from((-7, 2**31 - 1, -2**31, 1000)))
    return r


# -- comparisons ----------------------------------------------------------------------------

def _compare(name, ours, ref, pt, dtype, factor):
    """Problems of ``ours`` against the float64 ``ref`` (tests/accuracy.py's rule)."""
    if not isinstance(ours, torch.Tensor):
        return [(WRONG, f"{name}: got {type(ours).__name__}, expected a tensor")]
    if tuple(ours.shape) != tuple(ref.shape):
        return [(WRONG, f"{name}: shape {tuple(ours.shape)}, expected {tuple(ref.shape)}")]
    ours = ours.detach()
    nan = torch.isnan(ours) & ~torch.isnan(ref)
    if nan.any():
        first = tuple(nan.nonzero()[0].tolist())
        return [(NAN, f"{name}: {int(nan.sum())} of {ours.numel()} NaN (first at {first})")]
    err, bound = max_err(ours, ref), factor * max_err(pt, ref) + floor(ref, dtype)
    if not err <= bound:
        diff = (ours.double() - ref.double()).abs().nan_to_num(float("inf"))
        at = tuple(int(i) for i in np.unravel_index(int(diff.argmax()), diff.shape))
        return [(WRONG, f"{name}: max error {err:.3g} > bound {bound:.3g} (at {at}: "
                        f"{float(ours[at]):.4g}, reference {float(ref[at]):.4g})")]
    return []


def _flip_empty(lse):
    """flash-attn's drop-in reports +inf for rows that see no key."""
    return torch.where(lse == float("-inf"), float("inf"), lse)


# -- dense entry points -----------------------------------------------------------------------

DENSE_NAMES = {
    "flash_attention": dict(causal="causal", scale="softmax_scale", window="window_size",
                            softcap="softcap", alibi="alibi_slopes", sinks="sinks",
                            deterministic="deterministic", batch_invariant="batch_invariant",
                            dropout="dropout_p"),
    "flash_attn_func": dict(causal="causal", scale="softmax_scale", window="window_size",
                            softcap="softcap", alibi="alibi_slopes", sinks="learnable_sink",
                            deterministic="deterministic", dropout="dropout_p"),
    "scaled_dot_product_attention": dict(causal="is_causal", scale="scale", dropout="dropout_p"),
}
DENSE_NAMES["flash_attention_with_lse"] = DENSE_NAMES["flash_attention"]
# flash-attn's private wrappers (ring-flash-attn's calls): window_size is split into
# window_size_left / window_size_right there (build_private)
DENSE_NAMES["_flash_attn_forward"] = dict(causal="causal", scale="softmax_scale",
                                          window="window_size", softcap="softcap",
                                          alibi="alibi_slopes", dropout="dropout_p")
DENSE_NAMES["_flash_attn_backward"] = dict(DENSE_NAMES["_flash_attn_forward"],
                                           deterministic="deterministic")
FA_PRIVATE = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
              "_flash_attn_varlen_backward")
# torch's SDPA signature: the drop-in, and the two routes that reach it from torch's function
PATCHED_MODULE = "patch_sdpa(module)"
REGISTRY = "torch registry F.sdpa(flash)"
SDPA_ENTRIES = ("scaled_dot_product_attention", PATCHED_MODULE, REGISTRY)
for _entry in SDPA_ENTRIES[1:]:
    DENSE_NAMES[_entry] = DENSE_NAMES["scaled_dot_product_attention"]


@st.composite
def dense_recipe(draw, entry, defects=False):
    r = _base(draw, defects)
    r["B"] = draw(st.sampled_from((1, 2, 3, 1, 2, 0)))
    r["SQ"], r["SK"] = draw(st.sampled_from(SEQLENS)), draw(st.sampled_from(SEQLENS))
    names = DENSE_NAMES[entry]
    registry = entry == REGISTRY
    if entry in SDPA_ENTRIES:
        r.update(draw(option_recipe({"causal", "scale"})))
        r["forms"] = "plain"  # torch's signature: bools and floats
        r["enable_gqa"] = True if r["H"] != r["HKV"] else draw(st.booleans())
        r["mask"] = None if r["causal"] else draw(st.sampled_from((None, "bool", "additive")))
        if registry:  # what SDPA's flash backend takes (else torch finds no kernel)
            r["mask"], r["DV"] = None, r["D"]
            r["causal"] = r["causal"] and r["SQ"] == r["SK"]
            if ON_GPU and r["dtype"] == torch.float32:
                r["dtype"] = torch.bfloat16
            if not ON_GPU and not defects and draw(st.sampled_from((False,) * 5 + (True,))):
                r["dtype"] = torch.float64  # the kernels refuse it: torch's own kernel runs
        if r["mask"]:
            r["mask_shape"] = draw(st.sampled_from(("(L, S)", "(B, H, L, S)", "(B, 1, L, S)",
                                                    "(1, H, 1, S)", "(H, L, 1)")))
    else:
        r.update(draw(option_recipe(set(names), defects)))
    if entry == "flash_attn_func":
        r["return_attn_probs"] = draw(st.booleans())
    r["route"] = draw(st.sampled_from(("default", "default", "dense-split")))
    r["grad"] = (not defects and entry not in FA_PRIVATE and r["dtype"] != torch.float64
                 and draw(st.sampled_from((False, False, False, True))))
    # SDPA's flash backend takes a unit stride on headdim only
    lay = {n: draw(layouts(4) if registry else qkv_layouts()) for n in ("q", "k", "v")}
    lay.update(_option_layouts(draw, r))
    if r.get("mask"):
        lay["attn_mask"] = draw(layouts(4, unit_last=False))
    r["layouts"] = lay
    return r


def _mask_shape(spec, B, H, L, S):
    return {"(L, S)": (L, S), "(B, H, L, S)": (B, H, L, S), "(B, 1, L, S)": (B, 1, L, S),
            "(1, H, 1, S)": (1, H, 1, S), "(H, L, 1)": (H, L, 1)}[spec]


def build_dense(entry, r):
    c = Case(entry, r)
    c.names = dict(DENSE_NAMES[entry], q="q", k="k", v="v")
    B, SQ, SK, H, HKV, D, DV, dt = (r[n] for n in ("B", "SQ", "SK", "H", "HKV", "D", "DV",
                                                    "dtype"))
    sdpa = entry in SDPA_ENTRIES
    compat = entry in ("flash_attn_func",) + FA_PRIVATE  # flash-attn's LSE: +inf, not -inf
    if sdpa:
        c.names.update(q="query", k="key", v="value")
    q, k, v = c.randn(B, SQ, H, D, dtype=dt), c.randn(B, SK, HKV, D, dtype=dt), \
        c.randn(B, SK, HKV, DV, dtype=dt)
    c.values.update(q=q, k=k, v=v)
    views = {}
    for n, x in (("q", q), ("k", k), ("v", v)):
        name = c.names[n]
        api = x.transpose(1, 2) if sdpa else x  # SDPA's (B, H, N, D)
        views[n] = c.place(name, api, r["layouts"][n], grad=r["grad"])
        c.params[name] = views[n]
    c.positional = 3
    if r["route"] == "dense-split":
        c.patches = {"DENSE_SPLIT_MIN_KEYS": 8}
    mask = None
    if sdpa:
        if r["mask"]:
            shape = _mask_shape(r["mask_shape"], B, H, SQ, SK)
            mask = (torch.rand(shape, generator=c.gen) < 0.7 if r["mask"] == "bool"
                    else c.randn(*shape, dtype=dt, scale=2.0)).to(DEVICE)
            c.params["attn_mask"] = c.place("attn_mask", mask, r["layouts"]["attn_mask"])
        ref_opts = _options(c, B, H)
        if r["enable_gqa"]:
            c.params["enable_gqa"] = True
        causal = ref_opts.pop("causal")
        if causal:  # torch's is_causal: top-left aligned
            mask = torch.ones(SQ, SK, dtype=torch.bool, device=DEVICE).tril()
        if mask is not None:
            ref_opts["attn_mask"] = mask.expand(B, H, SQ, SK)
        c.fn = flashtriton.scaled_dot_product_attention
    else:
        ref_opts = _options(c, B, H)
        c.fn = {"flash_attention": flashtriton.flash_attention,
                "flash_attention_with_lse": flashtriton.flash_attention_with_lse,
                "flash_attn_func": fa.flash_attn_func}.get(entry)  # (FA_PRIVATE: build_private)
    returns_lse = (entry == "flash_attention_with_lse" or r.get("return_attn_probs")
                   or entry in FA_PRIVATE)
    if entry == "flash_attn_func" and r["return_attn_probs"]:
        c.params["return_attn_probs"] = True
    if entry == "flash_attention_with_lse":
        c.unpack = lambda res: (res.out, res.lse)
    elif entry == "flash_attn_func" and r["return_attn_probs"] or entry in FA_PRIVATE:
        c.unpack = lambda res: (res[0], res[1])

    def reference(q, k, v, dtype):
        ref = attention_reference(q, k, v, dtype=dtype, **ref_opts)
        if sdpa:
            return ref.out.transpose(1, 2), ref.lse
        return ref.out, (_flip_empty(ref.lse) if compat else ref.lse)

    def expect():
        ref, pt = reference(q, k, v, torch.float64), reference(q, k, v, dt)
        want = {"out": (ref[0], pt[0], 2, dt)}
        if returns_lse:
            want["lse"] = (ref[1], pt[1], 2, dt)
        return want

    c.expect = expect
    c.views = views
    c.reference = reference
    if r["grad"]:  # (SDPA's gradients in its own layout)
        api = (lambda x: x.transpose(1, 2)) if sdpa else (lambda x: x)
        c.backward = _backward(c, [views["q"], views["k"], views["v"]],
                               (api(q), api(k), api(v)),
                               lambda *x: reference(*map(api, x[:3]), x[3])[0], dt)
    return c


def run_explained(c) -> Tuple[str, str]:
    """flashtriton.explain and validation.supported take every option of the flash_attention
    call they describe (no kernel runs): the first explains it, the second says the kernels
    run it (None)."""
    views = c.views
    options = {n: x for n, x in c.params.items() if n not in ("q", "k", "v")}
    problems = []
    for name, fn in (("flashtriton.explain", flashtriton.explain),
                     ("validation.supported", validation.supported)):
        try:
            answer = fn(views["q"], views["k"], views["v"], **options)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}: {_exception(e)}")
            continue
        if name == "validation.supported" and answer is not None:
            problems.append(f"{name} refuses it: {answer}")
    return (REFUSED, "; ".join(problems)) if problems else (OK, "")


def _backward(c, views, values, reference, dt):
    """Gradients of out w.r.t. the views against the reference's (factor 3)."""
    def run(out):
        if out.numel() == 0:
            return []
        if not out.requires_grad:
            return [(WRONG, "out does not require grad although its inputs do")]
        dout = torch.randn(out.shape, generator=c.gen).to(DEVICE, out.dtype)
        ours = torch.autograd.grad(out, views, dout, allow_unused=True)
        r64 = [x.detach().double().requires_grad_() for x in values]
        rlp = [x.detach().clone().requires_grad_() for x in values]
        g64 = torch.autograd.grad(reference(*r64, torch.float64), r64, dout.double(),
                                  allow_unused=True)
        glp = torch.autograd.grad(reference(*rlp, dt), rlp, dout, allow_unused=True)
        problems = []
        for name, g, a, b in zip(("dq", "dk", "dv"), ours, g64, glp):
            g = torch.zeros_like(a) if g is None else g
            a = torch.zeros_like(g, dtype=torch.float64) if a is None else a
            b = torch.zeros_like(g) if b is None else b
            problems += _compare(name, g, a, b, dt, 3)
        return problems
    return run


# -- varlen entry points --------------------------------------------------------------------

VARLEN_NAMES = {
    "flash_attention_varlen": dict(DENSE_NAMES["flash_attention"]),
    "flash_attn_varlen_func": dict(DENSE_NAMES["flash_attn_func"]),
}
VARLEN_NAMES["flash_attention_varlen_with_lse"] = VARLEN_NAMES["flash_attention_varlen"]
VARLEN_NAMES["_flash_attn_varlen_forward"] = dict(DENSE_NAMES["_flash_attn_forward"])
VARLEN_NAMES["_flash_attn_varlen_backward"] = dict(DENSE_NAMES["_flash_attn_backward"])
VARLEN_MODES = ("plain", "plain", "seqused_k", "paged", "paged")


@st.composite
def varlen_recipe(draw, entry, defects=False, modes=VARLEN_MODES):
    r = _base(draw, defects)
    B = draw(st.sampled_from((1, 2, 3, 1, 2, 3, 0)))
    r["mode"] = draw(st.sampled_from(modes))
    decode = draw(st.sampled_from((False, False, True)))
    lens = st.lists(st.sampled_from((0, 1, 2, 3, 5, 8, 12)), min_size=B, max_size=B)
    r["lens_q"] = [1] * B if decode else draw(lens)
    r["lens_k"] = draw(st.lists(st.sampled_from((0, 1, 2, 4, 7, 9, 12, 17)),
                                min_size=B, max_size=B))
    if r["mode"] == "seqused_k":
        r["used"] = [draw(st.integers(0, n)) for n in r["lens_k"]]
    r["extra_q"] = draw(st.sampled_from((0, 0, 0, 2)))
    if r["mode"] in ("plain", "seqused_k"):
        r["extra_k"] = draw(st.sampled_from((0, 0, 2)))
    else:
        r["page_size"] = draw(st.sampled_from((8, 16)))
        r["extra_pages"] = draw(st.sampled_from((0, 1)))
        r["spare"] = draw(st.sampled_from((0, 1, 2)))
        r["unused_slots"] = draw(st.sampled_from((-1, "pages")))
        r["lengths_in"] = draw(st.sampled_from(("seqused_k", "seqused_k", "cu_seqlens_k",
                                                 "both")))
        r["DV"] = r["D"] if draw(st.booleans()) else r["DV"]
    r["slack"] = (draw(st.sampled_from((0, 0, 1, 3))), draw(st.sampled_from((0, 0, 1, 3))))
    r["max_as"] = draw(st.sampled_from(("int", "int", "tensor")))
    r["out"] = (not r["extra_q"] and entry not in FA_PRIVATE
                and draw(st.sampled_from((False, False, True))))
    r["grad"] = (not defects and entry not in FA_PRIVATE
                 and draw(st.sampled_from((False, False, False, True))))
    r["stale"] = draw(st.sampled_from(("nan", "random")))
    r["route"] = draw(st.sampled_from(("default", "default", "prefill", "merge-kernel")))
    r.update(draw(option_recipe(set(VARLEN_NAMES[entry]), defects)))
    if entry == "flash_attn_varlen_func":
        r["returns"] = draw(st.sampled_from(("out", "return_attn_probs", "return_softmax_lse")))
    r["layouts"] = _index_layouts(draw, r, ("cu_seqlens_q", "cu_seqlens_k", "seqused_k"),
                                  out=draw(layouts(3)))
    return r


def _cu(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(torch.int32)


ROUTES = {"default": {}, "prefill": {"KVCACHE_PREFILL_MIN_ROWS": 1},
          "merge-kernel": {"DECODE_MERGE_IN_KERNEL": False}}


def build_varlen(entry, r):
    c = Case(entry, r)
    c.names = dict(VARLEN_NAMES[entry], q="q", k="k", v="v")
    H, HKV, D, DV, dt, mode = (r[n] for n in ("H", "HKV", "D", "DV", "dtype", "mode"))
    lens_q, lens_k = r["lens_q"], r["lens_k"]
    B = len(lens_q)
    nan = float("nan")
    cu_q = _cu(lens_q)
    total_q = int(cu_q[-1])
    q = c.randn(total_q + r["extra_q"], H, D, dtype=dt)  # rows past the sequences: no output
    keys = []  # sequence b's keys and values: (rows of k, rows of v) as index lists
    if mode in ("plain", "seqused_k"):
        used = r.get("used", lens_k)
        cu_k = _cu(lens_k)
        total_k = int(cu_k[-1]) + r["extra_k"]
        k, v = c.randn(total_k, HKV, D, dtype=dt), c.randn(total_k, HKV, DV, dtype=dt)
        read = torch.zeros(total_k, dtype=torch.bool)
        for b in range(B):
            rows = list(range(int(cu_k[b]), int(cu_k[b]) + used[b]))
            read[rows] = True
            keys.append(rows)
        if r["stale"] == "nan":  # keys no sequence reads
            k[~read], v[~read] = nan, nan
        counts = used
    else:
        ps = r["page_size"]
        counts = lens_k
        per_seq = [-(-n // ps) for n in counts]
        width = max(per_seq + [1]) + r["extra_pages"]
        n_pages = sum(per_seq) + r["spare"]
        n_pages = max(n_pages, 1)
        order = torch.randperm(n_pages, generator=c.gen).tolist()
        k, v = (c.randn(n_pages, ps, HKV, d, dtype=dt) for d in (D, DV))
        table = torch.full((B, width), -1, dtype=torch.int32)
        if r["unused_slots"] == "pages":
            table = c.randint(0, n_pages, (B, width)).to(torch.int32)
        read = torch.zeros(n_pages, ps, dtype=torch.bool)
        at = 0
        for b, n in enumerate(counts):
            pages = order[at:at + per_seq[b]]
            at += per_seq[b]
            table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            rows = [(pages[i // ps], i % ps) for i in range(n)]
            for p, o in rows:
                read[p, o] = True
            keys.append(rows)
        if r["stale"] == "nan":
            k[~read], v[~read] = nan, nan
        c.values["block_table"] = table
    c.values.update(q=q, k=k, v=v, cu_seqlens_q=cu_q)
    lay = r["layouts"]
    grad = r["grad"]
    views = {n: c.place(c.names[n], x, lay[n], grad=grad) for n, x in (("q", q), ("k", k),
                                                                         ("v", v))}
    c.params.update(q=views["q"], k=views["k"], v=views["v"])
    c.params["cu_seqlens_q"] = c.place("cu_seqlens_q", cu_q, lay["cu_seqlens_q"])
    paged = mode == "paged"
    give_cu_k = not paged or r["lengths_in"] in ("cu_seqlens_k", "both")
    give_used = mode == "seqused_k" or paged and r["lengths_in"] in ("seqused_k", "both")
    cu_k_val = _cu(lens_k)
    c.values["cu_seqlens_k"] = cu_k_val
    c.params["cu_seqlens_k"] = (c.place("cu_seqlens_k", cu_k_val, lay["cu_seqlens_k"])
                                if give_cu_k else None)
    max_q = max(lens_q, default=0) + r["slack"][0]
    max_k = max(lens_k, default=0) + r["slack"][1]
    as_max = (lambda x: x) if r["max_as"] == "int" else (lambda x: torch.tensor(x))
    c.params["max_seqlen_q"], c.params["max_seqlen_k"] = as_max(max_q), as_max(max_k)
    c.positional = 7
    if give_used:
        used_t = torch.tensor(counts, dtype=torch.int32)
        c.values["seqused_k"] = used_t
        c.params["seqused_k"] = c.place("seqused_k", used_t, lay["seqused_k"])
    if paged:
        c.params["block_table"] = c.place("block_table", c.values["block_table"],
                                          lay["block_table"])
    ref_opts = _options(c, B, H)
    compat = entry in ("flash_attn_varlen_func",) + FA_PRIVATE  # flash-attn's LSE: +inf
    returns = r.get("returns", "return_lse" if entry.endswith("_with_lse") or entry in FA_PRIVATE
                    else "out")
    if entry == "flash_attn_varlen_func" and returns != "out":
        c.params[returns] = True
    out_view = None
    if r["out"]:
        out_val = torch.full((total_q, H, DV), nan, dtype=dt, device=DEVICE)
        out_view = c.place("out", out_val, lay["out"], role="output")
        c.params["out"] = out_view
    c.patches = dict(ROUTES[r["route"]])
    c.fn = {"flash_attention_varlen": flashtriton.flash_attention_varlen,
            "flash_attention_varlen_with_lse": flashtriton.flash_attention_varlen_with_lse,
            "flash_attn_varlen_func": fa.flash_attn_varlen_func}.get(entry)  # (FA_PRIVATE)
    if entry.endswith("_with_lse"):
        c.unpack = lambda res: (res.out[:total_q], res.lse[:, :total_q])
    elif compat and returns != "out":
        c.unpack = lambda res: (res[0][:total_q], res[1][:, :total_q])
    else:
        c.unpack = lambda res: (res[:total_q], None)
    alibi = ref_opts.pop("alibi_slopes", None)

    def gather(x, rows):
        if paged:
            return torch.stack([x[p, o] for p, o in rows]) if rows else x[:0, 0]
        return x[rows] if rows else x[:0]

    def reference(q, k, v, dtype):
        outs, lses = [], []
        for b in range(B):
            qb = q[int(cu_q[b]):int(cu_q[b + 1])]
            kb, vb = gather(k, keys[b]), gather(v, keys[b])
            slopes = None if alibi is None else (alibi[b] if alibi.dim() == 2 else alibi)
            ref = attention_reference(qb[None], kb[None], vb[None], dtype=dtype,
                                      alibi_slopes=slopes, **ref_opts)
            outs.append(ref.out[0])
            lses.append(ref.lse[0])
        out = torch.cat(outs) if outs else torch.zeros(0, H, DV, dtype=dtype)
        lse = torch.cat(lses, dim=1) if lses else torch.zeros(H, 0, dtype=dtype)
        return out, (_flip_empty(lse) if compat else lse)

    def expect():
        ref, pt = reference(q, k, v, torch.float64), reference(q, k, v, dt)
        want = {"out": (ref[0], pt[0], 2, dt)}
        if returns != "out":
            want["lse"] = (ref[1], pt[1], 2, dt)
        if out_view is not None:
            want["out="] = want["out"]
        return want

    c.expect = expect
    c.out_view = out_view
    c.reference = reference
    c.total_k = int(cu_k_val[-1])
    if grad and mode == "plain" and out_view is None:
        c.backward = _backward(c, [views["q"], views["k"], views["v"]], (q, k, v),
                               lambda *x: reference(*x[:3], x[3])[0], dt)
    return c


# -- KV-cache entry points ------------------------------------------------------------------

KV_NAMES = {
    "attention_with_kvcache": dict(causal="causal", scale="softmax_scale", window="window_size",
                                   softcap="softcap", alibi="alibi_slopes", sinks="sinks",
                                   batch_invariant="batch_invariant", num_splits="num_splits",
                                   return_lse="return_lse"),
    "flash_attn_with_kvcache": dict(causal="causal", scale="softmax_scale",
                                    window="window_size", softcap="softcap",
                                    alibi="alibi_slopes", sinks="learnable_sink",
                                    num_splits="num_splits", return_lse="return_softmax_lse"),
}


@st.composite
def kv_recipe(draw, entry, defects=False):
    r = _base(draw, defects, own_v_dim=False)
    B = r["B"] = draw(st.sampled_from((1, 2, 3, 1, 2)))
    r["SQ"] = draw(st.sampled_from((0, 1, 1, 2, 3, 5)))
    r["paged"] = draw(st.booleans())
    new = r["new"] = draw(st.sampled_from((None, None, 0, 1, 2, 4)))
    n_new = new or 0
    if r["paged"]:
        r["page_size"] = draw(st.sampled_from((8, 16)))
        r["width"] = draw(st.sampled_from((1, 2, 3)))
        r["spare"] = draw(st.sampled_from((0, 1, 2)))
        r["unused_slots"] = draw(st.sampled_from((-1, "pages")))
        capacity = r["width"] * r["page_size"]
    else:
        capacity = r["capacity"] = draw(st.sampled_from((8, 12, 17, 24)))
        r["batch_idx"] = draw(st.sampled_from((False, False, True)))
        r["rows"] = B + draw(st.sampled_from((0, 0, 1, 2)))
    same = draw(st.sampled_from((False, False, False, True)))
    if same:
        r["cache_seqlens"] = draw(st.integers(0, capacity - n_new))
    else:
        r["cache_seqlens"] = [draw(st.integers(0, capacity - n_new)) for _ in range(B)]
    lens = [r["cache_seqlens"]] * B if same else r["cache_seqlens"]
    left_padded = draw(st.sampled_from((False, False, True)))
    r["leftpad"] = [draw(st.integers(0, n)) for n in lens] if left_padded else None
    r.update(draw(option_recipe(set(KV_NAMES[entry]), defects)))
    if r.get("batch_invariant") and r["paged"] and r["leftpad"] is not None:
        r["batch_invariant"] = False  # not supported (documented)
    r["num_splits"] = draw(st.sampled_from((0, 0, 1, 2, 3, 7)))
    r["return_lse"] = draw(st.booleans())
    r["stale"] = draw(st.sampled_from(("nan", "random")))
    r["kv_packed"] = draw(st.sampled_from((False, False, True)))
    r["route"] = draw(st.sampled_from(("default", "default", "prefill", "merge-kernel")))
    if entry == "attention_with_kvcache" and not defects:
        r["q_by_keyword"] = draw(st.sampled_from((False,) * 7 + (True,)))
    r["layouts"] = _index_layouts(draw, r, ("cache_seqlens", "cache_batch_idx", "cache_leftpad"),
                                  cache=draw(layouts(5 if r["kv_packed"] else 4)),
                                  v_cache=draw(layouts(4)))
    return r


def build_kv(entry, r):
    c = Case(entry, r)
    c.names = dict(KV_NAMES[entry], q="q", k="k", v="v", k_cache="k_cache", v_cache="v_cache")
    B, SQ, H, HKV, D, dt = (r[n] for n in ("B", "SQ", "H", "HKV", "D", "dtype"))
    n_new = r["new"] or 0
    lens = r["cache_seqlens"] if isinstance(r["cache_seqlens"], list) else [r["cache_seqlens"]] * B
    pad = r["leftpad"] or [0] * B
    nan = float("nan")
    lay = r["layouts"]
    q = c.randn(B, SQ, H, D, dtype=dt)
    k_new = c.randn(B, n_new, HKV, D, dtype=dt)
    v_new = c.randn(B, n_new, HKV, D, dtype=dt)
    if r["paged"]:
        ps, width = r["page_size"], r["width"]
        per_seq = [-(-(n + n_new) // ps) for n in lens]
        n_pages = max(sum(per_seq) + r["spare"], 1)
        order = torch.randperm(n_pages, generator=c.gen).tolist()
        table = (torch.full((B, width), -1, dtype=torch.int32) if r["unused_slots"] == -1
                 else c.randint(0, n_pages, (B, width)).to(torch.int32))
        at = 0
        for b in range(B):
            table[b, :per_seq[b]] = torch.tensor(order[at:at + per_seq[b]], dtype=torch.int32)
            at += per_seq[b]
        c.values["block_table"] = table

        def slot(b, pos):
            return int(table[b, pos // ps]), pos % ps
        cache_shape = (n_pages, ps, HKV, D)
        rows = None
    else:
        rows = r["rows"]
        if r["batch_idx"]:
            idx = (torch.randperm(rows, generator=c.gen)[:B] if n_new
                   else c.randint(0, rows, (B,))).to(torch.int32)
            c.values["cache_batch_idx"] = idx
        else:
            idx = torch.arange(B, dtype=torch.int32)

        def slot(b, pos):
            return int(idx[b]), pos
        cache_shape = (rows, r["capacity"], HKV, D)
    kc, vc = c.randn(*cache_shape, dtype=dt), c.randn(*cache_shape, dtype=dt)
    if r["stale"] == "nan":  # what no sequence reads: left padding, past the keys, other rows
        read = torch.zeros(cache_shape[:2], dtype=torch.bool)
        for b in range(B):
            for pos in range(pad[b], lens[b] + n_new):
                read[slot(b, pos)] = True
        kc[~read], vc[~read] = nan, nan
    if r["kv_packed"]:
        buf, view = embed(torch.stack([kc, vc], dim=2), lay["cache"], nan)
        k_cache, v_cache = view[:, :, 0], view[:, :, 1]
        c.placed.append(Placed("k_cache+v_cache", buf, [k_cache, v_cache], "cache"))
        c.layouts["k_cache+v_cache"] = lay["cache"]
    else:
        k_cache = c.place("k_cache", kc, lay["cache"], role="cache")
        v_cache = c.place("v_cache", vc, lay["v_cache"], role="cache")
    c.values.update(q=q, k=k_new, v=v_new, k_cache=kc, v_cache=vc)
    # the appends, and the caches as the reference sees them after
    kc_after, vc_after = kc.clone(), vc.clone()
    cache_placed = [p for p in c.placed if p.role == "cache"]
    for b in range(B):
        for i in range(n_new):
            at = slot(b, lens[b] + i)
            kc_after[at], vc_after[at] = k_new[b, i], v_new[b, i]
            for view, val in ((k_cache, k_new[b, i]), (v_cache, v_new[b, i])):
                owner = next(p for p in cache_placed if any(w is view for w in p.views))
                c.writes.append((owner, view, at, val))
    c.params.update(q=c.place("q", q, lay["q"]), k_cache=k_cache, v_cache=v_cache)
    if r["new"] is None:
        c.params.update(k=None, v=None)
    else:
        c.params.update(k=c.place("k", k_new, lay["k"]), v=c.place("v", v_new, lay["v"]))
    compat = entry == "flash_attn_with_kvcache"
    if compat:  # flash-attn's positional order
        c.params.update(rotary_cos=None, rotary_sin=None)
        c.positional = 7
    else:
        c.positional = 0 if r.get("q_by_keyword") else 5
    if isinstance(r["cache_seqlens"], list):
        seqlens = torch.tensor(lens, dtype=torch.int32)
        c.values["cache_seqlens"] = seqlens
        c.params["cache_seqlens"] = c.place("cache_seqlens", seqlens, lay["cache_seqlens"])
    else:
        c.params["cache_seqlens"] = r["cache_seqlens"]
    if "cache_batch_idx" in c.values:
        c.params["cache_batch_idx"] = c.place("cache_batch_idx", c.values["cache_batch_idx"],
                                              lay["cache_batch_idx"])
    if r["leftpad"] is not None:
        c.values["cache_leftpad"] = torch.tensor(pad, dtype=torch.int32)
        c.params["cache_leftpad"] = c.place("cache_leftpad", c.values["cache_leftpad"],
                                            lay["cache_leftpad"])
    if r["paged"]:
        c.params["block_table"] = c.place("block_table", table, lay["block_table"])
    ref_opts = _options(c, B, H)
    c.params[c.pn("num_splits")] = r["num_splits"]
    c.params[c.pn("return_lse")] = r["return_lse"]
    c.patches = dict(ROUTES[r["route"]])
    if compat:
        c.fn = fa.flash_attn_with_kvcache
        c.unpack = (lambda res: (res[0], res[1])) if r["return_lse"] else (lambda res: (res, None))
    else:
        c.fn = attention_with_kvcache
        c.unpack = lambda res: (res.out, res.lse)
    alibi = ref_opts.pop("alibi_slopes", None)

    def reference(dtype):
        outs, lses = [], []
        for b in range(B):
            at = [slot(b, pos) for pos in range(pad[b], lens[b] + n_new)]
            kb = torch.stack([kc_after[a] for a in at]) if at else kc_after[:0, 0]
            vb = torch.stack([vc_after[a] for a in at]) if at else vc_after[:0, 0]
            slopes = None if alibi is None else (alibi[b] if alibi.dim() == 2 else alibi)
            ref = attention_reference(q[b:b + 1], kb[None], vb[None], dtype=dtype,
                                      alibi_slopes=slopes, **ref_opts)
            outs.append(ref.out)
            lses.append(ref.lse)
        return torch.cat(outs), torch.cat(lses)

    def expect():
        ref, pt = reference(torch.float64), reference(dt)
        want = {"out": (ref[0], pt[0], 2, dt)}
        if r["return_lse"]:
            want["lse"] = (ref[1], pt[1], 2, dt)
        return want

    c.expect = expect
    return c


# -- PagedKVCache.attend --------------------------------------------------------------------

SEQ_IDS = ("a", 7, ("chat", 2))


@st.composite
def attend_recipe(draw, entry, defects=False):
    r = _base(draw, defects, own_v_dim=False)
    r["page_size"] = draw(st.sampled_from((8, 16)))
    n = draw(st.integers(1, 3))
    r["lengths"] = [draw(st.sampled_from((0, 1, 5, 8, 13, 20))) for _ in range(n)]
    r["ghost_pages"] = draw(st.integers(0, 3))
    r["call"] = draw(st.permutations(range(n)).flatmap(
        lambda p: st.integers(1, n).map(lambda m: list(p[:m]))))
    r["SQ"] = draw(st.sampled_from((0, 1, 1, 2, 3)))
    r["new"] = draw(st.sampled_from((None, 0, 1, 1, 3, 9)))
    r["spare"] = draw(st.integers(0, 3))
    r["stale"] = draw(st.sampled_from(("zeros", "nan", "random")))
    r.update(draw(option_recipe({"causal", "window", "softcap", "alibi", "sinks", "scale",
                                 "batch_invariant"}, defects)))
    r["num_splits"] = draw(st.sampled_from((0, 0, 1, 2, 3)))
    r["route"] = draw(st.sampled_from(("default", "default", "prefill", "merge-kernel")))
    lay = {n: draw(qkv_layouts()) for n in ("q", "k", "v")}
    lay.update(_option_layouts(draw, r))
    r["layouts"] = lay
    return r


def build_attend(entry, r):
    c = Case(entry, r)
    c.names = dict(KV_NAMES["attention_with_kvcache"], q="q", k="k", v="v")
    H, HKV, D, dt, ps = (r[n] for n in ("H", "HKV", "D", "dtype", "page_size"))
    ids = [SEQ_IDS[i] for i in range(len(r["lengths"]))]
    call = [ids[i] for i in r["call"]]
    B, SQ, n_new = len(call), r["SQ"], r["new"] or 0
    lengths = dict(zip(ids, r["lengths"]))
    need = sum(-(-(lengths[s] + n_new) // ps) - -(-lengths[s] // ps) for s in call)
    held = sum(-(-n // ps) for n in r["lengths"])
    n_pages = r["ghost_pages"] + held + need + r["spare"]
    cache = PagedKVCache(num_pages=max(n_pages, 1), page_size=ps, num_kv_heads=HKV,
                         head_dim=D, dtype=dt, device=DEVICE)
    if r["stale"] != "zeros":
        for pool in (cache.k, cache.v):
            pool.copy_(c.randn(*pool.shape, dtype=dt) if r["stale"] == "random"
                       else torch.full(pool.shape, float("nan"), dtype=dt))
    # The sequences' earlier tokens, written straight into their pages (a ghost sequence's
    # pages freed around them): what earlier attend() calls would have left.
    history = {}
    cache.add("ghost")
    cache._reserve(["ghost"], r["ghost_pages"] * ps)
    for s in ids:
        cache.add(s)
        n = lengths[s]
        cache._reserve([s], n)
        history[s] = (c.randn(n, HKV, D, dtype=dt), c.randn(n, HKV, D, dtype=dt))
        for i in range(n):
            page = cache._pages[s][i // ps]
            cache.k[page, i % ps], cache.v[page, i % ps] = history[s][0][i], history[s][1][i]
        cache._lengths[s] = n
    cache.free("ghost")
    q = c.randn(B, SQ, H, D, dtype=dt)
    k_new, v_new = c.randn(B, n_new, HKV, D, dtype=dt), c.randn(B, n_new, HKV, D, dtype=dt)
    c.values.update(q=q, k=k_new, v=v_new)
    lay = r["layouts"]
    c.params["q"] = c.place("q", q, lay["q"])
    if r["new"] is None:
        c.params.update(k=None, v=None)
    else:
        c.params.update(k=c.place("k", k_new, lay["k"]), v=c.place("v", v_new, lay["v"]))
    c.params["seq_ids"] = call
    c.positional = 4
    ref_opts = _options(c, B, H)
    c.params["num_splits"] = r["num_splits"]
    c.patches = dict(ROUTES[r["route"]])
    c.fn = cache.attend
    c.cache = cache
    pools = [Placed("PagedKVCache.k", cache.k, [cache.k], "cache"),
             Placed("PagedKVCache.v", cache.v, [cache.v], "cache")]
    c.placed += pools

    def state():
        return (list(cache._free), {s: list(p) for s, p in cache._pages.items()},
                dict(cache._lengths))

    def state_after(before, after):
        free0, pages0, lens0 = before
        free1, pages1, lens1 = after
        want_lens = {s: n + (n_new if s in call else 0) for s, n in lens0.items()}
        if lens1 != want_lens:
            return f"lengths {lens1}, expected {want_lens}"
        taken = []
        for s in ids:
            if pages1[s][:len(pages0[s])] != pages0[s]:
                return f"sequence {s!r}'s pages {pages0[s]} became {pages1[s]}"
            if len(pages1[s]) != -(-want_lens[s] // ps) and s in call:
                return (f"sequence {s!r} holds {len(pages1[s])} pages for {want_lens[s]} "
                        f"tokens of {ps}")
            taken += pages1[s][len(pages0[s]):]
        if sorted(taken + free1) != sorted(free0) or [p for p in free0 if p not in taken] != free1:
            return f"free list {free0} became {free1}, pages taken {taken}"
        return None

    c.state, c.state_after = state, state_after

    def post_writes():
        writes = []
        for b, s in enumerate(call):
            for i in range(n_new):
                pos = lengths[s] + i
                at = (cache._pages[s][pos // ps], pos % ps)
                writes += [(pools[0], cache.k, at, k_new[b, i]),
                           (pools[1], cache.v, at, v_new[b, i])]
        return writes

    c.post_writes = post_writes
    alibi = ref_opts.pop("alibi_slopes", None)

    def reference(dtype):
        outs = []
        for b, s in enumerate(call):
            kb = torch.cat([history[s][0], k_new[b]])
            vb = torch.cat([history[s][1], v_new[b]])
            slopes = None if alibi is None else (alibi[b] if alibi.dim() == 2 else alibi)
            outs.append(attention_reference(q[b:b + 1], kb[None], vb[None], dtype=dtype,
                                            alibi_slopes=slopes, **ref_opts).out)
        return torch.cat(outs)

    c.expect = lambda: {"out": (reference(torch.float64), reference(dt), 2, dt)}
    return c


# -- running a call -------------------------------------------------------------------------

def _snapshot(c):
    for p in c.placed:
        p.snapshot()
    return c.state() if c.state else None


def _exception(e):
    return f"{type(e).__name__}: {str(e)[:300]}"


def _state_changes(c, host_before):
    """What changed anywhere (every buffer, whole; the host state)."""
    problems = [p.changes(p.before) for p in c.placed]
    if c.state is not None and c.state() != host_before:
        problems.append(f"{c.state_name} state {host_before} became {c.state()}")
    return [x for x in problems if x]


def run_valid(c) -> Tuple[str, str]:
    host_before = _snapshot(c)
    try:
        with _time_limit(CALL_TIMEOUT_S), c.scope():
            res = c.invoke()
            out, lse = c.unpack(res)
            grad_problems = c.backward(out) if c.backward else []
    except CallTimeout as e:
        return TIMEOUT, str(e)
    except Exception as e:  # noqa: BLE001 - every exception is an outcome
        changed = _state_changes(c, host_before)
        if changed:
            return STATE, f"{_exception(e)}; after {'; '.join(changed)}"
        return (REFUSED if isinstance(e, (ValueError, TypeError)) else CRASH), _exception(e)
    problems = []
    writes = c.writes + (c.post_writes() if c.post_writes else [])
    for placed, view, index, value in writes:
        placed.twin(view, placed.expected)[index] = value.to(placed.buf.dtype)
    for p in c.placed:
        if p.role == "input":
            msg = p.changes(p.before)
        elif p.role == "output":
            msg = p.changes(p.before, outside_only=True)
        else:
            msg = p.changes(p.expected)
            msg = msg and msg + " (expected: the appended positions, to the appended values)"
        if msg:
            problems.append((WRONG, msg))
    if c.state_after is not None:
        msg = c.state_after(host_before, c.state())
        if msg:
            problems.append((WRONG, f"{c.state_name}: {msg}"))
    got = {"out": out, "lse": lse, "out=": getattr(c, "out_view", None)}
    if c.results is not None:
        got.update(c.results(res))
    for name, (ref, pt, factor, dtype) in c.expect().items():
        ours = got[name]
        if name == "lse" and isinstance(ours, torch.Tensor) and ours.dtype != torch.float32:
            problems.append((WRONG, f"lse is {ours.dtype}, expected float32"))
        elif name != "lse" and isinstance(ours, torch.Tensor) and ours.dtype != dtype:
            problems.append((WRONG, f"{name} is {ours.dtype}, expected {dtype}"))
        problems += _compare(name, ours, ref, pt, dtype, factor)
    if lse is not None and "lse" not in c.expect():
        problems.append((WRONG, "an LSE was returned although not asked for"))
    problems += grad_problems
    if not problems:
        return OK, ""
    worst = NAN if any(cls == NAN for cls, _ in problems) else WRONG
    return worst, "; ".join(msg for _, msg in problems)


class Defect(NamedTuple):
    label: str
    arg: str                      # the argument replaced
    value: object                 # its new value
    names: Tuple[str, ...]        # a message naming any of these names the argument
    errors: tuple = (ValueError, TypeError)

    def __repr__(self):
        return self.label


def _named(msg, names):
    return any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", msg) for n in names)


def _attempt(c, params, host_before):
    """(result, None, None); (None, error, None) for an error that left everything as it
    was; (None, None, (outcome, detail)) for a timeout or an error that changed state."""
    try:
        with _time_limit(CALL_TIMEOUT_S), c.scope():
            return c.invoke(params), None, None
    except CallTimeout as e:
        return None, None, (TIMEOUT, str(e))
    except Exception as e:  # noqa: BLE001 - every exception is an outcome
        changed = _state_changes(c, host_before)
        if changed:
            return None, None, (STATE, f"{_exception(e)}; after {'; '.join(changed)}")
        return None, e, None


def run_defect(c, d: Defect) -> Tuple[str, str]:
    params = dict(c.params, **{d.arg: d.value})
    if c.entry in SDPA_ENTRIES:
        return _run_sdpa_defect(c, d, params)
    host_before = _snapshot(c)
    # index contents are checked on the host for CPU tensors, for GPU ones in validation mode
    validating = validation.validating()
    validation.set_validation(True)
    try:
        _, e, outcome = _attempt(c, params, host_before)
    finally:
        validation.set_validation(validating)
    if outcome is not None:
        return outcome
    if e is None:
        changed = _state_changes(c, host_before)
        return ACCEPTED, "no error" + (f"; the call ran: {'; '.join(changed)}" if changed else "")
    if isinstance(e, d.errors):
        if _named(str(e), d.names):
            return OK, ""
        return NAMING, f"{_exception(e)} (does not name {' / '.join(d.names)})"
    if isinstance(e, (ValueError, TypeError)):
        return NAMING, f"{_exception(e)} (expected {' / '.join(x.__name__ for x in d.errors)})"
    return CRASH, _exception(e)


def _run_sdpa_defect(c, d, params):
    """The SDPA drop-in (and the routes to it) must do what torch's SDPA (c.torch_fn) does
    with the same call: raise where it raises (its error, or a ValueError / TypeError naming
    the argument), else return its result -- where torch's result is repeatable: some calls
    torch takes read memory that is not theirs (a value longer than the key, on the CPU), and
    any result is then torch's."""
    def torch_call():
        return (c.torch_fn or flashtriton.sdpa._TORCH_SDPA)(*list(params.values())[:3],
                                                          **dict(list(params.items())[3:]))

    def same(x, y):
        return (isinstance(x, torch.Tensor) and x.shape == y.shape
                and torch.allclose(x.double(), y.double(), atol=5e-2, rtol=5e-2,
                                   equal_nan=True))

    torch_res = torch_err = None
    try:
        torch_res = torch_call()
    except Exception as e:  # noqa: BLE001
        torch_err = e
    host_before = _snapshot(c)
    res, e, outcome = _attempt(c, params, host_before)
    if outcome is not None:
        return outcome
    if c.state is not None and c.state() != host_before:
        return WRONG, f"{c.state_name} state {host_before} became {c.state()}"
    if e is not None:
        if torch_err is None:
            return REFUSED, f"{_exception(e)}, where torch's SDPA returns a result"
        if isinstance(e, type(torch_err)) or isinstance(e, d.errors) and _named(str(e), d.names):
            return OK, ""
        return NAMING, f"{_exception(e)}, where torch's SDPA raises {_exception(torch_err)}"
    if torch_err is not None:
        return ACCEPTED, f"no error, where torch's SDPA raises {_exception(torch_err)}"
    if same(res, torch_res) or not same(torch_call(), torch_res):
        return OK, ""
    return WRONG, "result differs from torch's SDPA on the same call"


# -- defects --------------------------------------------------------------------------------

def _option_defects(c, B, H):
    """One bad option (of those the entry takes)."""
    out = []

    def add(canon, label, value, errors=(ValueError, TypeError)):
        name = c.pn(canon)
        if name is not None:
            out.append(Defect(f"{name}={label}", name, value, (name,), errors))

    for bad in ("'yes'", "None", "2"):
        add("causal", bad, eval(bad))
    add("deterministic", "'x'", "x")
    add("deterministic", "None", None)
    add("batch_invariant", "'yes'", "yes")
    add("batch_invariant", "0.5", 0.5)
    for label, value in (("(-2, 0)", (-2, 0)), ("(0, -5)", (0, -5)), ("(1.5, 2)", (1.5, 2)),
                         ("'ab'", "ab"), ("(1, 2, 3)", (1, 2, 3)), ("7", 7)):
        add("window", label, value)
    for label, value in (("-1.0", -1.0), ("nan", float("nan")), ("'x'", "x"), ("True", True)):
        add("softcap", label, value)
    for label, value in (("nan", float("nan")), ("inf", float("inf")), ("'x'", "x")):
        add("scale", label, value)
    add("alibi", "float16 (H,)", torch.rand(H).half())
    add("alibi", "(H + 1,)", torch.rand(H + 1))
    add("alibi", "(B + 1, H)", torch.rand(B + 1, H))
    add("alibi", "a list", [0.1] * H)
    add("sinks", "(H + 1,)", torch.randn(H + 1))
    add("sinks", "int32 (H,)", torch.zeros(H, dtype=torch.int32))
    add("sinks", "(1, H)", torch.randn(1, H))
    for label, value in (("1.5", 1.5), ("-0.1", -0.1), ("'x'", "x")):
        add("dropout", label, value)
    for label, value in (("2.5", 2.5), ("'2'", "2"), ("-1", -1), ("None", None)):
        add("num_splits", label, value)
    add("return_lse", "'yes'", "yes")
    return out


def _tensor_defects(c, roles, batch_dim=0, heads_dim=2, seq_dim=1, k_heads_dim=None):
    """One bad q / k / v: dtype, rank, device, a shape that does not match the others."""
    out = []
    q, k, v = (c.params.get(c.names[n]) for n in roles)
    nq, nk, nv = (c.names[n] for n in roles)
    if q is None or k is None:
        return out
    other = torch.float16 if q.dtype != torch.float16 else torch.bfloat16
    out += [Defect(f"{nq} float64", nq, q.detach().double(), (nq,)),
            Defect(f"{nk} {_short(other)}", nk, k.detach().to(other), (nk,)),
            Defect(f"{nv} int32", nv, v.detach().to(torch.int32), (nv,)),
            Defect(f"{nq} without its last dim", nq, q.detach()[..., 0], (nq,)),
            Defect(f"{nk} with a dim more", nk, k.detach()[None], (nk,)),
            Defect(f"{nq} a nested list", nq, q.detach().tolist(), (nq,)),
            Defect(f"{nq} on the meta device", nq, q.detach().to("meta"), (nq,)),
            Defect(f"{nk} head dim + 8", nk, _resized(k, -1, 8), (nk,)),
            Defect(f"{nv} one token more", nv, _resized(v, seq_dim, 1), (nv, nk))]
    if batch_dim is not None:
        out.append(Defect(f"{nk} batch + 1", nk, _resized(k, batch_dim, 1), (nk,)))
    k_heads_dim = heads_dim if k_heads_dim is None else k_heads_dim
    HKV = k.shape[k_heads_dim]
    if HKV >= 2:
        out.append(Defect(f"{nq} heads + 1, not a multiple of {nk}'s", nq,
                          _resized(q, heads_dim, 1), (nq, nk)))
    out.append(Defect(f"{nk} heads {q.shape[heads_dim] + 1} > {nq}'s", nk,
                      _resized(k, k_heads_dim, q.shape[heads_dim] + 1 - HKV), (nk, nq)))
    return out


def _resized(x, dim, more):
    """A fresh tensor of x's shape with ``more`` more elements along dim."""
    shape = list(x.shape)
    shape[dim] += more
    return torch.randn(shape).to(x.device, x.dtype)


def _headdim_300(c, roles, heads_dim=2):
    names = [c.names[n] for n in roles]
    xs = [c.params[n] for n in names]
    if any(x is None for x in xs):
        return []
    params = {n: _resized(x, -1, 300 - x.shape[-1]) for n, x in zip(names, xs)}
    return [Defect("head dim 300 on q, k and v", names[0], _Multi(params), (names[0],))]


class _Multi(dict):
    """A defect that replaces several arguments at once (their names -> values)."""


def dense_defects(c):
    B, H = c.r["B"], c.r["H"]
    sdpa = c.entry in SDPA_ENTRIES
    out = _tensor_defects(c, ("q", "k", "v"), heads_dim=1 if sdpa else 2,
                          seq_dim=2 if sdpa else 1)
    out += _headdim_300(c, ("q", "k", "v"))
    out += _option_defects(c, B, H)
    if sdpa:
        L, S = c.r["SQ"], c.r["SK"]
        out += [Defect("attn_mask (L + 1, S)", "attn_mask",
                       torch.ones(L + 1, S, dtype=torch.bool), ("attn_mask",)),
                Defect("attn_mask int32", "attn_mask", torch.ones(L, S, dtype=torch.int32),
                       ("attn_mask",)),
                Defect("attn_mask with is_causal", "attn_mask",
                       _Multi(attn_mask=torch.ones(L, S, dtype=torch.bool), is_causal=True),
                       ("attn_mask", "is_causal")),
                Defect("enable_gqa=False", "enable_gqa", False, ("enable_gqa", "key"))]
    return out


def varlen_defects(c):
    B, H = len(c.r["lens_q"]), c.r["H"]
    paged = c.r["mode"] == "paged"
    out = _tensor_defects(c, ("q", "k", "v"), batch_dim=None, heads_dim=1, seq_dim=0,
                          k_heads_dim=2 if paged else 1)
    out = [d for d in out if "with a dim more" not in d.label or not paged]
    out += _headdim_300(c, ("q", "k", "v"))
    out += _option_defects(c, B, H)
    lay = c.r["layouts"]
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        cu = c.values[name]
        if c.params.get(name) is None:
            continue
        out += [Defect(f"{name} int64", name, cu.long(), (name,)),
                Defect(f"{name} float32", name, cu.float(), (name,)),
                Defect(f"{name} 2-D", name, cu[None], (name,)),
                Defect(f"{name} one entry more", name, torch.cat([cu, cu[-1:]]),
                       ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table",
                        "alibi_slopes")),
                Defect(f"{name} starting at 1", name, c.place(name + "'", cu + 1, lay[name]),
                       (name,))]
        if B >= 2 and int(cu[1]) > 0:
            bad = cu.clone()
            bad[1] = int(cu[2]) + 1
            out.append(Defect(f"{name} decreasing", name, c.place(name + "'", bad, lay[name]),
                              (name,)))
        if name == "cu_seqlens_q" or not paged:
            total = c.values["q" if name == "cu_seqlens_q" else "k"].shape[0]
            bad = cu.clone()
            bad[-1] = total + 1
            out.append(Defect(f"{name} past the packed tokens", name,
                              c.place(name + "'", bad, lay[name]), (name,)))
    if not (paged and c.params.get("seqused_k") is not None):
        out.append(Defect("cu_seqlens_k=None", "cu_seqlens_k", None, ("cu_seqlens_k",)))
    longest_q = max(c.r["lens_q"], default=0)
    for name, longest in (("max_seqlen_q", longest_q), ("max_seqlen_k", max(c.r["lens_k"],
                                                                           default=0))):
        if longest >= 1 and (name == "max_seqlen_q" or not paged
                             or c.params.get("cu_seqlens_k") is not None):
            out.append(Defect(f"{name} below the longest", name, longest - 1, (name,)))
        out += [Defect(f"{name}=-1", name, -1, (name,)),
                Defect(f"{name}=2.5", name, 2.5, (name,)),
                Defect(f"{name}='3'", name, "3", (name,))]
    used = c.values.get("seqused_k")
    if B >= 1:
        base = used if used is not None else torch.tensor(c.r["lens_k"], dtype=torch.int32)
        b = int(c.randint(0, B))
        neg = base.clone()
        neg[b] = -1
        past = base.clone()
        if paged:
            width = c.values["block_table"].shape[1]
            past[b] = width * c.r["page_size"] + 1
        else:
            past[b] = c.r["lens_k"][b] + 1
        out += [Defect(f"seqused_k[{b}]=-1", "seqused_k",
                       c.place("seqused_k'", neg, lay["seqused_k"]), ("seqused_k",)),
                Defect(f"seqused_k[{b}]={int(past[b])} past its keys", "seqused_k",
                       c.place("seqused_k'", past, lay["seqused_k"]), ("seqused_k",)),
                Defect("seqused_k int64", "seqused_k", base.long(), ("seqused_k",)),
                Defect("seqused_k (B + 1,)", "seqused_k", torch.cat([base, base[:1]]),
                       ("seqused_k",))]
    if paged:
        out += _table_defects(c, B, c.values["block_table"],
                              c.values["k"].shape[0], [(n or 0) for n in c.r["lens_k"]], 0)
        k = c.values["k"]
        pages12 = torch.randn(k.shape[0], 12, *k.shape[2:]).to(k.dtype)
        out.append(Defect("pages of 12 tokens", "k", _Multi(k=pages12, v=pages12.clone()),
                          ("page_size", "k")))
    q = c.values["q"]
    DV = c.values["v"].shape[-1]
    out += [Defect("out one token more", "out", torch.zeros(q.shape[0] + 1, H, DV, dtype=q.dtype),
                   ("out",)),
            Defect("out float64", "out", torch.zeros(q.shape[0], H, DV, dtype=torch.float64),
                   ("out",)),
            Defect("out strided headdim", "out",
                   c.place("out'", torch.zeros(q.shape[0], H, DV, dtype=q.dtype),
                           Layout((0, 1, 2), (1, 1, 2), 0), role="output"), ("out",))]
    return out


def _table_defects(c, B, table, n_pages, lens, n_new):
    """Bad block tables: dtype, shape, and an entry outside the pool among the pages a
    sequence uses."""
    lay = c.r["layouts"]["block_table"]
    ps = c.r["page_size"]
    out = [Defect("block_table int64", "block_table", table.long(), ("block_table",)),
           Defect("block_table 1-D", "block_table", table[0] if B else table.flatten(),
                  ("block_table",)),
           Defect("block_table batch + 1", "block_table", torch.cat([table, table[:1]]),
                  ("block_table",))]
    users = [b for b in range(B) if lens[b] + n_new > 0]
    if users:
        b = users[int(c.randint(0, len(users)))]
        j = int(c.randint(0, -(-(lens[b] + n_new) // ps)))
        for bad in (n_pages, -1):
            t = table.clone()
            t[b, j] = bad
            out.append(Defect(f"block_table[{b}, {j}]={bad} outside the pool", "block_table",
                              c.place("block_table'", t, lay), ("block_table",)))
    return out


def kv_defects(c):
    r = c.r
    B, H = r["B"], r["H"]
    n_new = r["new"] or 0
    out = _tensor_defects(c, ("q", "k", "v")) if r["new"] is not None else []
    out += _option_defects(c, B, H)
    q, kc, vc = c.params["q"], c.params["k_cache"], c.params["v_cache"]
    out += [Defect("q float64", "q", q.double(), ("q",)),
            Defect("q 3-D", "q", q[..., 0], ("q",)),
            Defect("k_cache float64", "k_cache", kc.double(), ("k_cache",)),
            Defect("k_cache 3-D", "k_cache", kc[..., 0], ("k_cache",)),
            Defect("v_cache one token more", "v_cache", _resized(vc, 1, 1), ("v_cache",
                                                                             "k_cache")),
            Defect("q heads not a multiple of the cache's", "k_cache",
                   _Multi(k_cache=_resized(kc, 2, H + 1 - kc.shape[2]),
                          v_cache=_resized(vc, 2, H + 1 - vc.shape[2])), ("k_cache", "q"))]
    for name, cache in (("k_cache", c.values["k_cache"]), ("v_cache", c.values["v_cache"])):
        strided = c.place(name + "'", cache, Layout(tuple(range(4)), (1, 1, 1, 2), 0),
                          role="cache")
        out.append(Defect(f"{name} with a head-dim stride of 2", name, strided, (name,)))
    if r["new"] is not None:
        out.append(Defect("k without v", "v", None, ("k", "v")))
    capacity = (r["width"] * r["page_size"]) if r["paged"] else r["capacity"]
    lens = r["cache_seqlens"] if isinstance(r["cache_seqlens"], list) else [r["cache_seqlens"]] * B
    b = int(c.randint(0, B))
    lay = r["layouts"]
    bad_lens = [list(lens) for _ in range(2)]
    bad_lens[0][b] = capacity - n_new + 1
    bad_lens[1][b] = -1
    for label, bad in (("past the cache", bad_lens[0]), ("negative", bad_lens[1])):
        t = c.place("cache_seqlens'", torch.tensor(bad, dtype=torch.int32), lay["cache_seqlens"])
        out.append(Defect(f"cache_seqlens[{b}]={bad[b]} {label}", "cache_seqlens", t,
                          ("cache_seqlens",)))
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out += [Defect(f"cache_seqlens={capacity - n_new + 1} past the cache", "cache_seqlens",
                   capacity - n_new + 1, ("cache_seqlens",)),
            Defect("cache_seqlens int64", "cache_seqlens", seqlens.long(), ("cache_seqlens",)),
            Defect("cache_seqlens (B + 1,)", "cache_seqlens", torch.cat([seqlens, seqlens[:1]]),
                   ("cache_seqlens",)),
            Defect("cache_seqlens=2.5", "cache_seqlens", 2.5, ("cache_seqlens",)),
            Defect("cache_seqlens a list", "cache_seqlens", list(lens), ("cache_seqlens",)),
            Defect("rotary_cos without rotary_sin", "rotary_cos",
                   torch.ones(capacity + 8, 4, dtype=q.dtype), ("rotary_cos", "rotary_sin"))]
    if r["paged"]:
        out += _table_defects(c, B, c.values["block_table"], c.values["k_cache"].shape[0],
                              lens, n_new)
        out.append(Defect("cache_batch_idx with a paged cache", "cache_batch_idx",
                          torch.zeros(B, dtype=torch.int32), ("cache_batch_idx",)))
    else:
        rows = r["rows"]
        idx = c.values.get("cache_batch_idx", torch.arange(B, dtype=torch.int32))
        for bad in (rows, -1):
            t = idx.clone()
            t[b] = bad
            out.append(Defect(f"cache_batch_idx[{b}]={bad} outside the cache", "cache_batch_idx",
                              c.place("cache_batch_idx'", t, lay["cache_batch_idx"]),
                              ("cache_batch_idx",)))
        out.append(Defect("cache_batch_idx int64", "cache_batch_idx", idx.long(),
                          ("cache_batch_idx",)))
    pad = torch.tensor(r["leftpad"] or [0] * B, dtype=torch.int32)
    for label, value in (("past its keys", lens[b] + 1), ("negative", -1)):
        t = pad.clone()
        t[b] = value
        out.append(Defect(f"cache_leftpad[{b}]={value} {label}", "cache_leftpad",
                          c.place("cache_leftpad'", t, lay["cache_leftpad"]), ("cache_leftpad",)))
    return out


def attend_defects(c):
    r = c.r
    B, H = len(r["call"]), r["H"]
    out = _tensor_defects(c, ("q", "k", "v")) if r["new"] is not None else []
    out = [d for d in out if not d.label.startswith("k batch")]
    out += [d for d in _option_defects(c, B, H) if d.arg != "return_lse"]
    call = c.params["seq_ids"]
    q = c.params["q"]
    out += [Defect("an unknown sequence", "seq_ids", call[:-1] + ["unknown"], ("'unknown'",),
                   (ValueError, TypeError, KeyError)),
            Defect("a sequence twice", "seq_ids", call + call[:1], ("seq_ids",)),
            Defect("q float64", "q", q.double(), ("q",)),
            Defect("q head dim + 8", "q", _resized(q, -1, 8), ("q",)),
            Defect("return_lse=True", "return_lse", True, ("return_lse",)),
            Defect("cache_seqlens given", "cache_seqlens", torch.zeros(B, dtype=torch.int32),
                   ("cache_seqlens",))]
    if B > 1:
        out.append(Defect("q batch + 1", "q", _resized(q, 0, 1), ("q", "seq_ids")))
    if r["new"] is not None:
        out.append(Defect("k without v", "v", None, ("k", "v")))
        pages = c.cache.free_pages + 1
        big = torch.randn(B, pages * r["page_size"], r["HKV"], r["D"]).to(q.dtype)
        out.append(Defect("more new tokens than free pages", "k",
                          _Multi(k=big, v=big.clone()), ("pages",), (MemoryError,)))
    return out


# -- flash-attn's private wrappers (ring-flash-attn) ----------------------------------------

@st.composite
def private_recipe(draw, entry, defects=False):
    """dense_recipe / varlen_recipe's calls for flash-attn's private wrappers, made by keyword
    (as ring-flash-attn makes them) or positionally (as flash-attn's autograd functions do).
    The backwards take packed sequences without pages, the forward's out, LSE and dout in
    layouts of their own, and the gradient buffers (dq, dk, dv, or some of them) anywhere."""
    varlen, backward = "varlen" in entry, entry.endswith("_backward")
    if varlen:
        r = draw(varlen_recipe(entry, defects, modes=("plain",) if backward else VARLEN_MODES))
    else:
        r = draw(dense_recipe(entry, defects))
    r["by_keyword"] = draw(st.sampled_from((True, True, False)))
    if backward:
        n = 3 if varlen else 4
        r["given"] = draw(st.sampled_from(("dq dk dv",) * 4 + ("dq", "dk dv", "")))
        lay = dict(r["layouts"])
        for name in ("dout", "out", "dq", "dk", "dv"):
            lay[name] = draw(st.one_of(layouts(n), layouts(n, unit_last=False)))
        lay["softmax_lse"] = draw(layouts(n - 1, unit_last=False))
        r["layouts"] = lay
    return r


def _split_window(window):
    """window_size as the private wrappers take it: two int-likes in the pair's form."""
    if isinstance(window, (torch.Tensor, np.ndarray)):
        return window[0], window[1]
    return tuple(window)


def build_private(entry, r):
    varlen, backward = "varlen" in entry, entry.endswith("_backward")
    c = (build_varlen if varlen else build_dense)(entry, r)
    c.fn = getattr(fa, entry)
    p = c.params
    p["window_size_left"], p["window_size_right"] = _split_window(p.pop("window_size"))
    p.setdefault("dropout_p", 0.0)
    if p.get("softmax_scale") is None:  # flash-attn's callers pass a float
        p["softmax_scale"] = r["D"] ** -0.5
    p.setdefault("alibi_slopes", None)
    if backward:
        p.setdefault("deterministic", False)
        _private_backward_case(c, varlen)
    else:
        p["return_softmax"] = False
    names = list(inspect.signature(c.fn).parameters)
    assert set(p) <= set(names), set(p) - set(names)
    c.params = {n: p[n] for n in names if n in p}
    c.positional = 0 if r["by_keyword"] else next(
        (i for i, n in enumerate(names) if n not in p), len(names))
    return c


def _grads(out, leaves, dout):
    if not out.requires_grad:
        return [torch.zeros_like(x) for x in leaves]
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def _private_backward_case(c, varlen):
    """The backward's arguments: the float64 reference's out (in the input dtype) and LSE
    (flash-attn's: +inf for rows that see no key), a random dout (varlen: rows past the
    sequences NaN, never to be read), NaN gradient buffers; what it must give: the
    reference's gradients in the given buffers and flash-attn's softmax_d."""
    r, dt, lay = c.r, c.r["dtype"], c.r["layouts"]
    q, k, v = (c.values[n] for n in ("q", "k", "v"))
    nan = float("nan")
    leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out64, lse64 = c.reference(*leaves64, torch.float64)
    dout = c.randn(*out64.shape, dtype=dt)
    rows, Q = out64.shape[0], q.shape[0]  # varlen: the sequences' rows, q's rows
    out_in, dout_in, lse_in = out64.detach().to(dt), dout, lse64.detach().float()
    if varlen:  # rows past the sequences: NaN
        out_in, dout_in = (torch.cat([x, torch.full((Q - rows, *x.shape[1:]), nan, dtype=dt,
                                                    device=DEVICE)]) for x in (out_in, dout))
        lse_in = torch.cat([lse_in, torch.full((lse_in.shape[0], Q - rows), nan,
                                               device=DEVICE)], dim=1)
    c.params["dout"] = c.place("dout", dout_in, lay["dout"])
    c.params["out"] = c.place("out", out_in, lay["out"])
    c.params["softmax_lse"] = c.place("softmax_lse", lse_in, lay["softmax_lse"])
    bufs = {}
    for name, like in (("dq", q), ("dk", k), ("dv", v)):
        if name in r["given"].split():
            bufs[name] = c.place(name, torch.full(like.shape, nan, dtype=dt, device=DEVICE),
                                 lay[name], role="output")
        c.params[name] = bufs.get(name)
    # varlen: the sequences' rows (q's past them, k's and v's past cu_seqlens_k[-1]: no grad)
    cut = {"dq": slice(0, rows if varlen else None),
           "dk": slice(0, c.total_k if varlen else None)}
    cut["dv"] = cut["dk"]

    def softmax_d(dtype):
        """(1 - dropout_p) rowsum(dout * out) in flash-attn's padded layout, zero elsewhere."""
        delta = (dout.to(dtype) * out_in[:rows].to(dtype)).sum(-1)
        if not varlen:  # (B, H, seqlen_q rounded up to 128)
            B, SQ, H = delta.shape
            sd = torch.zeros(B, H, -(-SQ // 128) * 128, dtype=dtype, device=DEVICE)
            sd[:, :, :SQ] = delta.transpose(1, 2)
            return sd
        cu = c.values["cu_seqlens_q"]  # (H, total_q + 128 B), sequence b from cu[b] + 128 b
        B = cu.numel() - 1
        sd = torch.zeros(delta.shape[1], Q + 128 * B, dtype=dtype, device=DEVICE)
        for b in range(B):
            start, end = int(cu[b]), int(cu[b + 1])
            sd[:, start + 128 * b:end + 128 * b] = delta[start:end].t()
        return sd

    memo = {}

    def expect():
        if not memo:
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            g64 = _grads(out64, leaves64, dout.double())
            glp = _grads(c.reference(*leaves, dt)[0], leaves, dout)
            for i, name in enumerate(("dq", "dk", "dv")):
                if name in bufs:
                    memo[name] = (g64[i][cut[name]], glp[i][cut[name]], 3, dt)
            memo["softmax_d"] = (softmax_d(torch.float64), softmax_d(torch.float32), 2,
                                 torch.float32)
        return memo

    c.expect = expect
    c.unpack = lambda res: (None, None)
    c.results = lambda res: dict({n: b[cut[n]] for n, b in bufs.items()}, softmax_d=res)


def private_defects(c):
    """dense_defects / varlen_defects where the wrapper takes the argument, window_size's
    sides, return_softmax, and the backward's own: dout, out, softmax_lse, the gradient
    buffers (a defect's own buffer, too, must stay unchanged), dropout without rng_state."""
    r = c.r
    varlen, backward = "varlen" in c.entry, c.entry.endswith("_backward")
    takes = inspect.signature(c.fn).parameters
    out = [d for d in (varlen_defects(c) if varlen else dense_defects(c))
           if all(n in takes for n in (d.value if isinstance(d.value, _Multi) else [d.arg]))
           and d.label != "out strided headdim"]  # (the backward's out may have any strides)
    for name in ("window_size_left", "window_size_right"):
        for label, value in (("-2", -2), ("1.5", 1.5), ("'a'", "a"), ("None", None)):
            out.append(Defect(f"{name}={label}", name, value, (name,)))
    if varlen:
        out.append(Defect("zero_tensors='x'", "zero_tensors", "x", ("zero_tensors",)))
    if not backward:
        out += [Defect("return_softmax='yes'", "return_softmax", "yes", ("return_softmax",)),
                Defect("return_softmax=True without dropout", "return_softmax", True,
                       ("return_softmax",), (RuntimeError,))]
        if varlen:
            B = len(r["lens_q"])
            out.append(Defect("leftpad_k given", "leftpad_k",
                              torch.zeros(B, dtype=torch.int32, device=DEVICE), ("leftpad_k",),
                              (NotImplementedError,)))
        return out
    dout, o, lse = (c.params[n] for n in ("dout", "out", "softmax_lse"))
    seq = 0 if varlen else 1
    out += [Defect("dout one token more", "dout", _resized(dout, seq, 1), ("dout",)),
            Defect("dout float64", "dout", dout.double(), ("dout",)),
            Defect("dout a nested list", "dout", dout.tolist(), ("dout",)),
            Defect("out head dim + 8", "out", _resized(o, -1, 8), ("out",)),
            Defect("out float64", "out", o.double(), ("out",)),
            Defect("softmax_lse one row more", "softmax_lse", _resized(lse, -1, 1),
                   ("softmax_lse",)),
            Defect("softmax_lse float16", "softmax_lse", lse.half(), ("softmax_lse",)),
            Defect("softmax_lse None", "softmax_lse", None, ("softmax_lse",)),
            Defect("dropout_p=0.1 without rng_state", "dropout_p", 0.1, ("rng_state",))]
    if lse.shape[-1] != lse.shape[-2]:
        out.append(Defect("softmax_lse transposed", "softmax_lse", lse.transpose(-1, -2),
                          ("softmax_lse",)))
    nan = float("nan")
    for name, like in (("dq", c.values["q"]), ("dk", c.values["k"]), ("dv", c.values["v"])):
        dense = Layout(tuple(range(like.dim())), (1,) * like.dim(), 1)
        more = list(like.shape)
        more[seq] += 1
        out += [Defect(f"{name} one token more", name,
                       c.place(name + "'", torch.full(more, nan, dtype=like.dtype,
                                                      device=DEVICE), dense, role="output"),
                       (name,)),
                Defect(f"{name} float64", name,
                       c.place(name + "'", torch.full(like.shape, nan, dtype=torch.float64,
                                                      device=DEVICE), dense, role="output"),
                       (name,)),
                Defect(f"{name} a list", name, [], (name,))]
    return out


# -- routes from torch's SDPA: patch_sdpa(module), torch's flash-attention registry ---------

class _Attention(torch.nn.Module):
    """A module calling torch's SDPA in its forward, as diffusers' attention processors do;
    ``scoped`` records, a call, whether patch_sdpa's route was in place and in scope."""

    def __init__(self):
        super().__init__()
        self.scoped = []

    def forward(self, *args, **kwargs):
        self.scoped.append(F.scaled_dot_product_attention is not flashtriton.sdpa._TORCH_SDPA
                           and flashtriton.sdpa._SCOPE_DEPTH.get() > 0)
        return F.scaled_dot_product_attention(*args, **kwargs)


def build_patched_module(entry, r):
    """The SDPA drop-in's calls through a module under ``patch_sdpa(module)``; after each,
    torch's function, the module's hooks and the scope as before."""
    c = build_dense(entry, r)
    module = _Attention()

    def call(*args, **kwargs):
        with flashtriton.patch_sdpa(module):
            return module(*args, **kwargs)

    c.fn = call
    c.state_name = "patch_sdpa(module)"
    c.state = lambda: (F.scaled_dot_product_attention, len(module._forward_pre_hooks),
                       len(module._forward_hooks), flashtriton.sdpa._SCOPE_DEPTH.get(),
                       flashtriton.sdpa._ScopedRoute.handles)

    def state_after(before, after):
        if after != before:
            return f"(torch's SDPA, hooks, scope) {before} became {after}"
        if module.scoped != [True]:
            return f"the module's SDPA calls routed: {module.scoped}, expected [True]"
        return None

    c.state_after = state_after
    return c


def _flash_sdpa(*args, **kwargs):
    """torch's SDPA under its flash backend (torch's warnings of why it finds no kernel:
    off)."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return F.scaled_dot_product_attention(*args, **kwargs)


def _cpu_flash_route():
    """On the CPU, SDPA's flash backend calls aten::_scaled_dot_product_flash_attention_for_cpu
    (on a GPU aten::_scaled_dot_product_flash_attention, which the registry overrides, as do
    tests/test_torch_registry.py's CPU tests). This library routes the former (forward and
    backward) to the latter where a GPU's flash backend would take the call (no mask; causal
    only when square: its is_causal is top-left), and puts torch's CPU flash kernel under the
    latter as the kernel it had before activation, which the registry falls back to."""
    aten = torch.ops.aten
    fwd = torch.library.get_kernel("aten::_scaled_dot_product_flash_attention_for_cpu", "CPU")
    bwd = torch.library.get_kernel("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                                   "CPU")
    library = torch.library.Library("aten", "IMPL", "CPU")

    def to_flash(query, key, is_causal, attn_mask):
        return attn_mask is None and (not is_causal or query.shape[2] == key.shape[2])

    def philox():
        return torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)

    def for_cpu(keyset, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                scale=None):
        if not to_flash(query, key, is_causal, attn_mask):
            return fwd.call_boxed(keyset, query, key, value, dropout_p, is_causal,
                                  attn_mask=attn_mask, scale=scale)
        return tuple(aten._scaled_dot_product_flash_attention(query, key, value, dropout_p,
                                                              is_causal, False,
                                                              scale=scale)[:2])

    def for_cpu_backward(keyset, grad_out, query, key, value, out, lse, dropout_p, is_causal, *,
                         attn_mask=None, scale=None):
        if not to_flash(query, key, is_causal, attn_mask):
            return bwd.call_boxed(keyset, grad_out, query, key, value, out, lse, dropout_p,
                                  is_causal, attn_mask=attn_mask, scale=scale)
        return tuple(aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, key, value, out, lse, None, None, query.shape[2], key.shape[2],
            dropout_p, is_causal, *philox(), scale=scale))

    def flash(keyset, query, key, value, dropout_p=0.0, is_causal=False,
              return_debug_mask=False, *, scale=None):
        out, lse = fwd.call_boxed(keyset, query, key, value, dropout_p, is_causal, scale=scale)
        return (out, lse, None, None, query.shape[2], key.shape[2], *philox(),
                query.new_empty(0))

    def flash_backward(keyset, grad_out, query, key, value, out, lse, cum_seq_q, cum_seq_k,
                       max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                       scale=None):
        return tuple(bwd.call_boxed(keyset, grad_out, query, key, value, out, lse, dropout_p,
                                    is_causal, scale=scale))

    with warnings.catch_warnings():  # (torch warns that a kernel is overridden)
        warnings.simplefilter("ignore")
        for name, kernel in (("_scaled_dot_product_flash_attention_for_cpu", for_cpu),
                             ("_scaled_dot_product_flash_attention_for_cpu_backward",
                              for_cpu_backward),
                             ("_scaled_dot_product_flash_attention", flash),
                             ("_scaled_dot_product_flash_attention_backward", flash_backward)):
            library.impl(name, kernel, "CPU", with_keyset=True)
    return library


@contextlib.contextmanager
def _registry_active():
    """flashtriton's kernels on aten's flash operators through torch's registry
    (activate_flash_attention_impl("flashtriton")) for the block, restored after it; on the
    CPU on its dispatch key, reached through _cpu_flash_route."""
    route = None
    if not ON_GPU:
        route = _cpu_flash_route()
        register_flash_attention_impl("flashtriton",
                                      register_fn=lambda: torch_registry.activate("CPU"))
    try:
        activate_flash_attention_impl("flashtriton")
        try:
            yield
        finally:
            restore_flash_attention_impl()
    finally:
        if route is not None:
            torch_registry.register()
            route._destroy()


def _flash_kernels():
    return [line for op in ("_scaled_dot_product_flash_attention",
                            "_scaled_dot_product_flash_attention_backward",
                            "_scaled_dot_product_flash_attention_for_cpu")
            for line in torch._C._dispatch_dump(f"aten::{op}").splitlines()
            if line.startswith(("CPU:", "CUDA:"))]


def build_registry(entry, r):
    """The SDPA drop-in's calls through torch's SDPA under its flash backend with the registry
    override active (for the call and its backward); where the kernels refuse the call
    (float64) the registry runs torch's own kernel, whose result it must give. After each
    call: no implementation active, the operators' kernels as before."""
    c = build_dense(entry, r)
    c.fn, c.torch_fn, c.scope = _flash_sdpa, _flash_sdpa, _registry_active
    c.state_name = "torch's flash-attention registry"
    c.state = lambda: (current_flash_attention_impl(), _flash_kernels())
    c.state_after = lambda before, after: (None if after == before
                                           else f"{before} became {after}")
    if r["dtype"] == torch.float64:
        def expect():
            own = _flash_sdpa(*list(c.params.values())[:3], **dict(list(c.params.items())[3:]))
            return {"out": (own.double(), own, 2, torch.float64)}
        c.expect = expect
    return c


# -- the tests ------------------------------------------------------------------------------

ENTRIES = {
    "flash_attention": (dense_recipe, build_dense, dense_defects),
    "flash_attention_with_lse": (dense_recipe, build_dense, dense_defects),
    "flash_attention_varlen": (varlen_recipe, build_varlen, varlen_defects),
    "flash_attention_varlen_with_lse": (varlen_recipe, build_varlen, varlen_defects),
    "attention_with_kvcache": (kv_recipe, build_kv, kv_defects),
    "PagedKVCache.attend": (attend_recipe, build_attend, attend_defects),
    "scaled_dot_product_attention": (dense_recipe, build_dense, dense_defects),
    "flash_attn_func": (dense_recipe, build_dense, dense_defects),
    "flash_attn_varlen_func": (varlen_recipe, build_varlen, varlen_defects),
    "flash_attn_with_kvcache": (kv_recipe, build_kv, kv_defects),
    **{name: (private_recipe, build_private, private_defects) for name in FA_PRIVATE},
    PATCHED_MODULE: (dense_recipe, build_patched_module, dense_defects),
}
if HAS_REGISTRY:
    ENTRIES[REGISTRY] = (dense_recipe, build_registry, dense_defects)


class Tally:
    def __init__(self, title):
        self.title, self.results = title, []

    def add(self, description, outcome, detail):
        self.results.append((description, outcome, detail))
        if outcome != OK:
            print(f"[{outcome}] {description}\n    {detail}")

    def counts(self):
        return {o: sum(1 for _, x, _ in self.results if x == o) for o in OUTCOMES}

    def check(self, shown=4):
        counts = self.counts()
        line = ", ".join(f"{o} {n}" for o, n in counts.items() if n)
        print(f"FUZZ {self.title}: {len(self.results)} calls: {line}")
        if counts[OK] == len(self.results):
            return
        lines = [f"{self.title}: {len(self.results)} calls: {line}"]
        for o in OUTCOMES[1:]:
            failing = [(d, x) for d, x_o, x in self.results if x_o == o]
            if failing:
                lines.append(f"{o} ({len(failing)}):")
                lines += [f"  - {d}\n      {x}" for d, x in failing[:shown]]
        pytest.fail("\n".join(lines), pytrace=False)


def _apply(c, d: Defect):
    """The defect as a Defect over one argument, its _Multi replacements put in c.params."""
    if isinstance(d.value, _Multi):
        for n, x in d.value.items():
            if n != d.arg:
                c.params[n] = x
        return d._replace(value=d.value[d.arg])
    return d


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_valid_calls(entry):
    recipe, build, _ = ENTRIES[entry]
    tally = Tally(f"{entry}: valid calls")

    @seed(zlib.crc32(f"valid {entry}".encode()))
    @_settings(VALID_EXAMPLES)
    @given(r=recipe(entry))
    def run(r):
        c = build(entry, r)
        tally.add(c.describe(), *run_valid(c))

    run()
    tally.check()


def test_explain_and_supported_take_every_option():
    """Valid flash_attention calls (no kernel runs): explain and supported answer for them."""
    entry = "flash_attention"
    tally = Tally("flashtriton.explain / validation.supported of valid flash_attention calls")

    @seed(zlib.crc32(b"explain"))
    @_settings(4 * VALID_EXAMPLES)
    @given(r=dense_recipe(entry))
    def run(r):
        c = build_dense(entry, r)
        tally.add(c.describe(), *run_explained(c))

    run()
    tally.check()


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_one_defect_calls(entry):
    recipe, build, defects = ENTRIES[entry]
    tally = Tally(f"{entry}: one-defect calls")
    seen = {}

    @seed(zlib.crc32(f"defect {entry}".encode()))
    @_settings(DEFECT_EXAMPLES)
    @given(r=recipe(entry, defects=True), data=st.data())
    def run(r, data):
        c = build(entry, r)
        description = c.describe()
        d = data.draw(st.sampled_from(defects(c)), label="defect")
        # hypothesis's mutations repeat a drawn defect often: each kind a few times at most
        kind = re.sub(r"\[.*?\]|=-?\d+", "", d.label)
        assume(seen.get(kind, 0) < max(2, DEFECT_EXAMPLES // 25))
        seen[kind] = seen.get(kind, 0) + 1
        d = _apply(c, d)
        tally.add(f"{description} + defect {d.label}", *run_defect(c, d))

    run()
    tally.check()
