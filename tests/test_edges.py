"""The edges users reach: flash-attn's argument types, kvcache semantics with left padding,
many query tokens per KV head, memory safety whatever the index tensors hold, validation
mode, the flash_attn module aliases, PagedKVCache's failures and fallback logging.

Memory-safety cases surround every input with NaN guard bands (a read outside a tensor
reaches NaN and poisons the output) and every output / cache with sentinel values (a write
outside one changes them). Through Triton's interpreter a stray address is a host address,
so those cases run in a subprocess: a crash fails the test instead of killing the run.
"""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from accuracy import assert_rule
from conftest import DEVICE, ON_GPU
from flashtriton import configs, flash_attention, launch, validation
from flashtriton import runtime
from flashtriton.compat import flash_attn as fa
from flashtriton.decode import PagedKVCache, attention_with_kvcache
from flashtriton.reference import attention_reference

DT = torch.bfloat16
SENTINEL = 1234.0


def _randn(*shape, dtype=DT, gen=None):
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


# -- flash-attn's argument types ------------------------------------------------------------

@pytest.mark.parametrize("window", [torch.tensor([3, 0]), np.array([3, 0]), [3, 0],
                                    (np.int64(3), np.int32(0)), (torch.tensor(3), 0)],
                         ids=["tensor", "ndarray", "list", "numpy-ints", "0d-tensor"])
