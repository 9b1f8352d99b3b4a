"""Benchmark suite: flashtriton against torch SDPA backends, FlexAttention, flash-attn and naive
attention (the providers and suites of flashtriton.bench's registry).

    python -m flashtriton.bench                                  # every suite
    python -m flashtriton.bench --dims 128 --seqlens 4096 8192 --causal 1 --suites train
    python -m flashtriton.bench --merge run1/results.jsonl run2/results.jsonl --out all
                                                                 # one table and plots of several runs

Suites (flashtriton.bench.SUITES):
  train     batch * seqlen = --tokens (16K), nheads * headdim = --dmodel (2048), --dims x --seqlens x --causal
  gqa       Llama-3 70B attention: batch 1, 64 query heads, 8 KV heads, headdim 128, causal, --gqa-seqlens
  overhead  host time per call at a tiny shape (no CUDA graphs), each provider
  coldstart seconds of a new shape family's first calls at each of --dims in a fresh process
            with an empty Triton cache, and in a second process sharing that cache: the
            first forward + backward, the first at another length bucket, the slowest
            one-token step of a generation crossing a bucket
  decode    one query token over a KV cache (32 query heads, 8 KV heads, headdim 128, bf16):
            --decode-batches x --decode-lens; GB/s of K and V read and % of the copy
            bandwidth measured in the same run, for eager calls (their kernels) and for the
            step replayed from a CUDA graph (as serving engines run it); flashtriton
            contiguous and paged (16-token pages), in bf16 and over the cache quantised to
            float8_e4m3fn, against torch SDPA with GQA (--decode-providers); GPU time after
            an L2 flush that leaves no dirty lines (cold_ms), the copy too; the host's time
            a step, back to back

Every provider's output (and, in training, its gradients) is checked against
flashtriton.reference before its speed is measured; a row whose check fails says so instead.
For every shape and provider: median times (triton.testing.do_bench) of forward, backward and
forward + backward (in training, the providers measured --rounds times in turn, their order
rotated each round, and the median of the rounds kept), TFLOP/s (forward 4 * B * H * SQ * SK * D, halved when causal; backward 2.5x
that) and the peak extra memory of forward + backward. A shape that runs out of memory is a row
that says so. Writes results.jsonl (row by row), results.csv, results.md and, when matplotlib is
installed, tflops.png and memory.png to --out; the GPU name, versions, commit and date are in
every row.
"""

import json
import os
import sys

import torch

from .. import _env
from . import DECODE_PROVIDERS, PROVIDERS, SUITES, available, shapes
from . import common
from .common import meta as run_meta
from .decode import copy_bandwidth_gbps, run_decode
from .report import merge, report
from .train import COLD_SHAPE_TOKENS, cold_start_s, host_overhead_us, run_shape


def _progress(items):
    try:
        from tqdm import tqdm
        return tqdm(items, desc="bench", file=sys.stdout)
    except ImportError:
        return items


