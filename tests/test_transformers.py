"""transformers integration: small random Llama / Mistral / Gemma 2 built from configs.

Each check runs three copies of one model: float64 with transformers' eager attention (the
reference), float32 with transformers' "sdpa" implementation (PyTorch's own error; "eager"
for Gemma 2, whose softcap SDPA cannot express: transformers refuses "sdpa" there), and
float32 with "triton_fa". Logits must meet the accuracy rule with factor 2, every
parameter's gradient with factor 3 (tests/accuracy.py).
"""

import pytest
import torch

from accuracy import assert_rule
from conftest import DEVICE

transformers = pytest.importorskip("transformers")  # the test extra installs it

from flashtriton.integrations.transformers import register  # noqa: E402

register()
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _model(kind, impl, dtype, **extra):
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**TINY, **extra), transformers.LlamaForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**TINY, sliding_window=5, **extra)
        cls = transformers.MistralForCausalLM
    else:
        cfg = transformers.Gemma2Config(**TINY, head_dim=16, sliding_window=5,
                                        attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                        **extra)
        cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(0)  # the same weights for every implementation
    model = cls(cfg).to(DEVICE, dtype).eval()
    model.set_attn_implementation(impl)
    return model


def _models(kind, **extra):
    return {"ref": _model(kind, "eager", torch.float64, **extra),
            "torch": _model(kind, "eager" if kind == "gemma2" else "sdpa", torch.float32, **extra),
            "ours": _model(kind, "triton_fa", torch.float32, **extra)}


def _check(models, run):
    """run(model) -> logits whose squared mean is the loss; compare logits and all grads."""
    got = {}
    for name, model in models.items():
        logits = run(model, name)
        logits.double().pow(2).mean().backward()
        got[name] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    (ref, ref_g), (pt, pt_g), (ours, ours_g) = got["ref"], got["torch"], got["ours"]
    assert_rule("logits", ours, ref, pt, 2, torch.float32)
    for n in ref_g:
        assert_rule(f"grad {n}", ours_g[n], ref_g[n], pt_g[n], 3, torch.float32)


def _ids(shape, seed, low=0):
    return torch.randint(low, 128, shape, device=DEVICE,
                         generator=torch.Generator(DEVICE).manual_seed(seed))


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_logits_and_grads_match_sdpa(kind):
    ids = _ids((2, 12), 1)
    _check(_models(kind), lambda model, name: model(ids).logits)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_padding_mask(kind):
    ids = _ids((2, 10), 2, low=1)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding of the second sequence
    keep = mask.bool()
    pos = torch.arange(4, 10, device=DEVICE)[None]

    def run(model, name):
        # Padded positions' logits are not defined: the loss sees the real tokens only. The
        # references run each sequence alone, unpadded (transformers' float64 eager attention
        # turns the fully masked rows of the padding into NaN that reach the real tokens).
        if name == "ours":
            return model(ids, attention_mask=mask).logits[keep]
        return torch.cat([model(ids[:1]).logits[0],
                          model(ids[1:, 4:], position_ids=pos).logits[0]])
    _check(_models(kind), run)


def _packed(with_cu):
    s1, s2 = _ids((1, 7), 3), _ids((1, 5), 4)
    packed = torch.cat([s1, s2], 1)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None].to(DEVICE)
    cu = torch.tensor([0, 7, 12], dtype=torch.int32, device=DEVICE)
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7) if with_cu else {}

    def run(model, name):
        if name == "ours":  # packed; the others see each sequence alone
            return model(packed, position_ids=pos, **kw).logits[0]
        return torch.cat([model(s1).logits[0], model(s2).logits[0]])
    return run


@pytest.mark.parametrize("with_cu", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_sequences(with_cu):
    _check(_models("llama"), _packed(with_cu))


def test_dropout_in_training_only():
    model = _model("llama", "triton_fa", torch.float32, attention_dropout=0.5)
    ids = _ids((1, 9), 5)
    with torch.no_grad():
        eval_logits = model(ids).logits
        model.train()
        torch.manual_seed(1)
        a = model(ids).logits
        torch.manual_seed(1)
        b = model(ids).logits
    assert torch.equal(a, b)  # the seed decides the mask
    assert not torch.allclose(a, eval_logits)


def test_generate_runs_and_matches_eager():
    ref = _model("mistral", "eager", torch.float32)
    ours = _model("mistral", "triton_fa", torch.float32)
    ids = _ids((1, 6), 4)
    a = ref.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    b = ours.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_name_without_flash():
    with pytest.raises(ValueError, match="flash"):
        register("my_flash")
