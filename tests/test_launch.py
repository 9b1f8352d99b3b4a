"""The cached launch path of runtime._launch: which calls reuse a compiled kernel, and that such a
call hands the compiled kernel what Triton's JITFunction.run would (every argument in the
kernel's order, this call's grid, the current stream). A fake kernel stands in for Triton's
here; tests/test_attention.py::test_repeated_calls runs the real kernels through the path."""

import inspect
import types

import pytest
import torch
import triton

from accuracy import check_against_reference, make_qkv
from conftest import DEVICE, ON_GPU
from flashtriton import _env, flash_attention_with_lse, launch
from flashtriton import configs, runtime


class FakeCompiled:
    packed_metadata = "packed"
    function = "function"
    metadata = types.SimpleNamespace(global_scratch_size=0)

    def __init__(self):
        self.runs = []
        self.hooks = []

    def launch_metadata(self, grid, stream, *args):
        return "metadata"

    def run(self, gx, gy, gz, stream, function, packed, meta, enter_hook, exit_hook, *args):
        self.runs.append(((gx, gy, gz), stream, args))
        self.hooks.append((meta, enter_hook, exit_hook))


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
    def __init__(self, real=None):
        """A stand-in for launch.triton_attn._fwd / _dq / _dkdv (``real``: its argument names,
        tuning key and kind). Its one tile is best_config (set it before the first call)."""
        self.fn = FakeJIT()
        self.cache = {}
        self.kind, self.keys = "fwd", ["stride"]
        self.best_config = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4,
                                         num_stages=1)
        if real is not None:
            self.fn.arg_names, self.keys, self.kind = real.fn.arg_names, real.keys, real.kind
            self.best_config = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4,
                                             num_stages=1)
        self.tuned = 0

    def allowed(self, named_args, kwargs):
        return [runtime._cfg_tuple(self.best_config)]

    @property
    def by_tile(self):
        return {runtime._cfg_tuple(self.best_config): self.best_config}

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
    monkeypatch.setattr(runtime, "_COMPILED", {})
    monkeypatch.setattr(runtime, "_PLANS", {})  # keyed by id(): a dead fake's id comes back
    monkeypatch.setattr(runtime, "driver", types.SimpleNamespace(active=FakeDriver()))
    monkeypatch.setattr(_env, "AUTOTUNE", True)  # the tuning call, then the cached paths
    kernel = FakeAutotuner()
    yield kernel
    runtime._TUNED.pop((id(kernel), ("key",)), None)


def _call(kernel, q, k, stride=64, scale=0.5, seed=0, batch=2):
    runtime._launch(kernel, lambda meta: (triton.cdiv(40, meta["BLOCK_M"]), batch), ("key",),
                   q, k, stride, scale, seed=seed, FLAG=True)


def _pair(offset=0):
    base = torch.zeros(64 + offset, dtype=torch.int8)
    return base[offset:offset + 32], torch.zeros(32, dtype=torch.int8)


def test_third_call_runs_the_compiled_kernel(fake):
    before = runtime.FAST_LAUNCHES
    _call(fake, *_pair())                       # autotunes
    _call(fake, *_pair())                       # through JITFunction.run, cached
    assert fake.tuned == 1 and len(fake.fn.slow) == 1
    q, k = _pair()
    _call(fake, q, k, seed=77, batch=5)         # new tensors, seed and batch: cached kernel
    assert len(fake.fn.slow) == 1 and runtime.FAST_LAUNCHES == before + 1
    (grid, stream, args), = fake.fn.compiled[0].runs
    assert grid == (3, 5, 1) and stream == 1234
    assert args == (q.data_ptr(), k.data_ptr(), 64, 0.5, 77, True, 16)


def test_tiles_from_the_tables_launch_through_the_cached_path(fake, monkeypatch):
    # Without autotuning the first call compiles the tables' tile (no search), the second
    # runs the compiled kernel.
    monkeypatch.setattr(_env, "AUTOTUNE", False)
    for _ in range(2):
        _call(fake, *_pair())
    assert fake.tuned == 0 and len(fake.fn.slow) == 1 and len(fake.fn.compiled[0].runs) == 1
    assert fake.fn.slow[0][0] == (3, 2)  # the tile's BLOCK_M 16 in the grid
    assert fake.fn.slow[0][2]["BLOCK_M"] == 16


