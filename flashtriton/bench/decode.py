"""The decode suite: one query token over a KV cache (DECODE_SHAPE: 32 query heads, 8 KV heads,
headdim 128, bf16), --decode-batches x --decode-lens.

Each provider of DECODE_PROVIDERS (flashtriton over a contiguous cache and over 16-token
pages, through flash_attn_varlen_func over the pages, with batch_invariant=True, over the same
cache quantised to float8_e4m3fn (contiguous and paged), and torch SDPA with GQA) is checked
against flashtriton.reference (float32) first, the fp8 ones over the dequantised values; then
GB/s of K and V read (one byte an element in fp8) and % of the copy bandwidth measured in the
same run, for eager calls (their kernels) and for the step replayed from a CUDA graph (as
serving engines run it): GPU time after an L2 flush that leaves no dirty lines
(common.cold_ms), the copy too; and the host's time a step, back to back."""

import torch

from . import DECODE_PROVIDERS, DECODE_SHAPE, FP8_DECODE_PROVIDERS, DecodeInputs, decode_bytes
from .common import (TOLERANCE, cold_ms, cuda_graph, expected, per_call_us, rel_err,
                     tiles_mark, tiles_since)


def decode_inputs(B, N, H=32, HKV=8, D=128, page=16, device="cuda",
                  fp8: bool = False) -> DecodeInputs:
    """One decoding step's bf16 inputs: q (B, 1, H, D); a full contiguous cache (B, N, HKV,
    D); the same keys and values in shuffled pages of ``page`` tokens with their block table;
    cache_seqlens (all N); with ``fp8``, the same caches quantised (``quantized``)."""
    q = torch.randn(B, 1, H, D, device=device, dtype=torch.bfloat16)
    kc = torch.randn(B, N, HKV, D, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(B * N // page, device=device).view(B, -1).to(torch.int32)
    kp = torch.empty(B * N // page, page, HKV, D, device=device, dtype=torch.bfloat16)
    vp = torch.empty_like(kp)
    kp[table.view(-1).long()] = kc.view(-1, page, HKV, D)
    vp[table.view(-1).long()] = vc.view(-1, page, HKV, D)
    lens = torch.full((B,), N, dtype=torch.int32, device=device)
    x = DecodeInputs(q, kc, vc, kp, vp, table, lens)
    return x._replace(fp8=quantized(x)) if fp8 else x


def quantized(x: DecodeInputs, dtype=torch.float8_e4m3fn) -> DecodeInputs:
    """x's caches in fp8 as a serving engine stores them: one descale a (sequence, KV head),
    its largest magnitude over the fp8 range (FlashAttention-3's (B, HKV) factors)."""
    top = torch.finfo(dtype).max
    kd, vd = (c.abs().amax(dim=(1, 3)).float().clamp_min(1e-12) / top for c in (x.k, x.v))
    k8, v8 = ((c.float() / d[:, None, :, None]).to(dtype) for c, d in ((x.k, kd), (x.v, vd)))
    pages = x.table.view(-1).long()  # the same shuffled pages, in fp8
    kp8, vp8 = (torch.empty(x.k_pages.shape, dtype=dtype, device=c.device) for c in (k8, v8))
    page = x.k_pages.shape[1]
    kp8[pages] = k8.view(-1, page, *k8.shape[2:])
    vp8[pages] = v8.view(-1, page, *v8.shape[2:])
    return DecodeInputs(x.q, k8, v8, kp8, vp8, x.table, x.lens, k_descale=kd, v_descale=vd)


def dequantized(x: DecodeInputs):
    """An fp8 DecodeInputs' keys and values as the values they stand for (float32)."""
    return tuple(c.float() * d[:, None, :, None]
                 for c, d in ((x.k, x.k_descale), (x.v, x.v_descale)))


def copy_bandwidth_gbps(nbytes=2**31):
    """Device-to-device copy, bytes read plus written per second (the memory ceiling)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / cold_ms(lambda: dst.copy_(src)) * 1e-6


def check_decode(providers, x: DecodeInputs) -> dict:
    """{provider: (its step, relative error of its output against the reference)}; the fp8
    providers against the reference over x.fp8's dequantised values."""
    ref = expected(x.q, x.k, x.v)
    ref8 = (expected(x.q, *dequantized(x.fp8))
            if any(p in FP8_DECODE_PROVIDERS for p in providers) else None)
    out = {}
    for prov in providers:
        make, output = DECODE_PROVIDERS[prov]
        fn = make(x)
        err = rel_err(output(fn()), ref8 if prov in FP8_DECODE_PROVIDERS else ref)
        out[prov] = (fn, err if err == err else float("inf"))
    return out


def run_decode(batches, lens, meta, copy_gbps, providers=tuple(DECODE_PROVIDERS)):
    import triton
    from flashtriton import runtime
    H, HKV, D, page = (DECODE_SHAPE[k] for k in ("H", "HKV", "D", "page"))
    rows = []
    for B in batches:
        for N in lens:
            base = dict(meta, suite="decode", B=B, H=H, HKV=HKV, N=N, D=D, causal=False)
            try:
                torch.manual_seed(0)
                x = decode_inputs(B, N, H, HKV, D, page,
                                  fp8=any(p in FP8_DECODE_PROVIDERS for p in providers))
                mark = tiles_mark()  # flashtriton tunes in its check call
                checked = check_decode(providers, x)
                for prov, (fn, err) in checked.items():
                    row = dict(base, provider=prov, rel_err=err)
                    if not err < TOLERANCE:
                        row["status"] = (f"FAILED check (rel err {err:.2e} vs reference); speed "
                                         "not reported")
                    else:
                        nbytes = decode_bytes(B, N, HKV, D,
                                              1 if prov in FP8_DECODE_PROVIDERS else 2)
                        ms = cold_ms(fn)
                        graph = cuda_graph(fn)
                        graph_ms = cold_ms(graph.replay)
                        # do_bench's (dirty) flush, beside the runs timed with it before
                        dirty_ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100,
                                                           return_mode="median")
                        # the best of 5 loops: one loop of 50 calls swung with host noise
                        replays = runtime.FAST_LAUNCHES
                        row["loop_us"] = per_call_us(fn, calls=100, repeats=5)
                        if prov != "sdpa":  # replayed launches per call (1 or 2; 0: slow path)
                            row["replays_per_call"] = (runtime.FAST_LAUNCHES - replays) / 500
                            row["tiles"] = tiles_since(mark)  # a tile tuned for this row
                        row.update(status="ok", decode_ms=ms, decode_GBps=nbytes / ms * 1e-6,
                                   pct_of_copy=100 * nbytes / ms * 1e-6 / copy_gbps,
                                   graph_ms=graph_ms, graph_GBps=nbytes / graph_ms * 1e-6,
                                   graph_pct_of_copy=100 * nbytes / graph_ms * 1e-6 / copy_gbps,
                                   graph_dirty_GBps=nbytes / dirty_ms * 1e-6)
                    rows.append(row)
            except torch.cuda.OutOfMemoryError:
                rows.append(dict(base, provider="all", status="out of memory"))
            torch.cuda.empty_cache()
    return rows
