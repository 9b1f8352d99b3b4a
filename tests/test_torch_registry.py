"""torch's flash-attention registry: "flashtriton" registered at import and not activated,
activation and restore through torch's functions, and aten's flash-attention operators on the
kernels against the float64 reference, with the fallback of the calls they cannot take.

torch's own activation puts the kernels on the CUDA dispatch key. The CPU has no kernels for
these operators, so without a GPU the tests that run them put flashtriton's on the CPU key
(``torch_registry.activate("CPU")``) and run them through the dispatcher and aten's autograd
formulas as on a GPU; a fallback goes to a stand-in kernel registered before them.
"""

import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch

if not hasattr(torch.nn.attention, "activate_flash_attention_impl"):
    pytest.skip("torch < 2.11 has no flash-attention registry", allow_module_level=True)

from torch.nn.attention import (activate_flash_attention_impl,  # noqa: E402
                                current_flash_attention_impl, list_flash_attention_impls,
                                register_flash_attention_impl, restore_flash_attention_impl)
from torch.nn.attention import varlen as torch_varlen  # noqa: E402

import flashtriton  # noqa: E402,F401  (registers "flashtriton")
from accuracy import assert_rule  # noqa: E402
from conftest import DEVICE, ON_GPU  # noqa: E402
from flashtriton.integrations import torch_registry  # noqa: E402
from flashtriton.reference import attention_reference  # noqa: E402

aten = torch.ops.aten
KEY = "CUDA" if ON_GPU else "CPU"  # the dispatch key of DEVICE's tensors
SDPA_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
            "_flash_attention_forward", "_flash_attention_backward")


def _registrations(key):
    """The dispatcher's kernels of the flash operators for dispatch key ``key``."""
    return [line for op in SDPA_OPS for line in torch._C._dispatch_dump(f"aten::{op}").splitlines()
            if line.startswith(f"{key}:")]


@pytest.fixture
def active():
    """flashtriton's kernels on DEVICE's dispatch key for the test."""
    handle = torch_registry.activate(KEY)
    yield
    handle.remove()


