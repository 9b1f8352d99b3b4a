"""Where a Gluon backward program's time goes (H200 investigation of short walks): the kernel
run with a timeline (launch.attention_backward_gluon's _timeline; kernels.gluon_bwd._mark:
%globaltimer at the program's start, K and V's arrival, each consumer's end of walk and of
dK / dV stores, the producer's last reduction; and the SM), then per program the mean of
each phase, and per SM the gap between one program's end and the next one's start. Then
the steps (gluon_bwd._mark_step: %clock64 at TL_MARKS points of each consumer's first
TL_STEPS steps, in each of its warps): the mean SM cycles of each part of a step, a column a
warp, over the steps that are neither a walk's first nor its last.

    python scripts/probe_timeline.py [--cases window dense causal] [--set ONE_LOOP=1]
"""
import argparse

import torch
import triton

from flashtriton import launch
from flashtriton.bench_variants import set_gluon_options
from flashtriton.kernels import gluon_bwd

CASES = {  # name: (B, N, the backward's options); H = 16, D = 128, bf16
    "window": (2, 8192, dict(causal=True, window_size=(1023, 0))),
    "dense": (16, 1024, {}),
    "dense8k": (2, 8192, {}),
    "causal": (2, 8192, dict(causal=True)),
    "document": (2, 8192, "document"),  # bench_variants' documents of 2048 tokens
}


def case_options(name, N):
    """The case's attention options (a block mask built here for the document case)."""
    opts = CASES[name][2]
    if opts == "document":
        from flashtriton.bench_variants import _document_mod
        from flashtriton.block_mask import create_block_mask
        return dict(block_mask=create_block_mask(_document_mod, None, None, N, N, "cuda"))
    return opts


def phases(tl):
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=sorted(CASES))
    p.add_argument("--set", nargs="+", default=[], metavar="NAME=V",
                   help="Gluon kernel options (bench_variants.set_gluon_options)")
    args = p.parse_args()
    try:
        set_gluon_options(args.set)
    except ValueError as e:
        p.error(str(e))
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
        us, span, busy = phases(tl.cpu())
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


if __name__ == "__main__":
    main()
