"""Paged varlen (flash-attn 2.6+ / vLLM's call): packed queries over a paged KV cache, against
the float64 reference over each sequence's keys gathered from its pages."""

import pytest
import torch

from accuracy import assert_rule
from conftest import DEVICE, ON_GPU
from flashtriton import (flash_attention_varlen, flash_attention_varlen_with_lse, launch,
                         validation)
from flashtriton.compat import flash_attn as fa
from flashtriton.reference import attention_reference

if ON_GPU:
    LENS = [([1, 300, 0, 1, 1024], [900, 300, 13, 4000, 1500])]
    H, HKV, D = 8, 2, 128
else:
    LENS = [([1, 19, 0, 5], [30, 19, 7, 40])]
    H, HKV, D = 4, 2, 16


def _cu(lens):
    return torch.tensor([0] + list(lens), device=DEVICE).cumsum(0).to(torch.int32)


def paged_case(lens_k, page, dtype=torch.float16, spare=3, gen=None, heads=(HKV, D)):
    """Each sequence's keys and values (list of (n, HKV, D)), and the same keys in a shuffled
    pool of pages with its block table (unused entries -1 past each sequence's pages)."""
    gen = gen or torch.Generator().manual_seed(5)
    per_seq = [-(-n // page) for n in lens_k]
    width = max(per_seq) + 1
    n_pages = sum(per_seq) + spare
    order = torch.randperm(n_pages, generator=gen)
    pool_k = torch.randn(n_pages, page, *heads, generator=gen).to(DEVICE, dtype)
    pool_v = torch.randn(n_pages, page, *heads, generator=gen).to(DEVICE, dtype)
    table = torch.full((len(lens_k), width), -1, dtype=torch.int32)
    keys, at = [], 0
    for b, n in enumerate(lens_k):
        pages = order[at:at + per_seq[b]]
        at += per_seq[b]
        table[b, :len(pages)] = pages.to(torch.int32)
        ks = pool_k[pages.to(DEVICE)].flatten(0, 1)[:n]
        vs = pool_v[pages.to(DEVICE)].flatten(0, 1)[:n]
        keys.append((ks, vs))
    return pool_k, pool_v, table.to(DEVICE), keys


def _check(lens_q, lens_k, page, dtype, causal, use_seqused=True, heads=H, **options):
    tq = sum(lens_q)
    q = torch.randn(tq, heads, D, device=DEVICE, dtype=dtype)
    k, v, table, keys = paged_case(lens_k, page, dtype)
    cu_q = _cu(lens_q)
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    kw = dict(seqused_k=used) if use_seqused else {}
    out, lse = flash_attention_varlen_with_lse(
        q, k, v, cu_q, None if use_seqused else _cu(lens_k), max(lens_q), max(lens_k),
        causal=causal, block_table=table, **kw, **options)
    assert out.shape == q.shape and lse.shape == (heads, tq)
    slopes = options.pop("alibi_slopes", None)
    for b, (ks, vs) in enumerate(keys):
        qs = slice(int(cu_q[b]), int(cu_q[b + 1]))
        if lens_q[b] == 0:
            continue
        sl = None if slopes is None else (slopes[b] if slopes.dim() == 2 else slopes)
        args = [x.unsqueeze(0) for x in (q[qs], ks, vs)]
        ref = attention_reference(*[x.double() for x in args], causal=causal, alibi_slopes=sl,
                                  **options)
        pt = attention_reference(*args, causal=causal, alibi_slopes=sl, dtype=dtype, **options)
        assert_rule(f"out[{b}]", out[qs].unsqueeze(0), ref.out, pt.out, 2, dtype)
        assert_rule(f"lse[{b}]", lse[:, qs].unsqueeze(0), ref.lse, pt.lse, 2, dtype)
    return q, k, v, table, out


PAGES = [16, 256] if ON_GPU else [8, 16, 32]  # pages smaller, as large as, larger than a tile


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens", LENS)
def test_mixed_decode_and_prefill_rows(lens, causal, page):
    _check(*lens, page, torch.float16, causal)


@pytest.mark.parametrize("lens", LENS)
def test_lengths_from_cu_seqlens_k(lens):
    _check(*lens, 16, torch.bfloat16, True, use_seqused=False)


@pytest.mark.parametrize("page", [8, 32, 512])
def test_many_chunks_of_pages(page):
    """Keys past one chunk of the pointer path's page lists (64 tiles), sliding windows whose
    first tile starts inside a page, pages larger than a chunk."""
    lens = ([2, 1], [1100, 300]) if not ON_GPU else ([300, 1, 2000], [9000, 7000, 5000])
    _check(*lens, page, torch.float16, True)
    _check(*lens, page, torch.float16, True, window_size=(500, 0))


@pytest.mark.parametrize("option", ["window", "softcap", "alibi", "sinks", "gqa-4"])
def test_variants_over_pages(option):
    lens = LENS[0]
    options = dict(window={"window_size": (7, 0)}, softcap={"softcap": 5.0},
                   alibi={"alibi_slopes": torch.rand(len(lens[0]), H, device=DEVICE)},
                   sinks={"sinks": torch.randn(H, device=DEVICE)}, **{"gqa-4": {}})[option]
    _check(*lens, 16, torch.float16, True, heads=2 * H if option == "gqa-4" else H, **options)


def test_matches_contiguous_varlen():
    """The same keys packed contiguously give the same result (the kernel's paged addresses
    are the only difference)."""
    lens_q, lens_k = LENS[0]
    q, k, v, table, out = _check(lens_q, lens_k, 16, torch.float16, True)
    _, _, _, keys = paged_case(lens_k, 16, torch.float16)
    kc = torch.cat([ks for ks, _ in keys])
    vc = torch.cat([vs for _, vs in keys])
    ref = flash_attention_varlen(q, kc, vc, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k),
                                 causal=True)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=0)


