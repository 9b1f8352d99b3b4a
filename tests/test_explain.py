"""flashtriton.explain and the routing policy in configs: which family a call takes and why."""
import pytest
import torch

import flashtriton
from conftest import DEVICE
from flashtriton import _env, configs, runtime


def _qkv(N=64, D=128, dtype=torch.float32):
    return [torch.randn(1, N, 2, D, device=DEVICE, dtype=dtype) for _ in range(3)]


def test_explain_names_the_triton_family_and_the_reasons_here():
    """Off Hopper (or in fp32) both directions take the Triton kernels, with a reason for each."""
    e = flashtriton.explain(*_qkv(), causal=True)
    assert (e.forward, e.backward) == ("triton", "triton")
    assert len(e.reasons) == 2 and all(r.startswith("gluon: ") for r in e.reasons)
    assert "forward" in str(e) and "backward" in str(e)


def test_explain_reports_the_policy_thresholds(monkeypatch):
    """Below configs.GLUON_BWD_MIN_SEQLEN the backward's reason names the threshold; a head dim
    outside configs.GLUON_FWD_HEAD_DIMS / GLUON_BWD_HEAD_DIMS names the forward's and the
    backward's."""
    monkeypatch.setattr(configs, "GLUON_BWD_MIN_SEQLEN", 4096)
    e = flashtriton.explain(*_qkv(N=64, D=128, dtype=torch.bfloat16))
    assert any("GLUON_BWD_MIN_SEQLEN" in r and "got 64" in r for r in e.reasons)
    e = flashtriton.explain(*_qkv(N=4096, D=72, dtype=torch.bfloat16))
    assert any(f"head dims {configs.GLUON_FWD_HEAD_DIMS}" in r and "head dim 72" in r
               for r in e.reasons)
    assert any("GLUON_BWD_HEAD_DIMS" in r and "got 72" in r for r in e.reasons)


def test_explain_checks_its_arguments():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="window"):
        flashtriton.explain(q, k, v, window_size=(-5, 0))
    with pytest.raises((TypeError, ValueError)):
        flashtriton.explain(q, k[..., :64], v)


@pytest.mark.parametrize("head_dim,seqlen,causal,first", [
    (128, 8192, True, True), (128, 512, True, False), (128, 513, True, True),
    (128, 256, False, True), (64, 8192, False, True), (64, 1024, True, False),
    (64, 2048, True, True), (256, 8192, True, True),
    (256, 512, True, False), (72, 8192, False, False), (96, 8192, False, True),
    (96, 512, False, False), (80, 1024, True, True), (192, 8192, True, True),
    (112, 1023, False, False)])
def test_gluon_forward_first(head_dim, seqlen, causal, first):
    """configs.gluon_forward_first: head dims 128 and 256, causal calls from 513 queries; the
    head dim 64 and the padded head dims from their GLUON_FWD_MIN_SEQLEN; other head dims
    (72): the Triton forward."""
    assert configs.gluon_forward_first(head_dim, seqlen, causal) is first


def test_call_signature_holds_the_policy(monkeypatch):
    """A change of any policy value gives calls another signature (no replay crosses it)."""
    monkeypatch.setattr(runtime._env, "FAST_LAUNCH", True)
    monkeypatch.setattr(runtime._env, "INTERPRET", False)
    q = torch.empty(1, 8, 2, 16)
    before = runtime.call_signature("fwd", (), q)
    assert before == runtime.call_signature("fwd", (), q)
    for name, value in (("GLUON_VARIANTS", False), ("GLUON_BWD_MIN_SEQLEN", 2048),
                        ("DECODE_MERGE_IN_KERNEL", False), ("KVCACHE_PREFILL_MIN_ROWS", 1)):
        with monkeypatch.context() as m:
            m.setattr(configs, name, value)
            assert runtime.call_signature("fwd", (), q) != before, name


