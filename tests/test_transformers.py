"""transformers integration: small random Llama / Mistral / Gemma 2 built from configs.

Each check runs three copies of one model: float64 with transformers' eager attention (the
reference), float32 with transformers' "sdpa" implementation (PyTorch's own error; "eager"
for Gemma 2, whose softcap SDPA cannot express: transformers refuses "sdpa" there), and
float32 with "triton_fa". Logits must meet the accuracy rule with factor 2, every
parameter's gradient with factor 3 (tests/accuracy.py).

4-D masks: transformers' eager attention adds the mask to the scores, so its reference gets
the additive float64 form of every mask (a boolean mask would be added as 0 / 1).
"""

import logging

import pytest
import torch

from accuracy import assert_rule
from flashtriton.reference import attention_reference
from conftest import DEVICE

transformers = pytest.importorskip("transformers")  # the test extra installs it

from flashtriton.integrations import transformers as integration  # noqa: E402
from flashtriton.integrations.transformers import attention_forward, register  # noqa: E402

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


# --- 4-D masks ------------------------------------------------------------------------------

def _block_diagonal(splits, T):
    """(B, 1, T, T) bool: row b packs causal sequences of lengths splits[b]."""
    rows = []
    for lengths in splits:
        seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        rows.append((seg[:, None] == seg[None, :]) & torch.ones(T, T).tril().bool())
    return torch.stack(rows)[:, None].to(DEVICE)


def _additive(keep, dtype, bias=False):
    """keep as an additive mask in dtype: 0 (or a small bias) where kept, dtype's min elsewhere."""
    values = torch.zeros(keep.shape, dtype=dtype, device=DEVICE)
    if bias:  # finite values where kept: an additive mask read as a boolean would fail
        g = torch.Generator(DEVICE).manual_seed(6)
        values = (torch.randn(keep.shape, generator=g, device=DEVICE) * 0.5).to(dtype)
    return values.masked_fill(~keep, torch.finfo(dtype).min)


def _check_4d(keep, form, ids):
    """Reference: eager float64 with the additive float64 mask; torch (sdpa) and ours get the
    mask in ``form``: "bool", "additive" (float32), or "additive_bf16" (another dtype than q,
    with a finite bias where kept)."""
    if form == "bool":
        mask = keep
    else:
        mask = _additive(keep, torch.bfloat16 if form == "additive_bf16" else torch.float32,
                         bias=form == "additive_bf16")
    masks = {"ref": mask.double() if mask.is_floating_point() else _additive(keep, torch.float64),
             "torch": mask.float() if mask.is_floating_point() else mask,
             "ours": mask}
    _check(_models("llama"), lambda model, name: model(ids, attention_mask=masks[name]).logits)


@pytest.mark.parametrize("form", ["bool", "additive", "additive_bf16"])
def test_block_diagonal_4d_mask(form):
    """Two rows, each packing its own split into causal blocks (the mask's batch differs)."""
    _check_4d(_block_diagonal([[4, 6], [7, 3]], 10), form, _ids((2, 10), 7))


def test_prefix_bidirectional_4d_mask():
    """PaliGemma-style: the first 4 tokens see each other, the rest is causal."""
    T, prefix = 10, 4
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    keep = ((j <= i) | ((i < prefix) & (j < prefix)))[None, None].to(DEVICE)
    _check_4d(keep.expand(2, 1, T, T), "bool", _ids((2, T), 8))


def test_4d_mask_that_requires_grad_falls_back_to_sdpa(caplog):
    """A learned additive mask: transformers' sdpa takes it (and its gradient), logged."""
    keep = _block_diagonal([[5, 5]], 10)
    ids = _ids((1, 10), 9)
    grads, logits = {}, {}
    for impl in ("sdpa", "triton_fa"):
        model = _model("llama", impl, torch.float32)
        bias = _additive(keep, torch.float32, bias=True).requires_grad_()
        with caplog.at_level(logging.DEBUG, logger="flashtriton"):
            logits[impl] = model(ids, attention_mask=bias).logits
        logits[impl].pow(2).mean().backward()
        grads[impl] = bias.grad
    reasons = [r.getMessage() for r in caplog.records
               if r.levelno == logging.DEBUG and "sdpa attention instead" in r.getMessage()]
    assert reasons and all("requires grad" in r for r in reasons), reasons
    torch.testing.assert_close(logits["triton_fa"], logits["sdpa"])
    torch.testing.assert_close(grads["triton_fa"], grads["sdpa"])


