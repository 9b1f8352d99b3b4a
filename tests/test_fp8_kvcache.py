"""FP8 KV caches (float8_e4m3fn / e5m2 with per-KV-head descale factors, FlashAttention-3's
k_descale / v_descale): decoding against the float64 reference over the same dequantised
values, appends that quantise in place, FA3's fp8 q, and the checks of the new arguments."""

import pathlib

import pytest
import torch

from accuracy import assert_rule
from conftest import DEVICE, ON_GPU
from flashtriton import configs
from flashtriton.compat import flash_attn as fa
from flashtriton.decode import PagedKVCache, attention_with_kvcache
from flashtriton.reference import attention_reference
from test_kvcache import _paged  # contiguous caches in shuffled pages

DT = torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
CAP = 1024 if ON_GPU else 64  # cache capacity per sequence


def _quantize(x, descale, fp8):
    """x (B, S, HKV, D) as an fp8 cache holds it: x / descale (per KV head), saturated."""
    d = descale.view(-1, 1, descale.shape[-1], 1)
    return (x.float() / d).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)


def _dequantize(cache, descale):
    return cache.double() * descale.double().view(-1, 1, descale.shape[-1], 1)


def _descales(B, HKV, shape, gen):
    """k's and v's factors, (B, HKV) or (HKV,), around what scales N(0, 3) values into e4m3."""
    size = (B, HKV) if shape == "batch" else (HKV,)
    return [(0.01 + 0.02 * torch.rand(size, generator=gen)).to(DEVICE) for _ in range(2)]


def _check(out, lse, q, k_deq, v_deq, lens, causal, **opts):
    """out and lse against the float64 reference over the dequantised keys and values, under
    the accuracy rule against torch in bf16 over the same values."""
    for b in range(q.shape[0]):
        n = int(lens[b])
        args = (q[b:b + 1], k_deq[b:b + 1, :n], v_deq[b:b + 1, :n])
        ref = attention_reference(*args, causal=causal, **opts)
        pt = attention_reference(*args, causal=causal, dtype=DT, **opts)
        assert_rule(f"out[{b}]", out[b:b + 1], ref.out, pt.out, 2, DT)
        assert_rule(f"lse[{b}]", lse[b:b + 1], ref.lse, pt.lse, 2, DT)


def _cache(B, HKV, D, fp8, shape, gen):
    """Random keys and values of N(0, 3) quantised into fp8 caches: (k_cache, v_cache,
    k_descale, v_descale, k_deq, v_deq)."""
    kd, vd = _descales(B, HKV, shape, gen)
    k = 3 * torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE)
    v = 3 * torch.randn(B, CAP, HKV, D, generator=gen).to(DEVICE)
    kc, vc = _quantize(k, kd, fp8), _quantize(v, vd, fp8)
    return kc, vc, kd, vd, _dequantize(kc, kd), _dequantize(vc, vd)


