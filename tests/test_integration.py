"""patch_sdpa (process-wide and scoped to one module), logging, the env report and profiler
names."""

import logging
import threading

import pytest
import torch
import torch.nn.functional as F

import flashtriton
import flashtriton.sdpa as sdpa_mod
from accuracy import assert_rule
from conftest import DEVICE
from flashtriton.reference import attention_reference
from modules import AttentionBlock, SdpaBlock


def test_patch_sdpa_routes_and_restores(monkeypatch):
    original = F.scaled_dot_product_attention
    model = SdpaBlock().to(DEVICE)
    x = torch.randn(2, 21, 64, device=DEVICE)
    expected = model(x)
    calls = []
    real_run = sdpa_mod._run
    monkeypatch.setattr(sdpa_mod, "_run", lambda *a, **k: calls.append(1) or real_run(*a, **k))
    with flashtriton.patch_sdpa():
        assert F.scaled_dot_product_attention is flashtriton.scaled_dot_product_attention
        got = model(x)
    assert F.scaled_dot_product_attention is original and calls == [1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    handle = flashtriton.patch_sdpa()
    # Unsupported calls fall back to torch's original, also while patched (no recursion).
    q = torch.randn(1, 2, 5, 16, device=DEVICE)
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=torch.randn(5, 5, device=DEVICE,
                                                                        requires_grad=True))
    handle.restore()
    assert F.scaled_dot_product_attention is original and out.shape == q.shape


def _count_kernel_runs(monkeypatch):
    calls = []
    real_run = sdpa_mod._sdpa_run
    monkeypatch.setattr(sdpa_mod, "_sdpa_run",
                        lambda *a, **k: calls.append(1) or real_run(*a, **k))
    return calls


def _no_hooks(module):
    return not module._forward_pre_hooks and not module._forward_hooks


def test_patch_sdpa_module_routes_only_that_module(monkeypatch):
    original = F.scaled_dot_product_attention
    inside, outside = SdpaBlock().to(DEVICE), SdpaBlock().to(DEVICE)
    x = torch.randn(2, 21, 64, device=DEVICE)
    expected_in, expected_out = inside(x), outside(x)
    calls = _count_kernel_runs(monkeypatch)
    with flashtriton.patch_sdpa(inside) as handle:
        assert F.scaled_dot_product_attention is not original
        got_in = inside(x)
        assert len(calls) == 1
        got_out = outside(x)
        q = torch.randn(1, 2, 5, 16, device=DEVICE)
        direct = F.scaled_dot_product_attention(q, q, q)
        assert len(calls) == 1  # neither the other module nor a call outside any forward
        with pytest.raises(RuntimeError):
            inside(torch.randn(2, 21, 63, device=DEVICE))  # the scope ends with the exception
        outside(x)
        assert len(calls) == 1
    assert F.scaled_dot_product_attention is original and _no_hooks(inside)
    torch.testing.assert_close(got_in, expected_in, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_out, expected_out) and torch.equal(direct, original(q, q, q))
    handle.restore()  # a second restore does nothing
    assert F.scaled_dot_product_attention is original
    inside(x)
    assert len(calls) == 1


def test_patch_sdpa_modules_restored_in_any_order(monkeypatch):
    original = F.scaled_dot_product_attention
    first, second = SdpaBlock().to(DEVICE), SdpaBlock().to(DEVICE)
    x = torch.randn(1, 9, 64, device=DEVICE)
    calls = _count_kernel_runs(monkeypatch)
    h1, h2 = flashtriton.patch_sdpa(first), flashtriton.patch_sdpa(second)
    first(x), second(x)
    assert len(calls) == 2
    h1.restore()
    first(x)
    assert len(calls) == 2 and F.scaled_dot_product_attention is not original
    second(x)
    assert len(calls) == 3
    h2.restore()
    assert F.scaled_dot_product_attention is original and _no_hooks(first) and _no_hooks(second)


