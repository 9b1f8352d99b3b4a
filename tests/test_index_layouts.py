"""Index tensors and caches of any layout, and every check before any write.

Index tensors (cache_seqlens, cache_batch_idx, cache_leftpad, block_table, seqused_k,
cu_seqlens_*) and the small tensors the kernels index (alibi slopes, sinks, descales) given
as strided views give bitwise the results of the same call with contiguous copies, on every
entry point and route. A KV cache the kernels cannot write in place is refused naming it and
its strides, and a refused call (bad num_splits, seqused_k out of range, ...) leaves caches,
``out=`` and a PagedKVCache's pages and free list exactly as they were.
"""

import copy

import pytest
import torch

from conftest import DEVICE
from flashtriton import (configs, flash_attention_varlen_with_lse, flash_attention_with_lse,
                         validation)
from flashtriton.compat import flash_attn as fa
from flashtriton.decode import PagedKVCache, attention_with_kvcache

DT = torch.float16
B, H, HKV, D, CAP, PAGE = 2, 4, 2, 16, 32, 8


def _strided(t: torch.Tensor, decoy: torch.Tensor = None) -> torch.Tensor:
    """t's values in a view that is not contiguous: a 1-D tensor as every other element of a
    buffer interleaving it with ``decoy`` (by default t[0] throughout: t's storage read as a
    dense array then holds t[0] twice, a wrong result), a 2-D one transposed in memory."""
    if t.dim() == 1:
        decoy = t[:1].expand_as(t) if decoy is None else decoy
        view = torch.stack([t, decoy], 1)[:, 0]
    else:
        view = t.t().contiguous().t()
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


def _dense(args: dict) -> dict:
    """args with every tensor a contiguous copy."""
    return {n: x.contiguous() if isinstance(x, torch.Tensor) else x for n, x in args.items()}


def _rand(*shape, gen, dtype=DT):
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _assert_same(got, want, what):
    for name, a, b in zip(("out", "lse"), got, want):
        if b is None:
            assert a is None, f"{what}: {name}"
        else:
            assert torch.equal(a, b), f"{what}: {name} differs from the contiguous call's"


def _cache_call(paged: bool, gen):
    """An attention_with_kvcache call's arguments (caches, q, one new token) with every index
    tensor the layout takes."""
    lens = torch.tensor([5, 17], dtype=torch.int32, device=DEVICE)
    args = dict(q=_rand(B, 1, H, D, gen=gen), k=_rand(B, 1, HKV, D, gen=gen),
                v=_rand(B, 1, HKV, D, gen=gen), cache_seqlens=lens)
    if paged:
        pages = 2 * CAP // PAGE
        args.update(k_cache=_rand(pages, PAGE, HKV, D, gen=gen),
                    v_cache=_rand(pages, PAGE, HKV, D, gen=gen),
                    block_table=torch.randperm(pages, generator=gen)[:B * 3].view(B, 3)
                    .to(DEVICE, torch.int32))
    else:
        args.update(k_cache=_rand(3, CAP, HKV, D, gen=gen), v_cache=_rand(3, CAP, HKV, D, gen=gen),
                    cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32, device=DEVICE),
                    cache_leftpad=torch.tensor([1, 3], dtype=torch.int32, device=DEVICE))
    return args


def _kvcache(args: dict):
    """attention_with_kvcache on fresh copies of the caches: ((out, lse), k_cache, v_cache)."""
    args = dict(args)
    caches = {n: args.pop(n).clone() for n in ("k_cache", "v_cache")}
    res = attention_with_kvcache(args.pop("q"), caches["k_cache"], caches["v_cache"],
                                 args.pop("k"), args.pop("v"), **args)
    return res, caches


# Routes of attention_with_kvcache: the split kernel (one split, merged splits), the prefill
# forward over the cache (contiguous or paged) and batch_invariant's forward.
ROUTES = {"split1": dict(num_splits=1), "split2": dict(num_splits=2),
          "prefill": dict(prefill=True), "invariant": dict(batch_invariant=True)}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_index_views_equal_contiguous_copies(monkeypatch, paged, route):
    """Strided views of cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi slopes
    and sinks give bitwise the output, LSE and appended caches of contiguous copies."""
    opts = dict(ROUTES[route])
    if opts.pop("prefill", False):
        monkeypatch.setattr(configs, "KVCACHE_PREFILL_MIN_ROWS", 1)
    gen = torch.Generator().manual_seed(11)
    args = _cache_call(paged, gen)
    if route != "invariant":
        args.update(alibi_slopes=torch.rand(B, H, generator=gen).to(DEVICE) * 0.3)
    args.update(sinks=torch.randn(H, generator=gen).to(DEVICE), causal=True, **opts)
    views = dict(args, **{n: _strided(args[n]) for n in
                          ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table",
                           "alibi_slopes", "sinks") if n in args})
    want, want_caches = _kvcache(_dense(views))
    got, caches = _kvcache(views)
    _assert_same(got, want, route)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(caches[name], want_caches[name]), f"{name}: appended elsewhere"