@pytest.mark.parametrize("D,named", [(128, True), (96, True), (192, False), (256, False)])
def test_deterministic_keeps_the_gluon_backward_up_to_head_dim_128(D, named):
    """deterministic=True names the Gluon backward's varying dQ sums up to head dim 128 (96
    padded to 128); over it the Gluon backward takes dQ from the Triton dQ kernel and stays
    eligible."""
    e = flashtriton.explain(*_qkv(N=8192, D=D, dtype=torch.bfloat16), deterministic=True)
    assert any("deterministic=True" in r for r in e.reasons) is named


def test_padded_head_dims_take_the_gluon_backward_from_their_length(monkeypatch):
    """A padded head dim's backward reason names configs.GLUON_PADDED_BWD_MIN_SEQLEN below its
    length, and not from it (here from 2048 tokens)."""
    monkeypatch.setitem(configs.GLUON_PADDED_BWD_MIN_SEQLEN, 96, 2048)
    least = configs.GLUON_PADDED_BWD_MIN_SEQLEN[96]
    e = flashtriton.explain(*_qkv(N=least // 2, D=96, dtype=torch.bfloat16))
    assert any("GLUON_PADDED_BWD_MIN_SEQLEN" in r and f"got {least // 2}" in r
               for r in e.reasons)
    e = flashtriton.explain(*_qkv(N=least, D=96, dtype=torch.bfloat16))
    assert not any("GLUON_PADDED_BWD_MIN_SEQLEN" in r for r in e.reasons)


def _keywords(fn):
    import inspect
    return {name for name, p in inspect.signature(fn).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_explain_and_supported_take_every_option_of_flash_attention():
    """explain and validation.supported describe flash_attention's calls: every keyword
    option it takes, they take (compared by signature, so a new option cannot be missed)."""
    from flashtriton.validation import supported
    options = _keywords(flashtriton.flash_attention)
    assert options == _keywords(flashtriton.flash_attention_with_lse)
    assert options <= _keywords(flashtriton.explain), options - _keywords(flashtriton.explain)
    assert options <= _keywords(supported), options - _keywords(supported)


def test_explain_and_supported_check_sinks_and_mods():
    """sinks, causal and the mods as flash_attention checks them; explain launches nothing
    for a mask_mod (no block mask is built)."""
    import triton

    from flashtriton.validation import supported

    @triton.jit
    def everything(b, h, q_idx, kv_idx):
        return q_idx >= 0

    q, k, v = _qkv(N=16, D=16)
    sinks = torch.zeros(2, device=DEVICE)
    assert supported(q, k, v, causal=True, sinks=sinks) is None
    e = flashtriton.explain(q, k, v, causal=True, sinks=sinks)
    assert (e.forward, e.backward) == flashtriton.explain(q, k, v, causal=True)[:2]
    for bad in (torch.zeros(3, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE)):
        with pytest.raises((ValueError, TypeError), match="^sinks must"):
            flashtriton.explain(q, k, v, sinks=bad)
        assert supported(q, k, v, sinks=bad).startswith("sinks must")
    reason = supported(q, k, v, causal=True, mask_mod=everything)
    assert reason is not None and "cannot be combined with ['causal']" in reason
    with pytest.raises(ValueError, match=r"cannot be combined with \['causal'\]"):
        flashtriton.explain(q, k, v, causal=True, mask_mod=everything)
    assert "score_mod_grad was given without score_mod" in supported(
        q, k, v, score_mod_grad=everything)
    assert supported(q, k, v, mask_mod=everything) is None
    e = flashtriton.explain(q, k, v, mask_mod=everything)
    assert e.forward == "triton"


def test_explain_says_when_the_interpreter_runs_the_call():
    e = flashtriton.explain(*_qkv())
    assert e.interpreted is _env.INTERPRET
    assert ("interpreter" in str(e)) is _env.INTERPRET
    if _env.INTERPRET:
        assert "TRITON_INTERPRET=1" in str(e).splitlines()[2]