def test_window_size_takes_any_int_likes(window):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (_randn(1, 24, 2, 16, gen=gen) for _ in range(3))
    want = fa.flash_attn_func(q, k, v, window_size=(3, 0))
    torch.testing.assert_close(fa.flash_attn_func(q, k, v, window_size=window), want,
                               atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_scale_and_softcap_take_numpy_floats_and_0d_tensors(kind):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (_randn(1, 20, 2, 16, gen=gen) for _ in range(3))
    box = np.float32 if kind == "numpy" else torch.tensor
    want = fa.flash_attn_func(q, k, v, softmax_scale=0.3, softcap=5.0, causal=True)
    got = fa.flash_attn_func(q, k, v, softmax_scale=box(0.3), softcap=box(5.0), causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("option", [dict(softcap=float("inf")), dict(softmax_scale=float("nan")),
                                    dict(softmax_scale=float("inf")),
                                    dict(softmax_scale=torch.tensor(float("inf"))),
                                    dict(softcap=float("nan"))],
                         ids=["softcap-inf", "scale-nan", "scale-inf", "scale-0d-inf",
                              "softcap-nan"])
def test_non_finite_options_raise(option):
    q = _randn(1, 8, 2, 16)
    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        fa.flash_attn_func(q, q, q, **option)


@pytest.mark.parametrize("bad", [(1.5, 0), (True, 0), "ab", (1, 2, 3), torch.tensor([1.0, 0.0])],
                         ids=["float", "bool", "string", "triple", "float-tensor"])
def test_window_size_rejects_non_ints(bad):
    q = _randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="window_size"):
        flash_attention(q, q, q, window_size=bad)


# -- kvcache: rotary with left padding, many query tokens -----------------------------------

def _rotate(x, pos, cos, sin, interleaved):
    """Rotary reference on (B, S, H, D) at integer positions (B, S), float64."""
    rd = 2 * cos.shape[1]
    c = cos.double()[pos.long()][:, :, None, :]
    s = sin.double()[pos.long()][:, :, None, :]
    xr = x[..., :rd].double()
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2]) * torch.complex(c, s)
        rot = torch.stack([z.real, z.imag], -1).flatten(-2)
    else:
        z = torch.complex(xr[..., :rd // 2], xr[..., rd // 2:]) * torch.complex(c, s)
        rot = torch.cat([z.real, z.imag], -1)
    return torch.cat([rot, x[..., rd:].double()], -1)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_leftpad_rotary_at_absolute_cache_indices(causal):
    """flash-attn rotates the new k (and q when causal) at the cache indices cache_seqlens[b]
    + i, left padding included (its kernel adds the padding back)."""
    gen = torch.Generator().manual_seed(7)
    B, H, HKV, D, rd, new, cap = 2, 4, 2, 32, 16, 3, 64
    theta = 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    angles = torch.arange(cap, dtype=torch.float64)[:, None] * theta
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    k_cache = _randn(B, cap, HKV, D, dtype=torch.float32, gen=gen)
    v_cache = _randn(B, cap, HKV, D, dtype=torch.float32, gen=gen)
    lens = torch.tensor([20, 31], dtype=torch.int32, device=DEVICE)
    pad = torch.tensor([7, 2], dtype=torch.int32, device=DEVICE)
    q = _randn(B, new, H, D, dtype=torch.float32, gen=gen)
    k_new = _randn(B, new, HKV, D, dtype=torch.float32, gen=gen)
    v_new = _randn(B, new, HKV, D, dtype=torch.float32, gen=gen)
    k_before = k_cache.clone()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                     rotary_sin=sin, cache_seqlens=lens, cache_leftpad=pad,
                                     causal=causal, rotary_interleaved=False)
    steps = torch.arange(new, device=DEVICE)
    k_rot = _rotate(k_new, lens[:, None] + steps, cos, sin, False)
    q_rot = _rotate(q, lens[:, None] + (steps if causal else 0 * steps), cos, sin, False)
    for b in range(B):
        n, p = int(lens[b]), int(pad[b])
        torch.testing.assert_close(k_cache[b, n:n + new].double(), k_rot[b], atol=1e-5, rtol=0)
        torch.testing.assert_close(k_cache[b, :n], k_before[b, :n], atol=0, rtol=0)
        kk = k_cache[b:b + 1, p:n + new].double()
        vv = v_cache[b:b + 1, p:n + new].double()
        ref = attention_reference(q_rot[b:b + 1], kk, vv, causal=causal)
        torch.testing.assert_close(out[b:b + 1].double(), ref.out, atol=2e-5, rtol=0)


def _cache_case(gen, B, SQ, H, HKV, D, cap, paged):
    k_full = _randn(B, cap, HKV, D, gen=gen)
    v_full = _randn(B, cap, HKV, D, gen=gen)
    q = _randn(B, SQ, H, D, gen=gen)
    if not paged:
        return q, k_full, v_full, None
    n = cap // paged
    perm = torch.randperm(B * n, generator=gen).to(DEVICE)
    k_pages = torch.empty(B * n, paged, HKV, D, dtype=DT, device=DEVICE)
    v_pages = torch.empty_like(k_pages)
    k_pages[perm] = k_full.reshape(B * n, paged, HKV, D)
    v_pages[perm] = v_full.reshape(B * n, paged, HKV, D)
    return q, k_pages, v_pages, perm.view(B, n).to(torch.int32), k_full, v_full


@pytest.mark.parametrize("route", ["split", "prefill"])
@pytest.mark.parametrize("paged", [0, 16], ids=["contiguous", "page16"])
def test_many_query_tokens_per_kv_head(monkeypatch, route, paged):
    """6 query heads a KV head x 12 tokens = 72 packed rows in tiles of 16 rows (5 row
    blocks), or the prefill kernel (over pages too), causal with left padding (contiguous)."""
    monkeypatch.setattr(configs, "DECODE_MAX_ROWS", 16)
    monkeypatch.setattr(configs, "KVCACHE_PREFILL_MIN_ROWS", 1 if route == "prefill" else 10**9)
    gen = torch.Generator().manual_seed(8)
    B, SQ, H, HKV, D, cap = 2, 12, 12, 2, 32, 64
    case = _cache_case(gen, B, SQ, H, HKV, D, cap, paged)
    q, k_cache, v_cache, table = case[:4]
    k_full, v_full = (case[4], case[5]) if paged else (k_cache, v_cache)
    lens = torch.tensor([45, 30], dtype=torch.int32, device=DEVICE)
    pad = None if paged else torch.tensor([5, 0], dtype=torch.int32, device=DEVICE)
    calls = []
    real = launch.triton_forward
    monkeypatch.setattr(launch, "triton_forward",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                      cache_leftpad=pad, causal=True)
    assert bool(calls) == (route == "prefill")
    for b in range(B):
        first = 0 if pad is None else int(pad[b])
        args = (q[b:b + 1], k_full[b:b + 1, first:lens[b]], v_full[b:b + 1, first:lens[b]])
        ref = attention_reference(*args, causal=True)
        pt = attention_reference(*args, causal=True, dtype=DT)
        assert_rule(f"out[{b}]", out[b:b + 1], ref.out, pt.out, 2, DT)
        assert_rule(f"lse[{b}]", lse[b:b + 1], ref.lse, pt.lse, 2, DT)


def test_decode_rows_policy():
    assert configs.decode_rows(6, 64, 128) == (128, 3)    # 384 rows
    assert configs.decode_rows(6, 128, 256) == (64, 12)   # head dim 256: half the rows
    assert configs.decode_rows(8, 1, 128) == (16, 1)      # at least 16 rows
    assert configs.decode_rows(4, 16, 64) == (64, 1)
    rows = configs.KVCACHE_PREFILL_MIN_ROWS
    assert configs.kvcache_prefill(1, rows) and configs.kvcache_prefill(8, rows // 8)
    assert not configs.kvcache_prefill(1, rows - 1) and not configs.kvcache_prefill(8, rows // 8 - 1)


def test_decode_outputs_come_from_the_poisoned_allocator(monkeypatch):
    """conftest poisons runtime._empty / _empty_like: decoding's out and lse come from them."""
    made = []
    real = runtime._empty
    monkeypatch.setattr(runtime, "_empty", lambda *a: made.append(real(*a)) or made[-1])
    q = _randn(1, 1, 4, 16)
    cache = _randn(1, 32, 2, 16)
    out, lse = attention_with_kvcache(q, cache, cache, cache_seqlens=20, num_splits=1)
    ptrs = {t.data_ptr() for t in made}
    assert out.data_ptr() in ptrs and lse.data_ptr() in ptrs


# -- the flash_attn module aliases ----------------------------------------------------------

def test_install_makes_flash_attn_imports_run_on_flashtriton():
    saved = {n: sys.modules.get(n) for n in ("flash_attn", "flash_attn.flash_attn_interface",
                                             "flash_attn.bert_padding")}
    package = fa.install()
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: F401
        from flash_attn.bert_padding import pad_input, unpad_input
        import flash_attn.flash_attn_interface as interface
        import flash_attn
        assert flash_attn is package and flash_attn_func is fa.flash_attn_func
        assert interface.flash_attn_with_kvcache is fa.flash_attn_with_kvcache
        assert unpad_input.__module__ == "flashtriton.compat.bert_padding"
        assert flash_attn.__version__.startswith("2.")
        q = _randn(1, 8, 2, 16)
        torch.testing.assert_close(flash_attn_func(q, q, q, causal=True),
                                   flash_attention(q, q, q, causal=True), atol=0, rtol=0)
        assert fa.install() is package  # idempotent
    finally:
        fa.uninstall()
    for name, module in saved.items():
        assert sys.modules.get(name) is module


# -- validation mode ------------------------------------------------------------------------

def _varlen_inputs(lens_q, lens_k, H=2, HKV=1, D=16):
    tq, tk = sum(lens_q), sum(lens_k)
    return (_randn(tq, H, D), _randn(tk, HKV, D), _randn(tk, HKV, D),
            torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).to(torch.int32),
            torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).to(torch.int32))


@pytest.mark.parametrize("edit,match", [
    (lambda cu_q, cu_k: cu_q.__setitem__(0, 2), r"cu_seqlens_q\[0\] = 2"),
    (lambda cu_q, cu_k: cu_k.__setitem__(-1, 500), r"cu_seqlens_k\[3\] = 500 exceeds"),
    (lambda cu_q, cu_k: cu_q.__setitem__(2, 3), r"cu_seqlens_q\[2\] = 3 < cu_seqlens_q\[1\]"),
    (lambda cu_q, cu_k: cu_q.__setitem__(1, 2), "sequence 1 has 12 tokens .* more than max_seqlen_q"),
], ids=["not-from-0", "past-the-end", "decreasing", "longer-than-max"])
def test_bad_cu_seqlens_raise_naming_the_entry(monkeypatch, edit, match):
    monkeypatch.setattr(validation, "_VALIDATE", True)  # (CPU tensors are checked anyway)
    q, k, v, cu_q, cu_k = _varlen_inputs([5, 9, 4], [7, 3, 8])
    edit(cu_q, cu_k)
    with pytest.raises(ValueError, match=match):
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 8)