def test_kvcache_batch_idx_view_appends_into_its_rows():
    """The issue's repro: cache_batch_idx [2, 1, 0, 1][::2] = [2, 0] appends into rows 2 and 0
    (not into row 1, the storage's second entry) and leaves row 1 alone."""
    gen = torch.Generator().manual_seed(12)
    args = _cache_call(False, gen)
    args.update(cache_batch_idx=torch.tensor([2, 1, 0, 1], dtype=torch.int32, device=DEVICE)[::2],
                cache_leftpad=None)
    _, caches = _kvcache(args)
    for b, row in enumerate((2, 0)):
        n = int(args["cache_seqlens"][b])
        assert torch.equal(caches["k_cache"][row, n], args["k"][b, 0])
    assert torch.equal(caches["k_cache"][1], args["k_cache"][1])


def test_fp8_cache_descale_views_equal_contiguous_copies():
    """k_descale / v_descale as strided views (a transposed (batch, nheads_k) and a (nheads_k,)
    slice) quantise appends and dequantise keys as contiguous copies do."""
    gen = torch.Generator().manual_seed(13)
    args = _cache_call(False, gen)
    fp8 = torch.float8_e4m3fn
    args.update(k_cache=args["k_cache"].to(fp8), v_cache=args["v_cache"].to(fp8),
                q=args["q"].to(torch.bfloat16), k=args["k"].to(torch.bfloat16),
                v=args["v"].to(torch.bfloat16), num_splits=2,
                k_descale=_strided(torch.rand(B, HKV, generator=gen).to(DEVICE) + 0.5),
                v_descale=(torch.rand(2 * HKV, generator=gen).to(DEVICE) + 0.5)[::2])
    (out, lse), caches = _kvcache(args)
    (out2, lse2), caches2 = _kvcache(_dense(args))
    _assert_same((out, lse), (out2, lse2), "fp8")
    assert torch.equal(caches["k_cache"].view(torch.uint8), caches2["k_cache"].view(torch.uint8))
    assert torch.equal(caches["v_cache"].view(torch.uint8), caches2["v_cache"].view(torch.uint8))


def test_flash_attn_with_kvcache_index_views():
    """The drop-in: strided cache_seqlens / cache_batch_idx and learnable_sink, bitwise the
    contiguous call's."""
    gen = torch.Generator().manual_seed(14)
    args = _cache_call(False, gen)
    args.update(learnable_sink=torch.randn(H, generator=gen).to(DEVICE))
    views = dict(args, **{n: _strided(args[n]) for n in
                          ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "learnable_sink")})
    results = []
    for call in (_dense(views), views):
        kc, vc = call.pop("k_cache").clone(), call.pop("v_cache").clone()
        out, lse = fa.flash_attn_with_kvcache(call.pop("q"), kc, vc, call.pop("k"), call.pop("v"),
                                              return_softmax_lse=True, num_splits=2, **call)
        results.append((out, lse, kc))
    _assert_same(results[1][:2], results[0][:2], "flash_attn_with_kvcache")
    assert torch.equal(results[1][2], results[0][2])


def _varlen_call(paged: bool, gen, lens_q=(3, 2), lens_k=(9, 14)):
    """flash_attention_varlen's arguments: packed q, packed (or paged) k, v, offsets, seqused_k,
    ALiBi slopes and sinks."""
    cu = lambda lens: torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)  # noqa
    args = dict(q=_rand(sum(lens_q), H, D, gen=gen), cu_seqlens_q=cu(lens_q),
                max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=True,
                seqused_k=torch.tensor([n - 2 for n in lens_k], dtype=torch.int32,
                                       device=DEVICE),
                alibi_slopes=torch.rand(B, H, generator=gen).to(DEVICE) * 0.3,
                sinks=torch.randn(H, generator=gen).to(DEVICE))
    if paged:
        pages = 8
        args.update(k=_rand(pages, PAGE, HKV, D, gen=gen), v=_rand(pages, PAGE, HKV, D, gen=gen),
                    cu_seqlens_k=None,
                    block_table=torch.randperm(pages, generator=gen)[:B * 2].view(B, 2)
                    .to(DEVICE, torch.int32))
    else:
        args.update(k=_rand(sum(lens_k), HKV, D, gen=gen), v=_rand(sum(lens_k), HKV, D, gen=gen),
                    cu_seqlens_k=cu(lens_k))
    return args