@pytest.mark.parametrize("layout", ["padding", "position_ids", "cu_seq_lens"])
def test_fallback_keeps_masks(layout, caplog):
    """float64, which the kernels do not take: transformers' sdpa gets a dense mask with the
    call's causal / padding / packing constraints, logged with the reason."""
    ref, ours = _model("llama", "eager", torch.float64), _model("llama", "triton_fa",
                                                                torch.float64)
    if layout == "padding":
        ids = _ids((2, 10), 2, low=1)
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        with caplog.at_level(logging.DEBUG, logger="flashtriton"):
            got = ours(ids, attention_mask=mask).logits[mask.bool()]
        pos = torch.arange(4, 10, device=DEVICE)[None]
        want = torch.cat([ref(ids[:1]).logits[0], ref(ids[1:, 4:], position_ids=pos).logits[0]])
    else:
        with caplog.at_level(logging.DEBUG, logger="flashtriton"):
            got = _packed(layout == "cu_seq_lens")(ours, "ours")
        want = _packed(False)(ref, "ref")
    assert any("dtype torch.float64" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(got, want)


def test_packed_position_ids_batch_of_two():
    """position_ids that restart at 0 pack sequences in every row of a batch, not only B = 1."""
    seqs = [_ids((1, n), 10 + n) for n in (7, 5, 4, 8)]
    packed = torch.cat([torch.cat(seqs[:2], 1), torch.cat(seqs[2:], 1)])
    pos = torch.stack([torch.cat([torch.arange(7), torch.arange(5)]),
                       torch.cat([torch.arange(4), torch.arange(8)])]).to(DEVICE)

    def run(model, name):
        if name == "ours":
            return model(packed, position_ids=pos).logits.reshape(-1, 128)
        return torch.cat([model(s).logits[0] for s in seqs])
    _check(_models("llama"), run)


# --- keywords that change the result --------------------------------------------------------

class _Module(torch.nn.Module):
    is_causal = True


def _qkv(dv=16):
    g = torch.Generator(DEVICE).manual_seed(11)
    q, k = (torch.randn(1, 2, 4, 16, generator=g, device=DEVICE) for _ in range(2))
    return q, k, torch.randn(1, 2, 4, dv, generator=g, device=DEVICE)


def _gpt_oss(impl, dtype):
    """A tiny random gpt-oss: sliding-window and full layers alternate, attention sinks in
    each (transformers passes them as s_aux), random sinks so that they matter."""
    cfg = transformers.GptOssConfig(**{**TINY, "num_hidden_layers": 4}, head_dim=16,
                                    num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=5, experts_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    model = model.to(DEVICE, dtype).eval()
    model.set_attn_implementation(impl)
    return model


def test_gpt_oss_sinks_match_eager():
    """gpt-oss's sinks (s_aux) run in the kernels: logits and every gradient (the sinks'
    too) against float64 eager, windowed and full layers; generate() agrees with eager."""
    models = {"ref": _gpt_oss("eager", torch.float64), "torch": _gpt_oss("eager", torch.float32),
              "ours": _gpt_oss("triton_fa", torch.float32)}
    ids = _ids((2, 12), 12)
    _check(models, lambda model, name: model(ids).logits)
    assert models["ours"].model.layers[1].self_attn.sinks.grad.abs().max() > 0
    prompt = _ids((1, 6), 13)
    a = models["torch"].generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    b = models["ours"].generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_sinks_keywords():
    """s_aux or sinks reach the kernels (the result changes); both at once is an error; a call
    that the kernels cannot run (here: a head dim over 256) with sinks is refused, not sent to
    sdpa, which would drop them."""
    q, k, v = _qkv()
    sinks = torch.full((2,), 3.0, device=DEVICE)
    plain = attention_forward(_Module(), q, k, v, None)[0]
    for name in ("s_aux", "sinks"):
        out = attention_forward(_Module(), q, k, v, None, **{name: sinks})[0]
        assert (out - plain).abs().max() > 1e-3, name
    with pytest.raises(ValueError, match="twice"):
        attention_forward(_Module(), q, k, v, None, s_aux=sinks, sinks=sinks)
    wide = torch.randn(1, 2, 4, 512, device=DEVICE)
    with pytest.raises(NotImplementedError, match="sinks"):
        attention_forward(_Module(), wide, wide, wide, None, s_aux=sinks)


def _deepseek_v3(impl, dtype):
    """A tiny random DeepSeek-V3: MLA with q / k head dim 16 + 8 (no rope + rope) and v head
    dim 16, dense MLP layers (routing ties would differ between dtypes)."""
    cfg = transformers.DeepseekV3Config(**{**TINY, "num_key_value_heads": 4}, q_lora_rank=32,
                                        kv_lora_rank=16, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16,
                                        first_k_dense_replace=TINY["num_hidden_layers"],
                                        n_routed_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, n_group=1, topk_group=1)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).to(DEVICE, dtype).eval()
    model.set_attn_implementation(impl)
    return model


def test_deepseek_v3_mla_matches_eager(caplog):
    """MLA's value head dim (16, q and k 24) runs in the kernels, not the sdpa fallback:
    logits and every gradient against float64 eager; generate() agrees with sdpa."""
    models = {"ref": _deepseek_v3("eager", torch.float64),
              "torch": _deepseek_v3("sdpa", torch.float32),
              "ours": _deepseek_v3("triton_fa", torch.float32)}
    with caplog.at_level(logging.DEBUG, logger="flashtriton"):
        _check(models, lambda model, name: model(_ids((2, 12), 14)).logits)
        prompt = _ids((1, 6), 15, low=2)  # (no pad token 0 in the prompt)
        a = models["torch"].generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        b = models["ours"].generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)
    assert not [r for r in caplog.records if "fall" in r.getMessage()], caplog.text