def test_decode_batch_takes_the_split_kernel(monkeypatch):
    """One query a sequence (max_seqlen_q 1): the KV-cache split kernel, not the forward."""
    lens_k = [30, 7, 45, 1]
    q = torch.randn(len(lens_k), H, D, device=DEVICE, dtype=torch.float16)
    k, v, table, keys = paged_case(lens_k, 16)
    calls = []
    monkeypatch.setattr(launch, "triton_forward", lambda *a, **kw: calls.append(a))
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=_cu([1] * 4), seqused_k=used,
                                         max_seqlen_q=1, max_seqlen_k=45, causal=True,
                                         block_table=table, return_softmax_lse=True)
    assert not calls and lse.shape == (H, 4)
    for b, (ks, vs) in enumerate(keys):
        ref = attention_reference(q[b:b + 1, None].double(), ks[None].double(),
                                  vs[None].double())
        torch.testing.assert_close(out[b:b + 1].double(), ref.out[0], atol=2e-3, rtol=0)
        torch.testing.assert_close(lse[:, b].double(), ref.lse[0, :, 0], atol=1e-3, rtol=0)


@pytest.mark.parametrize("kernel", ["forward", "split"])
def test_mixed_batch_splits_the_work(monkeypatch, kernel):
    """A mixed batch: the forward computes the sequences of several queries and leaves the
    one-query ones (IS_VARLEN 4), which the split-KV kernel computes (and nothing else): with
    the other kernel's launch dropped, its rows keep what out held."""
    from flashtriton.launch import decode as decode_launch
    lens_q, lens_k = LENS[0]
    q = torch.randn(sum(lens_q), H, D, device=DEVICE, dtype=torch.float16)
    k, v, table, _ = paged_case(lens_k, 16)
    cu_q, used = _cu(lens_q), torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    want = flash_attention_varlen(q, k, v, cu_q, None, max(lens_q), max(lens_k), causal=True,
                                  seqused_k=used, block_table=table)
    if kernel == "forward":
        monkeypatch.setattr(decode_launch, "paged_singles", lambda *a: None)
    else:
        monkeypatch.setattr(launch, "triton_forward", lambda *a: None)
    out = torch.full_like(q, 7.0)
    fa.flash_attn_varlen_func(q, k, v, cu_q, None, max(lens_q), max(lens_k), causal=True,
                              block_table=table, seqused_k=used, out=out)
    single = torch.tensor([n == 1 for n in lens_q]).repeat_interleave(torch.tensor(lens_q))
    mine = single if kernel == "split" else ~single
    assert mine.any() and (~mine).any()
    torch.testing.assert_close(out[mine], want[mine], atol=0, rtol=0)
    assert (out[~mine] == 7).all()