def _varlen(args: dict):
    args = dict(args)
    return flash_attention_varlen_with_lse(args.pop("q"), args.pop("k"), args.pop("v"),
                                           args.pop("cu_seqlens_q"), args.pop("cu_seqlens_k"),
                                           args.pop("max_seqlen_q"), args.pop("max_seqlen_k"),
                                           **args)


VARLEN = {"packed": (False, (3, 2)), "paged": (True, (3, 2)), "paged-decode": (True, (1, 1))}


@pytest.mark.parametrize("case", list(VARLEN))
def test_varlen_index_views_equal_contiguous_copies(case):
    """flash_attention_varlen with cu_seqlens_q / _k, seqused_k, block_table (transposed in
    memory), alibi slopes and sinks as strided views: bitwise the contiguous call's (packed
    keys, paged keys on the forward, and a paged decode batch on the split kernel)."""
    paged, lens_q = VARLEN[case]
    gen = torch.Generator().manual_seed(15)
    args = _varlen_call(paged, gen, lens_q)
    names = ["cu_seqlens_q", "seqused_k", "alibi_slopes", "sinks"]
    names += ["block_table"] if paged else ["cu_seqlens_k"]
    views = dict(args, **{n: _strided(args[n]) for n in names})
    views["cu_seqlens_q"] = _strided(args["cu_seqlens_q"], args["cu_seqlens_q"] + 1)
    _assert_same(_varlen(views), _varlen(_dense(views)), case)


def test_flash_attn_varlen_func_index_views():
    """The drop-in's varlen call with strided offsets, seqused_k and learnable_sink."""
    gen = torch.Generator().manual_seed(16)
    args = _varlen_call(False, gen)
    args.pop("alibi_slopes")
    args["learnable_sink"] = args.pop("sinks")
    views = dict(args, **{n: _strided(args[n])
                          for n in ("cu_seqlens_k", "seqused_k", "learnable_sink")})
    results = [fa.flash_attn_varlen_func(**call, return_softmax_lse=True)
               for call in (_dense(views), views)]
    _assert_same(results[1], results[0], "flash_attn_varlen_func")


def test_dense_alibi_and_sinks_views():
    """flash_attention with (batch, nheads) slopes transposed in memory and strided sinks."""
    gen = torch.Generator().manual_seed(17)
    q, k, v = _rand(B, 5, H, D, gen=gen), _rand(B, 9, HKV, D, gen=gen), _rand(B, 9, HKV, D, gen=gen)
    opts = dict(alibi_slopes=_strided(torch.rand(B, H, generator=gen).to(DEVICE)),
                sinks=_strided(torch.randn(H, generator=gen).to(DEVICE)))
    _assert_same(flash_attention_with_lse(q, k, v, causal=True, **opts),
                 flash_attention_with_lse(q, k, v, causal=True, **_dense(opts)), "dense")


@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_cache_with_a_head_dim_stride_is_refused(name):
    """A cache whose head dim is not at unit stride (buf[..., ::2]) is refused naming it and
    its strides, before the append; nothing is written."""
    gen = torch.Generator().manual_seed(18)
    args = _cache_call(False, gen)
    buf = _rand(3, CAP, HKV, 2 * D, gen=gen)
    before = buf.clone()
    args[name] = buf[..., ::2]
    with pytest.raises(ValueError, match=rf"{name} must have a unit stride on headdim; got "
                                         rf"strides \(2048, 64, 32, 2\)"):
        attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                               args.pop("k"), args.pop("v"), **args)
    assert torch.equal(buf, before)


def test_paged_varlen_pool_with_a_head_dim_stride_is_read_as_a_copy():
    """flash_attention_varlen only reads its pages: a pool with a head-dim stride runs, as its
    contiguous copy does (the forward and the decode batch on the split kernel)."""
    gen = torch.Generator().manual_seed(19)
    for lens_q in ((3, 2), (1, 1)):
        args = _varlen_call(True, gen, lens_q)
        buf = torch.stack([args["k"], args["v"]], -1)
        views = dict(args, k=buf[..., 0], v=buf[..., 1])
        _assert_same(_varlen(views), _varlen(_dense(views)), f"paged {lens_q}")


