"""ring-flash-attn (pip ring-flash-attn) unchanged on flashtriton's flash-attn drop-in.

ring-flash-attn builds its ring and all-gather attention on flash-attn's private kernel
wrappers (flash_attn.flash_attn_interface._flash_attn_forward, _flash_attn_backward and their
varlen forms), called by keyword with the defaults it reads off their signatures. The first
tests hold flashtriton's four against flash-attn 2.8's signatures (written out below from
flash-attn v2.8.3's flash_attn_interface.py) and their results against float64 attention.
The ring tests run ring-flash-attn's own functions, forward and backward, at world sizes 2
and 4 (gloo, one process a rank, the kernels through the interpreter: tests/test_ring.py's
pattern) and check each rank's shard of the output, LSE and gradients against float64
attention over the whole sequence (tests/accuracy.py's rule). They are skipped where
ring-flash-attn is not installed (the [test] extra installs it; it requires nothing).
"""

import datetime
import importlib
import importlib.util
import inspect
import os
import sys
import tempfile
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accuracy import assert_rule, make_qkv
from conftest import DEVICE, ON_GPU
from flashtriton import flash_attention
from flashtriton.compat import flash_attn as fa
from flashtriton.reference import attention_reference

HAVE_RING_FLASH_ATTN = importlib.util.find_spec("ring_flash_attn") is not None
needs_ring_flash_attn = pytest.mark.skipif(
    not HAVE_RING_FLASH_ATTN, reason="ring-flash-attn is not installed (pip install "
    "ring-flash-attn, or the [test] extra)")

# flash-attn v2.8.3's flash_attn/flash_attn_interface.py (2.8.0 .. 2.8.3 agree): every
# parameter positional-or-keyword, in this order; E: no default.
E = inspect.Parameter.empty
FLASH_ATTN_28_SIGNATURES = {
    "_flash_attn_forward": [
        ("q", E), ("k", E), ("v", E), ("dropout_p", E), ("softmax_scale", E), ("causal", E),
        ("window_size_left", E), ("window_size_right", E), ("softcap", E),
        ("alibi_slopes", E), ("return_softmax", E)],
    "_flash_attn_varlen_forward": [
        ("q", E), ("k", E), ("v", E), ("cu_seqlens_q", E), ("cu_seqlens_k", E),
        ("max_seqlen_q", E), ("max_seqlen_k", E), ("dropout_p", E), ("softmax_scale", E),
        ("causal", E), ("window_size_left", -1), ("window_size_right", -1), ("softcap", 0.0),
        ("alibi_slopes", None), ("return_softmax", False), ("block_table", None),
        ("leftpad_k", None), ("seqused_k", None), ("zero_tensors", False)],
    "_flash_attn_backward": [
        ("dout", E), ("q", E), ("k", E), ("v", E), ("out", E), ("softmax_lse", E), ("dq", E),
        ("dk", E), ("dv", E), ("dropout_p", E), ("softmax_scale", E), ("causal", E),
        ("window_size_left", E), ("window_size_right", E), ("softcap", E),
        ("alibi_slopes", E), ("deterministic", E), ("rng_state", None)],
    "_flash_attn_varlen_backward": [
        ("dout", E), ("q", E), ("k", E), ("v", E), ("out", E), ("softmax_lse", E), ("dq", E),
        ("dk", E), ("dv", E), ("cu_seqlens_q", E), ("cu_seqlens_k", E), ("max_seqlen_q", E),
        ("max_seqlen_k", E), ("dropout_p", E), ("softmax_scale", E), ("causal", E),
        ("window_size_left", E), ("window_size_right", E), ("softcap", E),
        ("alibi_slopes", E), ("deterministic", E), ("rng_state", None),
        ("zero_tensors", False)],
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_28_SIGNATURES))
def test_signature_is_flash_attn_28s(name):
    params = inspect.signature(getattr(fa, name)).parameters.values()
    assert [(p.name, p.default) for p in params] == FLASH_ATTN_28_SIGNATURES[name]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    # what ring-flash-attn's get_default_args reads
    spec = inspect.getfullargspec(getattr(fa, name))
    assert spec.args == [n for n, _ in FLASH_ATTN_28_SIGNATURES[name]]
    try:
        flash_attn = fa.install()
        from flash_attn.flash_attn_interface import (_flash_attn_backward,  # noqa: F401
                                                     _flash_attn_forward,
                                                     _flash_attn_varlen_backward,
                                                     _flash_attn_varlen_forward)
        assert getattr(flash_attn.flash_attn_interface, name) is getattr(fa, name)
        assert flash_attn.__version__.startswith("2.8.")
    finally:
        fa.uninstall()


