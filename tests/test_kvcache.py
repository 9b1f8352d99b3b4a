"""KV-cache decoding: contiguous and paged caches, appends, splits, against the float64
reference."""

import pytest
import torch

from accuracy import assert_rule
from conftest import DEVICE, ON_GPU
from flashtriton import flash_attention_with_lse
from flashtriton import configs, runtime
from flashtriton.compat import flash_attn as fa
from flashtriton.decode import attention_with_kvcache, merge_attention_states
from flashtriton.reference import attention_reference

DT = torch.bfloat16
CAP = 1024 if ON_GPU else 96  # cache capacity per sequence


def _paged(k_full, v_full, page_size, gen):
    """Contiguous (B, CAP, HKV, D) caches scattered into shuffled pages, and the block table."""
    B, cap, HKV, D = k_full.shape
    n = cap // page_size
    perm = torch.randperm(B * n, generator=gen).to(DEVICE)
    pages = []
    for full in (k_full, v_full):
        p = torch.zeros(B * n, page_size, HKV, D, dtype=full.dtype, device=DEVICE)
        p[perm] = full.reshape(B * n, page_size, HKV, D)
        pages.append(p)
    return pages[0], pages[1], perm.view(B, n).to(torch.int32)


def _reference(q, k_full, v_full, lens, causal, **opts):
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        args = (q[b:b + 1], k_full[b:b + 1, :n], v_full[b:b + 1, :n])
        ref = attention_reference(*args, causal=causal, **opts)
        pt = attention_reference(*args, causal=causal, dtype=q.dtype, **opts)
        outs.append((ref, pt))
    cat = lambda i, f: torch.cat([f(o[i]) for o in outs])  # noqa: E731
    return (cat(0, lambda r: r.out), cat(0, lambda r: r.lse), cat(1, lambda r: r.out),
            cat(1, lambda r: r.lse))


# Page sizes 8-256 (the CPU's 96-token caches cannot hold a 256-token page; the GPU's can).
PAGES = [0, 8, 32] + ([256] if ON_GPU else [])