def test_patch_sdpa_module_under_a_later_process_patch(monkeypatch):
    """A process-wide patch made after a scoped one and undone after it: the scoped function
    stays in its chain, and a second scoped patch routes without calling itself."""
    original = F.scaled_dot_product_attention
    block, other = SdpaBlock().to(DEVICE), SdpaBlock().to(DEVICE)
    x = torch.randn(1, 9, 64, device=DEVICE)
    calls = _count_kernel_runs(monkeypatch)
    scoped = flashtriton.patch_sdpa(block)
    wrapped = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda *a, **k: wrapped(*a, **k)  # another library's
    try:
        scoped.restore()
        with flashtriton.patch_sdpa(other):
            other(x), block(x)
            assert len(calls) == 1
    finally:
        F.scaled_dot_product_attention = wrapped
    assert F.scaled_dot_product_attention is wrapped
    with flashtriton.patch_sdpa(block):
        block(x), other(x)
    assert len(calls) == 2 and F.scaled_dot_product_attention is original


class _ThreadedBlock(torch.nn.Module):
    """Calls SDPA in its own forward and, at the same time, in a thread it starts."""

    def forward(self, q):
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            other=F.scaled_dot_product_attention(q, q, q)))
        worker.start()
        worker.join()
        return F.scaled_dot_product_attention(q, q, q), result["other"]


def test_patch_sdpa_module_scope_is_per_thread(monkeypatch):
    block = _ThreadedBlock()
    q = torch.randn(1, 2, 7, 16, device=DEVICE)
    calls = _count_kernel_runs(monkeypatch)
    with flashtriton.patch_sdpa(block):
        ours, other = block(q)
    assert len(calls) == 1
    assert torch.equal(other, F.scaled_dot_product_attention(q, q, q))
    torch.testing.assert_close(ours, other, atol=1e-5, rtol=1e-5)


def test_patch_sdpa_module_must_be_a_module():
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        flashtriton.patch_sdpa(lambda x: x)


def test_debug_logging_names_each_launch(caplog):
    q = torch.randn(1, 20, 2, 16, device=DEVICE, requires_grad=True)
    with caplog.at_level(logging.DEBUG, logger="flashtriton"):
        flashtriton.flash_attention(q, q, q, causal=True).sum().backward()
    names = [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("launch")]
    assert names == ["_attn_fwd_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_dkdv_kernel"]
    launches = [r.getMessage() for r in caplog.records if r.getMessage().startswith("launch")]
    assert all("BLOCK_M=" in m and "grid=" in m and "num_warps=" in m for m in launches)
    # on a GPU, a kernel's first call for a key also logs the autotuner's choice
    tunings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("autotuned")]
    assert all("BLOCK_M" in m and "key" in m for m in tunings)
    assert len(tunings) <= 3 and (DEVICE != "cpu" or not tunings)


def test_env_report():
    from flashtriton.env import report
    text = report()
    assert f"torch {torch.__version__}" in text and "triton" in text and "kernels:" in text


def test_ops_have_their_own_names_in_profiler_traces():
    q = torch.randn(1, 20, 2, 16, device=DEVICE, requires_grad=True)
    with torch.profiler.profile() as prof:
        flashtriton.flash_attention(q, q, q).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"flashtriton::attn_fwd", "flashtriton::attn_bwd"} <= names


def test_patched_model_matches_reference():
    torch.manual_seed(0)
    model = SdpaBlock().to(DEVICE).to(torch.bfloat16)
    x = torch.randn(2, 33, 64, device=DEVICE, dtype=torch.bfloat16)
    with flashtriton.patch_sdpa():
        got = model(x)
    B, T, C = x.shape
    q, k, v = model.qkv(x).view(B, T, 3, 4, 16).permute(2, 0, 1, 3, 4)
    ref = attention_reference(q.detach(), k.detach(), v.detach(), causal=True)
    pt = attention_reference(q.detach(), k.detach(), v.detach(), causal=True, dtype=torch.bfloat16)
    assert_rule("out", got.transpose(1, 2), ref.out, pt.out, 2, torch.bfloat16)


def test_torch_export_for_inference():
    model = AttentionBlock().to(DEVICE).eval()
    x = torch.randn(2, 19, 64, device=DEVICE)
    exported = torch.export.export(model, (x,))
    assert any("flashtriton.attn_fwd" in str(n.target) for n in exported.graph.nodes)
    torch.testing.assert_close(exported.module()(x), model(x), atol=1e-6, rtol=1e-6)


def test_autocast():
    model = AttentionBlock().to(DEVICE)
    x = torch.randn(2, 19, 64, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
