"""transformers integration: small random Llama / Mistral / Gemma 2 against transformers' eager attention."""

import pytest
import torch

from conftest import DEVICE

transformers = pytest.importorskip("transformers")  # the test extra installs it

from flashtriton.integrations.transformers import register  # noqa: E402

register()
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _pair(kind, **extra):
    """The same random model twice: transformers' eager attention and flashtriton's."""
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, **extra)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**TINY, sliding_window=5, **extra)
        cls = transformers.MistralForCausalLM
    else:
        cfg = transformers.Gemma2Config(**TINY, head_dim=16, sliding_window=5,
                                        attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                        **extra)
        cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(0)
    ref = cls(cfg).to(DEVICE).eval()
    ours = cls(cfg).to(DEVICE).eval()
    ours.load_state_dict(ref.state_dict())
    ref.set_attn_implementation("eager")
    ours.set_attn_implementation("triton_fa")
    return ref, ours


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_logits_and_grads_match_eager(kind):
    ref, ours = _pair(kind)
    ids = torch.randint(0, 128, (2, 12), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    a, b = ref(ids).logits, ours(ids).logits
    torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)
    a.float().pow(2).mean().backward()
    b.float().pow(2).mean().backward()
    for (n, pa), pb in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=2e-4, rtol=2e-3, msg=n)


def test_padding_mask():
    ref, ours = _pair("llama")
    ids = torch.randint(1, 128, (2, 10), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding of the second sequence
    a, b = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(b[keep], a[keep], atol=2e-4, rtol=2e-4)


def test_packed_sequences_by_position_ids():
    ref, ours = _pair("llama")
    g = torch.Generator(DEVICE).manual_seed(3)
    s1, s2 = torch.randint(0, 128, (1, 7), device=DEVICE, generator=g), \
        torch.randint(0, 128, (1, 5), device=DEVICE, generator=g)
    packed = torch.cat([s1, s2], 1)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None].to(DEVICE)
    out = ours(packed, position_ids=pos).logits
    torch.testing.assert_close(out[:, :7], ref(s1).logits, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(out[:, 7:], ref(s2).logits, atol=2e-4, rtol=2e-4)


def test_generate_runs_and_matches_eager():
    ref, ours = _pair("mistral")
    ids = torch.randint(0, 128, (1, 6), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(4))
    a = ref.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    b = ours.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_name_without_flash():
    with pytest.raises(ValueError, match="flash"):
        register("my_flash")