@pytest.mark.parametrize("paged", [0, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("sq,causal,fp8,shape", [
    (1, False, E4M3, "batch"), (4, True, E4M3, "heads"), (1, False, E5M2, "heads")],
    ids=["decode-e4m3", "spec4-causal-e4m3", "decode-e5m2"])
def test_fp8_cache_matches_reference(paged, sq, causal, fp8, shape):
    gen = torch.Generator().manual_seed(0)
    B, H, HKV, D = 3, 8, 2, 64
    kc, vc, kd, vd, k_deq, v_deq = _cache(B, HKV, D, fp8, shape, gen)
    lens = torch.tensor([CAP // 3 + 5, 1, CAP - 7], dtype=torch.int32)
    q = torch.randn(B, sq, H, D, generator=gen).to(DEVICE, DT)
    table = None
    if paged:
        kc, vc, table = _paged(kc, vc, paged, gen)
    results = []
    for splits in (1, 3, 0):
        out, lse = attention_with_kvcache(q, kc, vc, cache_seqlens=lens.to(DEVICE),
                                          block_table=table, causal=causal, num_splits=splits,
                                          k_descale=kd, v_descale=vd)
        assert out.dtype == DT
        _check(out, lse, q, k_deq, v_deq, lens, causal)
        results.append(out)
    torch.testing.assert_close(results[0], results[1], atol=2e-2, rtol=0)


def test_fp8_cache_with_variants_sinks_and_many_query_rows(monkeypatch):
    """Softcap, a window, ALiBi and sinks over an fp8 cache; and a call with enough query rows
    for the prefill route, which an fp8 cache leaves to the split kernel."""
    monkeypatch.setattr(configs, "KVCACHE_PREFILL_MIN_ROWS", 8)
    gen = torch.Generator().manual_seed(1)
    B, H, HKV, D = 2, 4, 2, 32
    kc, vc, kd, vd, k_deq, v_deq = _cache(B, HKV, D, E4M3, "batch", gen)
    lens = torch.tensor([CAP - 3, CAP // 2], dtype=torch.int32)
    q = torch.randn(B, 6, H, D, generator=gen).to(DEVICE, DT)
    opts = dict(window_size=(20, 0), softcap=15.0,
                alibi_slopes=torch.rand(H, generator=gen).to(DEVICE) * 0.2,
                sinks=torch.randn(H, generator=gen).to(DEVICE))
    out, lse = attention_with_kvcache(q, kc, vc, cache_seqlens=lens.to(DEVICE), causal=True,
                                      num_splits=2, k_descale=kd, v_descale=vd, **opts)
    _check(out, lse, q, k_deq, v_deq, lens, True, **opts)


def test_bf16_q_beyond_fp16_range():
    """The split kernel multiplies fp8 K and V in fp16 with q's rows rescaled: rows of q far
    above fp16's range (and far below it) keep their values."""
    gen = torch.Generator().manual_seed(8)
    B, H, HKV, D = 2, 4, 2, 32
    kc, vc, kd, vd, k_deq, v_deq = _cache(B, HKV, D, E4M3, "heads", gen)
    q = torch.randn(B, 1, H, D, generator=gen)
    q[:, :, 0] *= 1e6   # |q| past 65504
    q[:, :, 1] *= 1e-9  # under fp16's subnormals
    q = q.to(DEVICE, DT)
    lens = torch.tensor([CAP, 21], dtype=torch.int32)
    for scale in (1e-7, None):
        out, lse = attention_with_kvcache(q, kc, vc, cache_seqlens=lens.to(DEVICE), k_descale=kd,
                                          v_descale=vd, softmax_scale=scale, num_splits=2)
        _check(out, lse, q, k_deq, v_deq, lens, False, softmax_scale=scale)


@pytest.mark.parametrize("paged", [0, 8], ids=["contiguous", "page8"])
def test_appends_quantise_into_the_cache_in_place(paged):
    gen = torch.Generator().manual_seed(2)
    B, H, HKV, D, new = 2, 4, 2, 32, 5
    kc, vc, kd, vd, _, _ = _cache(B, HKV, D, E4M3, "batch", gen)
    lens = torch.tensor([13, 30], dtype=torch.int32)  # appends cross page boundaries
    k_new = (3 * torch.randn(B, new, HKV, D, generator=gen)).to(DEVICE, DT)
    v_new = (3 * torch.randn(B, new, HKV, D, generator=gen)).to(DEVICE, DT)
    k_new[0, 0, 0, :4] = torch.tensor([1e6, -1e6, 448 * 0.5, 0.0])  # saturated, not inf / NaN
    q = torch.randn(B, new, H, D, generator=gen).to(DEVICE, DT)
    want_k, want_v = kc.clone(), vc.clone()
    for b in range(B):
        n = int(lens[b])
        want_k[b, n:n + new] = _quantize(k_new[b:b + 1], kd[b:b + 1], E4M3)[0]
        want_v[b, n:n + new] = _quantize(v_new[b:b + 1], vd[b:b + 1], E4M3)[0]
    table = None
    if paged:
        kc, vc, table = _paged(kc, vc, paged, gen)
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens.to(DEVICE),
                                          block_table=table, causal=True, k_descale=kd,
                                          v_descale=vd, return_softmax_lse=True)
    got_k, got_v = ((c[table.long()].reshape(B, CAP, HKV, D) if paged else c) for c in (kc, vc))
    # the new rows rounded as torch rounds value / descale, every other byte untouched
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    assert float(got_k[0, 13, 0, 0]) == 448.0 and float(got_k[0, 13, 0, 1]) == -448.0
    _check(out, lse, q, _dequantize(got_k, kd), _dequantize(got_v, vd), lens + new, True)


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_appends_round_ties_to_even_as_documented(fp8):
    """Every midpoint between neighbouring finite fp8 values (subnormals and the carry into
    the next power of two included) rounds to the one of even mantissa, as torch's cast does
    and the README and attention_with_kvcache say."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = values[values.isfinite() & (values >= 0)].unique()  # sorted, +0 first
    mids = (grid[:-1] + grid[1:]) / 2
    mids = torch.cat([mids, -mids])
    D = 16
    n = -(-mids.numel() // D)
    new = torch.cat([mids, mids.new_zeros(n * D - mids.numel())]).view(1, n, 1, D)
    assert torch.equal(new.to(DT).float(), new)  # the midpoints exact in q's dtype
    cache = torch.zeros(1, CAP, 1, D, dtype=fp8, device=DEVICE)
    ones = torch.ones(1, device=DEVICE)
    q = torch.zeros(1, 1, 1, D, dtype=DT, device=DEVICE)
    attention_with_kvcache(q, cache, cache.clone(), new.to(DEVICE, DT), new.to(DEVICE, DT),
                           cache_seqlens=0, k_descale=ones, v_descale=ones)
    want = new.to(fp8)
    assert torch.equal(cache[:, :n].cpu().view(torch.uint8), want.view(torch.uint8))
    assert (want.float().view(-1)[:mids.numel()] != mids).all()  # (ties all, none exact)
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    for doc in (attention_with_kvcache.__doc__, readme.read_text()):
        assert "rounded to nearest, ties to even" in " ".join(doc.split())


def test_fp8_new_rows_are_copied_as_they_are():
    gen = torch.Generator().manual_seed(3)
    B, H, HKV, D = 1, 2, 1, 16
    kc, vc, kd, vd, _, _ = _cache(B, HKV, D, E5M2, "heads", gen)
    k_new = _quantize(torch.randn(B, 2, HKV, D, generator=gen).to(DEVICE), kd, E5M2)
    v_new = _quantize(torch.randn(B, 2, HKV, D, generator=gen).to(DEVICE), vd, E5M2)
    q = torch.randn(B, 1, H, D, generator=gen).to(DEVICE, DT)
    attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=7, k_descale=kd, v_descale=vd)
    assert torch.equal(kc[:, 7:9].view(torch.uint8), k_new.view(torch.uint8))
    assert torch.equal(vc[:, 7:9].view(torch.uint8), v_new.view(torch.uint8))


def test_append_kv_into_fp8_takes_descales():
    """The public append_kv quantises with (nheads_k,) factors as the API does, and refuses
    an fp8 cache without them."""
    from flashtriton.decode import append_kv
    gen = torch.Generator().manual_seed(9)
    B, HKV, D = 2, 2, 16
    kc, vc, kd, vd, _, _ = _cache(B, HKV, D, E4M3, "heads", gen)
    k_new = (3 * torch.randn(B, 3, HKV, D, generator=gen)).to(DEVICE, DT)
    lens = torch.tensor([5, 40], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="descales"):
        append_kv(kc, vc, k_new, k_new, lens)
    append_kv(kc, vc, k_new, k_new, lens, descales=(kd, vd))
    assert torch.equal(kc[0, 5:8].view(torch.uint8),
                       _quantize(k_new[:1], kd, E4M3)[0].view(torch.uint8))
    assert torch.equal(vc[1, 40:43].view(torch.uint8),
                       _quantize(k_new[1:], vd, E4M3)[0].view(torch.uint8))


def test_fa3_fp8_q_with_q_descale():
    """FlashAttention-3's fp8 call: q in fp8 with q_descale, out in bfloat16, equal to the call
    with q dequantised."""
    gen = torch.Generator().manual_seed(4)
    B, H, HKV, D = 2, 4, 2, 32
    kc, vc, kd, vd, k_deq, v_deq = _cache(B, HKV, D, E4M3, "batch", gen)
    qd = (0.01 + 0.02 * torch.rand(B, HKV, generator=gen)).to(DEVICE)
    q8 = _quantize(3 * torch.randn(B, 1, H, D, generator=gen).to(DEVICE),
                   qd.repeat_interleave(H // HKV, dim=1), E4M3)
    q = (q8.float() * qd.repeat_interleave(H // HKV, dim=1)[:, None, :, None]).to(DT)
    lens = torch.tensor([CAP, 9], dtype=torch.int32, device=DEVICE)
    out, lse = fa.flash_attn_with_kvcache(q8, kc, vc, cache_seqlens=lens, q_descale=qd,
                                          k_descale=kd, v_descale=vd, return_softmax_lse=True)
    assert out.dtype == torch.bfloat16
    want = attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_descale=kd, v_descale=vd)
    assert torch.equal(out, want.out) and torch.equal(lse, want.lse)
    _check(out, lse, q, k_deq, v_deq, lens, False)


def test_new_descales_on_a_repeated_step():
    """A step repeated with other factors (on the GPU a replay of the remembered launches)
    reads the new ones."""
    gen = torch.Generator().manual_seed(5)
    B, H, HKV, D = 2, 8, 2, 64
    kc, vc, kd, vd, _, _ = _cache(B, HKV, D, E4M3, "batch", gen)
    lens = torch.tensor([CAP, CAP // 2], dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, 1, H, D, generator=gen).to(DEVICE, DT)
    for scale in (1.0, 0.5, 2.0):
        kd2, vd2 = kd * scale, vd * (3.0 - scale)
        out, lse = attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_descale=kd2,
                                          v_descale=vd2)
        _check(out, lse, q, _dequantize(kc, kd2), _dequantize(vc, vd2), lens, False)


def test_paged_kv_cache_helper_in_fp8():
    gen = torch.Generator().manual_seed(6)
    H, HKV, D = 4, 2, 32
    kd, vd = _descales(1, HKV, "heads", gen)
    cache = PagedKVCache(num_pages=8, page_size=8, num_kv_heads=HKV, head_dim=D, dtype=E4M3,
                         device=DEVICE, k_descale=kd, v_descale=vd)
    cache.add("a")
    seen_k, seen_v = [], []
    for n in (11, 1, 6):
        q = torch.randn(1, n, H, D, generator=gen).to(DEVICE, DT)
        k = (3 * torch.randn(1, n, HKV, D, generator=gen)).to(DEVICE, DT)
        v = (3 * torch.randn(1, n, HKV, D, generator=gen)).to(DEVICE, DT)
        out = cache.attend(q, k, v, ["a"], causal=True)
        seen_k.append(_dequantize(_quantize(k, kd, E4M3), kd))
        seen_v.append(_dequantize(_quantize(v, vd, E4M3), vd))
        kk, vv = torch.cat(seen_k, 1), torch.cat(seen_v, 1)
        ref = attention_reference(q, kk, vv, causal=True)
        pt = attention_reference(q, kk, vv, causal=True, dtype=DT)
        assert_rule(f"out[{n}]", out, ref.out, pt.out, 2, DT)
    with pytest.raises(ValueError, match="k_descale is needed"):
        PagedKVCache(num_pages=2, page_size=8, num_kv_heads=HKV, head_dim=D, dtype=E4M3,
                     device=DEVICE)
    with pytest.raises(ValueError, match=r"k_descale must have shape \(num_kv_heads,\)"):
        PagedKVCache(num_pages=2, page_size=8, num_kv_heads=HKV, head_dim=D, dtype=E4M3,
                     device=DEVICE, k_descale=kd[None], v_descale=vd)


def _bad_calls(q, kc, vc, kd, vd, kb):
    """(error, message, call) of fp8 arguments that must be refused before any launch."""
    B, HKV = q.shape[0], kc.shape[2]
    new = torch.zeros(B, 1, HKV, q.shape[3], dtype=DT, device=DEVICE)
    lens = torch.full((B,), 4, dtype=torch.int32, device=DEVICE)
    call = lambda **kw: attention_with_kvcache(  # noqa: E731
        q, kw.pop("kc", kc), kw.pop("vc", vc), new, new, cache_seqlens=lens, **kw)
    return [
        (ValueError, "k_descale is needed", lambda: call(v_descale=vd)),
        (ValueError, "v_descale is needed", lambda: call(k_descale=kd)),
        (TypeError, "k_descale must be float32", lambda: call(k_descale=kd.half(), v_descale=vd)),
        (TypeError, "v_descale must be a torch.Tensor", lambda: call(k_descale=kd, v_descale=0.5)),
        (ValueError, r"v_descale must have shape \(batch, nheads_k\)",
         lambda: call(k_descale=kd, v_descale=vd[:, :1])),
        (ValueError, r"k_descale must have shape", lambda: call(k_descale=kd[None], v_descale=vd)),
        (ValueError, "k_descale applies to fp8 KV caches",
         lambda: call(kc=kb, vc=kb.clone(), k_descale=kd, v_descale=vd)),
        (TypeError, "k_cache and v_cache must both be torch.float8_e4m3fn",
         lambda: call(vc=vc.to(DT), k_descale=kd, v_descale=vd)),
        (TypeError, "go into a cache of that dtype",
         lambda: attention_with_kvcache(q, kc, vc, new.to(E5M2), new.to(E5M2),
                                        cache_seqlens=lens, k_descale=kd, v_descale=vd)),
        (ValueError, "batch_invariant runs the forward kernel",
         lambda: call(k_descale=kd, v_descale=vd, batch_invariant=True)),
        (ValueError, "q_descale applies to an fp8 q",
         lambda: call(k_descale=kd, v_descale=vd, q_descale=kd)),
        (ValueError, "q_descale is needed",
         lambda: attention_with_kvcache(q.to(E4M3), kc, vc, cache_seqlens=lens, k_descale=kd,
                                        v_descale=vd)),
    ]


def test_fp8_bad_input_is_refused_before_any_launch():
    gen = torch.Generator().manual_seed(7)
    B, H, HKV, D = 2, 4, 2, 16
    kc, vc, kd, vd, _, _ = _cache(B, HKV, D, E4M3, "batch", gen)
    kb = torch.zeros(B, CAP, HKV, D, dtype=DT, device=DEVICE)
    q = torch.randn(B, 1, H, D, generator=gen).to(DEVICE, DT)
    before = kc.clone(), vc.clone()
    for error, message, call in _bad_calls(q, kc, vc, kd, vd, kb):
        with pytest.raises(error, match=message):
            call()
        # nothing appended: the checks ran before the append kernel
        assert torch.equal(kc.view(torch.uint8), before[0].view(torch.uint8)), message
        assert torch.equal(vc.view(torch.uint8), before[1].view(torch.uint8)), message


def test_append_kv_copies_fp8_values_into_an_fp8_cache():
    """The public append_kv copies k, v already in the cache's fp8 dtype as they are (no
    descales needed)."""
    from flashtriton.decode import append_kv
    gen = torch.Generator().manual_seed(10)
    B, HKV, D = 2, 2, 16
    kc, vc, _, _, _, _ = _cache(B, HKV, D, E4M3, "heads", gen)
    k_new = torch.randn(B, 3, HKV, D, generator=gen).to(DEVICE, E4M3)
    lens = torch.tensor([5, 40], dtype=torch.int32, device=DEVICE)
    append_kv(kc, vc, k_new, k_new, lens)
    assert torch.equal(kc[1, 40:43].view(torch.uint8), k_new[1].view(torch.uint8))
