"""Host time of the Gluon backward's launch path (launch.attention_backward in the main
thread, where cProfile sees it) for bench_variants' window and document variants and plain
causal attention at 8K: microseconds a call (no synchronisation in the loop), then a
cProfile by own time.

    python scripts/probe_gluon_bwd_host.py [--variants window document causal]
"""
import argparse
import cProfile
import pstats
import time

import torch

from flashtriton import launch
from flashtriton.bench_variants import _document_mod
from flashtriton.block_mask import create_block_mask


def variant(name, N, q):
    if name == "document":
        bm = create_block_mask(_document_mod, None, None, N, N, "cuda")
        return launch._gluon_variant(q, False, None, (-1, -1), 0.0, None, bm)
    window = (1023, 0) if name == "window" else (-1, -1)
    return launch._gluon_variant(q, True, None, window, 0.0, None, None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", default=["window", "document", "causal"])
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    B, N, H, D = 2, 8192, 16, 128
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    for name in args.variants:
        var = variant(name, N, q)
        out, lse = launch.attention_forward(q, k, v, var)
        run = lambda: launch.attention_backward(dout, q, k, v, out, lse, var)  # noqa: E731
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.calls):
            run()
        host = (time.perf_counter() - t) / args.calls * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / args.calls * 1e6
        print(f"== {name}: host {host:.0f} us a call, wall {wall:.0f}", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            run()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
