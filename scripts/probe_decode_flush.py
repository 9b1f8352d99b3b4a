"""Does do_bench's L2 flush charge the decoding step for write-backs? (docs/perf.md, session 26)

do_bench clears the L2 before each timed call by zeroing a 256 MB buffer: the H200's 50 MB of
L2 are left full of dirty lines, which the next kernel's reads evict, so the DRAM also writes
up to 50 MB during the timed call. A decoding step of 268 MB then moves up to 318. This times
the same CUDA graphs (ours, SDPA's, a plain Triton read of the same bytes, a copy of the same
bytes) after three flushes: do_bench's zeroing ("dirty"), the zeroing followed by a read of
another 256 MB buffer ("clean": the L2 holds clean lines of that buffer, nothing to write
back), and none ("warm"). Median of --reps replays each; GB/s of K and V (the read kernel:
of its bytes; the copy: read plus written) and % of do_bench's 2 GB copy.

    PYTHONPATH=. python scripts/probe_decode_flush.py [--shapes 1x65536 8x8192 64x1024]
"""
import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashtriton.bench import _graph, copy_bandwidth_gbps, decode_bytes, decode_inputs
from flashtriton.decode import attention_with_kvcache


@triton.jit
def _read(x_ptr, out_ptr, n, per_program, BLOCK: tl.constexpr):
    """Sums each program's contiguous run of x (the bytes a read-only kernel streams)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    start = pid * per_program
    for off in range(start, start + per_program, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def read_fn(x, programs):
    n = x.numel()
    per = triton.cdiv(triton.cdiv(n, programs), 4096) * 4096
    out = torch.empty(programs, device=x.device, dtype=torch.float32)
    return lambda: _read[(programs,)](x, out, n, per, BLOCK=4096, num_warps=8)


def timed(fn, flush, reps):
    graph = _graph(fn)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["1x65536", "8x8192", "64x1024"])
    p.add_argument("--reps", type=int, default=100)
    args = p.parse_args()
    copy = copy_bandwidth_gbps()
    big = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    other = torch.ones(128 << 20, dtype=torch.bfloat16, device="cuda")
    flushes = {"dirty": big.zero_,
               "clean": lambda: (big.zero_(), other.sum(dtype=torch.float32)),
               "warm": lambda: None}
    print(f"copy (do_bench, 2 GB) {copy:.0f} GB/s; GB/s (% of copy) by flush")
    print(f"{'B':>3s} {'N':>6s} {'way':>12s} " + " ".join(f"{f:>14s}" for f in flushes))
    for B, N in [map(int, s.split("x")) for s in args.shapes]:
        q, kc, vc, _, _, _, lens = decode_inputs(B, N)
        nbytes = decode_bytes(B, N)
        qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
        half = flat[: flat.numel() // 2]
        dst = torch.empty_like(half)
        ways = {
            "flashtriton": (lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                           return_lse=False), nbytes),
            "sdpa": (lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True), nbytes),
            "read": (read_fn(flat, 132 * 4), nbytes),
            "copy": (lambda: dst.copy_(half), nbytes),  # half read, half written
        }
        for name, (fn, nb) in ways.items():
            cells = []
            for flush in flushes.values():
                ms = timed(fn, flush, args.reps)
                gbps = nb / ms * 1e-6
                cells.append(f"{gbps:6.0f} ({100 * gbps / copy:3.0f}%)")
            print(f"{B:3d} {N:6d} {name:>12s} " + " ".join(f"{c:>14s}" for c in cells),
                  flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