def test_launch_hooks_only_where_set(fake, monkeypatch):
    # Triton's launcher calls its launch hooks, with metadata built for them, on every launch
    # (Triton >= 3.5 keeps an empty HookChain where none is set): a cached launch hands it
    # none where no hook would run, and the hook with its metadata where one is set.
    for _ in range(3):
        _call(fake, *_pair())
    hook = lambda metadata: None  # noqa: E731
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hook)
    _call(fake, *_pair())
    assert fake.fn.compiled[0].hooks == [(None, None, None), ("metadata", hook, None)]


@pytest.mark.parametrize("change", ["int", "float", "constexpr", "dtype", "unaligned", "seed64"])
def test_other_calls_go_through_triton(fake, change):
    _call(fake, *_pair())
    _call(fake, *_pair())
    q, k = _pair(offset=2 if change == "unaligned" else 0)
    if change == "dtype":
        k = k.view(torch.uint8)
    kw = {"int": dict(stride=128), "float": dict(scale=0.25), "seed64": dict(seed=2**31)}
    if change == "constexpr":
        runtime._launch(fake, lambda meta: (1, 1), ("key",), q, k, 64, 0.5, seed=0, FLAG=False)
    else:
        _call(fake, q, k, **kw.get(change, {}))
    assert len(fake.fn.slow) == 2 and not fake.fn.compiled[0].runs
    assert fake.fn.slow[-1][1][0] is q


def test_switched_off(fake, monkeypatch):
    monkeypatch.setattr(_env, "FAST_LAUNCH", False)
    for _ in range(3):
        _call(fake, *_pair())
    assert len(fake.fn.slow) == 2 and not runtime._COMPILED


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_repeated_calls(causal):
    # The same shapes three times with new data (on a GPU the third call runs the cached
    # compiled kernels), then another batch size with the same strides per batch: the grid
    # must follow the batch. Each result is checked against the float64 reference.
    before = runtime.FAST_LAUNCHES
    for B in (2, 2, 2, 3):
        q, k, v = make_qkv(B, 48, 48, 2, 2, 32, torch.float16, DEVICE)
        check_against_reference(
            lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, causal=causal)), q, k, v,
            causal)
    if ON_GPU and _env.FAST_LAUNCH:
        assert runtime.FAST_LAUNCHES > before


def test_kernel_without_tuning(fake):
    # launch_jit alone (the decoding merge kernel): the second call runs the compiled kernel.
    fn = FakeJIT()
    for _ in range(2):
        q, k = _pair()
        runtime.launch_jit(fn, (4,), q, k, 64, 0.5, seed=3, FLAG=True, BLOCK_M=8)
    assert len(fn.slow) == 1
    (grid, _, args), = fn.compiled[0].runs
    assert grid == (4, 1, 1) and args[0] == q.data_ptr() and args[2:] == (64, 0.5, 3, True, 8)


@pytest.fixture
def fake_attention(fake, monkeypatch):
    """Fake forward and backward kernels with the real kernels' arguments; a fresh call table."""
    monkeypatch.setattr(runtime, "_CALLS", {})
    kernels = {}
    for name in ("_fwd", "_dq", "_dkdv"):
        kernels[name] = FakeAutotuner(getattr(launch.triton_attn, name))
        monkeypatch.setattr(launch.triton_attn, name, kernels[name])
    yield kernels
    runtime._TUNED.clear()  # keyed by the fakes' ids


def _tensors(B=2, N=40, dtype=torch.float16):
    return [torch.zeros(B, N, 2, 32, dtype=dtype) for _ in range(3)]


