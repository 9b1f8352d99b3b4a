"""Where a decoding step's GPU time goes (the rows at 80-83% of copy, docs/perf.md's plan of
session 26): the step run with timelines (decode.TIMELINE: kernels.common.mark's
%globaltimer at each program's start, after its loop (split kernel) or its wait (merge
kernel), after its stores and at its end, and its SM), beside the same step's graph time
without them. Each timed step follows launch.flush_l2 (a clean L2); it is an eager call
(the launchers' path: steps with a timeline are not remembered), so the GPU is idle when it
starts. Per shape, the median over --rounds of: the split kernel's span (first start to last
end), the programs' start skew (mean and last), loop and stores (mean), the merging
program's tail after its stores (in-kernel merge), the SMs used, the merge kernel's start
after the split kernel's end (negative: launched early, PDL), its wait and span; GB/s of K
and V over the split kernel's span and over the graph's time. The timer's tick (the
smallest nonzero gap between two programs' starts) bounds the resolution.

    PYTHONPATH=. python scripts/probe_decode_timeline.py [--shapes 1x65536 8x8192 64x1024] [--paged]
"""
import argparse
import statistics

import torch
from triton.runtime import driver

from flashtriton import decode, launch
from flashtriton.bench import _graph, cold_ms, decode_bytes, decode_inputs
from flashtriton.decode import attention_with_kvcache


def phases(split, merge):
    """One timed step's numbers (us) from the split and merge kernels' tables (int64 ns)."""
    start, loop, stores, end, sms = (split[:, i] for i in range(5))
    t0 = int(start.min())
    out = dict(span=(int(end.max()) - t0) / 1e3,
               skew=float((start - t0).float().mean()) / 1e3,
               last_start=(int(start.max()) - t0) / 1e3,
               loop=float((loop - start).float().mean()) / 1e3,
               stores=float((stores - loop).float().mean()) / 1e3,
               tail=int((end - stores).max()) / 1e3,
               sms=len(set(sms.tolist())))
    starts = start.sort().values
    gaps = starts[1:] - starts[:-1]
    gaps = gaps[gaps > 0]
    out["tick"] = int(gaps.min()) / 1e3 if len(gaps) else float("nan")
    if merge is not None:
        m_start, m_wait, _, m_end, _ = (merge[:, i] for i in range(5))
        out.update(m_gap=(int(m_start.min()) - int(end.max())) / 1e3,
                   m_wait=float((m_wait - m_start).float().mean()) / 1e3,
                   m_span=(int(m_end.max()) - int(m_start.min())) / 1e3)
    return out


def probe(B, N, rounds, paged=False):
    q, kc, vc, kp, vp, table, lens = decode_inputs(B, N)
    kc, vc, table = (kp, vp, table) if paged else (kc, vc, None)
    step = lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens,  # noqa: E731
                                          block_table=table, return_lse=False)
    for _ in range(3):
        step()
    graph_us = cold_ms(_graph(step).replay) * 1e3
    run_decode, run_merge, mode, _ = launch.recall(decode.step_signature(
        q, kc, vc, lens, table, return_lse=False))
    programs = run_decode.grid[0] * run_decode.grid[1]
    merges = run_merge.grid[0] if mode == 1 else 0
    tables = (torch.zeros(programs, 5, dtype=torch.int64, device="cuda"),
              torch.zeros(max(1, merges), 5, dtype=torch.int64, device="cuda"))
    cache = driver.active.get_empty_cache_for_benchmark()
    runs = []
    decode.TIMELINE = tables
    try:
        for _ in range(rounds + 1):  # the first compiles the timed kernels
            launch.flush_l2(cache)
            step()
            torch.cuda.synchronize()
            runs.append(phases(tables[0].cpu(), tables[1].cpu() if merges else None))
    finally:
        decode.TIMELINE = None
    median = {k: statistics.median(r[k] for r in runs[1:]) for k in runs[1]}
    nbytes = decode_bytes(B, N)
    return dict(median, mode=mode, splits=run_decode.grid[0], programs=programs, graph=graph_us,
                span_gbps=nbytes / median["span"] * 1e-3, graph_gbps=nbytes / graph_us * 1e-3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["1x65536", "8x8192", "64x1024"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--paged", action="store_true", help="16-token pages, shuffled")
    args = parser.parse_args()
    cols = ["mode", "splits", "programs", "sms", "graph", "span", "skew", "last_start", "loop",
            "stores", "tail", "m_gap", "m_wait", "m_span", "tick", "span_gbps", "graph_gbps"]
    print("us unless named; mode 0 one split, 1 merge kernel, 2 merged in the split kernel")
    print(f"{'B':>3s} {'N':>6s} " + " ".join(f"{c:>10s}" for c in cols))
    for B, N in [map(int, shape.split("x")) for shape in args.shapes]:
        r = probe(B, N, args.rounds, args.paged)
        cells = [f"{r[c]:10.2f}" if isinstance(r.get(c), float) else f"{r.get(c, '-'):>10}"
                 for c in cols]
        print(f"{B:3d} {N:6d} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