def parser():
    p = common.parser("flashtriton.bench", __doc__)
    p.add_argument("--providers", nargs="+", default=["flashtriton", "sdpa_cudnn", "flex",
                                                      "sdpa_flash", "sdpa_efficient",
                                                      "flash_attn", "naive"],
                   choices=list(PROVIDERS),
                   help="attention implementations to compare (those not installed are left out)")
    p.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES),
                   help="which suites to run (see above)")
    p.add_argument("--decode-batches", nargs="+", type=int, default=[1, 8, 64],
                   help="decode suite: batch sizes")
    p.add_argument("--decode-lens", nargs="+", type=int, default=[1024, 8192, 65536, 131072],
                   help="decode suite: cached keys a sequence")
    p.add_argument("--decode-providers", nargs="+", default=list(DECODE_PROVIDERS),
                   choices=list(DECODE_PROVIDERS), help="decode suite: implementations")
    p.add_argument("--dims", nargs="+", type=int, default=[64, 128, 256],
                   help="train and coldstart suites: head dims")
    p.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384,
                                                                  32768],
                   help="train suite: sequence lengths")
    p.add_argument("--gqa-seqlens", nargs="+", type=int, default=[2048, 8192, 32768],
                   help="gqa suite: sequence lengths")
    p.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1],
                   help="train suite: 0 for full attention, 1 for causal")
    p.add_argument("--tokens", type=int, default=16384,
                   help="train suite: batch x seqlen (the batch is this over the seqlen)")
    p.add_argument("--dmodel", type=int, default=2048,
                   help="train suite: heads x head dim (the heads are this over the head dim)")
    p.add_argument("--rounds", type=int, default=3,
                   help="train and gqa suites: measure the providers this many times, their order "
                        "rotated each round; each figure is the median of its rounds")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="the inputs' dtype")
    common.add_out(p, "results.{jsonl,csv,md} and the plots")
    common.add_commit(p)
    p.add_argument("--merge", nargs="+", metavar="JSONL",
                   help="write the table, CSV and plots of saved runs' results.jsonl (no GPU)")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.merge:
        return merge(args.merge, args.out)
    common.need_gpus(p.prog)
    dtype = getattr(torch, args.dtype)
    providers = [prov for prov in args.providers if available(prov)]
    os.makedirs(args.out, exist_ok=True)
    meta = run_meta(args.commit)
    rows = []
    with open(os.path.join(args.out, "results.jsonl"), "w") as jsonl:  # row by row
        for shape in _progress(shapes(args)):
            for row in run_shape(shape, providers, dtype, meta, rounds=args.rounds):
                rows.append(row)
                jsonl.write(json.dumps(row) + "\n")
                jsonl.flush()
                print(f"{row['provider']:14s} {shape.suite} B={shape.B} H={shape.H}/{shape.HKV} "
                      f"D={shape.D} N={shape.N} causal={int(shape.causal)} "
                      + (f"fwd {row['fwd_tflops']:6.1f} bwd {row['bwd_tflops']:6.1f} TFLOP/s "
                         f"mem {row['peak_extra_MiB']:9.1f} MiB" if row["status"] == "ok"
                         else row["status"])
                      + "".join(f" {k} {v}" for k, v in row.get("tiles", {}).items()),
                      flush=True)
        if "overhead" in args.suites:
            for prov in providers:
                row = dict(meta, provider=prov, suite="overhead")
                try:
                    row.update(host_us=host_overhead_us(PROVIDERS[prov]), status="ok")
                except Exception as e:
                    row["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
                rows.append(row)
                jsonl.write(json.dumps(row) + "\n")
        if "coldstart" in args.suites:
            for D in args.dims:
                row = dict(meta, provider="flashtriton", suite="coldstart", D=D,
                           N=COLD_SHAPE_TOKENS, autotune=_env.AUTOTUNE)
                try:
                    (first, bucket, gen), (first2, bucket2, gen2) = cold_start_s(D)
                    row.update(status="ok", empty_cache_s=first, new_bucket_s=bucket,
                               generate_max_step_s=gen, second_process_s=first2,
                               second_new_bucket_s=bucket2, second_generate_max_step_s=gen2)
                except Exception as e:
                    row["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
                rows.append(row)
                jsonl.write(json.dumps(row) + "\n")
                print(f"coldstart {row}", flush=True)
        if "decode" in args.suites:
            copy = copy_bandwidth_gbps()
            for row in run_decode(args.decode_batches, args.decode_lens, meta, copy,
                                  args.decode_providers):
                row["copy_GBps"] = copy
                rows.append(row)
                jsonl.write(json.dumps(row) + "\n")
                print(f"decode {row['provider']:20s} B={row['B']} N={row['N']} "
                      + (f"{row['decode_GBps']:7.0f} GB/s eager, {row['graph_GBps']:7.0f} GB/s "
                         f"graph ({row['graph_pct_of_copy']:.0f}% of copy), "
                         f"{row['loop_us']:.1f} us per call back to back"
                         if row["status"] == "ok" else row["status"])
                      + "".join(f" {k} {v}" for k, v in row.get("tiles", {}).items()),
                      flush=True)
    report(rows, providers, meta, args.out)



