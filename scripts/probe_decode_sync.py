"""Decode host-time probe (H200 investigation of eager decode numbers): for contiguous and
paged (16-token pages) caches, whether repeated calls replay (calls remembered, fast launches
per call), host time per call (best of 5 loops of 200 back-to-back calls), and the host-side
ops one call runs and its kernels' GPU time (torch.profiler, per call over 20 calls)."""
import torch
from torch.profiler import ProfilerActivity, profile
from flashtriton import launch
from flashtriton.bench import decode_inputs, per_call_us
from flashtriton.decode import attention_with_kvcache

for B, N in [(1, 1024), (1, 8192), (8, 1024), (8, 8192)]:
    q, kc, vc, kp, vp, table, lens = decode_inputs(B, N)
    for name, fn in [("contiguous", lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens)),
                     ("paged16", lambda: attention_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                                block_table=table))]:
        for _ in range(3):
            fn()
        n0, c0 = launch.FAST_LAUNCHES, len(launch._CALLS)
        for _ in range(10):
            fn()
        per_call = (launch.FAST_LAUNCHES - n0) / 10
        us = per_call_us(fn, calls=200, repeats=5)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        events = prof.key_averages()
        ops = sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]
        kernels = [e for e in events if e.self_device_time_total > 0]
        print(f"B={B} N={N} {name:10s}: {us:6.1f} us/call, {per_call:.1f} fast launches/call, "
              f"{len(launch._CALLS)} calls remembered (+{len(launch._CALLS) - c0}); ops/call: "
              + ", ".join(f"{e.key} x{e.count / 20:g} {e.self_cpu_time_total / 20:.1f}us"
                          for e in ops)
              + "; GPU/call: " + ", ".join(f"{e.key[:40]} x{e.count / 20:g} "
                                          f"{e.self_device_time_total / 20:.1f}us" for e in kernels),
              flush=True)