def _kv(B=2, cap=32, HKV=2, D=16, rows=None):
    return _randn(rows or B, cap, HKV, D), _randn(rows or B, cap, HKV, D)


@pytest.mark.parametrize("case,match", [
    ("seqlens-past-cache", r"cache_seqlens\[1\] = 33 exceeds the cache's 32 positions"),
    ("append-past-cache", r"cache_seqlens\[0\] = 30 \+ 4 new keys exceeds"),
    ("negative-seqlens", r"cache_seqlens\[0\] = -1 is negative"),
    ("batch-idx", r"cache_batch_idx\[1\] = 5 is outside the cache's 3 rows"),
    ("leftpad", r"cache_leftpad\[0\] = 9 is outside \[0, cache_seqlens\[0\] = 8\]"),
    ("block-table", r"block_table\[1, 1\] = 9 is outside the pool's 8 pages"),
    ("block-table-negative", r"block_table\[0, 0\] = -1 is outside"),
    ("paged-seqlens", r"cache_seqlens\[0\] = 40 exceeds the 2 pages of 16 tokens"),
    ("rotary", r"rotary positions up to 30 need rotary_cos"),
])
def test_bad_cache_indices_raise_naming_the_entry(monkeypatch, case, match):
    monkeypatch.setattr(validation, "_VALIDATE", True)
    q = _randn(2, 1, 4, 16)
    k_cache, v_cache = _kv()
    lens = torch.tensor([8, 20], dtype=torch.int32, device=DEVICE)
    kw = {}
    if case == "seqlens-past-cache":
        lens[1] = 33
    elif case == "append-past-cache":
        lens[0] = 30
        kw = dict(k=_randn(2, 4, 2, 16), v=_randn(2, 4, 2, 16))
    elif case == "negative-seqlens":
        lens[0] = -1
    elif case == "batch-idx":
        k_cache, v_cache = _kv(rows=3)
        kw = dict(cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32, device=DEVICE))
    elif case == "leftpad":
        kw = dict(cache_leftpad=torch.tensor([9, 0], dtype=torch.int32, device=DEVICE))
    elif case == "rotary":
        lens[1] = 30
        kw = dict(rotary_cos=torch.ones(30, 4, device=DEVICE),
                  rotary_sin=torch.zeros(30, 4, device=DEVICE), k=_randn(2, 1, 2, 16),
                  v=_randn(2, 1, 2, 16))
        match = r"cache_seqlens\[1\] = 30: rotary positions up to 30 need rotary_cos"
    else:
        k_cache, v_cache = _randn(8, 16, 2, 16), _randn(8, 16, 2, 16)
        table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32, device=DEVICE)
        if case == "block-table-negative":
            table[0, 0] = -1
        if case == "paged-seqlens":
            lens[0] = 40
        kw = dict(block_table=table)
    with pytest.raises(ValueError, match=match):
        attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, **kw)


