"""Per-program timelines of flashtriton's kernels, from the library's timing-only marks (the
kernels' TL arguments; %globaltimer and %clock64 written by the programs). Needs a GPU.

    python tools/timeline.py backward [--cases window dense causal] [--set ONE_LOOP=1]
    python tools/timeline.py decode [--shapes 1x65536 8x8192 64x1024] [--paged] [--rounds 5]

backward: where a Gluon backward program's time goes. The kernel run with a timeline
(launch.attention_backward_gluon's _timeline; kernels.gluon.bwd._mark: %globaltimer at the
program's start, K and V's arrival, each consumer's end of walk and of dK / dV stores, the
producer's last reduction; and the SM), then per program the mean of each phase, and per SM
the gap between one program's end and the next one's start. Then the steps
(kernels.gluon.bwd._mark_step: %clock64 at TL_MARKS points of each consumer's first TL_STEPS steps, in
each of its warps): the mean SM cycles of each part of a step, a column a warp, over the steps
that are neither a walk's first nor its last.

decode: where a decoding step's GPU time goes. The step run with timelines
(flashtriton.launch.decode.TIMELINE: kernels.common.mark's %globaltimer at each program's
start, after its loop (split kernel) or its wait (merge kernel), after its stores and at its
end, and its SM), beside the same step's graph time without them. Each timed step follows
runtime.flush_l2 (a clean L2); it is an eager call (the launchers' path: steps with a
timeline are not remembered), so the GPU is idle when it starts. Per shape, the median over
--rounds of: the split kernel's span (first start to last end), the programs' start skew (mean
and last), loop and stores (mean), the merging program's tail after its stores (in-kernel
merge), the SMs used, the merge kernel's start after the split kernel's end (negative:
launched early, PDL), its wait and span; GB/s of K and V over the split kernel's span and over
the graph's time. The timer's tick (the smallest nonzero gap between two programs' starts)
bounds the resolution.
"""
import argparse
import statistics

import torch
import triton
from triton.runtime import driver

from flashtriton import decode, launch
from flashtriton.launch import decode as decode_launch
from flashtriton.launch import decode_replay
from flashtriton.bench import decode_bytes
from flashtriton.bench.common import cold_ms, cuda_graph
from flashtriton.bench.decode import decode_inputs
from flashtriton.bench.variants import set_gluon_options
from flashtriton.decode import attention_with_kvcache
from flashtriton.kernels.gluon import bwd as gluon_bwd


# The Gluon backward's timeline

CASES = {  # name: (B, N, the backward's options); H = 16, D = 128, bf16
    "window": (2, 8192, dict(causal=True, window_size=(1023, 0))),
    "dense": (16, 1024, {}),
    "dense8k": (2, 8192, {}),
    "causal": (2, 8192, dict(causal=True)),
    "document": (2, 8192, "document"),  # bench.variants' documents of 2048 tokens
}


def case_options(name, N):
    """The case's attention options (a block mask built here for the document case)."""
    opts = CASES[name][2]
    if opts == "document":
        from flashtriton.bench.variants import _document_mod
        from flashtriton.block_mask import create_block_mask
        return dict(block_mask=create_block_mask(_document_mod, None, None, N, N, "cuda"))
    return opts


def backward_phases(tl):
    """Mean microseconds of each phase over the programs, the per-SM gaps, and the span."""
    tl = tl.double()
    start, kv, walk0, st0, walk1, drain, st1 = (tl[:, i] for i in (0, 2, 3, 4, 5, 6, 7))
    end = torch.stack([st0, st1, drain], 1).max(1).values
    us = {"start -> K/V landed": (kv - start).mean(),
          "K/V -> walk done (consumer 0)": (walk0 - kv).mean(),
          "walk done, consumer 1 - 0": (walk1 - walk0).mean(),
          "walk -> dK/dV issued (consumer 0)": (st0 - walk0).mean(),
          "walk -> last reduction read (producer)": (drain - torch.maximum(walk0, walk1)).mean(),
          "program (start -> end)": (end - start).mean()}
    gaps = []
    sm = tl[:, 1].long()
    for s in sm.unique():
        idx = (sm == s).nonzero().flatten()
        order = idx[start[idx].argsort()]
        gaps.append(start[order[1:]] - end[order[:-1]])
    gaps = torch.cat(gaps)
    us["SM idle between programs (mean)"] = gaps.mean()
    us["SM idle between programs (median)"] = gaps.median()
    span = end.max() - start.min()
    busy = (end - start).sum() / sm.unique().numel()
    return {k: float(v) / 1e3 for k, v in us.items()}, float(span) / 1e3, float(busy) / 1e3


