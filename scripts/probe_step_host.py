"""Host time of a repeated eager decoding step, on the CPU with the kernels faked (as in
tests/test_launch.py): the step replay path of ``attention_with_kvcache`` alone, without a
GPU. The fake compiled kernels do what Triton 3.6's do on the host but launch nothing:
``launch_metadata`` is Triton's own, and ``run`` is Triton's launcher wrapper around a C
launcher that does nothing. B=1, one query token, 32 query heads, 8 KV heads, D=128, bf16,
caches of 1K and 8K keys, 1 and 8 splits (the automatic count is 1 here: 4 SMs on a CPU);
the best of 5 loops of 5000 steps, in alternating rounds (scripts/probe_decode_host.py takes
a step apart on the GPU). The noise of a shared host is high: many short loops (--calls 500
--repeats 40) give steadier minima.

    PYTHONPATH=.:scripts python scripts/probe_step_host.py [--rounds 3] [--calls N --repeats R]
"""
import argparse
import time
import types

import torch
import triton
from triton.compiler.compiler import CompiledKernel

from flashtriton import _env, decode, launch

CALLS, REPEATS = 5000, 5  # --calls, --repeats


def _launcher():
    """Triton 3.6's launcher wrapper (CudaLauncher) around a C launcher that does nothing."""
    from triton.backends.nvidia.driver import CudaLauncher
    run = object.__new__(CudaLauncher)
    run.launch = lambda *args: None
    run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, True
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    return run


class FakeCompiled:
    packed_metadata = (4, 1, 0)
    function = 77
    name = "fake"
    src = None
    metadata = types.SimpleNamespace(global_scratch_size=0)
    launch_metadata = CompiledKernel.launch_metadata

    def __init__(self):
        self.run = _launcher()

    def _init_handles(self):
        pass


class FakeJIT:
    def __init__(self, arg_names):
        self.arg_names = arg_names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: FakeCompiled()


class FakeAutotuner:
    def __init__(self, real):
        self.fn = FakeJIT(real.fn.arg_names)
        self.cache = {}
        self.best_config = triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=1)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


def fake_kernels():
    _env.INTERPRET, _env.FAST_LAUNCH = False, True
    launch.driver = types.SimpleNamespace(active=FakeDriver())
    launch._decode = FakeAutotuner(launch._decode)
    decode._attn_merge_kernel = FakeJIT(decode._attn_merge_kernel.arg_names)
    decode.check_qkv = lambda *args, **kwargs: None  # CPU tensors outside the interpreter


def inputs(N, B=1, H=32, HKV=8, D=128):
    q = torch.zeros(B, 1, H, D, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.zeros(B, N, HKV, D, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((B,), N, dtype=torch.int32)
    return q, k_cache, v_cache, lens


def best_us(fn):
    best = float("inf")
    for _ in range(REPEATS):
        t = time.perf_counter()
        for _ in range(CALLS):
            fn()
        best = min(best, (time.perf_counter() - t) / CALLS * 1e6)
    return best


def step_fn(N, num_splits):
    q, k_cache, v_cache, lens = inputs(N)

    def step():
        return decode.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                             num_splits=num_splits)
    for _ in range(3):
        step()
    return step


def main():
    global CALLS, REPEATS
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=CALLS)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args()
    CALLS, REPEATS = args.calls, args.repeats
    fake_kernels()
    torch.set_num_threads(1)
    cases = [(N, s) for N in (1024, 8192) for s in (1, 8)]  # auto: 1 split (4 SMs)
    steps = {case: step_fn(*case) for case in cases}
    times = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            times[case].append(best_us(steps[case]))
    print(f"{'cache':>6s} {'splits':>8s}  us/step, each round (best of {REPEATS} loops of {CALLS})")
    for (N, s), ts in times.items():
        name = "auto" if s == 0 else str(s)
        print(f"{N:6d} {name:>8s}  min {min(ts):5.2f}  " + " ".join(f"{t:5.2f}" for t in ts))


if __name__ == "__main__":
    main()
