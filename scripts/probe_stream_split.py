"""Does the Gluon backward gain from running its batch in chunks on several streams? Its prep
kernel (delta, the zeroed fp32 dQ buffer) and dQ's copy are bandwidth-bound and run alone
before and after the compute-bound kernel (~117 us at 8K, docs/perf.md); with the batch in
chunks on their own streams, one chunk's prep or copy can run beside another's kernel (and in
its last wave). Times the whole call, the chunks in turn on one stream, and the chunks on 2
and 4 streams, rounds in rotated order (milliseconds, median of each round's do_bench).

    python scripts/probe_stream_split.py [--rounds 5]
"""
import argparse
import statistics

import torch
import triton

from flashtriton import launch

B, H, N, D = 4, 8, 8192, 128
CASES = {"window": dict(causal=True, window_size=(1023, 0)), "causal": dict(causal=True),
         "alibi": dict(causal=True), "dense": dict(causal=False)}


def _bwd(dout, q, k, v, out, lse, opts):
    return launch.attention_backward_gluon(dout, q, k, v, out, lse, **opts)


def chunked(tensors, opts, parts, streams):
    """The backward of each of `parts` batch chunks, chunk i on streams[i % len] (None: the
    current stream); the current stream waits for all."""
    cur = torch.cuda.current_stream()
    step = B // parts
    grads = []
    for i in range(parts):
        chunk = [t[i * step:(i + 1) * step] for t in tensors]
        s = streams[i % len(streams)] or cur
        if s is not cur:
            s.wait_stream(cur)
        with torch.cuda.stream(s):
            grads.append(_bwd(*chunk, opts))
        if s is not cur:
            for g in grads[-1]:
                g.record_stream(cur)
    for s in streams:
        if s is not None:
            cur.wait_stream(s)
    return [torch.cat(gs) for gs in zip(*grads)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    side = [torch.cuda.Stream() for _ in range(3)]
    forms = {"whole": (1, [None]), "chunks2 1 stream": (2, [None]),
             "chunks2 2 streams": (2, [None, side[0]]),
             "chunks4 2 streams": (4, [None, side[0]]),
             "chunks4 4 streams": (4, [None, *side])}
    print(f"B={B} H={H} N={N} D={D} bf16, ms a backward call (median of {args.rounds} rounds)")
    print(f"{'case':>8} " + " ".join(f"{f:>18}" for f in forms) + "   max|dq - whole|")
    for case in args.cases:
        opts = dict(CASES[case])
        if case == "alibi":
            opts["alibi_slopes"] = torch.rand(H, device="cuda", dtype=torch.float32)
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        out, lse = launch.attention_forward_gluon(q, k, v, **opts)
        dout = torch.randn_like(out)
        tensors = (dout, q, k, v, out, lse)
        ref = chunked(tensors, opts, 1, [None])
        errs = []
        for name, (parts, streams) in forms.items():
            got = chunked(tensors, opts, parts, streams)
            errs.append(max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)))
        times = {f: [] for f in forms}
        names = list(forms)
        for r in range(args.rounds):
            for f in names[r % len(names):] + names[:r % len(names)]:
                parts, streams = forms[f]
                times[f].append(triton.testing.do_bench(
                    lambda: chunked(tensors, opts, parts, streams), warmup=50, rep=300))
        print(f"{case:>8} " + " ".join(f"{statistics.median(times[f]):>18.3f}" for f in forms)
              + f"   {max(errs):.1e}", flush=True)


if __name__ == "__main__":
    main()
