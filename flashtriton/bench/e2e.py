"""End to end: a randomly initialised transformers Llama trained and generating with
``attn_implementation="sdpa"`` against flashtriton's (``triton_fa``,
flashtriton.integrations.transformers) in one process, and the diffusion models' attention
shapes against torch SDPA's backends and FlexAttention.

    python -m flashtriton.bench.e2e [--out DIR] [--parts train generate diffusion]
        [--dims 64 128] [--layers 8] [--hidden 2048] [--train-shapes 2x4096 1x16384]
        [--gen-batches 1 8] [--prompts 512 8192] [--new-tokens 128]

train: LlamaForCausalLM (--layers, --hidden, head dims --dims, a quarter as many KV heads as
query heads, bf16, AdamW) training steps (forward, loss, backward, optimizer step) at each
batch x seqlen of --train-shapes: tokens/s (median of 5 steps after 2), the peak memory of a
step above the model and optimizer state, and which SDPA backend the sdpa model's steps ran
(its kernels' names under the profiler). generate: greedy ``generate()`` of --new-tokens after
prompts of each of --prompts tokens (from configs.DENSE_SPLIT_MIN_KEYS keys flashtriton's
decoding steps run the split-KV kernel, configs.dense_split) at each of --gen-batches:
tokens/s, ms a token (and ms a token of a second pass over the same key lengths), the share
of the wall time the GPU was busy (profiler: the kernels' time over the wall time), which
tells a host-bound loop from a GPU-bound one, and how many of its first 4 tokens equal the
sdpa model's. Each model's logits on the first batch are checked against the sdpa model's
(same weights; MODEL_TOLERANCE) before any timing; a failed check reports no speed.
diffusion: forward attention of SDXL's self- and cross-attention (2 x 10 heads of 64, 4096
queries over 4096 or 77 keys) and FLUX's joint attention (24 heads of 128, 4608 tokens),
each provider checked against flashtriton.reference first: TFLOP/s (4 * B * H * SQ * SK * D).
Rows go to e2e.jsonl in --out, a table to stdout.
"""

import itertools
import json
import os
import statistics
import time

import torch

from . import common
from .common import TOLERANCE, expected, failed, meta as run_meta, rel_err

IMPLS = ("sdpa", "triton_fa")
# The largest relative error (norm) of a bf16 model's logits against the sdpa model's: two
# bf16 attentions through 8 layers; a wrong mask or layout is off by ~1.
MODEL_TOLERANCE = 5e-2
DIFFUSION = [  # (name, B, H, SQ, SK, D)
    ("SDXL self-attention", 2, 10, 4096, 4096, 64),
    ("SDXL cross-attention", 2, 10, 4096, 77, 64),
    ("FLUX joint attention", 1, 24, 4608, 4608, 128),
]
DIFFUSION_PROVIDERS = ("flashtriton", "sdpa_cudnn", "sdpa_flash", "flex")


def llama(impl: str, head_dim: int, layers: int, hidden: int, vocab: int, dtype, device,
          seed: int = 0):
    """A randomly initialised LlamaForCausalLM (the same weights for every ``impl``)."""
    import transformers
    from flashtriton.integrations.transformers import register
    register()
    heads = hidden // head_dim
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4), head_dim=head_dim,
        max_position_embeddings=1 << 17)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(device, dtype)
    model.set_attn_implementation(impl)
    return model


def sdpa_backends(run) -> str:
    """Which SDPA backends ``run()`` launched, from its CUDA kernels' names under the profiler
    ("math" where no fused attention kernel ran)."""
    if not torch.cuda.is_available():
        return "n/a (no GPU)"
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = {e.key.lower() for e in prof.key_averages()}
    found = [name for name, marks in (("cudnn", ("cudnn", "fort_native_sdpa")),
                                      ("flash", ("flash_fwd", "flash_bwd", "pytorch_flash")),
                                      ("efficient", ("fmha_cutlass", "efficient_attention")))
             if any(m in n for n in names for m in marks)]
    return "+".join(found) or "math"