def test_unused_block_table_entries_are_not_checked(monkeypatch):
    """vLLM pads block tables: only the pages a sequence uses must lie in the pool."""
    monkeypatch.setattr(validation, "_VALIDATE", True)
    k_cache, v_cache = _randn(4, 16, 2, 16), _randn(4, 16, 2, 16)
    table = torch.tensor([[0, -1, 99], [1, 2, -7]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([10, 20], dtype=torch.int32, device=DEVICE)
    out, _ = attention_with_kvcache(_randn(2, 1, 4, 16), k_cache, v_cache, cache_seqlens=lens,
                                    block_table=table)
    assert torch.isfinite(out).all()


def test_validation_switch(monkeypatch):
    monkeypatch.setattr(validation, "_VALIDATE", False)
    validation.set_validation(True)
    assert validation.validating()
    validation.set_validation(False)
    assert not validation.validating()
    env = dict(os.environ, FLASHTRITON_VALIDATE="1")
    code = "import flashtriton.validation as v; print(v.validating())"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr


# -- memory safety: the kernels, with the host checks off -----------------------------------

def _guarded(shape, dtype, fill, gen=None, guard=64):
    """A tensor of ``shape`` inside a larger buffer: random data (or ``fill``) with ``guard``
    elements of NaN (inputs) or SENTINEL (outputs) on both sides along dim 0."""
    whole = torch.full((shape[0] + 2 * guard, *shape[1:]), fill, dtype=dtype, device=DEVICE)
    inner = whole[guard:guard + shape[0]]
    if gen is not None:
        inner.copy_(torch.randn(*shape, generator=gen))
    return whole, inner


def _outputs_inside_sentinels(monkeypatch):
    """launch's output buffers inside SENTINEL guard bands; returns the list of buffers."""
    made = []

    def empty(shape, dtype, device):
        shape = tuple(shape)
        whole, inner = _guarded(shape if shape else (1,), dtype, SENTINEL)
        made.append((whole, inner))
        return inner.fill_(float("nan"))

    monkeypatch.setattr(runtime, "_empty", empty)
    monkeypatch.setattr(runtime, "_empty_like", lambda x, head_dim=None: empty(
        (*x.shape[:-1], head_dim or x.shape[-1]), x.dtype, x.device))
    return made


def _sentinels_intact(made, guard=64):
    for whole, _ in made:
        assert (whole[:guard] == SENTINEL).all() and (whole[-guard:] == SENTINEL).all(), \
            "a kernel wrote outside its output"


def _case_varlen_out_of_range():
    gen = torch.Generator().manual_seed(11)
    H, HKV, D, tq, tk = 2, 1, 16, 30, 40
    _, q = _guarded((tq, H, D), DT, float("nan"), gen)
    _, k = _guarded((tk, HKV, D), DT, float("nan"), gen)
    _, v = _guarded((tk, HKV, D), DT, float("nan"), gen)
    # sequence 0 valid; 1: keys past the end; 2: queries past the end; 3: negative start
    cu_q = torch.tensor([0, 10, 20, 10**6, 30], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 12, 10**6, 30, -5], dtype=torch.int32, device=DEVICE)
    out, lse = launch.attention_forward(q, k, v, launch.Variant(0.25, causal=True),
                                        launch.Varlen(cu_q, cu_k, 64, 64))
    ref = attention_reference(q[None, :10], k[None, :12], v[None, :12], causal=True)
    torch.testing.assert_close(out[:10].double(), ref.out[0], atol=2e-2, rtol=0)
    # sequence 1's queries see no keys: 0 and -inf; nothing else is NaN-free by necessity,
    # but nothing may read the NaN guard bands into the rows that were written
    assert (out[10:20] == 0).all() and (lse[:, 10:20] == float("-inf")).all()
    written = out[:20]
    assert torch.isfinite(written).all()
    # backward on the same indices stays inside its tensors too
    dout = torch.randn_like(out)
    out = torch.nan_to_num(out)
    dq, dk, dv, _ = launch.attention_backward(dout, q, k, v, out,
                                              lse.nan_to_num(neginf=float("-inf")),
                                              launch.Variant(0.25, causal=True),
                                              launch.Varlen(cu_q, cu_k, 64, 64))
    # sequence 0's gradients are right; sequence 1's queries (no keys) get dQ 0
    q0, k0, v0 = (x.detach().double().requires_grad_() for x in (q[:10], k[:12], v[:12]))
    ref = attention_reference(q0[None], k0[None], v0[None], causal=True, softmax_scale=0.25)
    grads = torch.autograd.grad(ref.out, (q0, k0, v0), dout[None, :10].double())
    for name, got, want in zip(("dq", "dk", "dv"), (dq[:10], dk[:12], dv[:12]), grads):
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=0, msg=name)
    assert (dq[10:20] == 0).all()


