"""diffusers: ``patch_sdpa(model)`` on a tiny random UNet2DConditionModel and a tiny Flux
transformer.

UNet2DConditionModel's attention processor (AttnProcessor2_0) calls
``F.scaled_dot_product_attention`` itself; Flux's goes through diffusers' attention dispatcher,
whose default "native" backend calls it. The scoped patch must reach both, and only there.

Each check runs one model three times: float64 unpatched (the reference), float32 unpatched
(PyTorch's own error) and float32 under ``patch_sdpa(model)``; the output must meet the
accuracy rule with factor 2 (tests/accuracy.py), every attention call of the model must run the
kernels, a diffusers ``Attention`` module outside the scope must keep torch's SDPA, and after the
block torch's function and the model's hooks are as before.
"""

import pytest
import torch
import torch.nn.functional as F

import flashtriton
import flashtriton.sdpa as sdpa_mod
from accuracy import assert_rule

diffusers = pytest.importorskip("diffusers")

from diffusers.models.attention import AttentionModuleMixin  # noqa: E402
from diffusers.models.attention_processor import Attention  # noqa: E402


def _unet():
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=32).eval()


def _unet_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    return dict(sample=torch.randn(1, 4, 8, 8, generator=g).to(dtype), timestep=torch.tensor([3]),
                encoder_hidden_states=torch.randn(1, 5, 32, generator=g).to(dtype))


def _flux():
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=False, axes_dims_rope=(4, 6, 6)).eval()


def _flux_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(16, 3)  # a 4 x 4 latent grid, one token per position
    img_ids[:, 1], img_ids[:, 2] = torch.arange(16) // 4, torch.arange(16) % 4
    return dict(hidden_states=torch.randn(1, 16, 4, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(1, 3, 32, generator=g).to(dtype),
                pooled_projections=torch.randn(1, 32, generator=g).to(dtype),
                timestep=torch.tensor([0.5], dtype=dtype), img_ids=img_ids.to(dtype),
                txt_ids=torch.zeros(3, 3, dtype=dtype))


def _attention_modules(model):
    """How many attention layers the model has: each calls SDPA once per forward."""
    return sum(isinstance(m, (Attention, AttentionModuleMixin)) for m in model.modules())


@pytest.mark.parametrize("build, inputs", [pytest.param(_unet, _unet_inputs, id="unet2d"),
                                           pytest.param(_flux, _flux_inputs, id="flux")])
def test_patch_sdpa_scoped_to_one_model(monkeypatch, build, inputs):
    original = F.scaled_dot_product_attention
    model = build()
    outsider = Attention(query_dim=16, heads=2, dim_head=8).eval()
    x_out = torch.randn(1, 6, 16)
    with torch.no_grad():
        ref = model.double()(**inputs(torch.float64)).sample
        model.float()
        torch_fp32 = model(**inputs(torch.float32)).sample
        outsider_expected = outsider(x_out)

        calls = []
        real_run = sdpa_mod._sdpa_run
        monkeypatch.setattr(sdpa_mod, "_sdpa_run",
                            lambda *a, **k: calls.append(1) or real_run(*a, **k))
        with flashtriton.patch_sdpa(model):
            ours = model(**inputs(torch.float32)).sample
            assert len(calls) == _attention_modules(model) > 0
            outsider_got = outsider(x_out)
            assert len(calls) == _attention_modules(model)

    assert_rule("sample", ours, ref, torch_fp32, 2, torch.float32)
    assert torch.equal(outsider_got, outsider_expected)
    assert F.scaled_dot_product_attention is original
    assert not model._forward_pre_hooks and not model._forward_hooks
    with torch.no_grad():
        model(**inputs(torch.float32))
    assert len(calls) == _attention_modules(model)
