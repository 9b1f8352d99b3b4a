"""Tests that need a GPU: long sequences, O(N) memory, torch.compile with inductor.

Skipped on machines without one; the device run executes them (README, Testing).
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from accuracy import check_against_reference, make_qkv
from conftest import ON_GPU
from flashtriton import flash_attention, flash_attention_with_lse, launch
from flashtriton import configs, runtime
from flashtriton.launch import Variant
from modules import AttentionBlock, SdpaBlock

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


@pytest.mark.parametrize("seqlen,heads,D", [(8192, 2, 128), (16384, 1, 64), (32768, 1, 128)],
                         ids=["8k-d128", "16k-d64", "32k-d128"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequences(seqlen, heads, D, causal):
    q, k, v = make_qkv(1, seqlen, seqlen, heads, heads, D, torch.bfloat16, "cuda")
    check_against_reference(lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, causal=causal)),
                            q, k, v, causal)


def _extra_memory(seqlen, B=1, H=16, D=128):
    """Peak memory of causal forward + backward beyond the inputs and dout; the bytes of out,
    dq, dk and dv; and the bytes of the fp32 dQ buffer that the Gluon backward adds into
    (where it runs: Hopper, configs.GLUON_BWD_HEAD_DIMS, from configs.GLUON_BWD_MIN_SEQLEN
    tokens), else 0."""
    q, k, v = make_qkv(B, seqlen, seqlen, H, H, D, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    flash_attention(q, k, v, causal=True).backward(dout)  # autotuning allocates scratch: not ours
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    flash_attention(q, k, v, causal=True).backward(dout)
    torch.cuda.synchronize()
    gluon = launch.backward_route(q, k, v, Variant(D ** -0.5, True))[0] == "gluon"
    return (torch.cuda.max_memory_allocated() - base, 4 * q.numel() * q.element_size(),
            4 * q.numel() if gluon else 0)


def test_memory_is_linear_in_seqlen():
    # Beyond out, dq, dk, dv only O(N) row statistics (lse, delta: 8 bytes a row) and the
    # Gluon backward's fp32 dQ buffer (O(N D), as dq) may be allocated, and 4x the sequence
    # must cost 4x the memory, not 16x.
    (m4, io4, acc4), (m16, io16, acc16) = _extra_memory(4096), _extra_memory(16384)
    for extra, io, acc, n in ((m4, io4, acc4, 4096), (m16, io16, acc16, 16384)):
        assert extra <= io + acc + 16 * 16 * n + (1 << 20), (n, extra, io, acc)
    assert m16 / m4 < 4.5, (m4, m16)


@pytest.mark.parametrize("options", [{}, {"window_size": (63, 0)}, {"softcap": 30.0},
                                     {"alibi": True}], ids=["plain", "window", "softcap", "alibi"])
def test_torch_compile_fullgraph(options):
    torch._dynamo.reset()
    model = AttentionBlock(dim=256, **options).cuda().to(torch.bfloat16)
    if model.alibi_slopes is not None:
        model.alibi_slopes = model.alibi_slopes.float()
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    eager = model(x)
    eager.float().pow(2).sum().backward()
    g_eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.float().pow(2).sum().backward()
    torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)
    for g, ge in zip((p.grad for p in model.parameters()), g_eager):
        torch.testing.assert_close(g, ge, atol=5e-2, rtol=5e-2)


def test_torch_compile_reduce_overhead_inference():
    """mode="reduce-overhead" replays the compiled model from a CUDA graph (the cure for the
    host time of small calls): the custom op must be capturable and give eager's result."""
    torch._dynamo.reset()
    model = AttentionBlock(dim=256).cuda().to(torch.bfloat16).eval()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):  # warm-up runs, then the recorded graph replays
            x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
            out = compiled(x).clone()
            torch.testing.assert_close(out, model(x), atol=2e-2, rtol=2e-2)