def _case_decode_out_of_range(paged, prefill=False):
    gen = torch.Generator().manual_seed(12)
    B, H, HKV, D, cap, page = 4, 4, 2, 16, 48, 16
    rows = B * cap // page if paged else B
    _, k_cache = _guarded((rows, cap if not paged else page, HKV, D), DT, float("nan"), gen)
    _, v_cache = _guarded((rows, cap if not paged else page, HKV, D), DT, float("nan"), gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q = torch.randn(B, 2, H, D, generator=gen).to(DEVICE, DT)
    k_new = torch.randn(B, 3, HKV, D, generator=gen).to(DEVICE, DT)
    v_new = torch.randn(B, 3, HKV, D, generator=gen).to(DEVICE, DT)
    if prefill:  # the prefill kernel's route for two query tokens
        configs.KVCACHE_PREFILL_MIN_ROWS = 1
    lens = torch.tensor([20, 10**6, 40, -4], dtype=torch.int32, device=DEVICE)
    kw = {}
    if paged:  # sequence 0: pages 0..2; 2: a page past the pool and a negative one
        table = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 10**5, -3], [9, 10, 11]],
                             dtype=torch.int32, device=DEVICE)
        kw = dict(block_table=table)
    else:  # sequence 2 points at a cache row past the cache
        kw = dict(cache_batch_idx=torch.tensor([0, 1, 9, 3], dtype=torch.int32, device=DEVICE))
    out, lse = attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                      causal=True, **kw)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    if paged:
        k0 = torch.cat([k_cache[p] for p in (0, 1, 2)])[None, :23]
        v0 = torch.cat([v_cache[p] for p in (0, 1, 2)])[None, :23]
    else:
        k0, v0 = k_cache[0:1, :23], v_cache[0:1, :23]
    torch.testing.assert_close(k0[0, 20:23], k_new[0], atol=0, rtol=0)  # appended
    ref = attention_reference(q[0:1], k0, v0, causal=True)
    torch.testing.assert_close(out[0:1].double(), ref.out, atol=2e-2, rtol=0)
    if paged:  # sequence 2 sees its one page in the pool (page 6), not the two outside
        ref = attention_reference(q[2:3], k_cache[6][None], v_cache[6][None])
        torch.testing.assert_close(out[2:3].double(), ref.out, atol=2e-2, rtol=0)
    else:  # its cache row is outside the cache: no keys
        assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()
    # 1 (length past the cache) and 3 (negative) see no keys; no append outside a cache
    for b in (1, 3):
        assert (out[b] == 0).all() and (lse[b] == float("-inf")).all()
    changed = (k_cache != k_before).flatten(1).any(1) | (v_cache != v_before).flatten(1).any(1)
    expect = torch.zeros_like(changed)
    expect[1 if paged else 0] = True  # sequence 0's appends: its second page / its row
    assert torch.equal(changed, expect), changed


