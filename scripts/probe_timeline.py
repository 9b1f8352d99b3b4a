"""Where a Gluon backward program's time goes (H200 investigation of short walks): the kernel
run with a timeline (launch.attention_backward_gluon's _timeline; kernels.gluon_bwd._mark:
%globaltimer at the program's start, K and V's arrival, each consumer's end of walk and of
dK / dV stores, the producer's last reduction; and the SM), then per program the mean of
each phase, and per SM the gap between one program's end and the next one's start.

    python scripts/probe_timeline.py [--cases window dense causal] [--set ONE_LOOP=1]
"""
import argparse

import torch

from flashtriton import launch
from flashtriton.bench_variants import set_gluon_option

CASES = {  # name: (B, N, causal, window_size); H = 16, D = 128, bf16
    "window": (2, 8192, True, (1023, 0)),
    "dense": (16, 1024, False, (-1, -1)),
    "dense8k": (2, 8192, False, (-1, -1)),
    "causal": (2, 8192, True, (-1, -1)),
}


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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=sorted(CASES))
    p.add_argument("--set", nargs="+", default=[], metavar="NAME=V",
                   help="Gluon kernel options (bench_variants.set_gluon_option)")
    args = p.parse_args()
    for item in args.set:
        name, _, value = item.partition("=")
        if not set_gluon_option(name, value):
            p.error(f"no Gluon option {name}")
    H, D = 16, 128
    for name in args.cases:
        B, N, causal, win = CASES[name]
        q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        out, lse = launch.attention_forward_gluon(q, k, v, causal=causal, window_size=win)
        tl = torch.zeros(-(-N // 128) * B * H, 8, dtype=torch.int64, device="cuda")
        for _ in range(3):
            launch.attention_backward_gluon(do, q, k, v, out, lse, causal=causal,
                                            window_size=win, _timeline=tl)
        torch.cuda.synchronize()
        us, span, busy = phases(tl.cpu())
        print(f"== {name}: B={B} N={N} causal={causal} window={win}, {tl.shape[0]} programs; "
              f"kernel span {span:.1f} us, busy per SM {busy:.1f} us")
        for k_, v_ in us.items():
            print(f"   {k_:42s} {v_:8.2f} us")


if __name__ == "__main__":
    main()