def test_repeated_forward_replays_the_call(fake_attention):
    # Call 1 tunes, call 2 compiles (through JITFunction.run) and is remembered, calls 3 and
    # 4 replay it with their own tensors and the same scalars; a call that differs in its
    # variant, strides or dtype goes through the launchers again.
    fwd = fake_attention["_fwd"]
    variant = launch.Variant(0.125, causal=True)
    for _ in range(2):
        launch.attention_forward(*_tensors(), variant)
    assert fwd.tuned == 1 and len(fwd.fn.slow) == 1 and len(runtime._CALLS) == 1
    (grid, slow_args, slow_kwargs), = fwd.fn.slow
    for _ in range(2):
        q, k, v = _tensors()
        out, lse = launch.attention_forward(q, k, v, variant)
    compiled = fwd.fn.compiled[0]
    assert len(fwd.fn.slow) == 1 and len(compiled.runs) == 2
    (shown, _, args) = compiled.runs[-1]
    assert shown == (2, 4, 1) == (*grid, 1)   # cdiv(40, 32) query blocks, B * H
    # the tensors as their data pointers (Triton's launcher then skips its pointer checks)
    assert args[:5] == tuple(t.data_ptr() for t in (q, k, v, out, lse))
    assert args[5:len(slow_args)] == slow_args[5:]
    names = fwd.fn.arg_names[len(slow_args):]
    assert args[len(slow_args):] == tuple({**slow_kwargs}[n] for n in names)

    q, k, v = _tensors()
    launch.attention_forward(q, k, v, variant._replace(softmax_scale=0.25))
    launch.attention_forward(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, variant)
    launch.attention_forward(*_tensors(dtype=torch.bfloat16), variant)
    assert len(compiled.runs) == 2             # none of them replayed the first call
    assert [a[1][0] is q for a in fwd.fn.slow[1:3]] == [True, True]


def test_repeated_backward_replays_both_kernels(fake_attention):
    dq_kernel, dkdv_kernel = fake_attention["_dq"], fake_attention["_dkdv"]
    variant = launch.Variant(0.125)
    for _ in range(3):
        q, k, v = _tensors()
        out, dout = torch.zeros_like(q), torch.zeros_like(q)
        lse = torch.zeros(2, 2, 40)
        dq, dk, dv, _ = launch.attention_backward(dout, q, k, v, out, lse, variant)
    assert len(dq_kernel.fn.slow) == len(dkdv_kernel.fn.slow) == 1
    (_, _, dq_args), = dq_kernel.fn.compiled[0].runs
    (_, _, dkdv_args), = dkdv_kernel.fn.compiled[0].runs
    assert dq_args[:6] == tuple(t.data_ptr() for t in (q, k, v, out, dout, lse))
    assert dq_args[7] == dq.data_ptr() and dkdv_args[6:8] == (dk.data_ptr(), dv.data_ptr())
    assert dq_args[6] == dkdv_args[5]          # the delta dQ writes is the one dK/dV reads


def test_dropout_and_tensor_variants_are_not_replayed(fake_attention):
    slopes = torch.ones(2)
    for variant in (launch.Variant(0.125, dropout_p=0.1, seed=5),
                    launch.Variant(0.125, alibi_slopes=slopes)):
        for _ in range(3):
            launch.attention_forward(*_tensors(), variant)
    assert not runtime._CALLS