def _guarded_paged(seed, total_q, H, HKV, D=16, page=8, n_pages=6):
    """Random q (total_q, H, D) and a pool of pages k, v, each inside NaN guard bands."""
    gen = torch.Generator().manual_seed(seed)
    _, q = _guarded((total_q, H, D), DT, float("nan"), gen)
    _, k = _guarded((n_pages, page, HKV, D), DT, float("nan"), gen)
    _, v = _guarded((n_pages, page, HKV, D), DT, float("nan"), gen)
    return q, k, v


def _case_paged_varlen_out_of_range():
    q, k, v = _guarded_paged(13, 24, 2, 1)
    # 0: valid (pages 2, 0); 1: a length past its pages; 2: a page outside the pool and a
    # negative one; 3: a negative length; 4: queries past q
    cu_q = torch.tensor([0, 6, 12, 18, 24, 10**6], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([13, 10**6, 20, -3, 5], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[2, 0, 10**5], [1, 3, 4], [5, 10**5, -7], [1, 1, 1], [0, 1, 2]],
                         dtype=torch.int32, device=DEVICE)
    out, lse = launch.attention_forward(
        q, k, v, launch.Variant(0.25, causal=True),
        launch.Varlen(cu_q, None, 6, 64, seqused_k=used, block_table=table))
    k0, v0 = (torch.cat([x[2], x[0]])[None, :13] for x in (k, v))
    ref = attention_reference(q[None, :6], k0, v0, causal=True, softmax_scale=0.25)
    torch.testing.assert_close(out[:6].double(), ref.out[0], atol=2e-2, rtol=0)
    for rows in (slice(6, 12), slice(18, 24)):  # no keys
        assert (out[rows] == 0).all() and (lse[:, rows] == float("-inf")).all()
    # sequence 2 reads its one page in the pool; nothing read a NaN guard band
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()


