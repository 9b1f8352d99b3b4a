"""batch_invariant=True: a sequence's decoding output is bitwise the same whatever else is in the
batch, whatever the grid or num_splits, and bitwise the flash_attention forward's over the same
keys, the rows of a training forward (seqlen_q = seqlen_k, causal) included."""

import pytest
import torch

from accuracy import assert_rule
from conftest import DEVICE, ON_GPU
from flashtriton import flash_attention, flash_attention_varlen
from flashtriton.decode import attention_with_kvcache
from flashtriton.reference import attention_reference

H, HKV, D = (8, 2, 128) if ON_GPU else (4, 2, 16)
LENS = [700, 1500, 3, 2048] if ON_GPU else [37, 50, 3, 64]
CAP = max(LENS) + 16
DT = torch.bfloat16


def _cache(paged):
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(len(LENS), CAP, HKV, D, generator=gen).to(DEVICE, DT)
    v = torch.randn(len(LENS), CAP, HKV, D, generator=gen).to(DEVICE, DT)
    if not paged:
        return k, v, None
    page = 16
    per = CAP // page
    order = torch.randperm(len(LENS) * per, generator=gen)
    table = order.view(len(LENS), per).to(torch.int32).to(DEVICE)
    kp = torch.empty(len(LENS) * per, page, HKV, D, dtype=DT, device=DEVICE)
    vp = torch.empty_like(kp)
    kp[table.view(-1).long()] = k.view(-1, page, HKV, D)
    vp[table.view(-1).long()] = v.view(-1, page, HKV, D)
    return kp, vp, table


def _step(q, cache, rows, lens, **kw):
    """attention_with_kvcache for the cache rows ``rows`` (their query tokens q[rows])."""
    k, v, table = cache
    idx = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor([lens[r] for r in rows], dtype=torch.int32, device=DEVICE)
    if table is None:
        where = dict(cache_batch_idx=idx)
    else:
        where = dict(block_table=table[idx.long()])
    return attention_with_kvcache(q[idx.long()], k, v, cache_seqlens=seqlens,
                                  batch_invariant=True, **where, **kw)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_decoding_does_not_depend_on_the_batch(paged, causal):
    cache = _cache(paged)
    q = torch.randn(len(LENS), 1, H, D, device=DEVICE, dtype=DT)
    whole = _step(q, cache, [0, 1, 2, 3], LENS, causal=causal)
    for rows, kw in (([1], {}), ([3, 1], dict(num_splits=3)), ([1, 2, 0], dict(num_splits=1)),
                     ([2, 0, 3, 1], dict(window_size=(-1, -1)))):
        part = _step(q, cache, rows, LENS, causal=causal, **kw)
        for i, r in enumerate(rows):
            assert torch.equal(part.out[i], whole.out[r]), (rows, r)
            assert torch.equal(part.lse[i], whole.lse[r]), (rows, r)
    # right, too: against the float64 reference over each sequence's keys
    k, v, _ = _cache(False)
    for b, n in enumerate(LENS):
        ref = attention_reference(q[b:b + 1].double(), k[b:b + 1, :n].double(),
                                  v[b:b + 1, :n].double(), causal=causal)
        pt = attention_reference(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=causal,
                                 dtype=DT)
        assert_rule(f"out[{b}]", whole.out[b:b + 1], ref.out, pt.out, 2, DT)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decoding_equals_the_forward_bitwise(paged):
    """Decoding step t (query t over keys 0..t) is bitwise row t of the training forward over
    the whole sequence (causal), and the forward of that one query over the same keys."""
    cache = _cache(paged)
    k, v, _ = _cache(False)
    b, n = 1, LENS[1]
    q_seq = torch.randn(1, n, H, D, device=DEVICE, dtype=DT)
    train = flash_attention(q_seq, k[b:b + 1, :n], v[b:b + 1, :n], causal=True,
                            batch_invariant=True)
    for t in (0, 1, n // 3, n - 2, n - 1):
        lens = list(LENS)
        lens[b] = t + 1
        q = torch.zeros(len(LENS), 1, H, D, device=DEVICE, dtype=DT)
        q[b, 0] = q_seq[0, t]
        step = _step(q, cache, [0, b, 3], lens, causal=True).out[1]
        alone = flash_attention(q_seq[:, t:t + 1], k[b:b + 1, :t + 1], v[b:b + 1, :t + 1],
                                causal=True, batch_invariant=True)
        assert torch.equal(step, alone[0]), t
        assert torch.equal(step, train[0, t:t + 1]), t


def test_packed_and_dense_forwards_agree_bitwise():
    """flash_attention_varlen's rows are bitwise flash_attention's on each sequence."""
    k, v, _ = _cache(False)
    lens_q = [5, 1, 3, 9] if not ON_GPU else [300, 1, 3, 900]
    q = torch.randn(sum(lens_q), H, D, device=DEVICE, dtype=DT)
    kk = torch.cat([k[b, :n] for b, n in enumerate(LENS)])
    vv = torch.cat([v[b, :n] for b, n in enumerate(LENS)])
    cu = lambda lens: torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)  # noqa
    out = flash_attention_varlen(q, kk, vv, cu(lens_q), cu(LENS), max(lens_q), max(LENS),
                                 causal=True, batch_invariant=True)
    at = 0
    for b, (m, n) in enumerate(zip(lens_q, LENS)):
        dense = flash_attention(q[None, at:at + m], k[b:b + 1, :n], v[b:b + 1, :n], causal=True,
                                batch_invariant=True)
        assert torch.equal(out[at:at + m], dense[0]), b
        at += m


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_sliced_q_runs(paged):
    """q as a slice of a longer query buffer (its rows do not flatten): run, bitwise what its
    contiguous copy gives, on every call (none replays the slice's first call)."""
    cache = _cache(paged)
    k, v, table = cache
    lens = torch.tensor(LENS, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        buf = torch.randn(len(LENS), 6, H, D, device=DEVICE, dtype=DT)
        q = buf[:, 1:4]
        assert not q.is_contiguous()
        got = attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                     causal=True, batch_invariant=True)
        want = attention_with_kvcache(q.contiguous(), k, v, cache_seqlens=lens,
                                      block_table=table, causal=True, batch_invariant=True)
        assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)
        ref = attention_reference(q[:1], k[:1, :LENS[0]], v[:1, :LENS[0]], causal=True) \
            if not paged else None
        if ref is not None:
            torch.testing.assert_close(got.out[:1].double(), ref.out, atol=2e-2, rtol=0)


def test_bad_options_raise():
    k, v, table = _cache(True)
    q = torch.randn(len(LENS), 1, H, D, device=DEVICE, dtype=DT)
    lens = torch.tensor(LENS, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="batch_invariant"):
        attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                               batch_invariant="yes")
    with pytest.raises(ValueError, match="cache_leftpad over a paged cache"):
        attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                               cache_leftpad=torch.zeros_like(lens), batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant"):
        flash_attention(q, q, q, batch_invariant=2)
