"""Where a replayed eager decoding step's host time goes, on this machine's host: each part of
`attention_with_kvcache`'s replay path timed alone (best of 5 loops of 2000 calls, back to
back), beside the whole step (automatic splits, merged in the split kernel or by the merge
kernel, and one split) and SDPA's step, at B=1 1K. The parts' sum against the step says what
the glue between them costs."""
import torch
import torch.nn.functional as F

from flashtriton import decode, launch
from flashtriton.bench import decode_inputs, per_call_us
from flashtriton.decode import attention_with_kvcache


def main():
    B, N = 1, 1024
    q, kc, vc, _, _, _, lens = decode_inputs(B, N)
    qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    tensors = (q, kc, vc, lens, None, None, None, None)
    step = lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens)  # noqa: E731

    def merge_kernel_step():  # the merge kernel's path (as under a capture), own signature
        decode.MERGE_IN_KERNEL = False
        try:
            return step()
        finally:
            decode.MERGE_IN_KERNEL = True
    for _ in range(3):  # the first call tunes (nothing to replay), the next remembers
        step()
        merge_kernel_step()
    sig = decode.step_signature(q, kc, vc, lens)
    run_decode, _, mode, (size, lse_at) = launch.recall(sig)
    assert mode == 2, mode  # splits merged in the split kernel
    _, SQ, H, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, SQ, dtype=torch.float32, device=q.device)
    ptrs = launch.pointers(*tensors, out, lse)
    counts = decode._workspace(q, size)[2]
    o_part = counts + 4 * decode._COUNTS
    fused = (*ptrs[:-2], o_part, o_part + 4 * lse_at, *ptrs[-2:], counts)
    nothing = launch.on_device_of(lambda x: None)
    parts = {
        "whole step (merged in kernel)": step,
        "whole step (merge kernel)": merge_kernel_step,
        "whole step, num_splits=1": lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                                   num_splits=1),
        "sdpa step": lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True),
        "on_device_of (nothing inside)": lambda: nothing(q),
        "step_signature": lambda: decode.step_signature(q, kc, vc, lens),
        "recall": lambda: launch.recall(sig),
        "torch.empty_like(q)": lambda: torch.empty_like(q, memory_format=torch.contiguous_format),
        "torch.empty(lse)": lambda: torch.empty(B, H, SQ, dtype=torch.float32, device=q.device),
        "torch.empty(partials)": lambda: torch.empty(size, dtype=torch.float32, device=q.device),
        "pointers(10)": lambda: launch.pointers(*tensors, out, lse),
        "workspace lookup": lambda: decode._workspace(q, size),
        "replay split kernel": lambda: run_decode(*fused),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "torch.cuda.current_device": torch.cuda.current_device,
    }
    for fn in parts.values():
        fn()
    print(f"{'part (B=1 1K)':32s} {'us/call':>8s}")
    for name, fn in parts.items():
        print(f"{name:32s} {per_call_us(fn, calls=2000, repeats=5):8.2f}", flush=True)


if __name__ == "__main__":
    main()