def gpu_busy(run) -> float:
    """The share of ``run()``'s wall time that the GPU spent in kernels (profiler)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    busy_us = sum(e.self_device_time_total for e in prof.key_averages())
    return busy_us * 1e-6 / wall


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train_rows(args, meta, device="cuda", dtype=torch.bfloat16, timed=True):
    """One row per head dim, shape and implementation."""
    rows = []
    for D in args.dims:
        for shape in args.train_shapes:
            B, N = (int(x) for x in shape.split("x"))
            ids = torch.randint(0, args.vocab, (B, N), device=device,
                                generator=torch.Generator(device).manual_seed(1))
            ref_logits = None
            for impl in IMPLS:
                row = dict(meta, part="train", impl=impl, D=D, B=B, N=N, layers=args.layers,
                           hidden=args.hidden)
                model = opt = None
                try:
                    model = llama(impl, D, args.layers, args.hidden, args.vocab, dtype, device)
                    with torch.no_grad():
                        logits = model(ids[:1, :min(N, 2048)]).logits.float()
                    if ref_logits is None:
                        ref_logits = logits
                    row["rel_err_vs_sdpa"] = err = rel_err(logits, ref_logits)
                    row["status"] = failed(err, MODEL_TOLERANCE)
                    del logits
                    if row["status"] or not timed:
                        row["status"] = row["status"] or "checked"
                        rows.append(row)
                        continue
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

                    def step():
                        loss = model(ids, labels=ids).loss
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)

                    for _ in range(2):
                        step()
                    _sync(device)
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    times = []
                    for _ in range(5):
                        t = time.perf_counter()
                        step()
                        _sync(device)
                        times.append(time.perf_counter() - t)
                    peak = torch.cuda.max_memory_allocated()
                    ms = statistics.median(times) * 1e3
                    row.update(status="ok", step_ms=ms, tokens_per_s=B * N / ms * 1e3,
                               peak_step_MiB=(peak - base) / 2**20,
                               peak_total_MiB=peak / 2**20)
                    if impl == "sdpa":
                        row["sdpa_backend"] = sdpa_backends(step)
                except torch.cuda.OutOfMemoryError:
                    row["status"] = "out of memory"
                rows.append(row)
                print(_line(row), flush=True)
                model = opt = None  # free them before the next model
                if device == "cuda":
                    torch.cuda.empty_cache()
    return rows


def generate_rows(args, meta, device="cuda", dtype=torch.bfloat16, timed=True):
    """One row per head dim, batch and implementation."""
    rows = []
    for D, B, prompt in itertools.product(args.dims, args.gen_batches, args.prompts):
        # no token 0: generate() takes pad_token_id=0 tokens for padding (a mask: another path)
        ids = torch.randint(1, args.vocab, (B, prompt), device=device,
                            generator=torch.Generator(device).manual_seed(2))
        ref = ref_tokens = None
        for impl in IMPLS:
            row = dict(meta, part="generate", impl=impl, D=D, B=B, prompt=prompt,
                       new_tokens=args.new_tokens, layers=args.layers, hidden=args.hidden)
            model = llama(impl, D, args.layers, args.hidden, args.vocab, dtype,
                          device).eval()
            try:
                with torch.no_grad():
                    logits = model(ids, logits_to_keep=1).logits[:, -1].float()

                    def gen(n=args.new_tokens):
                        return model.generate(ids, attention_mask=torch.ones_like(ids),
                                              max_new_tokens=n, min_new_tokens=n,
                                              do_sample=False, pad_token_id=0)
                    # the first calls (compilation) outside the timing; the tokens
                    # against the sdpa model's (bf16 greedy decoding may part on near ties)
                    tokens = gen(4)[:, prompt:]
                    if ref is None:
                        ref, ref_tokens = logits, tokens
                    row["rel_err_vs_sdpa"] = err = rel_err(logits, ref)
                    row["same_tokens_as_sdpa"] = float((tokens == ref_tokens).float().mean())
                    row["status"] = failed(err, MODEL_TOLERANCE)
                    if row["status"] or not timed:
                        row["status"] = row["status"] or "checked"
                        rows.append(row)
                        continue
                    # twice: the first pass meets each key length for the first time
                    # (SDPA's cuDNN backend builds a plan per new shape), the second
                    # repeats them
                    passes = []
                    for _ in range(2):
                        _sync(device)
                        t = time.perf_counter()
                        gen()
                        _sync(device)
                        passes.append(time.perf_counter() - t)
                    s = passes[0]
                    row.update(status="ok", tokens_per_s=B * args.new_tokens / s,
                               ms_per_token=s / args.new_tokens * 1e3,
                               ms_per_token_again=passes[1] / args.new_tokens * 1e3,
                               gpu_busy=gpu_busy(lambda: gen(16)))
                    if impl == "sdpa":
                        row["sdpa_backend"] = sdpa_backends(lambda: gen(2))
            except torch.cuda.OutOfMemoryError:
                row["status"] = "out of memory"
            rows.append(row)
            print(_line(row), flush=True)
            model = None  # free it before the next model
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def diffusion_rows(meta, device="cuda", dtype=torch.bfloat16, shapes=DIFFUSION,
                   providers=DIFFUSION_PROVIDERS, timed=True):
    """One row per diffusion shape and provider (forward only, no mask)."""
    import triton
    from . import PROVIDERS
    rows = []
    for name, B, H, SQ, SK, D in shapes:
        gen = torch.Generator(device).manual_seed(3)
        q = torch.randn(B, H, SQ, D, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(B, H, SK, D, device=device, dtype=dtype, generator=gen)
                for _ in range(2))
        ref = expected(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
        for prov in providers:
            row = dict(meta, part="diffusion", shape=name, provider=prov, B=B, H=H, SQ=SQ,
                       SK=SK, D=D)
            try:
                fn = PROVIDERS[prov]
                row["rel_err"] = err = rel_err(fn(q, k, v, False), ref)
                row["status"] = failed(err, TOLERANCE)
                if not row["status"] and timed:
                    ms = triton.testing.do_bench(lambda: fn(q, k, v, False), warmup=25,
                                                 rep=200, return_mode="median")
                    row.update(status="ok", fwd_ms=ms,
                               fwd_tflops=4 * B * H * SQ * SK * D / ms * 1e-9)
                row["status"] = row["status"] or "checked"
            except Exception as e:  # a provider that cannot run the shape
                row["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _line(r) -> str:
    if r["part"] == "diffusion":
        head = f"{r['shape']:22s} {r['provider']:12s}"
        body = f"{r['fwd_tflops']:6.1f} TFLOP/s" if r["status"] == "ok" else r["status"]
        return f"{head} {body}"
    head = (f"{r['part']:8s} D={r['D']} B={r['B']} "
            + (f"N={r['N']}" if r["part"] == "train" else f"prompt={r['prompt']}")
            + f" {r['impl']:9s}")
    if r["status"] != "ok":
        return f"{head} {r['status']}"
    if r["part"] == "train":
        body = (f"{r['tokens_per_s']:9.0f} tokens/s, step {r['step_ms']:.1f} ms, peak "
                f"{r['peak_step_MiB']:.0f} MiB above the model")
    else:
        body = (f"{r['tokens_per_s']:8.1f} tokens/s, {r['ms_per_token']:.2f} ms a token "
                f"({r['ms_per_token_again']:.2f} over the same lengths again), GPU busy "
                f"{100 * r['gpu_busy']:.0f}%")
    return f"{head} {body}" + (f" (SDPA backend: {r['sdpa_backend']})" if "sdpa_backend" in r
                               else "")


def table(rows) -> str:
    """The rows as markdown: flashtriton against sdpa for each model row (generate: tokens/s
    of the first pass, the second pass's in brackets), TFLOP/s per provider for the
    diffusion shapes."""
    out = []
    models = [r for r in rows if r["part"] in ("train", "generate")]
    keys = sorted({(r["part"], r["D"], r["B"], r.get("N", r.get("prompt"))) for r in models})
    if keys:
        out += ["| part | D | B | N / prompt | sdpa (backend) | flashtriton | speed-up | peak "
                "MiB sdpa / flashtriton |", "|---|---|---|---|---|---|---|---|"]
    for part, D, B, N in keys:
        got = {r["impl"]: r for r in models
               if (r["part"], r["D"], r["B"], r.get("N", r.get("prompt"))) == (part, D, B, N)}
        s, f = got.get("sdpa", {}), got.get("triton_fa", {})
        def cell(r):
            if r.get("status") != "ok":
                return r.get("status", "")[:30]
            if "ms_per_token_again" not in r:
                return f"{r['tokens_per_s']:.0f}"
            return f"{r['tokens_per_s']:.0f} ({r['B'] * 1e3 / r['ms_per_token_again']:.0f} again)"
        both = s.get("status") == f.get("status") == "ok"
        mem = (f"{s['peak_step_MiB']:.0f} / {f['peak_step_MiB']:.0f}"
               if both and part == "train" else "")
        out.append(f"| {part} | {D} | {B} | {N} | {cell(s)} ({s.get('sdpa_backend', '?')}) | "
                   f"{cell(f)} | {f['tokens_per_s'] / s['tokens_per_s']:.2f}x | {mem} |"
                   if both else f"| {part} | {D} | {B} | {N} | {cell(s)} | {cell(f)} | | |")
    diff = [r for r in rows if r["part"] == "diffusion"]
    if diff:
        provs = list(dict.fromkeys(r["provider"] for r in diff))
        out += ["", "| diffusion shape (forward TFLOP/s) | " + " | ".join(provs) + " |",
                "|---|" + "---|" * len(provs)]
        for name in dict.fromkeys(r["shape"] for r in diff):
            cells = []
            for p in provs:
                r = next(r for r in diff if (r["shape"], r["provider"]) == (name, p))
                cells.append(f"{r['fwd_tflops']:.0f}" if r["status"] == "ok" else r["status"][:30])
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def parser():
    p = common.parser("flashtriton.bench.e2e", __doc__)
    common.add_out(p, "e2e.jsonl")
    p.add_argument("--parts", nargs="+", default=["train", "generate", "diffusion"],
                   choices=["train", "generate", "diffusion"], help="which parts to run")
    p.add_argument("--dims", nargs="+", type=int, default=[64, 128],
                   help="the Llama's head dims, one model each")
    p.add_argument("--layers", type=int, default=8, help="the Llama's decoder layers")
    p.add_argument("--hidden", type=int, default=2048, help="the Llama's hidden size")
    p.add_argument("--vocab", type=int, default=32000, help="the Llama's vocabulary size")
    p.add_argument("--train-shapes", nargs="+", default=["2x4096", "1x16384"],
                   metavar="BxN", help="training steps' batch x sequence length")
    p.add_argument("--gen-batches", nargs="+", type=int, default=[1, 8],
                   help="generate()'s batch sizes")
    p.add_argument("--prompts", nargs="+", type=int, default=[512, 8192],
                   help="generate()'s prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=128,
                   help="tokens generate() produces after each prompt")
    return p


def parse(argv=None):
    return parser().parse_args(argv)


def main(argv=None):
    args = common.script_args(parser(), argv)
    meta, rows = run_meta(), []
    # the diffusion shapes first, before the model parts: after the training and generation
    # parts (and their profiler runs), short calls such as SDXL's 77-key cross-attention time
    # slower than in a fresh process
    if "diffusion" in args.parts:
        rows += diffusion_rows(meta)
    if "train" in args.parts:
        rows += train_rows(args, meta)
    if "generate" in args.parts:
        rows += generate_rows(args, meta)
    with open(os.path.join(args.out, "e2e.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))


if __name__ == "__main__":
    main()