def test_value_head_dim_differs():
    q, k, v = _qkv(dv=8)
    out, _ = attention_forward(_Module(), q, k, v, None)
    ref = attention_reference(*(x.transpose(1, 2).double() for x in (q, k, v)), causal=True)
    assert out.shape == (1, 4, 2, 8)
    assert torch.allclose(out.double(), ref.out, atol=1e-5)


def test_unknown_keywords():
    """Unknown keywords: None / False are ignored, anything else raises naming it; the
    bookkeeping ones are ignored; output_attentions gets None weights."""
    q, k, v = _qkv()
    out, _ = attention_forward(_Module(), q, k, v, None)
    for ignored in (dict(some_flag=None, other=False), dict(use_cache=True, layer_idx=1),
                    dict(output_attentions=True)):
        again, weights = attention_forward(_Module(), q, k, v, None, **ignored)
        assert weights is None and torch.equal(again, out)
    with pytest.raises(NotImplementedError, match="some_bias"):
        attention_forward(_Module(), q, k, v, None, some_bias=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="head_mask"):
        attention_forward(_Module(), q, k, v, None, head_mask=torch.ones(2))


def test_mask_function_keeps_patterns_it_cannot_rebuild():
    """The registered mask function: None / 2-D for what the attention function rebuilds
    itself (causal, sliding window, padding), sdpa's 4-D mask for an or_mask_function (a
    prefix-LM / image-token overlay) that the flash-style mask would drop."""
    import inspect

    from transformers.masking_utils import (create_causal_mask,
                                            create_sliding_window_causal_mask)

    def make(fn, impl, **extra):
        cfg = transformers.MistralConfig(**TINY, sliding_window=3)
        cfg._attn_implementation = impl
        names = inspect.signature(fn).parameters
        kw = dict(config=cfg, attention_mask=extra.pop("attention_mask", None), **extra)
        kw["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = \
            torch.zeros(2, 8, 64, device=DEVICE)
        for cache in ("cache", "past_key_values"):
            if cache in names:
                kw[cache] = None
        if "cache_position" in names:
            kw["cache_position"] = torch.arange(8, device=DEVICE)
        return fn(**kw)

    assert make(create_causal_mask, "triton_fa") is None
    assert make(create_sliding_window_causal_mask, "triton_fa") is None
    pad = torch.ones(2, 8, dtype=torch.long, device=DEVICE)
    pad[0, :2] = 0
    assert make(create_causal_mask, "triton_fa", attention_mask=pad).shape == (2, 8)

    def prefix(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx < 3
    for fn in (create_causal_mask, create_sliding_window_causal_mask):
        ours = make(fn, "triton_fa", or_mask_function=prefix, attention_mask=pad)
        want = make(fn, "sdpa", or_mask_function=prefix, attention_mask=pad)
        assert ours.dtype == torch.bool and ours.dim() == 4
        assert torch.equal(ours, want)
