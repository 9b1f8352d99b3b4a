"""The Gluon backward's fixed part at 8K (docs/perf.md: prep 68 us, dQ's copy 48 us): the prep
kernel (kernels.attn_bwd._attn_bwd_prep_kernel: delta from O and dO, the log2 LSE, zeros into
the fp32 dQ buffer) and dQ's copy into q's layout (tokens-major and heads-major), against a
plain copy of as many bytes (the bandwidth they could reach) and torch's zero_ of the
buffer.

    python scripts/probe_prep.py
"""
import torch
import triton

from flashtriton.kernels.attn_bwd import _attn_bwd_prep_kernel

B, N, H, D = 2, 8192, 16, 128


def us(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3


def main():
    o, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(B, H, N, device="cuda")
    dq_acc = torch.empty(B, H, N, D, device="cuda", dtype=torch.float32)
    lse2, delta = torch.empty(2, B * H * N, device="cuda")
    moved = 2 * o.numel() * 2 + dq_acc.numel() * 4  # bytes the prep kernel moves
    src = torch.empty(moved // 2, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    print(f"B={B} N={N} H={H} D={D}; prep moves {moved / 1e6:.0f} MB")
    t = us(lambda: dst.copy_(src))
    print(f"copy of {moved // 2 / 1e6:.0f} MB (reads and writes as many): {t:.1f} us, "
          f"{moved / t / 1e6:.2f} TB/s")
    t = us(lambda: dq_acc.zero_())
    print(f"zero_ of the dQ buffer ({dq_acc.numel() * 4 / 1e6:.0f} MB): {t:.1f} us")
    grid = (N // 64, B * H)

    def prep():
        _attn_bwd_prep_kernel[grid](
            o, do, lse, lse2, delta, dq_acc, o.stride(0), o.stride(1), o.stride(2),
            do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1), H, N, N,
            HEAD_DIM=D, BLOCK_M=64, num_warps=4)
    t = us(prep)
    print(f"prep kernel: {t:.1f} us, {moved / t / 1e6:.2f} TB/s")
    dq = torch.empty_like(o)
    t = us(lambda: dq.copy_(dq_acc.transpose(1, 2)))
    print(f"dQ copy into tokens-major q: {t:.1f} us, {(dq_acc.numel() * 6) / t / 1e6:.2f} TB/s")
    dq = torch.empty(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    t = us(lambda: dq.copy_(dq_acc))
    print(f"dQ copy into heads-major q: {t:.1f} us, {(dq_acc.numel() * 6) / t / 1e6:.2f} TB/s")


if __name__ == "__main__":
    main()