# The parts of a step, between _mark_step's marks k - 1 and k (k = 1 .. TL_MARKS - 1), then
# the whole. (Without EARLY_S the next S^T is the next step's own: parts 7, 8 and 12 are ~0.)
STEP_PARTS = ["start -> dS^T formed, dK issued", "-> dS^T stored, fenced",
              "-> the group's warps met, arrived", "-> both groups' dS^T in (ds_ready)",
              "-> dQ's product issued", "-> the step's products complete",
              "-> next Q / dO landed", "-> next S^T issued", "-> dQ staging slot free",
              "-> dQ stored, fenced", "-> the group's warps met, dQ staged",
              "-> next S^T complete"]


def step_parts(tl):
    """Mean SM cycles of each part of a step (STEP_PARTS, then the whole) in a column a warp:
    consumer 0's warps, then consumer 1's (steps 1 .. TL_STEPS - 2 that the walk continues
    past); the number of consumer 0's steps counted; and the SM cycles per ns (the median
    over programs whose walks fit in TL_STEPS: consumer 0's warp 0's cycles against the
    walk's %globaltimer ns)."""
    steps = gluon_bwd.TL_STEPS.value
    last = gluon_bwd.TL_MARKS.value - 1
    warps = gluon_bwd.TL_WARPS.value
    # program, step, consumer, mark, warp
    marks = tl[:, 8:].view(-1, steps, 2, last + 1, warps).double()
    seen = marks[..., 0, 0] != 0
    out, counted = [], 0
    for w in range(2):
        ok = seen[:, 1:-1, w] & seen[:, 2:, w]
        for warp in range(warps):
            m = marks[:, 1:-1, w, :, warp]
            rows = torch.cat([m[..., 1:] - m[..., :-1],
                              (marks[:, 2:, w, 0, warp] - m[..., 0])[..., None]], -1)
            out.append(rows[ok].mean(0))
        if w == 0:
            counted = int(ok.sum())
    n = seen[:, :, 0].sum(1)
    fits = (n > 1) & (n < steps)
    rows = torch.arange(tl.shape[0])[fits]
    cyc = marks[rows, n[fits] - 1, 0, last, 0] - marks[rows, 0, 0, 0, 0]
    ns = (tl[fits, 3] - tl[fits, 2]).double()
    rate = float((cyc / ns).median()) if fits.any() else float("nan")
    return out, counted, rate