@pytest.mark.parametrize("paged", PAGES, ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("sq,causal", [(1, False), (4, True), (3, False)],
                         ids=["decode", "spec4-causal", "chunk3"])
def test_kvcache_matches_reference(paged, sq, causal):
    gen = torch.Generator().manual_seed(0)
    B, H, HKV, D = 3, 8, 2, 64
    k_full = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    v_full = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    lens = torch.tensor([CAP // 3 + 5, 1, CAP - 7], dtype=torch.int32)  # ragged, one with 1 key
    q = torch.randn(B, sq, H, D, generator=gen).to(DEVICE, DT)
    if paged:
        k_cache, v_cache, table = _paged(k_full, v_full, paged, gen)
    else:
        k_cache, v_cache, table = k_full.clone(), v_full.clone(), None
    ref_out, ref_lse, pt_out, pt_lse = _reference(q, k_full, v_full, lens, causal)
    results = []
    for splits in (1, 3, 0):
        out, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens.to(DEVICE),
                                          block_table=table, causal=causal, num_splits=splits)
        assert_rule(f"out[splits={splits}]", out, ref_out, pt_out, 2, DT)
        assert_rule(f"lse[splits={splits}]", lse, ref_lse, pt_lse, 2, DT)
        results.append(out)
    # Splits change only the summation order.
    torch.testing.assert_close(results[0], results[1], atol=2e-2, rtol=0)


@pytest.mark.parametrize("paged", [0, 16], ids=["contiguous", "page16"])
def test_append_then_attend(paged):
    gen = torch.Generator().manual_seed(1)
    B, H, HKV, D, new = 2, 4, 4, 32, 5
    lens = torch.tensor([13, 14], dtype=torch.int32)     # appends cross page boundaries (16)
    k_full = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    v_full = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    k_new = torch.randn(B, new, HKV, D, generator=gen).to(DEVICE, DT)
    v_new = torch.randn(B, new, HKV, D, generator=gen).to(DEVICE, DT)
    q = torch.randn(B, new, H, D, generator=gen).to(DEVICE, DT)
    if paged:
        k_cache, v_cache, table = _paged(k_full, v_full, paged, gen)
    else:
        table, k_cache, v_cache = None, k_full.clone(), v_full.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                          cache_seqlens=lens.to(DEVICE), block_table=table,
                                          causal=True, return_softmax_lse=True)
    for b in range(B):  # the reference cache after the append
        k_full[b, lens[b]:lens[b] + new] = k_new[b]
        v_full[b, lens[b]:lens[b] + new] = v_new[b]
    if paged:  # the new tokens landed in the right pages
        got = k_cache[table.long()].reshape(B, CAP, HKV, D)
        assert torch.equal(got, k_full)
    else:
        assert torch.equal(k_cache, k_full)
    ref_out, ref_lse, pt_out, pt_lse = _reference(q, k_full, v_full, lens + new, True)
    assert_rule("out", out, ref_out, pt_out, 2, DT)
    assert_rule("lse", lse, ref_lse, pt_lse, 2, DT)


def test_variants_and_batch_idx():
    gen = torch.Generator().manual_seed(2)
    B, H, HKV, D = 2, 4, 2, 32
    k_cache = torch.randn(4, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    v_cache = torch.randn(4, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    idx = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([50, 77], dtype=torch.int32)
    q = torch.randn(B, 2, H, D, generator=gen).to(DEVICE, DT)
    slopes = torch.rand(H, generator=gen).to(DEVICE) * 0.2
    opts = dict(window_size=(20, 0), softcap=15.0, alibi_slopes=slopes)
    out, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens.to(DEVICE),
                                      cache_batch_idx=idx, causal=True, num_splits=2, **opts)
    ref_out, ref_lse, pt_out, pt_lse = _reference(q, k_cache[idx.long()], v_cache[idx.long()],
                                                  lens, True, **opts)
    assert_rule("out", out, ref_out, pt_out, 2, DT)
    assert_rule("lse", lse, ref_lse, pt_lse, 2, DT)


def test_merge_attention_states_equals_attention_over_the_union():
    q = torch.randn(2, 7, 4, 32, device=DEVICE, dtype=DT)
    k = torch.randn(2, 50, 2, 32, device=DEVICE, dtype=DT)
    v = torch.randn(2, 50, 2, 32, device=DEVICE, dtype=DT)
    a = flash_attention_with_lse(q, k[:, :20], v[:, :20])
    b = flash_attention_with_lse(q, k[:, 20:], v[:, 20:])
    merged = merge_attention_states([a.out, b.out], [a.lse, b.lse])
    whole = flash_attention_with_lse(q, k, v)
    torch.testing.assert_close(merged.out, whole.out, atol=1e-2, rtol=0)
    torch.testing.assert_close(merged.lse, whole.lse, atol=1e-4, rtol=0)


def test_kvcache_bad_input():
    q = torch.randn(1, 1, 4, 32, device=DEVICE, dtype=DT)
    cache = torch.randn(1, 64, 2, 32, device=DEVICE, dtype=DT)
    with pytest.raises(ValueError, match="page_size"):
        attention_with_kvcache(q, cache[:, :12], cache[:, :12], cache_seqlens=5,
                               block_table=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="cache_seqlens"):
        attention_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([5], device=DEVICE))
    with pytest.raises(ValueError, match="cache_leftpad"):
        fa.flash_attn_with_kvcache(q, cache, cache, cache_leftpad=torch.zeros(1, device=DEVICE))
    with pytest.raises(ValueError, match="rotary_cos"):
        attention_with_kvcache(q, cache, cache, rotary_cos=torch.ones(8, 20, device=DEVICE),
                               rotary_sin=torch.ones(8, 20, device=DEVICE))


def _rotate_complex(x, pos, theta, rd, interleaved):
    """Independent rotary reference: channel pairs as complex numbers times e^(i * pos * theta)."""
    xr = x[..., :rd].double()
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        z = torch.complex(xr[..., : rd // 2], xr[..., rd // 2:])
    z = z * torch.polar(torch.ones_like(theta), pos.double()[:, :, None, None] * theta)
    rot = (torch.stack([z.real, z.imag], -1).flatten(-2) if interleaved
           else torch.cat([z.real, z.imag], -1))
    return torch.cat([rot, x[..., rd:].double()], -1)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_rotary_on_q_and_new_k(interleaved, causal):
    gen = torch.Generator().manual_seed(3)
    B, H, HKV, D, rd, new = 2, 4, 2, 32, 16, 3
    theta = 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).to(DEVICE)
    pos_all = torch.arange(CAP, device=DEVICE, dtype=torch.float64)[:, None] * theta
    cos, sin = pos_all.cos().float(), pos_all.sin().float()
    k_cache = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, torch.float32)
    v_cache = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, torch.float32)
    lens = torch.tensor([10, 31], dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, new, H, D, generator=gen).to(DEVICE)
    k_new = torch.randn(B, new, HKV, D, generator=gen).to(DEVICE)
    v_new = torch.randn(B, new, HKV, D, generator=gen).to(DEVICE)
    steps = torch.arange(new, device=DEVICE)
    q_pos = lens[:, None] + (steps if causal else 0 * steps)
    k_pos = lens[:, None] + steps
    k_ref, v_ref = k_cache.clone().double(), v_cache.clone().double()
    k_rot = _rotate_complex(k_new, k_pos, theta, rd, interleaved)
    for b in range(B):
        k_ref[b, lens[b]:lens[b] + new] = k_rot[b]
        v_ref[b, lens[b]:lens[b] + new] = v_new[b].double()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                     rotary_sin=sin, cache_seqlens=lens, causal=causal,
                                     rotary_interleaved=interleaved)
    torch.testing.assert_close(k_cache.double(), k_ref, atol=1e-5, rtol=0)  # rotated k stored
    q_rot = _rotate_complex(q, q_pos, theta, rd, interleaved)
    for b in range(B):
        n = int(lens[b]) + new
        ref = attention_reference(q_rot[b:b + 1], k_ref[b:b + 1, :n], v_ref[b:b + 1, :n],
                                  causal=causal)
        torch.testing.assert_close(out[b:b + 1].double(), ref.out, atol=2e-5, rtol=0)