def _reference(q, k, v, dout, **options):
    """(out, lse, dq, dk, dv) of float64 attention and of torch in q's dtype."""
    results = []
    for dtype in (torch.float64, q.dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        ref = attention_reference(*leaves, dtype=dtype, **options)
        results.append((ref.out, ref.lse, *torch.autograd.grad(ref.out, leaves,
                                                                dout.to(dtype))))
    return results


def _check(what, ours, ref64, lowp, dtype):
    for name, x, r, p, factor in zip(("out", "lse", "dq", "dk", "dv"), ours, ref64, lowp,
                                     (2, 2, 3, 3, 3)):
        if name == "lse":  # flash-attn's +inf where float64's -inf: a row that sees no key
            assert torch.equal(torch.isinf(x), torch.isinf(r)), what
            x, r, p = (torch.where(torch.isinf(t), 0.0, t) for t in (x, r, p))
        assert_rule(f"{what} {name}", x, r, p, factor, dtype)


# (causal, window, softcap, alibi, SQ, SK, H, HKV, D, dtype)
DENSE = [(True, (-1, -1), 0.0, False, 24, 24, 2, 2, 16, torch.bfloat16),
         (False, (5, 3), 0.0, False, 17, 24, 2, 1, 16, torch.float16),
         (True, (-1, -1), 4.0, True, 24, 17, 2, 2, 32, torch.float32)]


@pytest.mark.parametrize("case", DENSE, ids=["causal", "window-gqa", "softcap-alibi-emptyrows"])
def test_dense_forward_backward(case):
    causal, window, softcap, alibi, SQ, SK, H, HKV, D, dtype = case
    B = 2
    q, k, v = make_qkv(B, SQ, SK, H, HKV, D, dtype, DEVICE, requires_grad=False)
    dout = torch.randn_like(q)
    slopes = torch.rand(B, H, device=DEVICE) if alibi else None
    scale = 0.3
    out, lse, s_dmask, rng_state = fa._flash_attn_forward(
        q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=window[0], window_size_right=window[1], softcap=softcap,
        alibi_slopes=slopes, return_softmax=False)
    assert s_dmask.shape == (0,) and s_dmask.dtype == dtype
    assert rng_state.shape == (2,) and rng_state.dtype == torch.int64
    assert out.dtype == dtype and lse.shape == (B, H, SQ) and lse.dtype == torch.float32
    # dq into a strided view (ring-flash-attn's zigzag passes buffer[:, :seqlen]); a dk of
    # another dtype than k's is refused (as flash-attn does)
    dq_buffer = torch.full((B, SQ + 3, H, D), float("nan"), dtype=dtype, device=DEVICE)
    dq, dk, dv = dq_buffer[:, :SQ], torch.empty_like(k, dtype=torch.float64), torch.empty_like(v)
    with pytest.raises(ValueError, match="dk must have"):
        fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal,
                                *window, softcap, slopes, False)
    dk = torch.empty_like(k)
    softmax_d = fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal,
                                        *window, softcap, slopes, False)
    assert torch.isnan(dq_buffer[:, SQ:]).all()
    options = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                   softmax_scale=scale)
    ref64, lowp = _reference(q, k, v, dout, **options)
    _check("dense", (out, lse, dq, dk, dv), ref64, lowp, dtype)
    rows = (SQ + 127) // 128 * 128
    assert softmax_d.shape == (B, H, rows) and softmax_d.dtype == torch.float32
    delta = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[:, :, :SQ].double(), delta, rtol=1e-5, atol=1e-5)
    assert not softmax_d[:, :, SQ:].any()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_forward_backward(causal):
    cu_q, cu_k = [0, 5, 17, 30], [0, 9, 17, 35]
    H, HKV, D, dtype = 2, 1, 16, torch.bfloat16
    q = torch.randn(cu_q[-1], H, D, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(cu_k[-1], HKV, D, dtype=dtype, device=DEVICE) for _ in range(2))
    dout = torch.randn_like(q)
    cu = [torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in (cu_q, cu_k)]
    lens = [(b - a, d - c) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
    max_q, max_k = (max(x) for x in zip(*lens))
    window = (6, 0) if causal else (-1, -1)
    out, lse, _, _ = fa._flash_attn_varlen_forward(
        q, k, v, *cu, max_q, max_k, 0.0, D ** -0.5, causal, *window)
    assert lse.shape == (H, cu_q[-1])
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    softmax_d = fa._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, *cu, max_q,
                                               max_k, 0.0, D ** -0.5, causal, *window, 0.0,
                                               None, False)
    # per sequence, against (1, seqlen, H, D) references
    refs = [], []
    for b in range(len(lens)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        pair = _reference(q[sq][None], k[sk][None], v[sk][None], dout[sq][None], causal=causal,
                          window_size=window)
        for acc, res in zip(refs, pair):
            acc.append(res)

    def packed(results):
        out, lse, dq, dk, dv = zip(*results)
        return (torch.cat(out, 1)[0], torch.cat(lse, 2)[0], torch.cat(dq, 1)[0],
                torch.cat(dk, 1)[0], torch.cat(dv, 1)[0])

    _check("varlen", (out, lse, dq, dk, dv), packed(refs[0]), packed(refs[1]), dtype)
    B = len(lens)
    assert softmax_d.shape == (H, cu_q[-1] + 128 * B)
    delta = (dout.double() * out.double()).sum(-1).t()
    for b in range(B):
        at = cu_q[b] + 128 * b
        torch.testing.assert_close(softmax_d[:, at:at + lens[b][0]].double(),
                                   delta[:, cu_q[b]:cu_q[b + 1]], rtol=1e-5, atol=1e-5)
    assert int((softmax_d != 0).sum()) <= H * cu_q[-1]


def test_dropout_replays_from_rng_state():
    """The forward's mask is flash_attention's under the same seed; the backward replays it
    from rng_state, and refuses to run without it."""
    q, k, v = make_qkv(1, 16, 16, 2, 1, 16, torch.float16, DEVICE)
    dout = torch.randn_like(q)
    torch.manual_seed(7)
    expected = flash_attention(q, k, v, causal=True, dropout_p=0.3)
    grads = torch.autograd.grad(expected, (q, k, v), dout)
    q, k, v = (x.detach() for x in (q, k, v))
    torch.manual_seed(7)
    out, lse, _, rng_state = fa._flash_attn_forward(q, k, v, 0.3, 0.25, True, -1, -1, 0.0,
                                                    None, False)
    assert torch.equal(out, expected) and rng_state.device == q.device
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    softmax_d = fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.3, 0.25, True,
                                        -1, -1, 0.0, None, False, rng_state)
    for ours, theirs in zip((dq, dk, dv), grads):
        assert torch.equal(ours, theirs)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2) * 0.7
    torch.testing.assert_close(softmax_d[:, :, :16], delta)
    with pytest.raises(ValueError, match="dropout_p > 0 .*rng_state"):
        fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.3, 0.25, True, -1, -1,
                                0.0, None, False)