def _case_paged_varlen_singles_out_of_range():
    """A mixed batch (configs.paged_singles): the one-query sequences on the split-KV kernel."""
    q, k, v = _guarded_paged(14, 12, 4, 2)
    # 0: six queries (pages 2, 0); 1: one query (pages 1, 3); 2: one, a length past its pages;
    # 3: one, a page outside the pool; 4: queries past q; 5: one query past q; 6: an end
    # before its start; 7: one query from a negative row
    cu_q = torch.tensor([0, 6, 7, 8, 9, 10**6, 10**6 + 1, -1, 0], dtype=torch.int32,
                        device=DEVICE)
    used = torch.tensor([13, 9, 10**6, 8, 5, 5, 5, 5], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[2, 0, 10**5], [1, 3, 4], [1, 1, 1], [10**5, -7, 1], [0, 1, 2],
                          [0, 1, 2], [0, 1, 2], [0, 1, 2]], dtype=torch.int32, device=DEVICE)
    varlen = launch.Varlen(cu_q, None, 6, 64, seqused_k=used, block_table=table)
    variant = launch.Variant(0.25, causal=True)
    assert launch._paged_singles(q, v, variant, varlen)
    out, lse = launch.attention_forward(q, k, v, variant, varlen)
    for rows, pages, n in ((slice(0, 6), (2, 0), 13), (slice(6, 7), (1, 3), 9)):
        kk, vv = (torch.cat([x[p] for p in pages])[None, :n] for x in (k, v))
        ref = attention_reference(q[None, rows], kk, vv, causal=True, softmax_scale=0.25)
        torch.testing.assert_close(out[rows].double(), ref.out[0], atol=2e-2, rtol=0)
    for row in (7, 8):  # no keys
        assert (out[row] == 0).all() and (lse[:, row] == float("-inf")).all()
    # rows 9-11 belong to no sequence (left as allocated); nothing read a NaN guard band
    assert torch.isfinite(out[:9]).all() and not torch.isnan(lse[:, :9]).any()