def test_paged_kv_cache_helper():
    from flashtriton.decode import PagedKVCache
    gen = torch.Generator().manual_seed(4)
    H, HKV, D = 4, 2, 32
    cache = PagedKVCache(num_pages=12, page_size=8, num_kv_heads=HKV, head_dim=D, dtype=DT,
                         device=DEVICE)
    history = {"a": [], "b": []}
    for s in history:
        cache.add(s)

    def step(seq_ids, n):
        q = torch.randn(len(seq_ids), n, H, D, generator=gen).to(DEVICE, DT)
        k = torch.randn(len(seq_ids), n, HKV, D, generator=gen).to(DEVICE, DT)
        v = torch.randn(len(seq_ids), n, HKV, D, generator=gen).to(DEVICE, DT)
        out = cache.attend(q, k, v, seq_ids, causal=True)
        for i, s in enumerate(seq_ids):  # dense reference over the whole history
            history[s].append((k[i], v[i]))
            kk = torch.cat([x[0] for x in history[s]])[None]
            vv = torch.cat([x[1] for x in history[s]])[None]
            ref = attention_reference(q[i:i + 1], kk, vv, causal=True)
            pt = attention_reference(q[i:i + 1], kk, vv, causal=True, dtype=DT)
            assert_rule(f"out[{s}]", out[i:i + 1], ref.out, pt.out, 2, DT)

    step(["a", "b"], 11)       # prefill: 2 pages each
    step(["a", "b"], 1)        # decode steps, ragged afterwards
    step(["b"], 6)             # b crosses into its third page
    assert cache.length("a") == 12 and cache.length("b") == 18
    assert cache.free_pages == 12 - 2 - 3
    cache.free("a")
    assert cache.free_pages == 12 - 3
    cache.add("c")
    history["c"] = []
    step(["c", "b"], 9)        # c reuses a's pages
    with pytest.raises(MemoryError):
        cache.attend(torch.zeros(1, 1, H, D, dtype=DT, device=DEVICE),
                     torch.zeros(1, 100, HKV, D, dtype=DT, device=DEVICE),
                     torch.zeros(1, 100, HKV, D, dtype=DT, device=DEVICE), ["c"])


def test_cache_leftpad():
    gen = torch.Generator().manual_seed(6)
    B, H, HKV, D, new = 2, 4, 2, 32, 2
    k_cache = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    v_cache = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    lens = torch.tensor([40, 60], dtype=torch.int32, device=DEVICE)
    pad = torch.tensor([7, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, new, H, D, generator=gen).to(DEVICE, DT)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cache_leftpad=pad,
                                     causal=True, num_splits=3)
    for b in range(B):  # the same as an unpadded cache holding keys pad[b]:lens[b]
        kk, vv = k_cache[b:b + 1, pad[b]:lens[b]], v_cache[b:b + 1, pad[b]:lens[b]]
        ref = attention_reference(q[b:b + 1], kk, vv, causal=True)
        pt = attention_reference(q[b:b + 1], kk, vv, causal=True, dtype=DT)
        assert_rule(f"out[{b}]", out[b:b + 1], ref.out, pt.out, 2, DT)