def test_import_registers_without_activating():
    """In a fresh process: after ``import flashtriton`` the name is listed, none is active and
    the flash operators' CPU and CUDA kernels are those before the import."""
    code = ("import torch\n"
            "from torch.nn.attention import current_flash_attention_impl, "
            "list_flash_attention_impls\n"
            f"ops = {SDPA_OPS!r}\n"
            "def kernels():\n"
            "    return [line for op in ops for line in "
            "torch._C._dispatch_dump('aten::' + op).splitlines() "
            "if line.startswith(('CPU:', 'CUDA:'))]\n"
            "before = kernels()\n"
            "import flashtriton\n"
            "print(kernels() == before, current_flash_attention_impl(), "
            "'flashtriton' in list_flash_attention_impls())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "None", "True"], done.stdout


def test_activate_and_restore_through_torch():
    before = _registrations("CUDA")
    assert "flashtriton" in list_flash_attention_impls()
    activate_flash_attention_impl("flashtriton")
    try:
        assert current_flash_attention_impl() == "flashtriton"
        assert len(_registrations("CUDA")) == 4 and _registrations("CUDA") != before
    finally:
        restore_flash_attention_impl()
    assert current_flash_attention_impl() is None
    assert _registrations("CUDA") == before


def test_activated_operators_run_flashtriton_until_restored():
    """The registry's activation and restore with the kernels on DEVICE's key: the operator
    runs flashtriton's kernels (in float32, which aten's flash kernel refuses) while active, and
    has the kernels it had before (on the CPU: none) after restore."""
    register_flash_attention_impl("flashtriton", register_fn=lambda: torch_registry.activate(KEY))
    q = torch.randn(1, 2, 7, 16, device=DEVICE)
    before = _registrations(KEY)
    try:
        activate_flash_attention_impl("flashtriton")
        out = aten._scaled_dot_product_flash_attention(q, q, q)[0]
        ref = attention_reference(*(q.transpose(1, 2).double(),) * 3)
        torch.testing.assert_close(out.transpose(1, 2).double(), ref.out, atol=1e-5, rtol=1e-5)
        restore_flash_attention_impl()
        assert current_flash_attention_impl() is None and _registrations(KEY) == before
        if not ON_GPU:
            with pytest.raises(NotImplementedError):
                aten._scaled_dot_product_flash_attention(q, q, q)
    finally:
        if current_flash_attention_impl() == "flashtriton":
            restore_flash_attention_impl()
        torch_registry.register()


def _leaves(*shapes, dtype=torch.float32):
    return [torch.randn(s, device=DEVICE, dtype=dtype, requires_grad=True) for s in shapes]


def _reference(q, k, v, dtype, **options):
    """The float64 reference and torch's own in ``dtype`` on (B, T, H, D) leaves' copies:
    (ReferenceOutput, leaves) pairs."""
    res = []
    for d in (torch.float64, dtype):
        leaves = [x.detach().to(d).requires_grad_() for x in (q, k, v)]
        res.append((attention_reference(*leaves, dtype=d, **options), leaves))
    return res


def _check(name, ours, refs, factor, dtype):
    assert_rule(name, ours, refs[0], refs[1], factor, dtype)


@pytest.mark.parametrize("SQ,SK,H,HKV,causal,scale", [
    pytest.param(9, 9, 2, 2, True, None, id="causal"),
    pytest.param(5, 12, 4, 2, False, 0.3, id="gqa-scale-sq<sk"),
    pytest.param(12, 5, 2, 1, True, None, id="mqa-causal-sq>sk"),
])
def test_sdpa_operator_forward_and_backward(active, SQ, SK, H, HKV, causal, scale):
    """aten::_scaled_dot_product_flash_attention and its backward (through aten's autograd
    formula) on (B, H, T, D), with aten's return values; causal is bottom-right aligned as in
    aten's flash kernel."""
    B, D = 2, 16
    q, k, v = _leaves((B, SQ, H, D), (B, SK, HKV, D), (B, SK, HKV, D))
    query, key, value = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's layout, BSHD memory
    res = aten._scaled_dot_product_flash_attention(query, key, value, is_causal=causal,
                                                   scale=scale)
    out, lse, cu_q, cu_k, max_q, max_k, seed, offset, debug = res
    assert out.shape == query.shape and out.stride() == query.stride()
    assert lse.shape == (B, H, SQ) and lse.dtype == torch.float32
    assert cu_q is None and cu_k is None and (max_q, max_k) == (SQ, SK)
    assert seed.shape == (2,) and offset.shape == () and seed.dtype == offset.dtype == torch.uint64
    assert seed.view(torch.int64).tolist() == [0, 0] and offset.view(torch.int64).item() == 0 and debug.numel() == 0
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    (ref, ref_leaves), (low, low_leaves) = _reference(q, k, v, torch.float32, causal=causal,
                                                      softmax_scale=scale)
    ref_lse = ref.lse.masked_fill(ref.lse == float("-inf"), float("inf"))
    low_lse = low.lse.masked_fill(low.lse == float("-inf"), float("inf"))
    _check("out", out.transpose(1, 2), (ref.out, low.out), 2, torch.float32)
    _check("lse", lse, (ref_lse, low_lse), 2, torch.float32)
    d_out = dout.transpose(1, 2)
    ref_g = torch.autograd.grad(ref.out, ref_leaves, d_out.double())
    low_g = torch.autograd.grad(low.out, low_leaves, d_out)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_g, low_g):
        _check(name, g, (r, p), 3, torch.float32)


def test_flash_operator_window(active):
    """aten::_flash_attention_forward / _backward on (B, T, H, D) with a sliding window."""
    q, k, v = _leaves((1, 11, 2, 16), (1, 11, 2, 16), (1, 11, 2, 16), dtype=torch.bfloat16)
    out, lse, *_ = aten._flash_attention_forward(q, k, v, None, None, 11, 11, 0.0, False, False,
                                                 window_size_left=3, window_size_right=1)
    dout = torch.randn_like(out)
    grads = aten._flash_attention_backward(dout, q, k, v, out, lse, None, None, 11, 11, 0.0,
                                           False, torch.zeros(2, dtype=torch.uint64,
                                                              device=DEVICE),
                                           torch.zeros((), dtype=torch.uint64, device=DEVICE),
                                           window_size_left=3, window_size_right=1)
    (ref, ref_leaves), (low, low_leaves) = _reference(q, k, v, torch.bfloat16,
                                                      window_size=(3, 1))
    _check("out", out, (ref.out, low.out), 2, torch.bfloat16)
    _check("lse", lse, (ref.lse, low.lse), 2, torch.bfloat16)
    ref_g = torch.autograd.grad(ref.out, ref_leaves, dout.double())
    low_g = torch.autograd.grad(low.out, low_leaves, dout)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_g, low_g):
        _check(name, g, (r, p), 3, torch.bfloat16)


