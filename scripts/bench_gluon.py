"""Forward TFLOP/s of the experimental Gluon kernel (launch.attention_forward_gluon) against
flashtriton's Triton forward and cuDNN SDPA, side by side in one process (H200; bf16, 16K
tokens per shape, d_model 2048 as in the bench). Each row is checked against SDPA first.

    python scripts/bench_gluon.py [--dims 64 128] [--seqlens 4096 8192 16384]
    timeout 60 python scripts/bench_gluon.py --smoke   # first: one small call per kernel
                                                       # (a barrier mistake hangs, not fails)
"""
import argparse

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtriton import flash_attention_with_lse
from flashtriton.launch import attention_forward_gluon


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--smoke", action="store_true",
                   help="one small call of each kernel against SDPA, printed as it finishes")
    args = p.parse_args()
    if args.smoke:
        q, k, v = (torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        for ws in (False, True):
            for causal in (False, True):
                out = attention_forward_gluon(q, k, v, causal, warp_specialize=ws)[0]
                ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                     is_causal=causal).transpose(1, 2)
                torch.cuda.synchronize()
                print(f"warp_specialize={ws} causal={causal}: max error "
                      f"{float((out.float() - ref.float()).abs().max()):.2e}", flush=True)
        return
    print(f"{'D':>4} {'N':>6} {'causal':>6} {'gluon':>7} {'gluon-ws':>8} {'triton':>7} "
          f"{'cudnn':>7}  max|gluon-sdpa| max|gluon-ws-sdpa|")
    for D in args.dims:
        for N in args.seqlens:
            B, H = max(1, 16384 // N), 2048 // D
            q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            for causal in (False, True):
                flops = 4 * B * H * N * N * D / (2 if causal else 1)

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                fns = {"gluon": lambda: attention_forward_gluon(q, k, v, causal),
                       "gluon-ws": lambda: attention_forward_gluon(q, k, v, causal,
                                                                   warp_specialize=True),
                       "triton": lambda: flash_attention_with_lse(q, k, v, causal=causal),
                       "cudnn": cudnn}
                ref = cudnn().transpose(1, 2).float()
                errs = [float((fns[name]()[0].float() - ref).abs().max())
                        for name in ("gluon", "gluon-ws")]
                tflops = {name: flops / triton.testing.do_bench(fn, warmup=25, rep=100,
                                                                return_mode="median") * 1e-9
                          for name, fn in fns.items()}
                print(f"{D:>4} {N:>6} {int(causal):>6} {tflops['gluon']:>7.0f} "
                      f"{tflops['gluon-ws']:>8.0f} {tflops['triton']:>7.0f} "
                      f"{tflops['cudnn']:>7.0f}  {errs[0]:.2e} {errs[1]:.2e}", flush=True)


if __name__ == "__main__":
    main()
