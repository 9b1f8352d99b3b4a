"""Forward TFLOP/s of the Gluon kernel (launch.attention_forward_gluon) against flashtriton's
Triton forward (FLASHTRITON_GLUON off) and cuDNN SDPA, side by side in one process (H200; bf16,
16K tokens per shape, d_model 2048 as in the bench; --gqa: 8 KV heads). Each row is checked
against SDPA first. Then the host time per forward call of flash_attention at a tiny shape,
Gluon and Triton (back-to-back calls, replayed).

--backward: the backward instead (TFLOP/s counted as 2.5x the forward's FLOPs, as the bench
does): the Gluon backward (launch.attention_backward_gluon, whole call: prep kernel, kernel,
dQ conversion) with dQ added by its producer's TMA reductions (w2) and not added (w1, timing
only), flashtriton's Triton backward (deterministic=True) and cuDNN's, each row's dQ/dK/dV
(w2's) checked against cuDNN's.

    python tools/bench_gluon.py [--dims 64 128] [--seqlens 4096 8192 16384] [--gqa]
    python tools/bench_gluon.py --backward [--dims 128] [--seqlens 2048 8192 16384]
    python tools/bench_gluon.py --backward --ab EARLY_S [--rounds 5]   # an option A/B
    python tools/bench_gluon.py --ab HEAVY_FIRST [--rounds 5]   # the forward's options
    python tools/bench_gluon.py --ab CONSUMER_REGS=232,240   # an integer option: two values
    timeout 200 python tools/bench_gluon.py --smoke   # first: one small call per variant
                                                       # (a barrier mistake hangs, not fails)
"""
import argparse

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtriton import _env, configs, flash_attention
from flashtriton.bench.common import per_call_us
from flashtriton.bench.variants import ab_parts as variant_ab_parts
from flashtriton.bench.variants import option_value
from flashtriton.launch import attention_backward_gluon, attention_forward_gluon


def triton_forward(q, k, v, causal):
    _env.GLUON = False
    try:
        return flash_attention(q, k, v, causal=causal, deterministic=True)  # Triton backward
    finally:
        _env.GLUON = True