def _varlen_case(lens_q, lens_k, H=2, D=16):
    cu = [torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)
          for lens in (lens_q, lens_k)]
    q, k, v = _leaves((sum(lens_q), H, D), (sum(lens_k), H, D), (sum(lens_k), H, D))
    return q, k, v, *cu


def _varlen_reference(q, k, v, cu_q, cu_k, dout, **options):
    """Per sequence: out, lse (H, total_q; +inf where no key is seen, aten's value) and the
    gradients, float64 and float32."""
    res = []
    for dtype in (torch.float64, torch.float32):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        outs, lses = [], []
        for b in range(cu_q.numel() - 1):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            r = attention_reference(leaves[0][qs][None], leaves[1][ks][None],
                                    leaves[2][ks][None], dtype=dtype, **options)
            outs.append(r.out[0])
            lses.append(r.lse[0])
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)
        grads = torch.autograd.grad(out, leaves, dout.to(dtype))
        res.append((out, lse.masked_fill(lse == float("-inf"), float("inf")), grads))
    return res


def test_varlen_attn(active):
    """torch.nn.attention.varlen_attn, causal, forward (out and LSE, with rows that see no key)
    and backward, against a loop over sequences."""
    lens_q, lens_k = [5, 1, 9], [3, 4, 9]
    q, k, v, cu_q, cu_k = _varlen_case(lens_q, lens_k)
    out, lse = torch_varlen.varlen_attn(q, k, v, cu_q, cu_k, 9, 9, window_size=(-1, 0),
                                        return_aux=torch_varlen.AuxRequest(lse=True))
    assert lse.shape == (2, sum(lens_q)) and torch.isposinf(lse[:, :2]).all()
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    (r_out, r_lse, r_g), (p_out, p_lse, p_g) = _varlen_reference(q, k, v, cu_q, cu_k, dout,
                                                                 causal=True)
    _check("out", out, (r_out, p_out), 2, torch.float32)
    _check("lse", lse, (r_lse, p_lse), 2, torch.float32)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, r_g, p_g):
        _check(name, g, (r, p), 3, torch.float32)


@pytest.mark.skipif(not hasattr(aten, "_flash_attention_forward_no_dropout_inplace"),
                    reason="this torch has no varlen_attn_out")
def test_varlen_attn_out_writes_in_place(active):
    q, k, v, cu_q, cu_k = _varlen_case([4, 7], [6, 2])
    buffer = torch.full((11, 2, 16), float("nan"), device=DEVICE)
    with torch.no_grad():
        res = torch_varlen.varlen_attn_out(buffer, q, k, v, cu_q, cu_k, 7, 6)
    assert res is buffer
    (r_out, _, _), (p_out, _, _) = _varlen_reference(q, k, v, cu_q, cu_k, torch.zeros_like(q))
    _check("out", buffer, (r_out, p_out), 2, torch.float32)


