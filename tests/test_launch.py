"""The cached launch path of launch._launch: which calls reuse a compiled kernel, and that such a
call hands the compiled kernel what Triton's JITFunction.run would (every argument in the
kernel's order, this call's grid, the current stream). A fake kernel stands in for Triton's
here; tests/test_attention.py::test_repeated_calls runs the real kernels through the path."""

import types

import pytest
import torch
import triton

from accuracy import check_against_reference, make_qkv
from conftest import DEVICE, ON_GPU
from flashtriton import _env, flash_attention_with_lse, launch


class FakeCompiled:
    packed_metadata = "packed"
    function = "function"

    def __init__(self):
        self.runs = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, gx, gy, gz, stream, function, packed, meta, enter_hook, exit_hook, *args):
        self.runs.append(((gx, gy, gz), stream, args))


class FakeJIT:
    """Records the launches that go through JITFunction.run; each returns a new compiled kernel."""
    __name__ = "fake_kernel"
    arg_names = ["Q", "K", "stride", "scale", "seed", "FLAG", "BLOCK_M"]

    def __init__(self):
        self.slow = []
        self.compiled = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow.append((grid(kwargs) if callable(grid) else grid, args, kwargs))
            self.compiled.append(FakeCompiled())
            return self.compiled[-1]
        return run


class FakeAutotuner:
    def __init__(self):
        self.fn = FakeJIT()
        self.cache = {}
        self.best_config = triton.Config({"BLOCK_M": 16}, num_warps=4, num_stages=1)
        self.tuned = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.tuned += 1
        return run


class FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(_env, "INTERPRET", False)
    monkeypatch.setattr(_env, "FAST_LAUNCH", True)
    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=FakeDriver()))
    kernel = FakeAutotuner()
    yield kernel
    launch._TUNED.pop((id(kernel), ("key",)), None)


def _call(kernel, q, k, stride=64, scale=0.5, seed=0, batch=2):
    launch._launch(kernel, lambda meta: (triton.cdiv(40, meta["BLOCK_M"]), batch), ("key",),
                   q, k, stride, scale, seed=seed, FLAG=True)


def _pair(offset=0):
    base = torch.zeros(64 + offset, dtype=torch.int8)
    return base[offset:offset + 32], torch.zeros(32, dtype=torch.int8)


def test_third_call_runs_the_compiled_kernel(fake):
    before = launch.FAST_LAUNCHES
    _call(fake, *_pair())                       # autotunes
    _call(fake, *_pair())                       # through JITFunction.run, cached
    assert fake.tuned == 1 and len(fake.fn.slow) == 1
    q, k = _pair()
    _call(fake, q, k, seed=77, batch=5)         # new tensors, seed and batch: cached kernel
    assert len(fake.fn.slow) == 1 and launch.FAST_LAUNCHES == before + 1
    (grid, stream, args), = fake.fn.compiled[0].runs
    assert grid == (3, 5, 1) and stream == 1234
    assert args[0] is q and args[1] is k and args[2:] == (64, 0.5, 77, True, 16)


@pytest.mark.parametrize("change", ["int", "float", "constexpr", "dtype", "unaligned", "seed64"])
def test_other_calls_go_through_triton(fake, change):
    _call(fake, *_pair())
    _call(fake, *_pair())
    q, k = _pair(offset=2 if change == "unaligned" else 0)
    if change == "dtype":
        k = k.view(torch.uint8)
    kw = {"int": dict(stride=128), "float": dict(scale=0.25), "seed64": dict(seed=2**31)}
    if change == "constexpr":
        launch._launch(fake, lambda meta: (1, 1), ("key",), q, k, 64, 0.5, seed=0, FLAG=False)
    else:
        _call(fake, q, k, **kw.get(change, {}))
    assert len(fake.fn.slow) == 2 and not fake.fn.compiled[0].runs
    assert fake.fn.slow[-1][1][0] is q


def test_switched_off(fake, monkeypatch):
    monkeypatch.setattr(_env, "FAST_LAUNCH", False)
    for _ in range(3):
        _call(fake, *_pair())
    assert len(fake.fn.slow) == 2 and not launch._COMPILED


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_repeated_calls(causal):
    # The same shapes three times with new data (on a GPU the third call runs the cached
    # compiled kernels), then another batch size with the same strides per batch: the grid
    # must follow the batch. Each result is checked against the float64 reference.
    before = launch.FAST_LAUNCHES
    for B in (2, 2, 2, 3):
        q, k, v = make_qkv(B, 48, 48, 2, 2, 32, torch.float16, DEVICE)
        check_against_reference(
            lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, causal=causal)), q, k, v,
            causal)
    if ON_GPU and _env.FAST_LAUNCH:
        assert launch.FAST_LAUNCHES > before


def test_kernel_without_tuning(fake):
    # launch_jit alone (the decoding merge kernel): the second call runs the compiled kernel.
    fn = FakeJIT()
    for _ in range(2):
        q, k = _pair()
        launch.launch_jit(fn, (4,), q, k, 64, 0.5, seed=3, FLAG=True, BLOCK_M=8)
    assert len(fn.slow) == 1
    (grid, _, args), = fn.compiled[0].runs
    assert grid == (4, 1, 1) and args[0] is q and args[2:] == (64, 0.5, 3, True, 8)
