"""Autotune the Triton kernels over a grid of shapes and write what the autotuner chose as a
tuning table (flashtriton.tuning): the tables shipped in flashtriton/tuned/ come from it, and
a user can tune for their own GPU or shapes and load the file with FLASHTRITON_TUNING_FILE.

    python -m flashtriton.bench.tune --out my-gpu.json [--suites train decode generate]
        [--dims 64 128 256] [--seqlens 512 ... 32768] [--merge]

Suites, every call through the public API (so each kernel that a shape runs is tuned, and
the Gluon kernels, whose tiles are fixed, are not): ``train`` forward and backward of
``flash_attention`` (bf16, batch x seqlen = --tokens, heads x head dim = --dmodel, causal and
not); ``varlen`` the same packed (sequences of seqlen, causal); ``generate`` one query token
over --seqlens keys (``flash_attention``, what transformers' generate() calls with a
static-size cache), batch 1 and 8; ``cross`` diffusion cross-attention, --seqlens from 1024
queries over 77, 256 and 512 keys (batch 2, forward and backward); ``decode``
``attention_with_kvcache`` steps (32 query heads over 8 KV heads, contiguous and 16-token
pages, bf16 and fp8 caches) at --decode-batches x --decode-lens. The table is written after
each shape (a run cut short keeps what it tuned); --merge keeps the entries of an existing
--out that this run does not tune again.
"""

import sys
import time

import torch

from .. import _env, tuning
from . import common
from ..api import flash_attention, flash_attention_varlen
from ..decode import attention_with_kvcache

SUITES = ("train", "varlen", "generate", "cross", "decode")
CROSS_KEYS = (77, 256, 512)  # text-encoder key lists of diffusion cross-attention


def _train(D, N, causal, tokens, dmodel, varlen=False):
    B, H = max(1, tokens // N), max(1, dmodel // D)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    if varlen:
        cu = torch.arange(0, B * N + 1, N, device="cuda", dtype=torch.int32)
        out = flash_attention_varlen(*(x.view(B * N, H, D) for x in (q, k, v)), cu, cu, N, N,
                                     causal=causal)
    else:
        out = flash_attention(q, k, v, causal=causal)
    out.backward(torch.randn_like(out))


def _cross(D, SQ, SK, dmodel):
    """Diffusion cross-attention: SQ image queries over SK text keys, batch 2, forward and
    backward."""
    H = max(1, dmodel // D)
    q = torch.randn(2, SQ, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, SK, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    out = flash_attention(q, k, v)
    out.backward(torch.randn_like(out))


def _generate(D, N, B, dmodel):
    H = max(1, dmodel // D)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flash_attention(q, k, v, causal=True)


def _decode(D, N, B, paged, fp8):
    H, HKV, page = 32, 8, 16
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    extra = {}
    if paged:
        pages = B * N // page
        cache = [torch.randn(pages, page, HKV, D, device="cuda").to(dtype) for _ in range(2)]
        extra["block_table"] = torch.randperm(pages, device="cuda", dtype=torch.int32).view(B, -1)
    else:
        cache = [torch.randn(B, N, HKV, D, device="cuda").to(dtype) for _ in range(2)]
    if fp8:
        extra.update(k_descale=torch.ones(B, HKV, device="cuda"),
                     v_descale=torch.ones(B, HKV, device="cuda"))
    lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
    attention_with_kvcache(q, *cache, cache_seqlens=lens, return_lse=False, **extra)


def shapes(args):
    """(label, call) for every shape of the chosen suites."""
    out = []
    for D in args.dims:
        for N in args.seqlens:
            for causal in (False, True):
                if "train" in args.suites:
                    out.append((f"train D={D} N={N} causal={int(causal)}",
                                lambda D=D, N=N, c=causal: _train(D, N, c, args.tokens,
                                                                  args.dmodel)))
                if "varlen" in args.suites and causal:
                    out.append((f"varlen D={D} N={N} causal=1",
                                lambda D=D, N=N: _train(D, N, True, args.tokens, args.dmodel,
                                                        varlen=True)))
            if "cross" in args.suites and N >= 1024:
                for SK in CROSS_KEYS:
                    out.append((f"cross D={D} queries={N} keys={SK}",
                                lambda D=D, N=N, SK=SK: _cross(D, N, SK, args.dmodel)))
            if "generate" in args.suites:
                for B in (1, 8):
                    out.append((f"generate D={D} B={B} keys={N}",
                                lambda D=D, N=N, B=B: _generate(D, N, B, args.dmodel)))
    if "decode" in args.suites:
        for D in args.dims:
            for B in args.decode_batches:
                for N in args.decode_lens:
                    if B * N > args.decode_max_tokens:
                        continue
                    for paged in (False, True):
                        for fp8 in (False, True):
                            out.append((f"decode D={D} B={B} N={N} paged={int(paged)} "
                                        f"fp8={int(fp8)}",
                                        lambda D=D, N=N, B=B, p=paged, f=fp8:
                                        _decode(D, N, B, p, f)))
    return out


def parser():
    p = common.parser("flashtriton.bench.tune", __doc__)
    p.add_argument("--out", required=True, help="the tuning table to write (JSON)")
    p.add_argument("--merge", action="store_true",
                   help="keep the entries of an existing --out that this run does not tune")
    p.add_argument("--suites", nargs="+", default=["train", "generate", "decode"],
                   choices=SUITES, help="which shapes to tune (see above)")
    p.add_argument("--dims", nargs="+", type=int, default=[64, 128, 256], help="head dims")
    p.add_argument("--seqlens", nargs="+", type=int,
                   default=[512, 1024, 2048, 4096, 8192, 16384, 32768],
                   help="sequence lengths (generate: keys; cross: queries)")
    p.add_argument("--tokens", type=int, default=16384,
                   help="train and varlen: batch x seqlen")
    p.add_argument("--dmodel", type=int, default=2048, help="heads x head dim")
    p.add_argument("--decode-batches", nargs="+", type=int, default=[1, 8, 64],
                   help="decode: batch sizes")
    p.add_argument("--decode-lens", nargs="+", type=int, default=[1024, 8192, 65536],
                   help="decode: cached keys a sequence")
    p.add_argument("--decode-max-tokens", type=int, default=1 << 20,
                   help="skip decoding shapes with more batch x keys")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    common.need_gpus(p.prog)
    if _env.INTERPRET:
        sys.exit("python -m flashtriton.bench.tune times the kernels: unset TRITON_INTERPRET")
    _env.AUTOTUNE = True  # the search, whatever the environment says
    start = time.perf_counter()
    for label, call in shapes(args):
        t = time.perf_counter()
        before = len(tuning.recorded())
        try:
            call()
            torch.cuda.synchronize()
            status = "ok"
        except torch.cuda.OutOfMemoryError:
            status = "out of memory"
        torch.cuda.empty_cache()
        n = tuning.save(args.out, merge=args.merge)
        print(f"{label}: {status}, {len(tuning.recorded()) - before} new keys, "
              f"{time.perf_counter() - t:.1f} s ({n} entries in {args.out})", flush=True)
    print(f"tuned in {time.perf_counter() - start:.0f} s: {args.out}")


if __name__ == "__main__":
    main()
