"""Backward kernels one by one (H200 investigation of the D=128 backward): the GPU time of
each backward kernel per call (torch.profiler, 5 calls) for flashtriton and cuDNN SDPA on the
bench's shapes (16K tokens, d_model 2048, bf16), and the TFLOP/s of flashtriton's two kernels
from the products each runs (dQ kernel: S, dP, dQ; dK/dV kernel: S, dP, dV, dK; each
2 * N * N * D per head, halved when causal). Then the dK/dV kernel with each tile of --tiles
forced (BLOCK_M, BLOCK_N, warps, stages), the autotuner given that one candidate.

    python scripts/probe_backward_kernels.py --dims 128 --seqlens 4096 16384 \
        --tiles 64,64,4,2 64,128,8,2 64,128,8,3 128,64,8,2
"""
import argparse

import torch
import torch.nn.functional as F
import triton
from torch.profiler import ProfilerActivity, profile

from flashtriton import flash_attention, launch


def kernel_us(step, calls=5):
    """{kernel name: GPU microseconds per call} of ``step`` (warmed up by the caller)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / calls for e in prof.key_averages()
            if e.self_device_time_total > 0}


def backward_step(fn, q, k, v):
    out = fn(q, k, v)
    grad = torch.randn_like(out)
    for _ in range(3):  # tune, compile, remember
        out.backward(grad, retain_graph=True)
    return lambda: out.backward(grad, retain_graph=True)


def force_dkdv_tile(tile, configs=None):
    """The dK/dV autotuner with one candidate (or ``configs``), every cache of tuned configs
    and remembered calls cleared."""
    if tile is not None:
        bm, bn, warps, stages = tile
        configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps,
                                 num_stages=stages)]
    launch._dkdv.configs = configs
    launch._dkdv.cache.clear()
    launch._TUNED.clear()
    launch._CALLS.clear()
    launch._COMPILED.clear()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dims", nargs="+", type=int, default=[128])
    p.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--causal", nargs="+", type=int, default=[0, 1])
    p.add_argument("--tiles", nargs="*", default=[])
    args = p.parse_args()
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    tuned = list(launch._dkdv.configs)  # the autotuner's own candidates, restored per shape
    rows = []
    for D in args.dims:
        for N in args.seqlens:
            for causal in args.causal:
                B, H = 16384 // N, 2048 // D
                q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                products = 2 * B * H * N * N * D / (2 if causal else 1)  # FLOPs of one product

                def ours(q, k, v):
                    return flash_attention(q, k, v, causal=bool(causal))

                def cudnn(q, k, v):
                    with torch.nn.attention.sdpa_kernel(
                            torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(
                            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            is_causal=bool(causal)).transpose(1, 2)
                shape = f"D={D} N={N} causal={causal}"
                start = len(rows)
                for name, fn in (("cudnn", cudnn), ("flashtriton", ours)):
                    times = kernel_us(backward_step(fn, q, k, v))
                    total = sum(times.values())
                    top = sorted(times.items(), key=lambda kv: -kv[1])[:3]
                    rows.append(f"{shape} {name:11s} backward kernels {total:8.1f} us ("
                                + ", ".join(f"{n[:48]} {t:.1f}" for n, t in top) + ")")
                    if name == "flashtriton":
                        for n, t in times.items():
                            count = 4 if "dkdv" in n else 3 if "dq" in n else 0
                            if count:
                                rows.append(f"{shape}   {n}: {t:8.1f} us, "
                                            f"{count * products / t * 1e-6:6.0f} TFLOP/s of its "
                                            f"{count} products")
                for tile in tiles:
                    force_dkdv_tile(tile)
                    try:
                        times = kernel_us(backward_step(ours, q, k, v))
                        t = sum(t for n, t in times.items() if "dkdv" in n)
                        rows.append(f"{shape}   dK/dV tile {tile}: {t:8.1f} us, "
                                    f"{4 * products / t * 1e-6:6.0f} TFLOP/s")
                    except Exception as e:  # a tile that does not fit: say so, go on
                        rows.append(f"{shape}   dK/dV tile {tile}: {type(e).__name__} "
                                    f"{str(e)[:120]}")
                if tiles:
                    force_dkdv_tile(None, tuned)
                print("\n".join(rows[start:]), flush=True)


if __name__ == "__main__":
    main()