def test_return_softmax_and_unsupported_options():
    q, k, v = make_qkv(1, 16, 16, 2, 2, 16, torch.float16, DEVICE, requires_grad=False)
    args = (0.25, False, -1, -1, 0.0, None)
    with pytest.raises(RuntimeError, match="return_softmax is only supported when p_dropout"):
        fa._flash_attn_forward(q, k, v, 0.0, *args, True)
    with pytest.raises(NotImplementedError, match="return_softmax=True with dropout_p > 0"):
        fa._flash_attn_forward(q, k, v, 0.1, *args, True)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="leftpad_k"):
        fa._flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 16, 16, 0.0, 0.25, False,
                                      leftpad_k=torch.zeros(1, dtype=torch.int32, device=DEVICE))
    out, lse, _, _ = fa._flash_attn_forward(q, k, v, 0.0, *args, False)
    with pytest.raises(ValueError, match="softmax_lse must have shape"):
        fa._flash_attn_backward(q, q, k, v, out, lse[:, :1], None, None, None, 0.0, *args[:-1],
                                None, False)
    # dq, dk, dv may be None (flash-attn allocates and drops them)
    assert fa._flash_attn_backward(q, q, k, v, out, lse, None, None, None, 0.0, *args[:-1], None,
                                   False).shape == (1, 2, 128)