@pytest.mark.parametrize("paged", [0, 16], ids=["contiguous", "page16"])
def test_k_and_v_caches_with_different_layouts(paged):
    # K and V addresses are computed once when their strides agree (a packed kv buffer, or
    # two caches alike), separately otherwise: here V is a (heads, tokens) major view.
    gen = torch.Generator().manual_seed(4)
    B, H, HKV, D = 2, 4, 2, 32
    k_full = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    v_full = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    q = torch.randn(B, 1, H, D, generator=gen).to(DEVICE, DT)
    lens = torch.tensor([CAP - 3, CAP // 2], dtype=torch.int32)
    if paged:
        k_cache, v_cache, table = _paged(k_full, v_full, paged, gen)
    else:
        k_cache, v_cache, table = k_full, v_full, None
    v_other = v_cache.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert v_other.stride() != k_cache.stride()
    ref_out, ref_lse, pt_out, pt_lse = _reference(q, k_full, v_full, lens, False)
    for splits in (1, 2):
        out, lse = attention_with_kvcache(q, k_cache, v_other, cache_seqlens=lens.to(DEVICE),
                                          block_table=table, num_splits=splits)
        assert_rule(f"out[splits={splits}]", out, ref_out, pt_out, 2, DT)
        assert_rule(f"lse[splits={splits}]", lse, ref_lse, pt_lse, 2, DT)


def test_one_split_writes_the_output_without_a_merge(monkeypatch):
    # One split (batches that fill the GPU, or num_splits=1) writes its result as the
    # output: no partial buffers, no merge launch; more splits merge (here by the merge
    # kernel, as under a CUDA graph's capture).
    from flashtriton.launch import decode as decode_launch
    monkeypatch.setattr(configs, "DECODE_MERGE_IN_KERNEL", False)
    merges = []
    real = decode_launch.merge_partials
    monkeypatch.setattr(decode_launch, "merge_partials",
                        lambda *a: merges.append(a[0].shape[0]) or real(*a))  # splits merged
    gen = torch.Generator().manual_seed(3)
    B, H, HKV, D = 2, 4, 2, 32
    k_cache = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    v_cache = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    q = torch.randn(B, 1, H, D, generator=gen).to(DEVICE, DT)
    lens = torch.tensor([CAP, 5], dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the first call launches, the second replays
        one = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=1)
    assert merges == []
    two = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=2)
    assert merges == [2]
    torch.testing.assert_close(one.out, two.out, atol=2e-2, rtol=0)
    torch.testing.assert_close(one.lse, two.lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("in_kernel", [True, False], ids=["in-kernel", "merge-kernel"])
def test_splits_merged_in_the_kernel_or_by_the_merge_kernel(monkeypatch, in_kernel):
    # Eager steps over small caches merge their splits in the split kernel (the split that
    # finishes last, found by a count per (sequence, KV head) in the stream's workspace) where
    # it loads them at once (4 here: 16 rows of 128); with the switch off (or under a capture,
    # over large caches, over more splits) the merge kernel does. Both match the reference,
    # and the counts end at zero.
    from flashtriton.launch import decode as decode_launch
    from flashtriton.launch import decode_replay
    monkeypatch.setattr(configs, "DECODE_MERGE_IN_KERNEL", in_kernel)
    monkeypatch.setattr(configs, "DECODE_MERGE_MAX_BYTES", 1 << 30)  # the GPU's caches are larger
    merges = []  # the MERGE of each split kernel launch
    real = runtime._launch
    monkeypatch.setattr(runtime, "_launch",
                        lambda *a, **kw: merges.append(kw["MERGE"]) or real(*a, **kw))
    gen = torch.Generator().manual_seed(5)
    B, H, HKV, D, SQ = 2, 8, 2, 128, 4
    k_cache = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    v_cache = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    q = torch.randn(B, SQ, H, D, generator=gen).to(DEVICE, DT)
    lens = torch.tensor([CAP - 3, CAP // 2], dtype=torch.int32, device=DEVICE)
    ref_out, ref_lse, pt_out, pt_lse = _reference(q, k_cache, v_cache, lens, True)
    assert configs.decode_splits(4, B, HKV, CAP, configs.decode_split_granule(),
                                 decode_launch._num_sms(q.device)) == 4
    for _ in range(2):  # the first call launches, the second replays (on the GPU)
        out, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                          num_splits=4)
        assert_rule("out", out, ref_out, pt_out, 2, DT)
        assert_rule("lse", lse, ref_lse, pt_lse, 2, DT)
    # a first call runs the merge kernel's way too (what a capture takes) where the step will
    # replay (on the GPU); a replay calls no launcher
    if in_kernel:
        assert merges == ([False, True] if ON_GPU else [True, True])
    else:
        assert merges[0] is False and True not in merges
    if in_kernel:
        counts = decode_replay._workspace(q, 0)[0][:decode_replay._COUNTS].view(torch.int32)
        assert int(counts.abs().sum()) == 0
        merges.clear()
        attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=5)
        assert merges[0] is False and True not in merges  # 5 splits: two loads


@pytest.mark.parametrize("splits,in_kernel", [(1, False), (4, False), (4, True)],
                         ids=["one-split", "merge-kernel", "in-kernel"])
def test_without_lse_the_output_is_the_same(monkeypatch, splits, in_kernel):
    # return_lse=False (flash-attn's return_softmax_lse=False) stores and allocates no LSE:
    # the output is the one with the LSE, bit for bit, on each way a step can take (on the GPU
    # also when replayed), and the LSE's own calls still return it.
    monkeypatch.setattr(configs, "DECODE_MERGE_IN_KERNEL", in_kernel)
    monkeypatch.setattr(configs, "DECODE_MERGE_MAX_BYTES", 1 << 30)
    merges = []  # the MERGE of each split kernel launch
    real = runtime._launch
    monkeypatch.setattr(runtime, "_launch",
                        lambda *a, **kw: merges.append(kw["MERGE"]) or real(*a, **kw))
    gen = torch.Generator().manual_seed(8)
    B, H, HKV, D = 2, 8, 2, 32
    k_cache = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    v_cache = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    q = torch.randn(B, 1, H, D, generator=gen).to(DEVICE, DT)
    lens = torch.tensor([CAP - 1, CAP // 3], dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the first call launches, the second replays (on the GPU)
        with_lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                          num_splits=splits)
        out, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                          num_splits=splits, return_lse=False)
        assert lse is None and with_lse.lse is not None
        assert torch.equal(out, with_lse.out)
        compat = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                            num_splits=splits)
        assert isinstance(compat, torch.Tensor) and torch.equal(compat, with_lse.out)
    assert in_kernel == (True in merges)
    ref_out, _, pt_out, _ = _reference(q, k_cache, v_cache, lens, False)
    assert_rule("out", out, ref_out, pt_out, 2, DT)


def test_workspaces_of_many_streams_are_bounded(monkeypatch):
    # A workspace per (device, stream) for the in-kernel merge: a program that makes streams
    # without end must not keep one for each; a workspace grows (zeroed) for larger steps.
    from flashtriton.launch import decode_replay
    full = {(7, stream): None for stream in range(decode_replay._WORKSPACES_MAX)}
    monkeypatch.setattr(decode_replay, "_WORKSPACES", full)
    x = torch.zeros(1, device=DEVICE)
    buf, n, ptr = decode_replay._workspace(x, 100)
    assert (len(decode_replay._WORKSPACES) == 1 and n == decode_replay._COUNTS + 100
            and ptr == buf.data_ptr())
    assert decode_replay._workspace(x, 50)[0] is buf  # room enough: the same one
    bigger = decode_replay._workspace(x, 200)[0]
    assert bigger.numel() == decode_replay._COUNTS + 200 and int(bigger.abs().sum()) == 0


def test_merge_partials_over_many_splits():
    # More splits than the merge kernel loads at once (64 of 128 columns), some empty (LSE
    # -inf, weight 0), one row with every split empty (out 0, LSE -inf): against float64.
    from flashtriton.decode import merge_partials
    gen = torch.Generator().manual_seed(6)
    S, B, H, SQ, D = 70, 1, 2, 1, 128
    o_part = torch.randn(S, B, H, SQ, D, generator=gen).to(DEVICE)
    lse_part = (4 * torch.randn(S, B, H, SQ, generator=gen)).to(DEVICE)
    lse_part[::3] = float("-inf")
    lse_part[:, :, 1] = float("-inf")
    out = torch.empty(B, SQ, H, D, dtype=DT, device=DEVICE)
    lse = torch.empty(B, H, SQ, device=DEVICE)
    merge_partials(o_part, lse_part, out, lse)
    w = torch.softmax(lse_part[:, :, 0].double(), 0)                  # (S, B, SQ)
    want = (w[..., None] * o_part[:, :, 0].double()).sum(0)           # (B, SQ, D)
    torch.testing.assert_close(out[:, :, 0].double(), want, atol=1e-2, rtol=0)
    torch.testing.assert_close(lse[:, 0].double(), torch.logsumexp(lse_part[:, :, 0].double(), 0),
                               atol=1e-5, rtol=0)
    assert bool((out[:, :, 1] == 0).all()) and bool((lse[:, 1] == float("-inf")).all())


@pytest.mark.parametrize("B, HKV, N, want", [(4, 8, 65536, 8), (1, 8, 65536, 16),
                                             (1, 8, 32768, 16), (1, 8, 16384, 16),
                                             (1, 8, 4096, 16), (2, 8, 2048, 8),
                                             (1, 4, 4096, 32), (4, 8, 4096, 8),
                                             (2, 8, 131072, 8), (8, 8, 131072, 4),
                                             (16, 8, 65536, 2), (16, 8, 1024, 2),
                                             (64, 8, 65536, 1), (1, 8, 1024, 8),
                                             (64, 8, 1024, 1)])
def test_split_heuristic_fills_the_gpu_in_one_wave(B, HKV, N, want):
    # 132 SMs (H200): one program per SM where that makes >= 8 splits of >= 256 keys, else
    # at most two per SM, without a nearly empty extra wave, at most one 128-key tile each (a
    # 1K cache at B=1: 8 splits).
    splits = configs.decode_splits(0, B, HKV, N, 128, 132)
    assert splits == want
    programs = splits * B * HKV
    if splits >= 8 and N >= 256 * splits and programs <= 132:
        assert 132 - B * HKV < programs  # one wave
    else:
        assert splits in (1, N // 128) or 132 < programs <= 2 * 132
    assert configs.decode_splits(5, B, HKV, 65536, 128, 132) == 5  # explicit
    for two_per_sm in (dict(paged=True), dict(fp8=True)):  # paged or fp8 caches: two per SM
        n = configs.decode_splits(0, B, HKV, N, 128, 132, **two_per_sm)
        assert n in (1, N // 128) or 132 < n * B * HKV <= 2 * 132


def test_decode_tile_is_tuned_per_grid_waves(monkeypatch):
    # Splits of the same length over grids of different sizes tune their own tiles (a tile
    # tuned for one wave of programs read four waves 0.5% slower than SDPA, perf-journal.md): on
    # 4 SMs, B=1 over 8 split granules (8 splits of one) and B=16 over one (one split each)
    # share the split bucket, in 2 and 4 waves.
    from flashtriton import configs, launch
    from flashtriton.launch import decode as decode_launch
    monkeypatch.setattr(runtime, "_TUNED", {})
    monkeypatch.setattr(decode_launch, "_num_sms", lambda device: 4)
    g = configs.decode_split_granule()  # 16 in the interpreter, 128 on a GPU
    keys = []
    for B, N in [(1, 8 * g), (16, g)]:
        q = torch.randn(B, 1, 2, 16, device=DEVICE)
        kc, vc = (torch.randn(B, N, 1, 16, device=DEVICE) for _ in range(2))
        out = attention_with_kvcache(q, kc, vc, cache_seqlens=N, return_lse=False).out
        ref = attention_reference(q.double(), kc.double(), vc.double()).out
        low = attention_reference(q, kc, vc, dtype=torch.float32).out
        assert_rule(f"out[B={B}]", out, ref, low, 2, torch.float32)
        keys += [k[1] for k in runtime._TUNED if k[0] == id(launch.triton_attn._decode) and k[1] not in keys]
    assert len(keys) == 2 and keys[0][1] == keys[1][1], keys  # one split bucket
    assert (keys[0][2], keys[1][2]) == (2, 4), keys  # waves


def test_every_argument_by_keyword():
    """q (the argument on_device_of reads the device from) by its keyword too, in any order;
    a missing q is Python's own TypeError naming it."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 4, 32, generator=gen).to(DEVICE, DT)
    cache = torch.randn(1, CAP, 2, 32, generator=gen).to(DEVICE, DT)
    lens = torch.tensor([CAP // 2], dtype=torch.int32, device=DEVICE)
    want = attention_with_kvcache(q, cache, cache, cache_seqlens=lens)
    for got in (attention_with_kvcache(q=q, k_cache=cache, v_cache=cache, cache_seqlens=lens),
                attention_with_kvcache(cache_seqlens=lens, v_cache=cache, k_cache=cache, q=q)):
        assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'q'"):
        attention_with_kvcache(k_cache=cache, v_cache=cache, cache_seqlens=lens)


@pytest.mark.parametrize("bad", ["k_cache", "block_table", "cache_seqlens", "k_cache_none"])
def test_non_tensor_arguments_raise_type_errors(bad):
    # A list where a tensor belongs is a TypeError naming the argument, also for a call that
    # matches a remembered step in everything else (the replay path must not swallow it).
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 4, 32, generator=gen).to(DEVICE, DT)
    cache = torch.randn(1, CAP, 2, 32, generator=gen).to(DEVICE, DT)
    lens = torch.tensor([CAP], dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        attention_with_kvcache(q, cache, cache, cache_seqlens=lens)
    args = dict(k_cache=cache, cache_seqlens=lens)
    name = bad.replace("_none", "")
    args[name] = None if bad.endswith("none") else [1, 2, 3]
    with pytest.raises(TypeError, match=name):
        attention_with_kvcache(q, args.pop("k_cache"), cache, **args)


ROUTES = [("one-split", 1, False, 0), ("merge-kernel", 3, False, 0), ("in-kernel", 4, True, 0),
          ("prefill", 0, False, 1)]


@pytest.mark.parametrize("paged", [0, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("route,splits,in_kernel,prefill_rows", ROUTES, ids=[r[0] for r in ROUTES])
def test_sinks_on_every_route(monkeypatch, paged, route, splits, in_kernel, prefill_rows):
    """Attention sinks over a KV cache: one split adds them in the split kernel, the merges
    (merge kernel, in-kernel) start from them, the prefill route runs the forward with them;
    out and lse against the reference with the sinks, new sinks on a replayed step, no LSE
    asked, and a sequence without keys (out 0, lse = the sink)."""
    monkeypatch.setattr(configs, "DECODE_MERGE_IN_KERNEL", in_kernel)
    monkeypatch.setattr(configs, "DECODE_MERGE_MAX_BYTES", 1 << 30)
    if prefill_rows:
        monkeypatch.setattr(configs, "KVCACHE_PREFILL_MIN_ROWS", prefill_rows)
    gen = torch.Generator().manual_seed(7)
    B, H, HKV, D, SQ = 3, 8, 2, 64, 2
    k_full = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    v_full = torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE, DT)
    k_cache, v_cache, table = (_paged(k_full, v_full, paged, gen) if paged
                               else (k_full, v_full, None))
    q = torch.randn(B, SQ, H, D, generator=gen).to(DEVICE, DT)
    lens = torch.tensor([CAP - 5, 0, CAP // 2], dtype=torch.int32, device=DEVICE)
    for call in range(3):
        sinks = (torch.randn(H, generator=gen) * 2).to(DEVICE)
        ref_out, ref_lse, pt_out, pt_lse = _reference(q, k_full, v_full, lens, True,
                                                      sinks=sinks)
        out, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                          block_table=table, causal=True, num_splits=splits,
                                          sinks=sinks, return_lse=call < 2)
        assert_rule(f"out (call {call})", out, ref_out, pt_out, 2, DT)
        if call < 2:
            assert_rule(f"lse (call {call})", lse, ref_lse, pt_lse, 2, DT)
            torch.testing.assert_close(lse[1], sinks[:, None].expand(H, SQ))
        else:
            assert lse is None
        assert (out[1] == 0).all()


def test_kvcache_sinks_bad_input():
    q = torch.randn(1, 1, 4, 16, device=DEVICE, dtype=DT)
    kc = torch.randn(1, 8, 2, 16, device=DEVICE, dtype=DT)
    with pytest.raises(ValueError, match=r"sinks must have shape \(nheads,\) = \(4,\)"):
        attention_with_kvcache(q, kc, kc, sinks=torch.zeros(2, device=DEVICE))
    with pytest.raises(TypeError, match="sinks must be float16, bfloat16 or float32"):
        attention_with_kvcache(q, kc, kc, sinks=torch.zeros(4, device=DEVICE, dtype=torch.int64))


@pytest.mark.parametrize("opts", [dict(causal=True), dict(), dict(causal=True, window_size=(40, 0)),
                                  dict(softcap=3.0), dict(causal=True, alibi="head"),
                                  dict(causal=True, sinks=True)],
                         ids=["causal", "full", "window", "softcap", "alibi", "sinks"])
@pytest.mark.parametrize("SQ", [1, 3])
def test_dense_few_queries_run_the_split_kernel(monkeypatch, opts, SQ):
    """flash_attention with few query rows a KV head over many keys (configs.dense_split: a
    decoding step handed the whole cache, as transformers' generate() does) runs the split-KV
    kernel: out, LSE and the gradients (the backward kernels over its out and LSE) against the
    float64 reference; explain() names the route."""
    import flashtriton
    from accuracy import check_against_reference, make_qkv
    from flashtriton.launch import decode as decode_launch
    monkeypatch.setattr(configs, "DENSE_SPLIT_MIN_KEYS", 32)
    calls = []
    real = decode_launch.dense_split
    monkeypatch.setattr(decode_launch, "dense_split", lambda *a: calls.append(1) or real(*a))
    q, k, v = make_qkv(2, SQ, 3 * configs.decode_split_granule() + 5, 4, 2, 32, DT, DEVICE)
    opts = dict(opts)
    if opts.pop("alibi", None):
        opts["alibi_slopes"] = torch.rand(4, device=DEVICE) * 0.3
    sinks = (torch.randn(4, device=DEVICE) * 2) if opts.pop("sinks", False) else None
    ref_opts = {n: x for n, x in opts.items() if n != "causal"}
    if sinks is not None:
        ref_opts["sinks"] = sinks
    assert flashtriton.explain(q, k, v, **opts).forward == "split"
    check_against_reference(
        lambda q, k, v: tuple(flash_attention_with_lse(q, k, v, sinks=sinks, **opts)),
        q, k, v, opts.get("causal", False), **ref_opts)
    assert calls == [1]


def test_dense_split_route_only_where_it_fits(monkeypatch):
    """Not for as many queries as keys, fewer keys than DENSE_SPLIT_MIN_KEYS, 1024 query rows a
    KV head or more (configs.kvcache_prefill), a score mask, dropout, batch_invariant or MLA's
    value head dim."""
    import flashtriton
    from flashtriton import launch
    monkeypatch.setattr(configs, "DENSE_SPLIT_MIN_KEYS", 64)
    x = lambda B, N, H, D=32: torch.zeros(B, N, H, D, device=DEVICE, dtype=DT)  # noqa: E731
    assert flashtriton.explain(x(1, 1, 4), x(1, 64, 2), x(1, 64, 2)).forward == "split"
    assert flashtriton.explain(x(1, 64, 4), x(1, 64, 2), x(1, 64, 2)).forward != "split"
    assert flashtriton.explain(x(1, 1, 4), x(1, 63, 2), x(1, 63, 2)).forward != "split"
    assert flashtriton.explain(x(1, 512, 2), x(1, 4096, 1), x(1, 4096, 1)).forward != "split"
    assert flashtriton.explain(x(1, 1, 4), x(1, 64, 2), x(1, 64, 2),
                               batch_invariant=True).forward != "split"
    assert flashtriton.explain(x(1, 1, 4), x(1, 64, 2), x(1, 64, 2),
                               dropout_p=0.1).forward != "split"
    variant = launch.Variant(0.1, attn_mask=torch.zeros(1, 1, 1, 64, dtype=torch.bool))
    assert launch.forward_route(x(1, 1, 4), x(1, 64, 2), x(1, 64, 2), variant)[0] != "split"
    variant = launch.Variant(0.1)
    assert launch.forward_route(x(1, 1, 4), x(1, 64, 2), x(1, 64, 2, 16), variant)[0] != "split"
    assert configs.dense_split(4, 1, 64) and not configs.dense_split(4, 1, 63)


def test_dense_split_merges_in_the_merge_kernel(monkeypatch):
    """The dense split route never merges in the split kernel (whose stream workspace, made
    during torch.compile's CUDA-graph warmup, would stay in the graph's pool); the KV-cache
    call over the same keys does."""
    from flashtriton.launch import decode as decode_launch
    from flashtriton.launch import decode_replay
    monkeypatch.setattr(configs, "DENSE_SPLIT_MIN_KEYS", 32)
    monkeypatch.setattr(configs, "DECODE_MERGE_IN_KERNEL", True)
    monkeypatch.setattr(decode_replay, "_WORKSPACES", {})
    used = []
    real = decode_launch._workspace
    monkeypatch.setattr(decode_launch, "_workspace", lambda *a: used.append(1) or real(*a))
    q = torch.randn(1, 1, 4, 32, device=DEVICE, dtype=DT)
    k, v = (torch.randn(1, 3 * configs.decode_split_granule(), 2, 32, device=DEVICE, dtype=DT)
            for _ in range(2))
    dense = flash_attention_with_lse(q, k, v)
    assert not used
    cached = attention_with_kvcache(q, k, v, cache_seqlens=k.shape[1], num_splits=3)
    assert used  # (the merge in the split kernel: this test can see it)
    assert torch.allclose(dense.out.float(), cached.out.float(), atol=1e-2)


@pytest.mark.parametrize("seqlens", ["int", "tensor"])
def test_kvcache_step_under_torch_compile_equals_the_eager_call(seqlens):
    """attention_with_kvcache under torch.compile: Dynamo does not trace its launches
    (launch.decode.attend runs eagerly at a graph break; traced, a compiled step over 8K keys
    was wrong on the GPU), so the compiled step equals the eager one bitwise, splits merged."""
    torch.manual_seed(0)
    B, N, H, HKV, D = 2, 96, 4, 2, 32
    q = torch.randn(B, 1, H, D, device=DEVICE, dtype=DT)
    k, v = (torch.randn(B, N, HKV, D, device=DEVICE, dtype=DT) for _ in range(2))
    lens = N if seqlens == "int" else torch.full((B,), N, dtype=torch.int32, device=DEVICE)

    def step(q, k, v):
        return attention_with_kvcache(q, k, v, cache_seqlens=lens, causal=True,
                                      num_splits=3).out
    eager = step(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager")
    for _ in range(2):
        assert torch.equal(compiled(q, k, v), eager)
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True).out
    low = attention_reference(q, k, v, causal=True, dtype=DT).out
    assert_rule("compiled KV-cache step", eager, ref, low, 2, DT)


def test_eager_kvcache_and_dense_split_calls_import_no_dynamo():
    """In a fresh process, an eager KV-cache step and a dense call on the split route leave
    torch._dynamo unimported: importing it (what making a torch.compiler.disable wrapper
    does) cost 5-6 s on an H100 machine's first such call of a process, a generation's first
    step after its prompt."""
    import subprocess
    import sys
    code = """
import sys, torch
from flashtriton import configs, flash_attention
from flashtriton.decode import attention_with_kvcache
configs.DENSE_SPLIT_MIN_KEYS = 32
q = torch.randn(1, 1, 2, 16)
k, v = (torch.randn(1, 64, 2, 16) for _ in range(2))
flash_attention(q, k, v, causal=True)
attention_with_kvcache(q, k, v, cache_seqlens=40)
print("torch._dynamo" in sys.modules)
"""
    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"
