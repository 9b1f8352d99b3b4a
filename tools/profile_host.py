"""Where the host time of one call goes (a tuning aid for docs/perf.md).

    python tools/profile_host.py

At a tiny shape (the GPU work is far shorter than the launch path), prints the wall time per
call of flashtriton's forward, forward + backward and decode step beside SDPA's, then a
cProfile of the forward, and of forward + backward, by own time.
"""

import cProfile
import pstats

import torch
import torch.nn.functional as F

from flashtriton import _env, flash_attention
from flashtriton.bench import common
from flashtriton.decode import attention_with_kvcache


def per_call_us(fn, calls=300):
    return common.per_call_us(fn, calls, warmup=20)


def main():
    q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    kc, vc = (torch.randn(1, 8192, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q1 = q[:, :1]
    lens = torch.full((1,), 8192, dtype=torch.int32, device="cuda")
    rows = {
        "flashtriton fwd": lambda: flash_attention(q, k, v),
        "sdpa fwd": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                           v.transpose(1, 2)),
        "flashtriton fwd+bwd": lambda: flash_attention(qg, kg, vg).sum().backward(),
        "sdpa fwd+bwd": lambda: F.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2)).sum().backward(),
        "flashtriton decode (8K cache)": lambda: attention_with_kvcache(q1, kc, vc,
                                                                         cache_seqlens=lens),
    }
    # The backward alone, three ways: autograd's backward of a kept graph (engine + our
    # Function's backward), our launcher called directly, and SDPA's kept graph.
    out = flash_attention(qg, kg, vg)
    ref = F.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2),
                                         vg.transpose(1, 2))
    grad, grad_ref = torch.randn_like(out), torch.randn_like(ref)
    from flashtriton import launch
    lse = torch.zeros(1, 4, 128, device="cuda")
    variant = launch.Variant(0.125)
    rows.update({
        "flashtriton fwd (grad on)": lambda: flash_attention(qg, kg, vg),
        "sdpa fwd (grad on)": lambda: F.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2)),
        "flashtriton bwd of a kept graph": lambda: out.backward(grad, retain_graph=True),
        "sdpa bwd of a kept graph": lambda: ref.backward(grad_ref, retain_graph=True),
        "flashtriton attention_backward": lambda: launch.attention_backward(
            grad, q, k, v, out.detach(), lse, variant),
    })
    for name, fn in rows.items():
        print(f"{name:32s} {per_call_us(fn):8.1f} us/call", flush=True)
    _env.FAST_LAUNCH = False  # the same calls, every launch through Triton's JITFunction.run
    for name in ("flashtriton fwd", "flashtriton fwd+bwd", "flashtriton decode (8K cache)",
                 "flashtriton attention_backward"):
        print(f"{name + ', fast launch off':32s} {per_call_us(rows[name]):8.1f} us/call", flush=True)
    _env.FAST_LAUNCH = True
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        flash_attention(q, k, v)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        flash_attention(qg, kg, vg).sum().backward()
    torch.cuda.synchronize()
    prof.disable()
    print("== forward + backward")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    # The same loop under torch.profiler, CPU and CUDA: every thread (the autograd engine runs
    # the backward on its device thread), launch calls, and the kernels' own GPU time, so the
    # forward + backward's host time can be split into ours, Triton's, the engine's and idle.
    for name, fn in (("flashtriton", lambda: flash_attention(qg, kg, vg).sum().backward()),
                     ("sdpa", rows["sdpa fwd+bwd"])):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as tp:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
        print(f"== torch.profiler, {name} forward + backward, 50 calls")
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                      max_name_column_width=60))


if __name__ == "__main__":
    main()