def backward(args):
    H, D = 16, 128
    for name in args.cases:
        B, N, _ = CASES[name]
        opts = case_options(name, N)
        q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        out, lse = launch.attention_forward_gluon(q, k, v, **opts)
        tl = torch.zeros(-(-N // 128) * B * H, gluon_bwd.TL_ROW.value, dtype=torch.int64,
                         device="cuda")
        for _ in range(3):
            launch.attention_backward_gluon(do, q, k, v, out, lse, **opts, _timeline=tl)
        torch.cuda.synchronize()
        us, span, busy = backward_phases(tl.cpu())
        calls = [triton.testing.do_bench(lambda: launch.attention_backward_gluon(
            do, q, k, v, out, lse, **opts, _timeline=t), warmup=10, rep=50) * 1e3
            for t in (None, torch.zeros_like(tl))]
        print(f"== {name}: B={B} N={N} {CASES[name][2]}, {tl.shape[0]} programs; "
              f"kernel span {span:.1f} us, busy per SM {busy:.1f} us; the backward's call "
              f"{calls[0]:.1f} us, with the marks {calls[1]:.1f}")
        for k_, v_ in us.items():
            print(f"   {k_:42s} {v_:8.2f} us")
        parts, counted, rate = step_parts(tl.cpu())
        print(f"   a step's parts, SM cycles (consumer 0's warps 0-3, then consumer 1's; "
              f"{counted} steps of consumer 0; {rate:.2f} cycles a ns)")
        for i, part in enumerate(STEP_PARTS + ["the step"]):
            print(f"   {part:36s}" + "".join(f"{float(c[i]):6.0f}" for c in parts))


# The decoding step's timelines

def decode_phases(split, merge):
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


def decode_probe(B, N, rounds, paged=False):
    from flashtriton import runtime
    q, kc, vc, kp, vp, table, lens = decode_inputs(B, N)
    kc, vc, table = (kp, vp, table) if paged else (kc, vc, None)
    step = lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens,  # noqa: E731
                                          block_table=table, return_lse=False)
    for _ in range(3):
        step()
    graph_us = cold_ms(cuda_graph(step).replay) * 1e3
    known = decode_replay.remembered(decode.step_signature(q, kc, vc, lens, table,
                                                           return_lse=False))
    programs = known.run_decode.grid[0] * known.run_decode.grid[1]
    merges = known.run_merge.grid[0] if known.mode == "merge" else 0
    tables = (torch.zeros(programs, 5, dtype=torch.int64, device="cuda"),
              torch.zeros(max(1, merges), 5, dtype=torch.int64, device="cuda"))
    cache = driver.active.get_empty_cache_for_benchmark()
    runs = []
    decode_launch.TIMELINE = tables
    try:
        for _ in range(rounds + 1):  # the first compiles the timed kernels
            runtime.flush_l2(cache)
            step()
            torch.cuda.synchronize()
            runs.append(decode_phases(tables[0].cpu(), tables[1].cpu() if merges else None))
    finally:
        decode_launch.TIMELINE = None
    median = {k: statistics.median(r[k] for r in runs[1:]) for k in runs[1]}
    nbytes = decode_bytes(B, N)
    return dict(median, mode=known.mode, splits=known.run_decode.grid[0], programs=programs,
                graph=graph_us, span_gbps=nbytes / median["span"] * 1e-3,
                graph_gbps=nbytes / graph_us * 1e-3)


def decode_steps(args):
    cols = ["mode", "splits", "programs", "sms", "graph", "span", "skew", "last_start", "loop",
            "stores", "tail", "m_gap", "m_wait", "m_span", "tick", "span_gbps", "graph_gbps"]
    print("us unless named; mode: one (one split), merge (the merge kernel), in-kernel (merged "
          "in the split kernel)")
    print(f"{'B':>3s} {'N':>6s} " + " ".join(f"{c:>10s}" for c in cols))
    for B, N in [map(int, shape.split("x")) for shape in args.shapes]:
        r = decode_probe(B, N, args.rounds, args.paged)
        cells = [f"{r[c]:10.2f}" if isinstance(r.get(c), float) else f"{r.get(c, '-'):>10}"
                 for c in cols]
        print(f"{B:3d} {N:6d} " + " ".join(cells), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="kernel", required=True)
    b = sub.add_parser("backward", help="the Gluon backward's programs and steps")
    b.add_argument("--cases", nargs="+", default=list(CASES), choices=sorted(CASES))
    b.add_argument("--set", nargs="+", default=[], metavar="NAME=V",
                   help="Gluon kernel options (bench.variants.set_gluon_options)")
    d = sub.add_parser("decode", help="the decoding step's split and merge kernels")
    d.add_argument("--shapes", nargs="+", default=["1x65536", "8x8192", "64x1024"])
    d.add_argument("--rounds", type=int, default=5)
    d.add_argument("--paged", action="store_true", help="16-token pages, shuffled")
    args = p.parse_args(argv)
    if args.kernel == "backward":
        try:
            set_gluon_options(args.set)
        except ValueError as e:
            p.error(str(e))
        backward(args)
    else:
        decode_steps(args)


if __name__ == "__main__":
    main()