def test_out_is_written_in_place():
    lens_q, lens_k = LENS[0]
    q = torch.randn(sum(lens_q), H, D, device=DEVICE, dtype=torch.float16)
    k, v, table, _ = paged_case(lens_k, 16)
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    want = flash_attention_varlen(q, k, v, _cu(lens_q), None, max(lens_q), max(lens_k),
                                  causal=True, seqused_k=used, block_table=table)
    buf = torch.full((sum(lens_q) + 2, H, D), 7.0, device=DEVICE, dtype=torch.float16)
    out = buf[1:-1]
    got = fa.flash_attn_varlen_func(q, k, v, _cu(lens_q), None, max(lens_q), max(lens_k),
                                    causal=True, block_table=table, seqused_k=used, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert (buf[0] == 7).all() and (buf[-1] == 7).all()
    # the decode route writes into out too
    qd = q[:4].clone()
    outd = torch.empty_like(qd)
    fa.flash_attn_varlen_func(qd, k, v, _cu([1] * 4), None, 1, max(lens_k),
                              block_table=table[:4], seqused_k=used[:4], out=outd)
    torch.testing.assert_close(outd, flash_attention_varlen(
        qd, k, v, _cu([1] * 4), _cu(lens_k[:4]), 1, max(lens_k), block_table=table[:4]))



def test_zero_heads_with_any_strides():
    """Pages of zero heads whose headdim stride is not 1 (an empty view of a permuted buffer):
    an empty tensor counts as contiguous whatever its strides, and contiguous() returned it
    unchanged, so the decode route refused the call (naming k_cache); found by
    tests/test_fuzz.py."""
    k = torch.randn(5000, device=DEVICE).as_strided((3, 8, 0, 32), (1536, 64, 2, 2))
    v = torch.randn(3, 8, 0, 32, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 2]], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([12, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 0, 32, device=DEVICE)
    out = flash_attention_varlen(q, k, v, _cu([1, 1]), None, 1, 16, block_table=table,
                                 seqused_k=used)
    assert out.shape == (2, 0, 32)
    assert validation.unit_last(k).stride(-1) == 1

def _bad(**edit):
    lens_q, lens_k = [3, 2], [20, 9]
    q = torch.randn(5, H, D, device=DEVICE, dtype=torch.float16)
    k, v, table, _ = paged_case(lens_k, 16, spare=0)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=_cu(lens_q), cu_seqlens_k=None, max_seqlen_q=3,
                max_seqlen_k=20, block_table=table,
                seqused_k=torch.tensor(lens_k, dtype=torch.int32, device=DEVICE))
    args.update(edit)
    return args


@pytest.mark.parametrize("edit,error,match", [
    (dict(seqused_k=torch.tensor([20, 9])), ValueError, "seqused_k"),
    (dict(seqused_k=torch.tensor([20], dtype=torch.int32)), ValueError, "seqused_k"),
    (dict(seqused_k=[20, 9]), TypeError, "seqused_k"),
    (dict(seqused_k=torch.tensor([20, 49], dtype=torch.int32)), ValueError,
     r"seqused_k\[1\] = 49 exceeds the 3 pages of 16 tokens in block_table\[1\]"),
    (dict(seqused_k=torch.tensor([-1, 9], dtype=torch.int32)), ValueError, "seqused_k"),
    (dict(seqused_k=None), TypeError, "cu_seqlens_k"),
    (dict(block_table=torch.zeros(2, 2)), ValueError, "block_table"),
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError, "block_table"),
    (dict(block_table=torch.tensor([[0, 1], [9, 2]], dtype=torch.int32)), ValueError,
     r"block_table\[1, 0\] = 9 is outside"),
    (dict(out=torch.empty(5, H, D)), ValueError, "out"),
    (dict(out=torch.empty(4, H, D, dtype=torch.float16)), ValueError, "out"),
], ids=["seqused-dtype", "seqused-shape", "seqused-type", "seqused-past-pages",
        "seqused-negative", "no-lengths", "table-dtype", "table-batch", "page-outside-pool",
        "out-dtype", "out-shape"])