def test_varlen_backward_softmax_d_zero_for_rows_past_the_sequences():
    """q's rows past cu_seqlens_q[-1] belong to no sequence: their dout and out (NaN here) are
    not read, and softmax_d is zero wherever no sequence's row is (it held their NaN rowsum;
    found by tests/test_fuzz.py)."""
    H, D, dtype = 2, 16, torch.float16
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=DEVICE)
    q = torch.randn(10, H, D, dtype=dtype, device=DEVICE)  # rows 8 and 9: past the sequences
    k, v = (torch.randn(8, H, D, dtype=dtype, device=DEVICE) for _ in range(2))
    out, lse, _, _ = fa._flash_attn_varlen_forward(q, k, v, cu, cu, 5, 5, 0.0, D ** -0.5, False)
    dout = torch.randn_like(q)
    out[8:], dout[8:], lse[:, 8:] = float("nan"), float("nan"), float("nan")
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    softmax_d = fa._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu, cu, 5, 5,
                                               0.0, D ** -0.5, False, -1, -1, 0.0, None, False)
    assert softmax_d.shape == (H, 10 + 128 * 2) and not softmax_d.isnan().any()
    delta = (dout[:8].float() * out[:8].float()).sum(-1).t()
    expected = torch.zeros_like(softmax_d)
    expected[:, 0:5], expected[:, 128 + 5:128 + 8] = delta[:, :5], delta[:, 5:8]
    torch.testing.assert_close(softmax_d, expected)
    assert not any(x.isnan().any() for x in (dq[:8], dk, dv))


@pytest.mark.parametrize("side,value,error", [
    ("window_size_left", 1.5, TypeError), ("window_size_right", None, TypeError),
    ("window_size_left", -2, ValueError), ("window_size_right", "a", TypeError)])
def test_window_side_errors_name_the_side(side, value, error):
    """A bad window_size_left / window_size_right raises naming that argument (not the
    window_size pair they make; found by tests/test_fuzz.py), and the backward leaves the
    gradient buffers as they were."""
    q, k, v = make_qkv(1, 6, 6, 2, 2, 16, torch.float16, DEVICE, requires_grad=False)
    options = dict(dropout_p=0.0, softmax_scale=0.25, causal=False, window_size_left=-1,
                   window_size_right=-1, softcap=0.0, alibi_slopes=None)
    out, lse, _, _ = fa._flash_attn_forward(q=q, k=k, v=v, return_softmax=False, **options)
    options[side] = value
    with pytest.raises(error, match=rf"\b{side}\b"):
        fa._flash_attn_forward(q=q, k=k, v=v, return_softmax=False, **options)
    dq = torch.full_like(q, float("nan"))
    with pytest.raises(error, match=rf"\b{side}\b"):
        fa._flash_attn_backward(dout=torch.ones_like(out), q=q, k=k, v=v, out=out,
                                softmax_lse=lse, dq=dq, dk=None, dv=None, deterministic=False,
                                **options)
    assert dq.isnan().all()


