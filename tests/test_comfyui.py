"""The ComfyUI attention function against ComfyUI's contract, with tensors shaped as ComfyUI passes them."""

import importlib.util
import pathlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from flashtriton.integrations.comfyui import attention_flashtriton, attention_override


def comfy_reference(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False):
    """ComfyUI's pytorch attention, written from its contract, in float64."""
    if not skip_reshape:
        q, k, v = (x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2) for x in (q, k, v))
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    if mask is not None and mask.dim() == 3:
        mask = mask[:, None]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


CASES = [
    pytest.param(dict(shape=(2, 37, 4 * 32), kv=(2, 23, 4 * 32)), id="flat-cross-attention"),
    pytest.param(dict(shape=(2, 4, 37, 32), kv=(2, 4, 37, 32), skip_reshape=True), id="bhnd"),
    pytest.param(dict(shape=(2, 4, 37, 32), kv=(2, 2, 37, 32), skip_reshape=True,
                      skip_output_reshape=True), id="bhnd-gqa-out-bhnd"),
    pytest.param(dict(shape=(2, 37, 4 * 32), kv=(2, 37, 4 * 32), mask="bool3"), id="mask-bool-BNM"),
    pytest.param(dict(shape=(2, 37, 4 * 32), kv=(2, 37, 4 * 32), mask="float2"), id="mask-float-NM"),
]


@pytest.mark.parametrize("case", CASES)
def test_contract(case):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(case["shape"], generator=g).to(DEVICE, torch.float16)
    k = torch.randn(case["kv"], generator=g).to(DEVICE, torch.float16)
    v = torch.randn(case["kv"], generator=g).to(DEVICE, torch.float16)
    N, M = (q.shape[2], k.shape[2]) if case.get("skip_reshape") else (q.shape[1], k.shape[1])
    mask = {None: None,
            "bool3": torch.rand(2, N, M, generator=g).to(DEVICE) > 0.3,
            "float2": (torch.rand(N, M, generator=g) * 3 - 1).to(DEVICE, torch.float16)}[case.get("mask")]
    kw = dict(skip_reshape=case.get("skip_reshape", False),
              skip_output_reshape=case.get("skip_output_reshape", False))
    out = attention_flashtriton(q, k, v, 4, mask=mask, attn_precision=torch.float32, **kw)
    ref = comfy_reference(q, k, v, 4, mask=mask, **kw)
    assert out.shape == ref.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=0)


def test_override_falls_back_for_what_it_cannot_do():
    calls = []

    def original(*args, **kwargs):
        calls.append(args[3])
        return "original"

    q = torch.randn(1, 8, 2 * 16, device=DEVICE, dtype=torch.float64)  # fp64: not supported
    assert attention_override(original, q, q, q, 2) == "original" and calls == [2]
    q = q.to(torch.float16)
    out = attention_override(original, q, q, q, 2, mask=None)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and calls == [2]


def test_node_patches_a_clone():
    # ComfyUI is not on PyPI: a stand-in for the ModelPatcher and the module the node imports.
    registered = {}
    comfy_attention = types.ModuleType("comfy.ldm.modules.attention")
    comfy_attention.register_attention_function = lambda name, fn: registered.update({name: fn})
    for name in ("comfy", "comfy.ldm", "comfy.ldm.modules"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["comfy.ldm.modules.attention"] = comfy_attention

    class Patcher:
        def __init__(self, options):
            self.model_options = options

        def clone(self):
            return Patcher({k: dict(v) for k, v in self.model_options.items()})

    path = pathlib.Path(__file__).resolve().parent.parent / "integrations" / "comfyui" / "__init__.py"
    spec = importlib.util.spec_from_file_location("flashtriton_comfy_node", path)
    node_mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(node_mod)
        model = Patcher({"transformer_options": {}})
        (patched,) = node_mod.PatchAttentionFlashtriton().patch(model)
        assert patched is not model and model.model_options["transformer_options"] == {}
        assert patched.model_options["transformer_options"]["optimized_attention_override"] \
            is attention_override
        assert registered == {"flashtriton": attention_flashtriton}
        assert node_mod.NODE_DISPLAY_NAME_MAPPINGS["PatchAttentionFlashtriton"] == \
            "Patch attention (flashtriton)"
    finally:
        for name in ("comfy.ldm.modules.attention", "comfy.ldm.modules", "comfy.ldm", "comfy"):
            sys.modules.pop(name, None)
