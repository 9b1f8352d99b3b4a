"""Does a variant's measured speed depend on what ran just before it? bench_variants
measures flashtriton and FlexAttention in turn; this runs flashtriton's window and
document variants again and again, after itself and after FlexAttention, with Python's
garbage collector left on, run first, or off, and counts the collections during each
measurement; then the host time of a forward call against its GPU time.

    python scripts/probe_bench_order.py [--variants window document]
"""
import argparse
import gc
import time

import torch

from flashtriton.bench import Shape, _inputs, _measure
from flashtriton.bench_variants import _flex, _ours

COLLECTIONS = [0, 0, 0]


def _count(phase, info):
    if phase == "start":
        COLLECTIONS[info["generation"]] += 1


def measure(label, name, fn, shape):
    COLLECTIONS[:] = [0, 0, 0]
    r = _measure(fn, shape, torch.bfloat16)
    print(f"{name:>9} {label:<32} fwd {r['fwd_ms']:.3f} ms  bwd {r['bwd_ms']:.3f} ms  "
          f"gc gen0/1/2 {COLLECTIONS}", flush=True)


def host_us(fn, q, k, v, calls=50):
    """Host microseconds a forward call (no synchronisation inside the loop) and the
    wall microseconds a call once the GPU has finished."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn(q, k, v, None)
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t) / calls * 1e6


def by_allocation(name, trials=6, repeats=3):
    """The variant's backward timed `repeats` times on each of `trials` fresh allocations
    (shifted by a spacer of a random size): does its time follow the tensors' placement or
    the clock? (Each line ends with the time it finished, for `nvidia-smi dmon -o T`.)"""
    import triton
    B, H, N, D = 2, 16, 8192, 128
    ours = _ours(name, B, H, N, "cuda")
    shape = Shape(name, B, H, H, N, D, True)
    spacers = []
    for trial in range(trials):
        spacers.append(torch.empty(int(torch.randint(1, 64, ()).item()) * 2**20 + 4096 * trial,
                                   dtype=torch.uint8, device="cuda"))
        q, k, v = _inputs(shape, torch.bfloat16)
        out = ours(q, k, v, None)
        dout = torch.randn_like(out)
        ms = [triton.testing.do_bench(lambda: out.backward(dout, retain_graph=True),
                                      grad_to_none=[q, k, v], warmup=50, rep=200,
                                      return_mode="median") for _ in range(repeats)]
        print(f"{name:>9} allocation {trial}: q at {q.data_ptr() % 2**24:#x} (mod 16 MiB), "
              f"bwd ms {' '.join('%.3f' % x for x in ms)}  {time.strftime('%H:%M:%S')}",
              flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", default=["window", "document"])
    p.add_argument("--allocations", action="store_true",
                   help="instead: each variant's backward on fresh allocations (by_allocation)")
    args = p.parse_args()
    if args.allocations:
        for name in args.variants:
            by_allocation(name)
        return
    gc.callbacks.append(_count)
    B, H, N, D = 2, 16, 8192, 128
    for name in args.variants:
        ours, flex = _ours(name, B, H, N, "cuda"), _flex(name, B, H, N, "cuda")
        shape = Shape(name, B, H, H, N, D, True)
        measure("ours", name, ours, shape)
        measure("ours again", name, ours, shape)
        measure("flex", name, flex, shape)
        measure("ours after flex", name, ours, shape)
        measure("ours again", name, ours, shape)
        measure("flex", name, flex, shape)
        gc.collect()
        measure("ours after flex, gc.collect()", name, ours, shape)
        measure("flex", name, flex, shape)
        gc.disable()
        measure("ours after flex, gc off", name, ours, shape)
        gc.enable()
        q, k, v = _inputs(shape, torch.bfloat16)
        with torch.no_grad():
            print(f"{name:>9} forward, no grad: host / wall us a call "
                  f"{'%.0f / %.0f' % host_us(ours, q, k, v)}")
        print(f"{name:>9} forward, grad:    host / wall us a call "
              f"{'%.0f / %.0f' % host_us(ours, q, k, v)}")
        out = ours(q, k, v, None)
        dout = torch.randn_like(out)

        def bwd(*_):
            out.backward(dout, retain_graph=True)
        print(f"{name:>9} backward:         host / wall us a call "
              f"{'%.0f / %.0f' % host_us(bwd, q, k, v)}")


if __name__ == "__main__":
    main()