def test_gluon_forward_replays_alibi_and_block_masks(fake_attention, monkeypatch):
    """Where the Gluon forward runs (stood in for here), a call with ALiBi or a block mask
    whose signature was seen replays with this call's pointers, its slopes' and lists'
    included, in the kernel's order (q, k, v, out, lse, slopes, lists); another shape of
    slopes is another signature; and the Triton forward, whose leading tensors differ, never
    records under such a signature."""
    replays = []
    monkeypatch.setattr(launch, "gluon_misfit", lambda *a, **k: None)
    monkeypatch.setattr(launch, "_gluon_forward",
                        lambda *a: lambda *ptrs: replays.append(ptrs))

    def lists():
        return torch.zeros(1, 1, 1, 4, dtype=torch.int32)
    for variant in (lambda: launch.Variant(0.125, alibi_slopes=torch.ones(2)),
                    lambda: launch.Variant(0.125, kv_blocks=lists(), q_blocks=lists())):
        runtime._CALLS.clear()
        for call in range(3):
            var = variant()
            q, k, v = (torch.zeros(1, 40, 2, 128, dtype=torch.bfloat16) for _ in range(3))
            out, lse = launch.attention_forward(q, k, v, var)
            assert len(runtime._CALLS) == 1
            if call:  # the first call launched; the others replayed with their own tensors
                extra = var.alibi_slopes if var.alibi_slopes is not None else var.kv_blocks
                assert replays[-1] == (*[t.data_ptr() for t in (q, k, v, out, lse)],
                                       *((extra.data_ptr(), None) if var.kv_blocks is None
                                         else (None, extra.data_ptr())), None)
        assert len(replays) == 2
        replays.clear()
    var = launch.Variant(0.125, alibi_slopes=torch.ones(1, 2))  # (B, H) slopes: another call
    launch.attention_forward(*(torch.zeros(1, 40, 2, 128, dtype=torch.bfloat16)
                               for _ in range(3)), var)
    assert not replays and len(runtime._CALLS) == 2
    monkeypatch.setattr(launch, "gluon_misfit", lambda *a, **k: "the Triton forward")
    runtime._CALLS.clear()
    for _ in range(3):
        launch.attention_forward(*(torch.zeros(1, 40, 2, 128, dtype=torch.bfloat16)
                                   for _ in range(3)), var)
    assert not runtime._CALLS and not replays


def test_gluon_replays_hand_each_pointer_to_its_kernel_argument():
    """GluonReplay and GluonBwdReplay put each pointer where the Gluon kernels (and the
    backward's prep kernel) take it: descriptors over q, k, v (and dO, the fp32 dQ buffer,
    the log2 LSE and delta) by their views, then the plain pointers, named as the kernels
    name their leading arguments."""
    from flashtriton.kernels.gluon import bwd as gluon_bwd, fwd as gluon_fwd
    from flashtriton.kernels.attn_bwd import _attn_bwd_prep_kernel
    views = tuple(([40 + i, 128], [128 + i, 1]) for i in range(7))

    def named(args, names):
        return {n: (int(a.base), a.shape, a.strides) if hasattr(a, "base") else a
                for n, a in zip(names, args)}
    got = []
    launch.gluon_attn.GluonReplay(lambda *a: got.append(a), views[:3])(*[16 * i for i in range(1, 9)])
    assert named(got[0], gluon_fwd._attn_fwd_gluon_kernel.arg_names) == {
        "q_desc": (16, *views[0]), "k_desc": (32, *views[1]), "v_desc": (48, *views[2]),
        "O": 64, "LSE": 80, "ALIBI": 96, "BMASK": 112, "SINK": 128}
    prep, kernel = [], []
    ptrs = dict(out=1, dout=2, lse=3, lse2=4, delta=5, dq_acc=6, q=7, k=8, v=9, dk=10, dv=11,
                alibi=12, bmask=None)
    launch.gluon_attn.GluonBwdReplay(lambda *a: prep.append(a), lambda *a: kernel.append(a),
                          views)(**ptrs)
    assert named(prep[0], _attn_bwd_prep_kernel.arg_names) == dict(
        O=1, DO=2, LSE=3, LSE2=4, DELTA=5, DQ=6)
    assert named(kernel[0], gluon_bwd._attn_bwd_gluon_kernel.arg_names) == {
        "q_desc": (7, *views[0]), "k_desc": (8, *views[1]), "v_desc": (9, *views[2]),
        "do_desc": (2, *views[3]), "dq_desc": (6, *views[4]), "lse_desc": (4, *views[5]),
        "delta_desc": (5, *views[6]), "DK": 10, "DV": 11, "ALIBI": 12, "BMASK": None}