# -- ring-flash-attn's own functions over gloo ------------------------------------------------


def load_ring_flash_attn(try_package: bool) -> types.ModuleType:
    """ring-flash-attn's modules over flashtriton's flash-attn (install() first: they import
    flash_attn.flash_attn_interface's private functions at import time).

    ring-flash-attn 0.1.8's package __init__ also imports its Hugging Face adapter, which
    needs transformers and a name (transformers.modeling_flash_attention_utils
    .is_flash_attn_greater_or_equal_2_10) that transformers 5 no longer has; where that fails
    (or with try_package False, to spare a process the import of transformers), its modules
    are loaded without the package's __init__."""
    fa.install()
    if try_package:
        try:
            return importlib.import_module("ring_flash_attn")
        except ImportError as e:
            if not (e.name or "").startswith("transformers"):
                raise
    spec = importlib.util.find_spec("ring_flash_attn")
    package = types.ModuleType("ring_flash_attn")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["ring_flash_attn"] = package
    for module in ("ring_flash_attn", "ring_flash_attn_varlen", "zigzag_ring_flash_attn",
                   "zigzag_ring_flash_attn_varlen", "llama3_flash_attn_varlen"):
        for name, value in vars(importlib.import_module(f"ring_flash_attn.{module}")).items():
            if name.endswith("_func") or name.startswith("llama3_"):
                setattr(package, name, value)
    return package


def _packed_reference(q, k, v, cu, causal, dtype):
    """float64 (or dtype) attention over the packed sequences of cu: out, lse (H, total)."""
    outs, lses = [], []
    for a, b in zip(cu, cu[1:]):
        ref = attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal,
                                  dtype=dtype)
        outs.append(ref.out[0])
        lses.append(ref.lse[0])
    return torch.cat(outs), torch.cat(lses, 1)


def _local_rows(n, cu, layout, rank, world):
    """The indices of rank's tokens among n (packed, sequences at cu) in ring-flash-attn's
    layouts: contiguous chunks of each sequence (ring varlen), chunks r and 2W - 1 - r of each
    (zigzag), or the contiguous share of the packed tokens (llama3)."""
    if layout == "llama3":
        return torch.arange(n).chunk(world)[rank]
    parts = 2 * world if layout == "zigzag" else world
    rows = []
    for a, b in zip(cu, cu[1:]):
        chunks = torch.arange(a, b).chunk(parts)
        rows += [chunks[rank], chunks[parts - 1 - rank]] if layout == "zigzag" else [chunks[rank]]
    return torch.cat(rows)


# (function, causal, B, H, HKV, D, seqlen per rank; varlen: the packed sequences' lengths)
RING_CASES = {
    2: [("ring_flash_attn_func", True, 2, 2, 1, 16, 16),
        ("ring_flash_attn_func", False, 1, 2, 2, 16, 16),
        ("zigzag_ring_flash_attn_func", True, 2, 2, 2, 16, 16),
        ("ring_flash_attn_varlen_func", True, None, 2, 2, 16, [8, 12, 12]),
        ("zigzag_ring_flash_attn_varlen_func", True, None, 2, 1, 16, [12, 20]),
        ("llama3_flash_attn_varlen_func", True, None, 2, 2, 16, [5, 18, 9]),
        ("llama3_flash_attn_varlen_func", False, None, 2, 1, 32, [5, 18, 9])],
    # four processes on CI's two cores: the zigzag ring (every kind of step) and llama3
    4: [("zigzag_ring_flash_attn_func", True, 1, 2, 2, 16, 8),
        ("llama3_flash_attn_varlen_func", True, None, 2, 2, 16, [3, 20, 9])],
}