BAD_SPLITS = [("2", TypeError), (2.5, TypeError), (-1, ValueError), (True, TypeError),
              (None, TypeError)]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("bad,error", BAD_SPLITS, ids=[repr(b) for b, _ in BAD_SPLITS])
def test_bad_num_splits_is_refused_before_the_append(paged, bad, error):
    """num_splits takes an int >= 0: anything else is refused naming it before the append
    writes (native call and flash-attn's drop-in)."""
    gen = torch.Generator().manual_seed(20)
    args = _cache_call(paged, gen)
    kc, vc = args.pop("k_cache"), args.pop("v_cache")
    before = kc.clone(), vc.clone()
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match="num_splits"):
        attention_with_kvcache(q, kc, vc, k, v, num_splits=bad, **args)
    with pytest.raises(error, match="num_splits"):
        fa.flash_attn_with_kvcache(q, kc, vc, k, v, num_splits=bad, **args)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_numpy_and_tensor_num_splits_are_ints():
    """num_splits as a numpy integer or a 0-d integer tensor counts as its int."""
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(21)
    args = _cache_call(False, gen)
    outs = [attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"],
                                   cache_seqlens=args["cache_seqlens"], num_splits=n).out
            for n in (2, np.int64(2), torch.tensor(2))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def _paged_state(cache: PagedKVCache):
    return (cache.k.clone(), cache.v.clone(), copy.deepcopy(cache._pages), list(cache._free),
            dict(cache._lengths))


def _assert_state(cache: PagedKVCache, state):
    k, v, pages, free, lengths = state
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v), "the pool's pages were written"
    assert cache._pages == pages and cache._lengths == lengths
    assert cache._free == free, "the free list's order changed"


@pytest.mark.parametrize("bad", [dict(num_splits="2"), dict(num_splits=2.5),
                                 dict(num_splits=-1), dict(softcap=-1.0),
                                 dict(sinks=torch.zeros(3))],
                         ids=["splits-str", "splits-float", "splits-negative", "softcap",
                              "sinks-shape"])
def test_paged_kv_cache_refused_call_changes_nothing(bad):
    """A refused PagedKVCache.attend leaves its pool, page lists, lengths and free list (its
    order too: the next sequences get the same pages) as they were, with several sequences
    taking new pages in the call."""
    gen = torch.Generator().manual_seed(22)
    cache = PagedKVCache(num_pages=12, page_size=PAGE, num_kv_heads=HKV, head_dim=D, dtype=DT,
                         device=DEVICE)
    for s in ("a", "b", "c"):
        cache.add(s)
    cache.attend(_rand(3, 1, H, D, gen=gen), _rand(3, 5, HKV, D, gen=gen),
                 _rand(3, 5, HKV, D, gen=gen), ["a", "b", "c"])
    state = _paged_state(cache)
    with pytest.raises((TypeError, ValueError)):
        cache.attend(_rand(3, 1, H, D, gen=gen), _rand(3, 12, HKV, D, gen=gen),
                     _rand(3, 12, HKV, D, gen=gen), ["c", "a", "b"], **bad)
    _assert_state(cache, state)


@pytest.mark.parametrize("used,where", [(-1, 0), (10, 0), (15, 1)],
                         ids=["negative", "past-its-keys", "past-the-last"])
def test_varlen_seqused_k_out_of_range_is_refused(used, where, monkeypatch):
    """Packed keys: seqused_k[b] outside [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]] is refused
    naming it (as the paged call refuses lengths past its pages), out= left alone. (Entries
    are read on the host: CPU tensors always, GPU ones in validation mode.)"""
    monkeypatch.setattr(validation, "_VALIDATE", True)
    gen = torch.Generator().manual_seed(23)
    args = _varlen_call(False, gen)
    args["seqused_k"][where] = used
    out = torch.full((args["q"].shape[0], H, D), 7.0, dtype=DT, device=DEVICE)
    with pytest.raises(ValueError, match=rf"seqused_k\[{where}\] = {used} is outside"):
        _varlen(dict(args, out=out))
    assert (out == 7).all()
    args.pop("alibi_slopes")
    args["learnable_sink"] = args.pop("sinks")
    with pytest.raises(ValueError, match=rf"seqused_k\[{where}\] = {used} is outside"):
        fa.flash_attn_varlen_func(**args)


def test_varlen_seqused_k_at_the_bounds_runs():
    gen = torch.Generator().manual_seed(24)
    args = _varlen_call(False, gen)
    args["seqused_k"] = torch.tensor([0, 14], dtype=torch.int32, device=DEVICE)
    out, lse = _varlen(args)
    assert not out.isnan().any()


