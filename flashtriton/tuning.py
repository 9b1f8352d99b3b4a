"""Tuning tables: which tile each Triton kernel runs without autotuning.

By default no kernel is autotuned. A call's tile comes from a table: the one shipped for its
GPU's architecture (``flashtriton/tuned/sm90.json`` for Hopper, measured on an H200), then any
the user loads (``FLASHTRITON_TUNING_FILE``, ``load``), later tables first. An entry holds a
kernel's tuning key (its sequence-length buckets, head dims and variant switches), the dtype
and the tile the autotuner chose there. A call takes the entry whose key matches its own,
else the nearest one (``distance``: length buckets and head dims by octaves, switches by
mismatches), among the tiles that suit it (``configs.prune``); with no entry, the first of
those (configs' default for its head-dim class). A new shape compiles one tile per kernel
and measures nothing.

``FLASHTRITON_AUTOTUNE=1`` autotunes instead (Triton's autotuner over configs.candidates,
its results cached on disk by Triton); what it chose in this process is in ``recorded()``
and ``save(path)`` writes it as a table. ``python -m flashtriton.bench.tune`` runs the
autotuner over a grid of shapes and writes such a file (the shipped tables come from it).
"""

import json
import math
import os
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from . import _env

FORMAT = "flashtriton-tuning"
VERSION = 1
SHIPPED_DIR = Path(__file__).with_name("tuned")
# Key fields compared by octaves (log2 of the value): how far apart two lengths, head dims,
# grid waves or block sizes are. Head dims and packed query rows count double: a tile suits
# its head dim more than its length.
_OCTAVE_FIELDS = {"SQ_BUCKET": 1.0, "SK_BUCKET": 1.0, "SPLIT_BUCKET": 1.0, "WAVES": 1.0,
                  "SPARSE": 1.0, "PAGE_SIZE": 0.5, "HEAD_DIM": 2.0, "HEAD_DIM_V": 2.0,
                  "BLOCK_D": 2.0, "BLOCK_M": 2.0}
# float16 and bfloat16 tiles are interchangeable (the same bytes); other dtypes are far.
_DTYPE_NEAR = 0.25
_DTYPE_FAR = 8.0


class Entry(NamedTuple):
    """One tuned tile: ``kernel`` ("fwd", "dkdv", "dq", "decode"), the dtype of its query
    tensor ("bfloat16", ...), its tuning key as ((name, value), ...) in the kernel's key
    order, the tile (BLOCK_M, BLOCK_N, num_warps, num_stages), and the compute capability of
    the GPU it was measured on."""
    kernel: str
    dtype: str
    key: Tuple[Tuple[str, object], ...]
    config: Tuple[int, int, int, int]
    capability: Tuple[int, int]


# Tables loaded, later first: (source, entries) pairs; the shipped table of each architecture
# is loaded on the first call for it, before the user's files.
_TABLES: List[Tuple[str, List[Entry]]] = []
_EXACT: Dict[tuple, Tuple[int, int, int, int]] = {}
_SHIPPED_SEEN = set()
_ENV_LOADED = False
_RECORDED: Dict[tuple, Entry] = {}  # what the autotuner chose in this process


def _jsonable(value):
    return bool(value) if isinstance(value, bool) else value


def _entry_key(kernel: str, dtype: str, key, capability) -> tuple:
    return (kernel, dtype, tuple(key), tuple(capability))