@pytest.mark.parametrize("in_kernel", [False, True], ids=["merge-kernel", "in-kernel"])
def test_repeated_decode_replays_its_kernels(fake_attention, monkeypatch, in_kernel):
    # Splits merged by the merge kernel (under a capture): both kernels replay, the partials
    # one allocation; merged in the split kernel (eager, small caches): one launch, its
    # partials and counts in the stream's workspace, the output and LSE its merge's (its
    # first call also compiles the merge kernel's way, which a capture would take).
    from flashtriton import decode
    from flashtriton.launch import decode as decode_launch
    from flashtriton.launch import decode_replay
    monkeypatch.setattr(decode, "check_qkv", lambda *args, **kw: None)  # CPU, no interpreter
    monkeypatch.setattr(configs, "DECODE_MERGE_IN_KERNEL", in_kernel)
    monkeypatch.setattr(decode_replay, "_WORKSPACES", {})
    split = FakeAutotuner(launch.triton_attn._decode)
    split.best_config = triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)
    merge = FakeJIT()
    merge.arg_names = decode_launch._attn_merge_kernel.arg_names
    monkeypatch.setattr(launch.triton_attn, "_decode", split)
    monkeypatch.setattr(decode_launch, "_attn_merge_kernel", merge)

    def step(num_splits=3):
        q = torch.zeros(2, 1, 4, 32, dtype=torch.float16)
        cache = torch.zeros(2, 3 * configs.decode_split_granule(), 2, 32,
                            dtype=torch.float16)
        lens = torch.full((2,), 50, dtype=torch.int32)
        out, lse = decode.attention_with_kvcache(q, cache, cache, cache_seqlens=lens,
                                                 num_splits=num_splits)
        return q, cache, lens, out, lse

    for _ in range(2):
        step()
    assert len(split.fn.slow) == len(merge.slow) == 1 and len(runtime._CALLS) == 1
    (record,), = runtime._CALLS.values()  # the step's one record, by how it merges
    assert type(record) is (decode_replay.MergedInKernel if in_kernel
                            else decode_replay.MergeKernel)
    q, cache, lens, out, lse = step()
    (grid, _, args) = split.fn.compiled[0].runs[-1]
    assert len(split.fn.compiled[0].runs) == 1 + in_kernel  # call 2 replayed too
    assert grid == (3, 4, 1)                   # splits x (B * HKV)
    if in_kernel:
        (ws, _, counts), = decode_replay._WORKSPACES.values()
        assert counts == ws.data_ptr() and args[15] == counts  # the counts, then the partials
        assert (args[11] == counts + 4 * decode_replay._COUNTS
                and args[12] - args[11] == 4 * 3 * 2 * 4 * 32)
        assert args[13:15] == (out.data_ptr(), lse.data_ptr())
        return
    _, _, merge_args = merge.compiled[0].runs[-1]   # call 2 ran it cached, call 3 replayed
    assert args[8:11] == (None, None, None)    # no sinks, no fp8 descales
    assert args[13:16] == (None, None, None)   # no merge in the split kernel
    assert args[0] == q.data_ptr() and args[1] == cache.data_ptr() and args[3] == lens.data_ptr()
    assert args[11] == merge_args[0] and args[12] == merge_args[1]  # the partials merged
    # one allocation: the LSEs (16-byte aligned) after the 3 x 2 x 4 x 1 x 32 fp32 outputs
    assert args[12] - args[11] == 4 * 3 * 2 * 4 * 32 and args[12] % 16 == 0
    assert merge_args[2] == out.data_ptr() and merge_args[3] == lse.data_ptr()
    step(num_splits=2)                         # another split size: tuned or compiled anew
    assert split.tuned + len(split.fn.slow) == 3 and len(split.fn.compiled[0].runs) == 1