def test_bad_input_raises_naming_it(edit, error, match):
    args = _bad(**edit)
    for key in ("seqused_k", "block_table", "out"):
        x = args.get(key)
        if isinstance(x, torch.Tensor) and key != "out":
            args[key] = x.to(DEVICE)
    was = validation.validating()
    validation.set_validation(True)  # (entries are read on the host: validation mode)
    try:
        with pytest.raises(error, match=match):
            fa.flash_attn_varlen_func(**args)
    finally:
        validation.set_validation(was)


@pytest.mark.parametrize("edit,match", [
    (dict(page=12), "power of two"),
    (dict(dims=3), "pages"),
])
def test_bad_pages_raise(edit, match):
    page = edit.get("page", 16)
    q = torch.randn(5, H, D, device=DEVICE, dtype=torch.float16)
    k = torch.randn(3, page, HKV, D, device=DEVICE, dtype=torch.float16)
    if edit.get("dims"):
        k = k.flatten(0, 1)
    table = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        flash_attention_varlen(q, k, k, _cu([3, 2]), None, 3, 20, block_table=table,
                               seqused_k=torch.tensor([20, 9], dtype=torch.int32,
                                                      device=DEVICE))


def _forward_only_call(form, q, k, v):
    """flash_attn_varlen_func with block_table (prefill and decode routes), seqused_k over
    packed keys, or out= (a fresh buffer); (call, its keywords, the option the backward
    names)."""
    lens_q = [1, 1, 1] if form == "decode" else [3, 1, 2]
    lens_k = [20, 9, 17]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    kw = dict(causal=True)
    if form == "seqused_k":
        kw.update(seqused_k=torch.tensor([15, 9, 3], dtype=torch.int32, device=DEVICE))
    else:
        kw.update(block_table=v)
    if form == "out":
        kw.update(out=torch.full((sum(lens_q), H, D), 7.0, device=DEVICE, dtype=q.dtype))

    def call(q, k, v):
        return fa.flash_attn_varlen_func(q[:sum(lens_q)], k, v if form == "seqused_k" else k,
                                         cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    return call, kw, "seqused_k" if form == "seqused_k" else "block_table"


@pytest.mark.parametrize("form", ["block_table", "decode", "seqused_k", "out"])
def test_forward_with_grad_as_flash_attn(form):
    """flash-attn 2.6+ runs a paged varlen forward whose inputs require grad (its
    test_flash_attn_varlen_causal does, and skips the backward): the same bits as the call
    without grad, an output that requires grad, and a backward that raises naming the option.
    (k and v here: the pages and the block table, or packed keys with seqused_k.)"""
    q = torch.randn(6, H, D, device=DEVICE, dtype=torch.float16)
    if form == "seqused_k":
        k, v = (torch.randn(46, HKV, D, device=DEVICE, dtype=torch.float16) for _ in "kv")
    else:
        k, _, v, _ = paged_case([20, 9, 17], 8)   # v: the block table
    call, kw, option = _forward_only_call(form, q, k, v)
    want = call(q, k, v).clone()
    leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
    got = call(*leaves, v if form != "seqused_k" else v.clone().requires_grad_())
    assert got.requires_grad and torch.equal(got, want)
    if form == "out":  # the result is the caller's buffer
        assert got.data_ptr() == kw["out"].data_ptr()
    assert not call(q, k, v).requires_grad
    with pytest.raises(NotImplementedError, match=f"backward .*{option}.* not supported"):
        got.float().sum().backward()
    assert all(x.grad is None for x in leaves)