def parse(data: dict, source: str = "<table>") -> List[Entry]:
    """The entries of a table read from JSON; ValueError naming ``source`` where the data is
    not a flashtriton tuning table."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{source}: not a flashtriton tuning table (no \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise ValueError(f"{source}: tuning table version {data.get('version')!r}; this "
                         f"flashtriton reads version {VERSION}")
    cap = data.get("capability")
    if not (isinstance(cap, list) and len(cap) == 2 and all(isinstance(c, int) for c in cap)):
        raise ValueError(f"{source}: \"capability\" must be [major, minor], got {cap!r}")
    entries = []
    for i, e in enumerate(data.get("entries", [])):
        try:
            config = tuple(int(c) for c in e["config"])
            key = tuple((str(n), v) for n, v in e["key"].items())
            if len(config) != 4 or not isinstance(e["kernel"], str):
                raise ValueError
            entries.append(Entry(e["kernel"], str(e["dtype"]), key, config, tuple(cap)))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError(f"{source}: entry {i} is not {{\"kernel\", \"dtype\", \"key\": "
                             f"{{...}}, \"config\": [BLOCK_M, BLOCK_N, num_warps, num_stages]}}: "
                             f"{e!r}") from None
    return entries


def _add(source: str, entries: List[Entry]) -> None:
    _TABLES.insert(0, (source, entries))
    for e in reversed(entries):  # the first of a table's duplicates wins, as in choose()
        _EXACT[_entry_key(e.kernel, e.dtype, e.key, e.capability)] = e.config
    _forget_choices()


# What forgets the choices made under the tables (runtime's cached tiles and launches, added
# by runtime itself: on_change), called whenever the tables change.
_LISTENERS: List[Callable[[], None]] = []


def on_change(forget: Callable[[], None]) -> None:
    """Call forget() whenever the tables change (runtime drops its cached tiles and calls)."""
    _LISTENERS.append(forget)


def _forget_choices() -> None:
    """Calls made before a table changed keep no tile chosen without it."""
    for forget in _LISTENERS:
        forget()


def load(path) -> int:
    """Load a tuning table (a file ``save`` or ``python -m flashtriton.bench.tune`` wrote):
    its entries take precedence over the tables loaded before it (FLASHTRITON_TUNING_FILE's
    load first). Returns how many entries it holds."""
    _ensure_env_tables()
    entries = _read(path)
    _add(str(path), entries)
    return len(entries)


def _read(path) -> List[Entry]:
    path = Path(path)
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    return parse(data, str(path))


def _ensure_env_tables() -> None:
    """The files of FLASHTRITON_TUNING_FILE, once they all read: a missing or bad one raises
    (FileNotFoundError / ValueError naming it) before any is loaded, on every call until
    they all read."""
    global _ENV_LOADED
    if _ENV_LOADED:
        return
    for p in _env.TUNING_FILES:
        if not Path(p).exists():
            raise FileNotFoundError(f"FLASHTRITON_TUNING_FILE names {p!r}, which does not exist")
    tables = [(p, _read(p)) for p in _env.TUNING_FILES]
    _ENV_LOADED = True
    for p, entries in tables:
        _add(p, entries)


def _ensure_tables(capability: Tuple[int, int]) -> None:
    """The shipped table for ``capability`` (once, below every other table), and the files
    of FLASHTRITON_TUNING_FILE (once)."""
    _ensure_env_tables()
    if capability not in _SHIPPED_SEEN:
        _SHIPPED_SEEN.add(capability)
        path = SHIPPED_DIR / f"sm{capability[0]}{capability[1]}.json"
        if path.exists():
            with open(path) as f:
                entries = parse(json.load(f), str(path))
            # below every table loaded so far (the user's)
            _TABLES.append((str(path), entries))
            for e in entries:
                _EXACT.setdefault(_entry_key(e.kernel, e.dtype, e.key, e.capability), e.config)


def tables() -> List[Tuple[str, int]]:
    """The tables in use, first the one that wins: (source, entries)."""
    return [(source, len(entries)) for source, entries in _TABLES]


def _octaves(a, b) -> float:
    return abs(math.log2(max(float(a), 1.0)) - math.log2(max(float(b), 1.0)))


def distance(key: Dict[str, object], other: Dict[str, object]) -> float:
    """How far a tuning key is from another: each length bucket, grid waves and block size
    by its octaves, head dims and packed query rows by twice theirs, each other field 1 where
    it differs (or is missing from one side)."""
    d = 0.0
    for name in set(key) | set(other):
        if name not in key or name not in other:
            d += 1.0
        elif name in _OCTAVE_FIELDS:
            d += _OCTAVE_FIELDS[name] * _octaves(key[name], other[name])
        elif key[name] != other[name]:
            d += 1.0
    return d


def _dtype_distance(a: str, b: str) -> float:
    if a == b:
        return 0.0
    return _DTYPE_NEAR if {a, b} <= {"float16", "bfloat16"} else _DTYPE_FAR


def choose(kernel: str, dtype: str, key: Sequence[Tuple[str, object]],
           allowed: Sequence[Tuple[int, int, int, int]],
           capability: Tuple[int, int]) -> Tuple[int, int, int, int]:
    """The tile of a call: the entry of the loaded tables with its exact key, else the
    nearest entry (``distance``; the first table's on ties) whose tile is in ``allowed``,
    else ``allowed[0]``. ``allowed``: the tiles that suit the call, best first."""
    _ensure_tables(capability)
    exact = _EXACT.get(_entry_key(kernel, dtype, key, capability))
    if exact is not None and exact in allowed:
        return exact
    named = dict(key)
    best, best_d = None, math.inf
    for _, entries in _TABLES:
        for e in entries:
            if e.kernel != kernel or e.capability != capability or e.config not in allowed:
                continue
            d = distance(named, dict(e.key)) + _dtype_distance(dtype, e.dtype)
            if d < best_d:
                best, best_d = e.config, d
    return best if best is not None else allowed[0]


def record(kernel: str, dtype: str, key: Sequence[Tuple[str, object]],
           config: Tuple[int, int, int, int], capability: Tuple[int, int]) -> None:
    """Note the autotuner's choice for a key (``save`` writes them)."""
    key = tuple((n, _jsonable(v)) for n, v in key)
    entry = Entry(kernel, dtype, key, tuple(config), tuple(capability))
    _RECORDED[_entry_key(kernel, dtype, key, capability)] = entry


def recorded() -> List[Entry]:
    """The autotuner's choices in this process, in choice order."""
    return list(_RECORDED.values())


def to_json(entries: Sequence[Entry], **meta) -> dict:
    """A table of ``entries`` (all of one compute capability) as JSON data, with ``meta``
    (device, versions) beside them."""
    caps = {e.capability for e in entries}
    if len(caps) > 1:
        raise ValueError(f"a tuning table holds one compute capability; these entries hold "
                         f"{sorted(caps)}")
    cap = caps.pop() if caps else tuple(meta.pop("capability", (0, 0)))
    meta.pop("capability", None)
    return {"format": FORMAT, "version": VERSION, "capability": list(cap), **meta,
            "entries": [{"kernel": e.kernel, "dtype": e.dtype, "key": dict(e.key),
                         "config": list(e.config)} for e in entries]}


def save(path, entries: Optional[Sequence[Entry]] = None, merge: bool = False,
         meta: Optional[dict] = None) -> int:
    """Write ``entries`` (default: ``recorded()``, the autotuner's choices in this process) as
    a table that ``load`` and FLASHTRITON_TUNING_FILE read, one entry a line. merge: keep the
    entries of the file already at ``path`` whose keys the new ones do not hold (and its
    metadata). meta: the device and versions to write (default: this machine's). Returns how
    many entries it holds."""
    import torch
    import triton
    entries = list(recorded() if entries is None else entries)
    path = Path(path)
    if merge and path.exists():
        with open(path) as f:
            data = json.load(f)
        old = parse(data, str(path))
        new = {_entry_key(e.kernel, e.dtype, e.key, e.capability) for e in entries}
        entries += [e for e in old if _entry_key(e.kernel, e.dtype, e.key, e.capability)
                    not in new]
        meta = meta or {k: v for k, v in data.items()
                        if k not in ("format", "version", "capability", "entries")}
    if meta is None:
        meta = {"triton": triton.__version__, "torch": torch.__version__}
        if torch.cuda.is_available():
            meta["device"] = torch.cuda.get_device_name()
            meta["capability"] = list(torch.cuda.get_device_capability())
    data = to_json(entries, **meta)
    rows = ",\n".join(" " + json.dumps(e) for e in data.pop("entries"))
    head = json.dumps(data)[:-1]
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(f'{head}, "entries": [\n{rows}\n]}}\n')
    os.replace(tmp, path)
    return len(entries)


def reset() -> None:
    """Forget every loaded table (the shipped ones load again on the next call) and every
    recorded choice (tests)."""
    global _ENV_LOADED
    _TABLES.clear()
    _EXACT.clear()
    _SHIPPED_SEEN.clear()
    _RECORDED.clear()
    _ENV_LOADED = False
    _forget_choices()
