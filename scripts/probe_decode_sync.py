"""Decode timing probe: do_bench right after the first call (as flashtriton.bench does), again,
and per-call host time, for a few small shapes (H200 investigation of eager decode numbers)."""
import time, torch, triton
from flashtriton.decode import attention_with_kvcache
from flashtriton import launch
H, HKV, D = 32, 8, 128
for B, N in [(1, 8192), (8, 1024), (1, 65536)]:
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16); vc = torch.randn_like(kc)
    lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
    fn = lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    fn()
    n0 = launch.FAST_LAUNCHES
    ms1 = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    n1 = launch.FAST_LAUNCHES
    ms2 = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(50): fn()
    torch.cuda.synchronize(); loop = (time.perf_counter() - t) / 50 * 1e6
    print(f"B={B} N={N}: do_bench after 1 call {ms1:.1f} us ({n1 - n0} fast launches), again "
          f"{ms2:.1f} us, loop {loop:.1f} us/call, {len(launch._CALLS)} calls remembered")