def shapes(args):
    """(D, N, H, HKV, q, k, v) of each row: 16K tokens, d_model 2048, bf16 (B, N, H, D)."""
    for D in args.dims:
        for N in args.seqlens:
            B, H = max(1, 16384 // N), 2048 // D
            HKV = 8 if args.gqa else H
            q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            yield D, N, H, HKV, q, k, v


def cudnn_forward(q, k, v, causal):
    """cuDNN SDPA's forward of (B, N, H, D) q, k, v (GQA where k has fewer heads)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                  enable_gqa=kt.shape[1] != qt.shape[1])
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--gqa", action="store_true", help="8 KV heads")
    p.add_argument("--backward", action="store_true", help="the backward instead")
    p.add_argument("--ab", metavar="NAME[=A,B]",
                   help="configs.GLUON_FWD_OPTIONS[NAME] (--backward: GLUON_BWD_OPTIONS') "
                   "off and on (or A "
                   "and B, e.g. CONSUMER_REGS=232,240; several joined by + change together), "
                   "round-robin")
    p.add_argument("--rounds", type=int, default=5, help="--ab's rounds")
    p.add_argument("--smoke", action="store_true",
                   help="one small call per variant against SDPA, printed as it finishes")
    args = p.parse_args()
    if args.smoke:
        q, k, v = (torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        for causal in (False, True):
            out = attention_forward_gluon(q, k, v, causal)[0]
            ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                 is_causal=causal).transpose(1, 2)
            torch.cuda.synchronize()
            err = float((out.float() - ref.float()).abs().max())
            print(f"causal={causal}: max error {err:.2e}", flush=True)
            out, lse = attention_forward_gluon(q, k, v, causal)
            for opts in ({}, dict(window_size=(100, 50)), dict(softcap=5.0),
                         dict(alibi_slopes=torch.full((2, ), 0.1, device="cuda"))):
                out, lse = attention_forward_gluon(q, k, v, causal, **opts)
                grads = attention_backward_gluon(torch.ones_like(out), q, k, v, out, lse,
                                                 causal, **opts)
                torch.cuda.synchronize()
                print(f"backward causal={causal} {sorted(opts)}: finite "
                      f"{all(bool(g.isfinite().all()) for g in grads)}", flush=True)
        return
    if args.backward:
        return backward_ab(args) if args.ab else backward(args)
    if args.ab:
        return forward_ab(args)
    print(f"{'D':>4} {'N':>6} {'HKV':>4} {'causal':>6} {'gluon':>7} {'triton':>7} {'cudnn':>7}"
          f"  max|gluon-sdpa|")
    for D, N, H, HKV, q, k, v in shapes(args):
        for causal in (False, True):
            flops = 4 * q.shape[0] * H * N * N * D / (2 if causal else 1)
            cudnn = cudnn_forward(q, k, v, causal)
            fns = {"gluon": lambda: attention_forward_gluon(q, k, v, causal),
                   "triton": lambda: triton_forward(q, k, v, causal),
                   "cudnn": cudnn}
            ref = cudnn().transpose(1, 2).float()
            err = float((fns["gluon"]()[0].float() - ref).abs().max())
            tflops = {name: flops / triton.testing.do_bench(fn, warmup=25, rep=100,
                                                            return_mode="median") * 1e-9
                      for name, fn in fns.items()}
            print(f"{D:>4} {N:>6} {HKV:>4} {int(causal):>6} {tflops['gluon']:>7.0f} "
                  f"{tflops['triton']:>7.0f} {tflops['cudnn']:>7.0f}  {err:.2e}", flush=True)
    q, k, v = (torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    gluon = per_call_us(lambda: flash_attention(q, k, v, causal=True), 300, 20, 5)
    tri = per_call_us(lambda: triton_forward(q, k, v, True), 300, 20, 5)
    print(f"host us per flash_attention forward (1 x 128 x 16 x 128, causal): gluon {gluon:.1f}, "
          f"triton {tri:.1f}")


def backward(args):
    """The --backward table (see the module docstring)."""
    cols = ("w2", "w1")
    print(f"{'D':>4} {'N':>6} {'HKV':>4} {'causal':>6} " + " ".join(f"{c:>6}" for c in cols)
          + f" {'triton':>7} {'cudnn':>6}  max|w2-cudnn| dq/dk/dv")
    for D, N, H, HKV, q, k, v in shapes(args):
        B = q.shape[0]
        dout = torch.randn_like(q)
        leaves = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
        for causal in (False, True):
            flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref_out = F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                                         enable_gqa=HKV != H)
            out, lse = attention_forward_gluon(q, k, v, causal)
            tq, tk, tv = (x.detach().clone().requires_grad_() for x in (q, k, v))
            tri_out = triton_forward(tq, tk, tv, causal)
            dref = dout.transpose(1, 2)
            fns = {f"w{m}": (lambda m=m: attention_backward_gluon(dout, q, k, v, out, lse,
                                                                  causal, _dq_mode=m))
                   for m in (2, 1)}
            fns["triton"] = lambda: torch.autograd.grad(tri_out, (tq, tk, tv), dout,
                                                        retain_graph=True)
            fns["cudnn"] = lambda: torch.autograd.grad(ref_out, leaves, dref,
                                                       retain_graph=True)
            ref = [g.transpose(1, 2).float() for g in fns["cudnn"]()]
            errs = " ".join("/".join(f"{float((g.float() - r).abs().max()):.1e}"
                                     for g, r in zip(fns[name](), ref)) for name in ("w2", ))
            tflops = {name: flops / triton.testing.do_bench(fn, warmup=10, rep=60,
                                                            return_mode="median") * 1e-9
                      for name, fn in fns.items()}
            print(f"{D:>4} {N:>6} {HKV:>4} {int(causal):>6} " + " ".join(
                f"{tflops.get(n, 0):>6.0f}" for n in cols) +
                f" {tflops['triton']:>7.0f} {tflops['cudnn']:>6.0f}  {errs}", flush=True)


def with_options(fn, table, **options):
    """fn with a kernel's options (table: configs.GLUON_FWD_OPTIONS or GLUON_BWD_OPTIONS)
    updated by options while it runs."""
    def run():
        saved = dict(table)
        table.update(options)
        try:
            return fn()
        finally:
            table.update(saved)
    return run


def round_robin(fns, flops, rounds):
    """fns timed in turn, `rounds` times (100 ms each): per fn the median TFLOP/s over the
    rounds and, in brackets, (max - min) / median in %. Identical kernels measured one after
    the other differ by up to 7% on the H200: an A/B needs the rounds."""
    runs = [[] for _ in fns]
    for _ in range(rounds):
        for fn, got in zip(fns, runs):
            got.append(flops / triton.testing.do_bench(fn, warmup=10, rep=100,
                                                       return_mode="median") * 1e-9)
    cells = []
    for got in runs:
        mid = sorted(got)[len(got) // 2]
        cells.append(f"{mid:.0f} ({100 * (max(got) - min(got)) / mid:.0f}%)")
    return " ".join(f"{c:>14}" for c in cells)


def ab_parts(ab: str):
    """--ab's parts (bench.variants.ab_parts), a bad one a SystemExit."""
    try:
        return variant_ab_parts(ab)
    except ValueError as e:
        raise SystemExit(f"--ab: {e}")


def ab_settings(ab: str, table: dict):
    """--ab [fwd.|bwd.]NAME[=A,B]: the two settings of `table` (configs.GLUON_FWD_OPTIONS or
    GLUON_BWD_OPTIONS) {NAME: A} and {NAME: B} (default 0 and 1), booleans where the option is
    one (or None: chosen by configs.gluon_fwd_options / gluon_bwd_options), integers else.
    Several joined by + change together (fwd.CONSUMER_REGS=232,240+fwd.PRODUCER_REGS=40,24:
    {232, 40} and {240, 24}); parts naming the other kernel's table only are left out, and
    none left is an error."""
    settings = [{}, {}]
    for _, tables, bare, vals in ab_parts(ab):
        if any(t is table for t in tables):
            for st, x in zip(settings, vals):
                st[bare] = option_value(table[bare], x)
    if not settings[0]:
        raise SystemExit(f"--ab {ab}: no option of this kernel")
    return settings


def ab_labels(settings):
    """The two settings as column labels: NAME=V[,NAME=V]."""
    return [",".join(f"{k}={int(v)}" for k, v in st.items()) for st in settings]


def forward_ab(args):
    """--ab NAME[=A,B]: the Gluon forward with configs.GLUON_FWD_OPTIONS[NAME] off and on (A
    and B), and cuDNN's, round-robin (round_robin)."""
    settings = ab_settings(args.ab, configs.GLUON_FWD_OPTIONS)
    a, b = ab_labels(settings)
    print(f"{'D':>4} {'N':>6} {'HKV':>4} {'causal':>6} {a:>14} {b:>14} {'cudnn':>14}  "
          f"max|x-cudnn| (each)")
    for D, N, H, HKV, q, k, v in shapes(args):
        for causal in (False, True):
            flops = 4 * q.shape[0] * H * N * N * D / (2 if causal else 1)
            fwd = lambda: attention_forward_gluon(q, k, v, causal)[0]  # noqa: E731
            fns = [with_options(fwd, configs.GLUON_FWD_OPTIONS, **st) for st in settings]
            cudnn = cudnn_forward(q, k, v, causal)
            ref = cudnn().transpose(1, 2).float()
            errs = " ".join(f"{float((fn().float() - ref).abs().max()):.1e}" for fn in fns)
            print(f"{D:>4} {N:>6} {HKV:>4} {int(causal):>6} "
                  + round_robin(fns + [cudnn], flops, args.rounds) + f"  {errs}", flush=True)


def backward_ab(args):
    """--backward --ab NAME[=A,B]: the Gluon backward (w2) with configs.GLUON_BWD_OPTIONS[NAME]
    off and on (A and B), and cuDNN's, round-robin (round_robin)."""
    settings = ab_settings(args.ab, configs.GLUON_BWD_OPTIONS)
    a, b = ab_labels(settings)
    print(f"{'D':>4} {'N':>6} {'HKV':>4} {'causal':>6} {a:>14} {b:>14} {'cudnn':>14}  "
          f"max|x-cudnn| dq/dk/dv (each)")
    for D, N, H, HKV, q, k, v in shapes(args):
        dout = torch.randn_like(q)
        leaves = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
        for causal in (False, True):
            flops = 2.5 * 4 * q.shape[0] * H * N * N * D / (2 if causal else 1)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref_out = F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                                         enable_gqa=HKV != H)
            out, lse = attention_forward_gluon(q, k, v, causal)
            w2 = lambda: attention_backward_gluon(dout, q, k, v, out, lse, causal)  # noqa: E731
            fns = [with_options(w2, configs.GLUON_BWD_OPTIONS, **st) for st in settings]
            fns.append(lambda: torch.autograd.grad(ref_out, leaves, dout.transpose(1, 2),
                                                   retain_graph=True))
            ref = [g.transpose(1, 2).float() for g in fns[2]()]
            errs = " ".join("/".join(f"{float((g.float() - r).abs().max()):.1e}"
                                     for g, r in zip(fn(), ref)) for fn in fns[:2])
            print(f"{D:>4} {N:>6} {HKV:>4} {int(causal):>6} "
                  + round_robin(fns, flops, args.rounds) + f"  {errs}", flush=True)


if __name__ == "__main__":
    main()