def test_repeated_decode_step_replays_before_the_checks(fake_attention, monkeypatch):
    # A plain decoding step that matches a remembered one replays without checking its
    # arguments again (host time); a step that differs in a dtype, a stride, a setting or
    # an append goes through the checks (and the launchers) again.
    from flashtriton import decode
    checks = []
    monkeypatch.setattr(decode, "check_qkv", lambda *args, **kw: checks.append(args[3]))
    split = FakeAutotuner(launch.triton_attn._decode)
    split.best_config = triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)
    monkeypatch.setattr(launch.triton_attn, "_decode", split)
    q = torch.zeros(2, 1, 4, 32, dtype=torch.float16)
    cache = torch.zeros(2, configs.decode_split_granule(), 2, 32, dtype=torch.float16)
    lens = torch.full((2,), 50, dtype=torch.int32)

    def step(**kw):
        args = dict(dict(q=q, k_cache=cache, v_cache=cache, cache_seqlens=lens, num_splits=1), **kw)
        return decode.attention_with_kvcache(args.pop("q"), args.pop("k_cache"),
                                             args.pop("v_cache"), **args)
    for _ in range(3):
        step()
    assert len(checks) == 2 and len(split.fn.compiled[0].runs) == 1  # call 3 replayed
    out = step(q=q.clone())
    assert len(checks) == 2 and len(split.fn.compiled[0].runs) == 2
    assert split.fn.compiled[0].runs[-1][2][0] != q.data_ptr() and out.out.shape == q.shape
    for kw in (dict(softcap=5.0), dict(causal=True), dict(q=q.transpose(2, 3).contiguous()
                                                          .transpose(2, 3)),
               dict(k_cache=cache.double(), v_cache=cache.double()), dict(window_size=[-1, -1]),
               dict(k=q[:, :, :2], v=q[:, :, :2])):
        before = len(checks)
        try:
            step(**kw)
        except Exception:
            pass  # the fakes cannot run every variant; what matters is that it was checked
        assert len(checks) > before, kw
    # flags equal to the remembered step's but not bools (0 == False): refused, not replayed
    runs = len(split.fn.compiled[0].runs)
    for flag, value in (("causal", 0), ("return_lse", 1), ("rotary_interleaved", "x"),
                        ("batch_invariant", 0)):
        with pytest.raises(TypeError, match=f"^{flag} must be a bool"):
            step(**{flag: value})
    for value in (True, 1.0):  # equal to the remembered num_splits=1, but not an int
        with pytest.raises(TypeError, match="^num_splits must be an int"):
            step(num_splits=value)
    assert len(split.fn.compiled[0].runs) == runs


def test_on_device_of_takes_the_first_argument_by_keyword():
    """Every function on_device_of wraps takes its first argument by its keyword too."""
    @runtime.on_device_of
    def first(x, y=1, *, z=2):
        return x, y, z
    assert first(0) == (0, 1, 2) and first(x=0, z=3) == (0, 1, 3) and first(y=4, x=0)[1] == 4
    with pytest.raises(TypeError, match="'x'"):
        first(y=4)
    assert next(iter(inspect.signature(first).parameters)) == "x"  # (functools.wraps)
    q, k, v = (torch.randn(1, 4, 1, 16) for _ in range(3))
    variant = launch.Variant(0.25)
    want = launch.attention_forward(q, k, v, variant)
    got = launch.attention_forward(v=v, variant=variant, k=k, q=q)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    grads = launch.attention_backward(dout=torch.ones_like(q), q=q, k=k, v=v, out=want[0],
                                      lse=want[1], variant=variant)
    assert grads[0].shape == q.shape


def test_descriptor_scratch_is_not_kept_between_launches():
    # Each launch gets its own block (freed when the launch returns): a buffer kept across
    # calls would sit in a CUDA-graph pool during torch.compile's warmup (a live tensor that
    # is no output), and the default stream's handle is shared by every device.
    import weakref
    buf = runtime._scratch(256, 128, stream=0)
    assert buf.numel() >= 256 and buf.dtype == torch.int8
    assert buf.device.type == ("cpu" if runtime._env.INTERPRET else "cuda")
    kept = weakref.ref(buf)
    del buf
    assert kept() is None


def test_launchers_run_on_their_inputs_device(monkeypatch):
    # Triton launches on the current device: a call whose tensors live on another GPU makes
    # that GPU current for the call (stand-ins for two GPUs; tests/test_gpu.py runs it on two).
    entered = []

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            return False

    class OnGPU:
        def __init__(self, index):
            self.index = index

        def get_device(self):
            return self.index

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Device)
    run = launch.on_device_of(lambda x, y: y)
    assert run(OnGPU(1), "out") == "out" and entered == [1]
    assert run(OnGPU(0), "out") == "out" and entered == [1]         # already current
    assert run(torch.zeros(1), "out") == "out" and entered == [1]   # CPU
    assert run([1, 2], "out") == "out" and entered == [1]           # not a tensor
    for fn in (launch.attention_forward, launch.attention_backward):
        assert fn.__wrapped__  # the launchers carry the guard