def test_batch_invariant_over_a_cache_whose_rows_do_not_flatten():
    """batch_invariant over a contiguous cache that the forward cannot see as packed token rows
    (caches sliced on their positions) runs on contiguous copies after the append: out, LSE
    and the caches bitwise those of the same call over dense caches, the buffers' other
    positions untouched; twice (no replay of a record made on the copies)."""
    gen = torch.Generator().manual_seed(25)
    args = _cache_call(False, gen)
    args.update(cache_leftpad=None, batch_invariant=True)
    bufs = {n: _rand(3, 2 * CAP, HKV, D, gen=gen) for n in ("k_cache", "v_cache")}
    for n, buf in bufs.items():
        buf[:, :CAP] = args[n]
    before = {n: buf[:, CAP:].clone() for n, buf in bufs.items()}
    for _ in range(2):
        want, caches = _kvcache(args)
        whole = {n: buf.clone() for n, buf in bufs.items()}
        views = {n: buf[:, :CAP] for n, buf in whole.items()}
        rest = {n: x for n, x in args.items() if n not in ("q", "k", "v", "k_cache", "v_cache")}
        got = attention_with_kvcache(args["q"], views["k_cache"], views["v_cache"], args["k"],
                                     args["v"], **rest)
        _assert_same(got, want, "batch_invariant over sliced caches")
        for n in views:
            assert torch.equal(views[n], caches[n]), n
            assert torch.equal(whole[n][:, CAP:], before[n]), n


@pytest.mark.parametrize("num_splits", [1, 3])
def test_left_padding_values_are_never_read(num_splits):
    """NaN in a cache's left padding (positions before cache_leftpad[b]) changes nothing: the
    split kernel's key blocks that start in the padding take its values as 0 (0 x NaN is NaN
    in P V), at one split and merged splits."""
    gen = torch.Generator().manual_seed(31)
    args = _cache_call(False, gen)
    args.update(num_splits=num_splits, k=None, v=None)
    want, _ = _kvcache(args)
    for n, pad in ((2, 1), (0, 3)):  # cache rows of the two sequences, their left padding
        for cache in ("k_cache", "v_cache"):
            args[cache] = args[cache].clone()
            args[cache][n, :pad] = float("nan")
    got, _ = _kvcache(args)
    assert not got.out.isnan().any()
    _assert_same(got, want, "NaN in the left padding")


def test_varlen_gradients_of_rows_past_the_sequences_are_zero():
    """Packed rows past cu_seqlens[-1] (q's and k / v's) belong to no sequence: their
    gradients are 0, not what the allocator held."""
    gen = torch.Generator().manual_seed(33)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    q, k, v = (_rand(15, H if i == 0 else HKV, D, gen=gen).requires_grad_() for i in range(3))
    out, _ = flash_attention_varlen_with_lse(q, k, v, cu, cu, 7, 7, causal=True)
    out[:12].float().sum().backward()
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert torch.equal(x.grad[12:], torch.zeros_like(x.grad[12:])), name
        assert x.grad[:12].abs().sum() > 0, name


def test_public_append_kv_checks_before_it_writes():
    """flashtriton.decode.append_kv reads strided index tensors as attention_with_kvcache
    does (the append lands in the rows the view names) and refuses a cache with a head-dim
    stride or an out-of-range length before writing anything."""
    from flashtriton.decode import append_kv
    gen = torch.Generator().manual_seed(37)
    k_new, v_new = (_rand(2, 1, HKV, D, gen=gen) for _ in range(2))
    caches = [_rand(3, CAP, HKV, D, gen=gen) for _ in range(2)]
    want = [c.clone() for c in caches]
    lens = torch.tensor([4, 9, 2, 9], dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([2, 1, 0, 1], dtype=torch.int32, device=DEVICE)
    append_kv(*want, k_new, v_new, lens[::2].contiguous(), cache_batch_idx=rows[::2].contiguous())
    append_kv(*caches, k_new, v_new, lens[::2], cache_batch_idx=rows[::2])
    assert all(torch.equal(a, b) for a, b in zip(caches, want))
    wide = _rand(3, CAP, HKV, 2 * D, gen=gen)
    before = wide.clone()
    with pytest.raises(ValueError, match="k_cache"):
        append_kv(wide[..., ::2], wide[..., ::2], k_new, v_new, lens[::2])
    assert torch.equal(wide, before)