def _run_case(name, *args):
    """Run _case_<name>(*args) in a fresh interpreter (host checks off, outputs guarded)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import conftest, test_edges as t; "
            "import pytest; mp = pytest.MonkeyPatch(); "
            "mp.setattr(t.validation, '_contents', lambda *a: False); "
            "made = t._outputs_inside_sentinels(mp); "
            f"t._case_{name}(*{args!r}); t._sentinels_intact(made); print('case ok'); "
            # every check has run: leave without torch's exit-time teardown, whose autograd
            # threads can abort a process that ran a CUDA backward (pytorch/pytorch#51861)
            "import os; sys.stdout.flush(); os._exit(0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=here, timeout=900)
    assert run.returncode == 0 and "case ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_varlen_kernels_stay_inside_their_tensors():
    _run_case("varlen_out_of_range")


def test_paged_varlen_kernel_stays_inside_its_tensors():
    _run_case("paged_varlen_out_of_range")


def test_paged_varlen_singles_stay_inside_their_tensors():
    _run_case("paged_varlen_singles_out_of_range")


@pytest.mark.parametrize("paged,prefill", [(False, False), (True, False), (False, True)],
                         ids=["contiguous", "paged", "prefill"])
def test_decode_kernels_stay_inside_their_tensors(paged, prefill):
    _run_case("decode_out_of_range", paged, prefill)


# -- PagedKVCache's failures leave it as it was ---------------------------------------------

def test_paged_cache_failure_leaves_the_cache_unchanged():
    cache = PagedKVCache(num_pages=5, page_size=8, num_kv_heads=2, head_dim=16, dtype=DT,
                         device=DEVICE)
    for s in ("a", "b"):
        cache.add(s)
    q, k = _randn(2, 1, 4, 16), _randn(2, 12, 2, 16)
    cache.attend(q, k, k, ["a", "b"])  # 2 pages each, 1 free

    def state():
        return (cache.free_pages, list(cache._free), cache.length("a"), cache.length("b"),
                {s: list(p) for s, p in cache._pages.items()})

    before = state()
    with pytest.raises(MemoryError):  # each needs one more page: the pool has one
        cache.attend(q, _randn(2, 5, 2, 16), _randn(2, 5, 2, 16), ["a", "b"])
    assert state() == before
    with pytest.raises(KeyError, match="'zz'"):
        cache.attend(q, k, k, ["a", "zz"])
    assert state() == before
    with pytest.raises(ValueError, match="heads"):  # refused after a's page was reserved
        cache.attend(q[:1], _randn(1, 5, 3, 16), _randn(1, 5, 3, 16), ["a"])
    assert state() == before
    with pytest.raises(KeyError, match="'zz'"):
        cache.length("zz")
    with pytest.raises(KeyError, match="'zz'"):
        cache.free("zz")


# -- fallbacks to torch say why -------------------------------------------------------------

def test_sdpa_fallback_is_logged_with_its_reason(caplog):
    from flashtriton import scaled_dot_product_attention
    q = torch.randn(1, 2, 8, 16, device=DEVICE, dtype=torch.float64)  # float64: not ours
    with caplog.at_level(logging.DEBUG, logger="flashtriton"):
        scaled_dot_product_attention(q, q, q)
    assert any("falls back" in r.message and "float64" in r.message for r in caplog.records)


def test_comfyui_fallback_is_logged_with_its_reason(caplog):
    from flashtriton.integrations.comfyui import attention_override
    q = torch.randn(1, 8, 32, device=DEVICE, dtype=torch.float64)
    with caplog.at_level(logging.DEBUG, logger="flashtriton"):
        attention_override(lambda *a, **kw: "theirs", q, q, q, 2)
    assert any("falls back" in r.message and "float64" in r.message for r in caplog.records)


@pytest.mark.skipif(not ON_GPU, reason="validation off on GPU tensors: the GPU suite")
def test_gpu_index_tensors_are_not_read_without_validation(monkeypatch):
    monkeypatch.setattr(validation, "_VALIDATE", False)
    q, k, v, cu_q, cu_k = _varlen_inputs([5, 9, 4], [7, 3, 8])
    cu_q[0] = 2  # no ValueError: nothing reads the device tensor's entries
    fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 8)


def test_gluon_kernels_only_on_the_triton_they_are_written_for(monkeypatch):
    import triton
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    launch.gluon_triton_misfit.cache_clear()
    try:
        assert "3.7.1" in launch.gluon_triton_misfit()
        monkeypatch.setattr(triton, "__version__", "3.6.0")
        launch.gluon_triton_misfit.cache_clear()
        assert launch.gluon_triton_misfit() is None
    finally:
        launch.gluon_triton_misfit.cache_clear()


def test_rotary_positions_past_the_table_do_not_fail_without_validation(monkeypatch):
    """Cache indices past rotary_cos's rows (which validation refuses) read the table's last
    row instead of failing torch's bounds check (a device-side assert on a GPU)."""
    monkeypatch.setattr(validation, "_contents", lambda *t: False)
    q, k_new = _randn(2, 1, 4, 16), _randn(2, 1, 2, 16)
    k_cache, v_cache = _kv()
    lens = torch.tensor([5, 31], dtype=torch.int32, device=DEVICE)
    cos, sin = torch.ones(8, 4, device=DEVICE), torch.zeros(8, 4, device=DEVICE)
    out, _ = attention_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=lens,
                                    rotary_cos=cos, rotary_sin=sin)
    assert torch.isfinite(out).all()