def test_patch_sdpa_same_result_and_faster_than_fa2():
    """patch_sdpa() routes a model's SDPA calls to flashtriton: the same result as torch, and a
    faster training step than torch's flash backend (FA2) at seqlen 4K (cuDNN is faster than
    both on Hopper: see the README's performance table)."""
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtriton
    model = SdpaBlock(2048, 16).cuda().to(torch.bfloat16)
    x = torch.randn(4, 4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        model(x).float().square().mean().backward()

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = model(x)
        fa2_ms = triton.testing.do_bench(step, grad_to_none=[x], return_mode="median")
    with flashtriton.patch_sdpa():
        out = model(x)
        step()  # autotune outside the timing
        ours_ms = triton.testing.do_bench(step, grad_to_none=[x], return_mode="median")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert ours_ms < fa2_ms, (ours_ms, fa2_ms)


def test_decode_tuner_times_the_gpu_not_the_host():
    """The decoding tuner's benchmarker (runtime.gpu_time_ms) times the GPU: a call that spends
    ~300 us of host time after launching a ~20 us kernel times as the kernel alone, where
    do_bench (Triton's tuner's default) times the host."""
    import time

    import triton

    def kernel():
        torch.cuda._sleep(40_000)  # ~20 us at the H200's ~2 GHz

    def slow_host():
        kernel()
        t = time.perf_counter()
        while time.perf_counter() - t < 300e-6:
            pass
    alone = runtime.gpu_time_ms(kernel)[0]
    assert 0.005 < alone < 0.1, alone
    assert runtime.gpu_time_ms(slow_host)[0] < 1.5 * alone, alone
    # the host's 300 us, less what do_bench's L2 flush before each start event overlaps
    # (0.233-0.247 ms on an H100)
    assert triton.testing.do_bench(slow_host, warmup=5, rep=20) > 0.15


def test_flush_l2_leaves_no_write_back_on_the_timed_call():
    """bench.cold_ms times after runtime.flush_l2, which reads 256 MB; do_bench's flush zeroes
    them, and the dirty lines it leaves in the L2 are written back during the timed call. A
    268 MB read (a decoding step's size at B=8 8K) runs >= 5% faster after flush_l2 (the
    H200: ~11% for a reduction, 13% for a decoding step)."""
    import triton
    from triton.runtime import driver

    from flashtriton.bench.common import cold_ms
    x = torch.ones(134 << 20, device="cuda", dtype=torch.bfloat16)
    read = lambda: x.sum(dtype=torch.float32)  # noqa: E731
    clean = min(cold_ms(read) for _ in range(3))
    dirty = min(triton.testing.do_bench(read, warmup=10, rep=50, return_mode="median")
                for _ in range(3))
    assert clean < 0.95 * dirty, (clean, dirty)
    cache = driver.active.get_empty_cache_for_benchmark()
    cache.fill_(7)
    runtime.flush_l2(cache)  # reads only: nothing written
    assert bool((cache == 7).all())


def test_decode_step_replays_from_a_cuda_graph(monkeypatch):
    """Serving engines capture decoding steps in CUDA graphs: a captured step, replayed after
    new query values, new cache contents and new lengths are copied into its inputs, must
    equal an eager call on those inputs (no host-side state baked into the graph). A capture
    merges the splits by the merge kernel, also where the eager calls before it merged them
    in the split kernel (small caches; here all): equal to an eager call that takes the
    merge kernel too, and close to one that merges in the split kernel (another order of the
    same sums)."""
    from flashtriton.decode import attention_with_kvcache
    monkeypatch.setattr(configs, "DECODE_MERGE_MAX_BYTES", 1 << 40)
    B, N, H, HKV, D = 4, 4096, 32, 8, 128
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([100, 4096, 2000, 3333], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention_with_kvcache(q, kc, vc, cache_seqlens=lens)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    q.copy_(torch.randn_like(q))
    kc.copy_(torch.randn_like(kc))
    lens.copy_(torch.tensor([4096, 1, 777, 2048], dtype=torch.int32))
    graph.replay()
    in_kernel = attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    monkeypatch.setattr(configs, "DECODE_MERGE_IN_KERNEL", False)
    eager = attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    torch.testing.assert_close(captured.out, eager.out, atol=0, rtol=0)
    torch.testing.assert_close(captured.lse, eager.lse, atol=0, rtol=0)
    torch.testing.assert_close(in_kernel.out, eager.out, atol=2e-3, rtol=0)
    torch.testing.assert_close(in_kernel.lse, eager.lse, atol=1e-5, rtol=0)


def test_decode_merge_in_the_kernel_is_the_same_every_step(monkeypatch):
    """Eager steps merge their splits in the split kernel: the split that counts itself done
    last reads the others' partials. Were a partial read before it was written (memory order),
    or a count left behind for the next step, repeated steps would differ: 300 steps over 16
    splits (one wave of 128 programs) all equal the first, bit for bit, and the counts end at
    zero."""
    from flashtriton.decode import attention_with_kvcache
    from flashtriton.launch import decode as decode_launch
    from flashtriton.launch import decode_replay
    monkeypatch.setattr(configs, "DECODE_MERGE_MAX_BYTES", 1 << 40)  # a 268 MB cache merged in the kernel
    B, N, H, HKV, D = 1, 65536, 32, 8, 128
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
    assert configs.decode_splits(0, B, HKV, N, configs.decode_split_granule(),
                                 decode_launch._num_sms(q.device)) == 16
    monkeypatch.setattr(runtime, "_CALLS", {})
    first = attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    (record,), = runtime._CALLS.values()
    assert type(record) is decode_replay.MergedInKernel  # merged in the split kernel
    steps = [attention_with_kvcache(q, kc, vc, cache_seqlens=lens) for _ in range(300)]
    for step in steps:
        torch.testing.assert_close(step.out, first.out, atol=0, rtol=0)
        torch.testing.assert_close(step.lse, first.lse, atol=0, rtol=0)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                         enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(first.out, ref, atol=2e-2, rtol=0)
    counts = decode_replay._workspace(q, 0)[0][:decode_replay._COUNTS].view(torch.int32)
    assert int(counts.abs().sum()) == 0


@pytest.mark.parametrize("in_kernel", [True, False], ids=["in-kernel", "merge-kernel"])
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
def test_decode_waits_for_the_kernel_before_it(monkeypatch, pdl, in_kernel):
    """Launched as programmatic dependents (Hopper), the split and merge kernels may start
    before the kernel ahead of them on the stream ends: a cache rewritten by the kernel just
    before the step must be read whole, and the result must equal a synchronised call's."""
    from flashtriton import _env
    from flashtriton.decode import attention_with_kvcache
    from flashtriton.launch import decode_replay
    monkeypatch.setattr(_env, "PDL", pdl)
    monkeypatch.setattr(configs, "DECODE_MERGE_IN_KERNEL", in_kernel)
    monkeypatch.setattr(configs, "DECODE_MERGE_MAX_BYTES", 1 << 40)
    monkeypatch.setattr(runtime, "_CALLS", {})
    B, N, H, HKV, D = 1, 65536, 32, 8, 128
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    old, new = (torch.randn(2, B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
    kv = old.clone()
    lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
    for _ in range(2):  # tune, then remember the call
        attention_with_kvcache(q, kv[0], kv[1], cache_seqlens=lens)
    kv.copy_(new)
    torch.cuda.synchronize()
    want = attention_with_kvcache(q, kv[0], kv[1], cache_seqlens=lens)
    for _ in range(3):
        kv.copy_(old)
        torch.cuda.synchronize()
        kv.copy_(new)  # 268 MB: the step's kernels queue behind this copy
        got = attention_with_kvcache(q, kv[0], kv[1], cache_seqlens=lens)
        torch.testing.assert_close(got.out, want.out, atol=0, rtol=0)
        torch.testing.assert_close(got.lse, want.lse, atol=0, rtol=0)
    (record,), = runtime._CALLS.values()  # this step's launches
    assert type(record) is (decode_replay.MergedInKernel if in_kernel
                            else decode_replay.MergeKernel)
    assert runtime.use_pdl(q.device) == pdl  # Hopper
    assert record.run_decode.compiled.metadata.launch_pdl == pdl
    assert in_kernel or record.run_merge.compiled.metadata.launch_pdl == pdl


def test_forward_replays_from_a_cuda_graph():
    """A captured forward (TMA loads: its descriptors live in scratch memory from the graph's
    pool) replayed on new inputs equals an eager call on them, and eager calls between
    capture and replay (sharing the stream's scratch buffer) do not disturb it."""
    from flashtriton import flash_attention
    q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # tune, compile, remember the call outside the capture
            flash_attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attention(q, k, v, causal=True)
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    other = flash_attention(k, v, q, causal=True)  # an eager call in between
    graph.replay()
    eager = flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(captured, eager, atol=0, rtol=0)
    torch.testing.assert_close(other, flash_attention(k, v, q, causal=True), atol=0, rtol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_inputs_on_a_gpu_that_is_not_current():
    """flash-attn and SDPA run on their inputs' device whatever device is current: so do we."""
    from flashtriton import flash_attention
    from flashtriton.decode import attention_with_kvcache
    torch.cuda.set_device(0)
    q, k, v = (torch.randn(2, 256, 4, 64, device="cuda:1", dtype=torch.float16,
                           requires_grad=True) for _ in range(3))
    out = flash_attention(q, k, v, causal=True)
    out.sum().backward()
    ref = F.scaled_dot_product_attention(*(x.detach().transpose(1, 2) for x in (q, k, v)),
                                         is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert q.grad.device == q.device and torch.isfinite(q.grad).all()
    cache = torch.randn(2, 512, 4, 64, device="cuda:1", dtype=torch.float16)
    dec = attention_with_kvcache(q[:, :1].detach(), cache, cache, cache_seqlens=512)
    dense = F.scaled_dot_product_attention(q[:, :1].detach().transpose(1, 2),
                                           cache.transpose(1, 2), cache.transpose(1, 2))
    torch.testing.assert_close(dec.out, dense.transpose(1, 2), atol=2e-3, rtol=2e-3)
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("sq", [64, 128, 1024], ids=lambda s: f"sq{s}")
@pytest.mark.parametrize("paged", [0, 16], ids=["contiguous", "page16"])
def test_kvcache_mqa_chunked_prefill(D, sq, paged):
    """flash_attn_with_kvcache with 6 query heads a KV head and many query tokens (chunked
    prefill, speculative decoding) at head dims 128 and 256: 384-6144 packed rows, which a
    single decoding tile could not hold (360 KB of shared memory at 64 tokens, D=128)."""
    from accuracy import assert_rule
    from flashtriton.compat import flash_attn as fa
    from flashtriton.reference import attention_reference
    gen = torch.Generator().manual_seed(sq + D)
    B, HKV, G, cap = 2, 2, 6, 4096
    k_full = torch.randn(B, cap, HKV, D, generator=gen).cuda().bfloat16()
    v_full = torch.randn(B, cap, HKV, D, generator=gen).cuda().bfloat16()
    q = torch.randn(B, sq, HKV * G, D, generator=gen).cuda().bfloat16()
    k_new = torch.randn(B, sq, HKV, D, generator=gen).cuda().bfloat16()
    v_new = torch.randn(B, sq, HKV, D, generator=gen).cuda().bfloat16()
    lens = torch.tensor([1000, 2900], dtype=torch.int32, device="cuda")
    if paged:
        n = cap // paged
        perm = torch.randperm(B * n, generator=gen).cuda()
        k_cache = torch.empty(B * n, paged, HKV, D, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.empty_like(k_cache)
        k_cache[perm], v_cache[perm] = (x.reshape(B * n, paged, HKV, D) for x in (k_full, v_full))
        kw = dict(block_table=perm.view(B, n).to(torch.int32))
    else:
        k_cache, v_cache, kw = k_full.clone(), v_full.clone(), {}
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                          causal=True, return_softmax_lse=True, **kw)
    for b in range(B):
        n0 = int(lens[b])
        kk = torch.cat([k_full[b:b + 1, :n0], k_new[b:b + 1]], 1)
        vv = torch.cat([v_full[b:b + 1, :n0], v_new[b:b + 1]], 1)
        ref = attention_reference(q[b:b + 1], kk, vv, causal=True)
        pt = attention_reference(q[b:b + 1], kk, vv, causal=True, dtype=torch.bfloat16)
        assert_rule(f"out[{b}]", out[b:b + 1], ref.out, pt.out, 2, torch.bfloat16)
        assert_rule(f"lse[{b}]", lse[b:b + 1], ref.lse, pt.lse, 2, torch.bfloat16)


@pytest.mark.parametrize("append", [False, True], ids=["step", "append"])
@pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "no-lse"])
def test_kvcache_prefill_route_replays(append, return_lse):
    """The prefill route's launches (the spans, the forward) replay on a later call with the
    same signature: new lengths, left padding, cache rows and data give the reference's
    result, and the replayed call takes the fast launches only."""
    from accuracy import assert_rule
    from flashtriton import configs
    from flashtriton.decode import attention_with_kvcache
    from flashtriton.reference import attention_reference
    gen = torch.Generator().manual_seed(5)
    B, SQ, HKV, G, D, cap = 3, 1024, 2, 4, 128, 3072
    assert configs.kvcache_prefill(G, SQ)
    k_cache = torch.randn(B + 1, cap, HKV, D, generator=gen).cuda().bfloat16()
    v_cache = torch.randn(B + 1, cap, HKV, D, generator=gen).cuda().bfloat16()
    for call in range(3):
        q = torch.randn(B, SQ, HKV * G, D, generator=gen).cuda().bfloat16()
        k_new = v_new = None
        if append:
            k_new = torch.randn(B, 16, HKV, D, generator=gen).cuda().bfloat16()
            v_new = torch.randn(B, 16, HKV, D, generator=gen).cuda().bfloat16()
        n_new = 16 if append else 0
        lens = torch.tensor([1100 + 300 * call, 2000 - 400 * call, 1500], dtype=torch.int32)
        pad = torch.tensor([7 * call, 100, 0], dtype=torch.int32)
        rows = torch.tensor([(call + b) % (B + 1) for b in range(B)], dtype=torch.int32)
        before = runtime.FAST_LAUNCHES
        out, lse = attention_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens.cuda(),
            cache_batch_idx=rows.cuda(), cache_leftpad=pad.cuda(), causal=True,
            return_lse=return_lse)
        if call == 2:  # spans + forward (+ the append) replayed
            assert runtime.FAST_LAUNCHES - before == 2 + append
        assert (lse is not None) == return_lse
        for b in range(B):
            r, first, n = int(rows[b]), int(pad[b]), int(lens[b]) + n_new
            kk, vv = k_cache[r:r + 1, first:n], v_cache[r:r + 1, first:n]
            ref = attention_reference(q[b:b + 1], kk, vv, causal=True)
            pt = attention_reference(q[b:b + 1], kk, vv, causal=True, dtype=torch.bfloat16)
            assert_rule(f"call {call} out[{b}]", out[b:b + 1], ref.out, pt.out, 2, torch.bfloat16)
            if return_lse:
                assert_rule(f"call {call} lse[{b}]", lse[b:b + 1], ref.lse, pt.lse, 2,
                            torch.bfloat16)


@pytest.mark.parametrize("B,HKV,kind", [(2, 8, "MergeKernel"), (16, 16, "OneSplit")],
                         ids=["merge", "one-split"])
def test_dense_split_replays_into_the_forwards_outputs(monkeypatch, B, HKV, kind):
    """A dense one-token call over 8K keys in SDPA's (B, H, N, D) layout on the split route is
    remembered under the forward's signature (a DenseSplit: the split and merge launches, or
    one split's, into the forward's out and LSE) and replayed on new tensors of that
    signature: each call within the accuracy rule of the float64 reference, the replayed
    one equal bit for bit to the same call with fast launches off."""
    from accuracy import assert_rule
    from flashtriton.launch import decode_replay
    from flashtriton.reference import attention_reference
    monkeypatch.setattr(runtime, "_CALLS", {})
    H, N, D = 2 * HKV, 8192, 128

    def qkv():
        q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(B, HKV, N, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))
        return q, k, v

    def check(name, q, k, v, res):
        ref = attention_reference(q.double(), k.double(), v.double())
        low = attention_reference(q, k, v, dtype=torch.bfloat16)
        assert_rule(name + " out", res.out, ref.out, low.out, 2, torch.bfloat16)
        assert_rule(name + " lse", res.lse, ref.lse, low.lse, 2, torch.bfloat16)

    first = qkv()
    check("first call", *first, flash_attention_with_lse(*first))
    (record,) = [e[0] for e in runtime._CALLS.values() if type(e[0]) is decode_replay.DenseSplit]
    assert type(record.record).__name__ == kind
    replays = runtime.FAST_LAUNCHES
    second = qkv()
    replayed = flash_attention_with_lse(*second)
    assert runtime.FAST_LAUNCHES == replays + (1 if kind == "OneSplit" else 2)
    check("replayed call", *second, replayed)
    monkeypatch.setattr(runtime._env, "FAST_LAUNCH", False)
    eager = flash_attention_with_lse(*second)
    assert torch.equal(replayed.out, eager.out) and torch.equal(replayed.lse, eager.lse)


def test_dense_split_first_met_in_a_capture(monkeypatch):
    """A CUDA graph's capture holding the split route's first call at a key length (its
    launches remembered there): an eager call at that length before any replay (replaying
    the capture's record) and the graph's replay both equal a call that starts afresh."""
    q, k, v = make_qkv(2, 1, 8192 + 128, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        flash_attention(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    monkeypatch.setattr(runtime, "_CALLS", {})  # then forget the call
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attention(q, k, v)
    replays = runtime.FAST_LAUNCHES
    eager = flash_attention(q, k, v)
    assert runtime.FAST_LAUNCHES > replays  # the capture's record replayed
    graph.replay()
    monkeypatch.setattr(runtime, "_CALLS", {})
    fresh = flash_attention(q, k, v)
    torch.testing.assert_close(eager, fresh, atol=0, rtol=0)
    torch.testing.assert_close(captured, fresh, atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_decoding_steps_on_the_split_route(mode):
    """One-token steps over 8K keys (configs.dense_split: the split-KV kernel) under
    torch.compile, CUDA graphs included (reduce-overhead: its warmup allocates in the graph's
    pool), equal the eager call and the float64 reference; the KV-cache API's step too."""
    import flashtriton
    from accuracy import assert_rule
    from flashtriton.decode import attention_with_kvcache
    from flashtriton.reference import attention_reference
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 1, 8192, 32, 8, 128, torch.bfloat16, "cuda", requires_grad=False)
    assert flashtriton.explain(q, k, v, causal=True).forward == "split"
    step = torch.compile(lambda q, k, v: flash_attention(q, k, v, causal=True), mode=mode)
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True).out
    low = attention_reference(q, k, v, causal=True, dtype=torch.bfloat16).out
    for _ in range(4):  # warmup, recording, replays
        out = step(q, k, v)
        assert_rule("compiled step", out.clone(), ref, low, 2, torch.bfloat16)
    assert torch.equal(out, flash_attention(q, k, v, causal=True))
    cached = torch.compile(lambda q, k, v: attention_with_kvcache(
        q, k, v, cache_seqlens=8192, causal=True, return_lse=False).out, mode=mode)
    for _ in range(4):
        assert_rule("compiled KV-cache step", cached(q, k, v).clone(), ref, low, 2,
                    torch.bfloat16)


def _same_results(results, what):
    """Each call's (out, lse, caches...) bitwise the first's (the contiguous call's)."""
    for i, got in enumerate(results[1:], 1):
        for j, (a, b) in enumerate(zip(got, results[0])):
            assert (a is None and b is None) or torch.equal(a, b), f"{what}: call {i}, item {j}"


@pytest.mark.parametrize("append", [False, True], ids=["step", "append"])
@pytest.mark.parametrize("paged", [0, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("route", ["split", "split-alibi", "prefill"])
def test_kvcache_index_views_equal_contiguous_copies(route, paged, append):
    """cache_seqlens, cache_batch_idx, cache_leftpad, block_table (transposed in memory),
    sinks and ALiBi slopes as strided views, on the split kernel and the prefill route, where
    plain steps replay their launches: a call with views after the contiguous call of the
    same shapes (whose record it must not replay with the views' storage) and again (its own
    record, if any), each with new data, give bitwise the contiguous call's output, LSE and
    caches."""
    from flashtriton.decode import attention_with_kvcache
    from test_index_layouts import _dense, _strided
    gen = torch.Generator().manual_seed(31)
    B, HKV, G, D, cap = 3, 2, 4, 128, 2048
    SQ = 256 if route == "prefill" else 1
    assert configs.kvcache_prefill(G, SQ) == (route == "prefill")
    rand = lambda *shape: torch.randn(*shape, generator=gen).cuda().bfloat16()  # noqa: E731
    rows = B + 1
    if paged:
        n = cap // paged
        k_cache, v_cache = rand(rows * n, paged, HKV, D), rand(rows * n, paged, HKV, D)
    else:
        k_cache, v_cache = rand(rows, cap, HKV, D), rand(rows, cap, HKV, D)
    for call in range(3):
        lens = [1000 + 300 * call, 17, 1900 - 200 * call]
        args = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32).cuda(), causal=True,
                    sinks=torch.randn(HKV * G, generator=gen).cuda())
        if route == "split-alibi":
            args["alibi_slopes"] = torch.rand(B, HKV * G, generator=gen).cuda() * 0.1
        if paged:
            args["block_table"] = torch.randperm(rows * n, generator=gen)[:B * n].view(B, n) \
                .to(torch.int32).cuda()
        else:
            args["cache_batch_idx"] = torch.tensor([(call + b) % rows for b in range(B)],
                                                   dtype=torch.int32).cuda()
            args["cache_leftpad"] = torch.tensor([3 * call, 0, 100], dtype=torch.int32).cuda()
        views = {name: _strided(x) if isinstance(x, torch.Tensor) else x
                 for name, x in args.items()}
        q = rand(B, SQ, HKV * G, D)
        new = (rand(B, 8, HKV, D), rand(B, 8, HKV, D)) if append else (None, None)
        results = []
        for a in (_dense(views), views, views):
            kc, vc = k_cache.clone(), v_cache.clone()
            out, lse = attention_with_kvcache(q, kc, vc, *new, **a)
            results.append((out, lse, kc, vc))
        _same_results(results, f"call {call}")


@pytest.mark.parametrize("case", ["packed", "paged", "paged-decode"])
def test_varlen_seqused_k_views_equal_contiguous_copies(case):
    """flash_attention_varlen with seqused_k, cu_seqlens_q / _k and block_table (transposed in
    memory) as strided views: bitwise the contiguous call's, twice with new data."""
    from flashtriton import flash_attention_varlen_with_lse
    from test_index_layouts import _dense, _strided
    gen = torch.Generator().manual_seed(32)
    H, HKV, D, page = 8, 2, 128, 16
    lens_q = [1, 1, 1] if case == "paged-decode" else [300, 1, 57]
    lens_k = [900, 300, 1500]
    cu = lambda lens: torch.tensor([0, *lens]).cumsum(0).to(torch.int32).cuda()  # noqa: E731
    rand = lambda *shape: torch.randn(*shape, generator=gen).cuda().bfloat16()  # noqa: E731
    for call in range(2):
        q = rand(sum(lens_q), H, D)
        args = dict(cu_seqlens_q=cu(lens_q), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                    causal=True, seqused_k=torch.tensor([n - 5 * (call + 1) for n in lens_k],
                                                        dtype=torch.int32).cuda())
        if case == "packed":
            k, v = rand(sum(lens_k), HKV, D), rand(sum(lens_k), HKV, D)
            args["cu_seqlens_k"] = cu(lens_k)
        else:
            n = -(-max(lens_k) // page)
            k, v = rand(3 * n + 2, page, HKV, D), rand(3 * n + 2, page, HKV, D)
            args["cu_seqlens_k"] = None
            args["block_table"] = torch.randperm(3 * n + 2, generator=gen)[:3 * n].view(3, n) \
                .to(torch.int32).cuda()
        views = {name: _strided(x) if isinstance(x, torch.Tensor) else x
                 for name, x in args.items()}
        results = [tuple(flash_attention_varlen_with_lse(q, k, v, **a))
                   for a in (_dense(views), views, views)]
        _same_results(results, f"{case} call {call}")


@pytest.mark.parametrize("page", [16, 256], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 239), (3, 799), (113, 203), (256, 512),
                                               (799, 3)], ids=lambda s: str(s))
def test_paged_varlen_forward_with_grad_as_flash_attn(seqlen_q, seqlen_k, page):
    """flash-attn's test_flash_attn_varlen_causal with a paged KV cache (batch 8, 9 heads,
    D=128, bf16, random padding): q requires grad, the forward runs (the output requires grad
    and matches the float64 reference), and, as flash-attn has no backward for it, a backward
    raises naming block_table."""
    from accuracy import assert_rule
    from flashtriton.compat import flash_attn as fa
    from flashtriton.reference import attention_reference
    gen = torch.Generator().manual_seed(seqlen_q * 1000 + seqlen_k + page)
    B, H, D, dtype = 8, 9, 128, torch.bfloat16
    lens_q = torch.randint(max(1, seqlen_q // 2), seqlen_q + 1, (B,), generator=gen)
    lens_k = torch.randint(max(1, seqlen_k // 2), seqlen_k + 1, (B,), generator=gen)
    width = -(-seqlen_k // page)
    n_blocks = 3 * B * width
    k_cache = torch.randn(n_blocks, page, H, D, generator=gen).to("cuda", dtype)
    v_cache = torch.randn(n_blocks, page, H, D, generator=gen).to("cuda", dtype)
    table = torch.randperm(n_blocks, generator=gen)[:B * width].view(B, width).to(
        "cuda", torch.int32)
    q = torch.randn(int(lens_q.sum()), H, D, generator=gen).to("cuda", dtype).requires_grad_()
    cu = [torch.cat([torch.zeros(1, dtype=torch.int32), x.cumsum(0).to(torch.int32)]).cuda()
          for x in (lens_q, lens_k)]
    out = fa.flash_attn_varlen_func(q, k_cache, v_cache, cu[0], cu[1], seqlen_q, seqlen_k, 0.0,
                                    causal=True, block_table=table)
    assert out.requires_grad and out.shape == q.shape
    with torch.no_grad():
        assert torch.equal(out, fa.flash_attn_varlen_func(
            q, k_cache, v_cache, cu[0], cu[1], seqlen_q, seqlen_k, 0.0, causal=True,
            block_table=table))
    for b in range(B):
        rows = slice(int(cu[0][b]), int(cu[0][b + 1]))
        pages = table[b].long()
        ks, vs = (x[pages].flatten(0, 1)[None, :int(lens_k[b])] for x in (k_cache, v_cache))
        qs = q[rows].detach()[None]
        ref = attention_reference(qs, ks, vs, causal=True)
        pt = attention_reference(qs, ks, vs, causal=True, dtype=dtype)
        assert_rule(f"out[{b}]", out[rows].detach()[None], ref.out, pt.out, 2, dtype)
    with pytest.raises(NotImplementedError, match="block_table"):
        out.backward(torch.randn_like(out))


_REGISTRY = pytest.mark.skipif(not hasattr(torch.nn.attention, "activate_flash_attention_impl"),
                               reason="torch < 2.11 has no flash-attention registry")


def _profiled(step):
    """step() under torch.profiler: the names of its ops and GPU kernels."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


def _ran_flashtriton(names):
    """Whether flashtriton's forward and backward ran and aten's own flash kernels did not."""
    return ({"flashtriton::attn_fwd", "flashtriton::attn_bwd"} <= names
            and any(n.startswith("_attn_fwd") for n in names)
            and not any("flash_fwd" in n or "flash_bwd" in n for n in names))


def _activated(step):
    """step() profiled with "flashtriton" active in torch's flash-attention registry."""
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
    activate_flash_attention_impl("flashtriton")
    try:
        return _profiled(step)
    finally:
        restore_flash_attention_impl()


@_REGISTRY
def test_torch_registry_runs_transformers_sdpa_flash_on_flashtriton():
    """A tiny random Llama with attn_implementation="sdpa" under SDPBackend.FLASH_ATTENTION:
    after activate_flash_attention_impl("flashtriton") its attention runs flashtriton's kernels
    (the profiler sees them and not aten's flash kernels, which the run before activation
    shows), and its logits and parameter gradients meet the accuracy rule against a float64
    eager copy, torch's flash run being the low-precision baseline."""
    transformers = pytest.importorskip("transformers")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from accuracy import assert_rule
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    ids = torch.randint(0, 128, (2, 200), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    got = {}

    def run(name, dtype, impl):
        torch.manual_seed(0)  # the same weights for every copy
        model = transformers.LlamaForCausalLM(cfg).to("cuda", dtype)
        model.set_attn_implementation(impl)

        def step():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                logits = model(ids).logits
            logits.double().pow(2).mean().backward()
            got[name] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
        return step

    run("ref", torch.float64, "eager")()
    stock = _profiled(run("torch", torch.bfloat16, "sdpa"))
    assert any("flash_fwd" in n for n in stock) and not _ran_flashtriton(stock)
    assert _ran_flashtriton(_activated(run("ours", torch.bfloat16, "sdpa")))
    (ref, ref_g), (pt, pt_g), (ours, ours_g) = got["ref"], got["torch"], got["ours"]
    assert_rule("logits", ours, ref, pt, 2, torch.bfloat16)
    for n in ref_g:
        assert_rule(f"grad {n}", ours_g[n], ref_g[n], pt_g[n], 3, torch.bfloat16)


@_REGISTRY
def test_torch_registry_runs_varlen_attn_on_flashtriton():
    """torch.nn.attention.varlen_attn (causal, a sequence with fewer keys than queries) after
    activation: flashtriton's kernels run, out and the LSE (+inf where a row sees no key, as
    aten's kernel gives) and the gradients meet the accuracy rule against a float64 loop over
    sequences, torch's flash run being the low-precision baseline."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    from accuracy import assert_rule
    from flashtriton.reference import attention_reference
    lens_q, lens_k, H, D, dtype = [5, 64, 130], [3, 64, 100], 4, 64, torch.bfloat16
    cu_q, cu_k = (torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
                  for lens in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), H, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(sum(lens_k), H, D, device="cuda", dtype=dtype) for _ in "kv")
    dout = torch.randn_like(q)
    got = {}

    def run(name):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

        def step():
            out, lse = varlen_attn(*leaves, cu_q, cu_k, max(lens_q), max(lens_k),
                                   window_size=(-1, 0), return_aux=AuxRequest(lse=True))
            got[name] = (out.detach(), lse, *torch.autograd.grad(out, leaves, dout))
        return step

    assert not _ran_flashtriton(_profiled(run("torch")))
    assert _ran_flashtriton(_activated(run("ours")))
    ref = []
    for b in range(len(lens_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        leaves = [x[s].double()[None].requires_grad_() for x, s in ((q, rows), (k, keys),
                                                                     (v, keys))]
        r = attention_reference(*leaves, causal=True)
        grads = torch.autograd.grad(r.out, leaves, dout[rows].double()[None])
        ref.append((r.out[0].detach(), r.lse[0], *(g[0] for g in grads)))
    ref_out, ref_lse = torch.cat([r[0] for r in ref]), torch.cat([r[1] for r in ref], dim=1)
    ref_grads = [torch.cat([r[i] for r in ref]) for i in (2, 3, 4)]
    ref_lse = ref_lse.masked_fill(ref_lse == float("-inf"), float("inf"))
    ours, pt = got["ours"], got["torch"]
    assert torch.equal(torch.isposinf(ours[1]), torch.isposinf(pt[1]))
    assert torch.isposinf(ours[1][:, :2]).all()
    for i, (name, r) in enumerate(zip(("out", "lse", "dq", "dk", "dv"),
                                      (ref_out, ref_lse, *ref_grads))):
        assert_rule(name, ours[i], r, pt[i], 2 if i < 2 else 3, dtype)


def _check_causal_sdpa(got, q, k, v, dout):
    """got["ours"] and got["torch"] (out, dq, dk, dv) of causal SDPA on (B, H, N, D) q, k, v:
    ours meets the accuracy rule against float64, torch's run being the baseline."""
    from accuracy import assert_rule
    from flashtriton.reference import attention_reference
    leaves = [x.double().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    r = attention_reference(*leaves, causal=True)
    ref = (r.out.transpose(1, 2), *(g.transpose(1, 2) for g in torch.autograd.grad(
        r.out, leaves, dout.double().transpose(1, 2))))
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        assert_rule(name, got["ours"][i], ref[i], got["torch"][i], 2 if i == 0 else 3, q.dtype)


@_REGISTRY
def test_torch_registry_runs_compiled_sdpa_on_flashtriton():
    """torch.compile of a function calling SDPA under the flash backend, compiled and run
    after activation: the compiled graph's flash operators run flashtriton's kernels
    (profiler), and out and the gradients meet the accuracy rule against float64, torch's
    flash run (uncompiled, before activation) being the low-precision baseline."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, N, D, dtype = 2, 4, 300, 64, torch.bfloat16
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
    dout = torch.randn_like(q)

    def attend(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    got = {}

    def run(name, fn):
        def step():
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            out = fn(*leaves)
            got[name] = (out.detach(), *torch.autograd.grad(out, leaves, dout))
        return step

    run("torch", attend)()
    torch._dynamo.reset()
    assert _ran_flashtriton(_activated(run("ours", torch.compile(attend))))
    torch._dynamo.reset()
    _check_causal_sdpa(got, q, k, v, dout)


@_REGISTRY
def test_torch_registry_runs_context_parallel_on_flashtriton():
    """torch's context_parallel over a world of one GPU (NCCL, this process) under the flash
    backend after activation: its ring's flash operators run flashtriton's kernels
    (profiler), and out and the gradients meet the accuracy rule against float64, torch's
    flash run (no context parallelism, before activation) being the low-precision baseline."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not dist.is_nccl_available() or dist.is_initialized():
        pytest.skip("needs NCCL and no process group of the test run's own")
    B, H, N, D, dtype = 2, 4, 256, 64, torch.bfloat16
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
    dout = torch.randn_like(q)
    got = {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))

        def run(name, parallel):
            def step():
                leaves = [x.detach().clone() for x in (q, k, v)]
                context = (context_parallel(mesh, buffers=leaves, buffer_seq_dims=[2, 2, 2])
                           if parallel else contextlib.nullcontext())
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION), context:
                    for x in leaves:
                        x.requires_grad_()
                    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
                    got[name] = (out.detach(), *torch.autograd.grad(out, leaves, dout))
            return step

        run("torch", False)()
        assert _ran_flashtriton(_activated(run("ours", True)))
    finally:
        dist.destroy_process_group()
    _check_causal_sdpa(got, q, k, v, dout)