def check_ring_case(rfa, rank, world, func, causal, B, H, HKV, D, size):
    torch.manual_seed(1234)  # every rank draws the same whole sequence
    # fp16 where it can: ring-flash-attn 0.1.8's ring_flash_attn(_varlen)_func returns dq in
    # bf16 whatever q's dtype (their backward's .to(torch.bfloat16))
    dtype = torch.bfloat16 if func.startswith("ring_") else torch.float16
    what = f"rank {rank}/{world} {func} causal={causal}"
    fn = getattr(rfa, func)
    if B is not None:  # (batch, seqlen, heads, dim): shards along dim 1
        N = size * world
        q, k, v = (torch.randn(B, N, h, D, dtype=dtype) for h in (H, HKV, HKV))
        dout = torch.randn(B, N, H, D, dtype=dtype)
        rows = _local_rows(N, [0, N], "zigzag" if func.startswith("zigzag") else "ring",
                           rank, world)
        local = [x[:, rows].clone().requires_grad_() for x in (q, k, v)]
        out, lse, _ = fn(*local, causal=causal, return_attn_probs=True)
        out.backward(dout[:, rows])
        ref64, lowp = _reference(q, k, v, dout, causal=causal)
        part = (lambda x, name: x[:, :, rows] if name == "lse" else x[:, rows])
    else:  # packed (total, heads, dim) sequences of the lengths in size
        cu = [0]
        for n in size:
            cu.append(cu[-1] + n)
        N = cu[-1]
        q, k, v = (torch.randn(N, h, D, dtype=dtype) for h in (H, HKV, HKV))
        dout = torch.randn(N, H, D, dtype=dtype)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        layout = func.split("_")[0]
        rows = _local_rows(N, cu, layout, rank, world)
        local = [x[rows].clone().requires_grad_() for x in (q, k, v)]
        if layout == "llama3":
            cu_q, cu_k, max_q, max_k, k_slice = rfa.llama3_flash_attn_prepare_cu_seqlens(
                cu_t, causal=causal, rank=rank, world_size=world)
            out, lse, _ = fn(*local, cu_q, cu_k, max_q, max_k, heads_k_stride=1,
                             local_k_slice=k_slice, causal=causal, return_attn_probs=True)
        else:
            cu_local = cu_t // world
            out, lse, _ = fn(*local, cu_local, max(size) // world, causal=causal,
                             return_attn_probs=True)
        out.backward(dout[rows])
        results = []
        for ref_dtype in (torch.float64, dtype):
            leaves = [x.to(ref_dtype).requires_grad_() for x in (q, k, v)]
            r_out, r_lse = _packed_reference(*leaves, cu, causal, ref_dtype)
            results.append((r_out, r_lse, *torch.autograd.grad(r_out, leaves,
                                                                dout.to(ref_dtype))))
        ref64, lowp = results
        part = (lambda x, name: x[:, rows] if name == "lse" else x[rows])
    ours = (out, lse, *(x.grad for x in local))
    names = ("out", "lse", "dq", "dk", "dv")
    _check(what, ours, *([part(x, n) for x, n in zip(r, names)] for r in (ref64, lowp)), dtype)


def _ring_worker(rank, world, init_file, cases):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        rfa = load_ring_flash_attn(try_package=rank == 0)
        from ring_flash_attn.utils import get_default_args
        defaults = get_default_args(rfa.ring_flash_attn_func.__globals__["_flash_attn_forward"])
        assert defaults["softcap"] == 0.0 and "window_size_left" in defaults
        for case in cases:
            check_ring_case(rfa, rank, world, *case)
    finally:
        dist.destroy_process_group()


@needs_ring_flash_attn
@pytest.mark.skipif(ON_GPU, reason="the gloo run of the interpreter (CPU)")
@pytest.mark.parametrize("world", sorted(RING_CASES))
def test_ring_flash_attn_gloo(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ring_worker, args=(world, os.path.join(tmp, "init"), RING_CASES[world]),
                 nprocs=world, join=True)