@pytest.fixture
def stand_in():
    """A recording CPU kernel for the SDPA forward and the flash forward and backward, put
    there before flashtriton's (as torch's own kernels are on a GPU); yields its calls."""
    calls = []
    library = torch.library.Library("aten", "IMPL", KEY)

    def aux(query):
        return (torch.zeros(2, dtype=torch.uint64, device=query.device),
                torch.zeros((), dtype=torch.uint64, device=query.device),
                query.new_empty(0))

    def sdpa(query, key, value, *args, **kwargs):
        calls.append(("sdpa", (query, key, value, *args), kwargs))
        B, H, SQ, _ = query.shape
        return (torch.zeros_like(query), query.new_zeros(B, H, SQ, dtype=torch.float32), None,
                None, SQ, key.shape[2], *aux(query))

    def forward(query, *args, **kwargs):
        calls.append(("forward", (query, *args), kwargs))
        return torch.zeros_like(query), query.new_zeros(1, dtype=torch.float32), *aux(query)

    def backward(grad_out, query, key, value, *args, **kwargs):
        calls.append(("backward", (grad_out, query, key, value, *args), kwargs))
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)

    with warnings.catch_warnings():  # (on a GPU, aten's kernels are overridden)
        warnings.simplefilter("ignore")
        library.impl("_scaled_dot_product_flash_attention", sdpa, KEY)
        library.impl("_flash_attention_forward", forward, KEY)
        library.impl("_flash_attention_backward", backward, KEY)
    handle = torch_registry.activate(KEY)
    yield calls
    handle.remove()
    library._destroy()


@pytest.mark.parametrize("case,words", [
    ("dropout", "dropout_p=0.25"),
    ("float64", "unsupported dtype torch.float64"),
    ("debug-mask", "return_debug_mask=True"),
    ("alibi", "alibi_slopes"),
    ("backward-dropout", "dropout_p=0.5"),
    ("int64-offsets", "cum_seq_q must be a 1-D int32 tensor"),
])
def test_unsupported_calls_run_the_previous_kernel(stand_in, caplog, case, words):
    q = torch.randn(1, 5, 2, 16, device=DEVICE)
    if case == "dropout":
        call = lambda: aten._scaled_dot_product_flash_attention(q, q, q, 0.25)  # noqa: E731
    elif case == "float64":
        x = q.double()
        call = lambda: aten._scaled_dot_product_flash_attention(x, x, x)  # noqa: E731
    elif case == "debug-mask":
        call = lambda: aten._scaled_dot_product_flash_attention(  # noqa: E731
            q, q, q, return_debug_mask=True)
    elif case == "alibi":
        call = lambda: aten._flash_attention_forward(  # noqa: E731
            q, q, q, None, None, 5, 5, 0.0, False, False,
            alibi_slopes=torch.ones(2, device=DEVICE))
    elif case == "backward-dropout":
        seed = torch.zeros(2, dtype=torch.uint64, device=DEVICE)
        offset = torch.zeros((), dtype=torch.uint64, device=DEVICE)
        call = lambda: aten._flash_attention_backward(  # noqa: E731
            q, q, q, q, q, q.new_zeros(1, 2, 5), None, None, 5, 5, 0.5, False, seed, offset)
    else:
        x, cu = q[0], torch.tensor([0, 5], device=DEVICE)
        call = lambda: aten._flash_attention_forward(  # noqa: E731
            x, x, x, cu, cu, 5, 5, 0.0, False, False)
    with caplog.at_level(logging.DEBUG, logger="flashtriton"):
        call()
    assert len(stand_in) == 1, stand_in
    kind, args, _ = stand_in[0]
    assert kind == {"backward-dropout": "backward", "alibi": "forward",
                    "int64-offsets": "forward"}.get(case, "sdpa")
    fallbacks = [r.getMessage() for r in caplog.records if "runs torch's kernel" in r.getMessage()]
    assert len(fallbacks) == 1 and words in fallbacks[0], fallbacks
    assert all(r.levelno == logging.DEBUG for r in caplog.records)
    assert not any(r.getMessage().startswith("launch") for r in caplog.records)


def test_supported_call_does_not_run_the_previous_kernel(stand_in):
    q = torch.randn(1, 2, 5, 16, device=DEVICE)
    out = aten._scaled_dot_product_flash_attention(q, q, q)[0]
    assert not stand_in and out.abs().sum() > 0


@pytest.mark.skipif(ON_GPU, reason="a GPU build of torch has aten's CUDA kernels to fall back to")
def test_without_a_previous_kernel_a_fallback_raises(active):
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(RuntimeError, match="dropout_p=0.25.*no other CPU kernel"):
        aten._scaled_dot_product_flash_attention(q, q, q, 0.25)
