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
    if not skip_reshape:  # k and v: heads of q's head dim (fewer under GQA)
        D = q.shape[-1] // heads
        q, k, v = (x.view(x.shape[0], x.shape[1], -1, D).transpose(1, 2) for x in (q, k, v))
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


@pytest.fixture
def fake_comfy(monkeypatch):
    """A stand-in for ComfyUI (not on PyPI): comfy.ldm.modules.attention's registry as newer
    ComfyUI has it (a name registered twice logs a warning and keeps the first), a
    ModelPatcher whose set_model_optimized_attention calls the function bare, as ComfyUI's
    does; and a loader for the node folder."""
    attention = types.ModuleType("comfy.ldm.modules.attention")
    attention.REGISTERED_ATTENTION_FUNCTIONS = {}
    attention.warnings = []

    def register_attention_function(name, func):
        if name not in attention.REGISTERED_ATTENTION_FUNCTIONS:
            attention.REGISTERED_ATTENTION_FUNCTIONS[name] = func
        else:
            attention.warnings.append(f"Attention function {name} already registered")

    def get_attention_function(name, default=...):
        if name not in attention.REGISTERED_ATTENTION_FUNCTIONS:
            if default is ...:
                raise KeyError(name)
            return default
        return attention.REGISTERED_ATTENTION_FUNCTIONS[name]

    attention.register_attention_function = register_attention_function
    attention.get_attention_function = get_attention_function
    for name in ("comfy", "comfy.ldm", "comfy.ldm.modules"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "comfy.ldm.modules.attention", attention)

    class Patcher:
        def __init__(self, options):
            self.model_options = options

        def clone(self):
            return Patcher({k: dict(v) for k, v in self.model_options.items()})

        def set_model_optimized_attention(self, optimized_attention):
            def optimized_attention_override(_, *args, **kwargs):
                return optimized_attention(*args, **kwargs)
            self.model_options["transformer_options"]["optimized_attention_override"] = \
                optimized_attention_override

    def load_node():
        path = pathlib.Path(__file__).resolve().parent.parent / "integrations" / "comfyui" \
            / "__init__.py"
        spec = importlib.util.spec_from_file_location("flashtriton_comfy_node", path)
        node = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(node)
        return node

    return types.SimpleNamespace(attention=attention, Patcher=Patcher, load_node=load_node)


def test_node_patches_a_clone(fake_comfy):
    node_mod = fake_comfy.load_node()
    model = fake_comfy.Patcher({"transformer_options": {}})
    (patched,) = node_mod.PatchAttentionFlashtriton().patch(model)
    assert patched is not model and model.model_options["transformer_options"] == {}
    assert patched.model_options["transformer_options"]["optimized_attention_override"] \
        is attention_override
    assert fake_comfy.attention.REGISTERED_ATTENTION_FUNCTIONS == \
        {"flashtriton": attention_flashtriton}
    assert node_mod.NODE_DISPLAY_NAME_MAPPINGS["PatchAttentionFlashtriton"] == \
        "Patch attention (flashtriton)"


def test_registered_once_at_import(fake_comfy):
    """The node registers "flashtriton" when ComfyUI imports it, not in patch(): repeated
    runs (and a second import) register nothing more and log no "already registered"."""
    node_mod = fake_comfy.load_node()
    registry = fake_comfy.attention.REGISTERED_ATTENTION_FUNCTIONS
    assert registry == {"flashtriton": attention_flashtriton}
    model = fake_comfy.Patcher({"transformer_options": {}})
    for _ in range(3):
        node_mod.PatchAttentionFlashtriton().patch(model)
    fake_comfy.load_node()
    assert registry == {"flashtriton": attention_flashtriton}
    assert fake_comfy.attention.warnings == []


GQA_BARE = [
    pytest.param(dict(shape=(2, 37, 4 * 32), kv=(2, 23, 2 * 32)), id="flat-gqa2"),
    pytest.param(dict(shape=(2, 37, 4 * 32), kv=(2, 37, 1 * 32), mask="bool3"),
                 id="flat-mqa-mask"),
    pytest.param(dict(shape=(2, 4, 37, 32), kv=(2, 2, 23, 32), skip_reshape=True),
                 id="bhnd-gqa2"),
    pytest.param(dict(shape=(2, 4, 37, 32), kv=(2, 1, 37, 32), skip_reshape=True,
                      skip_output_reshape=True, mask="float2"), id="bhnd-mqa-out-bhnd"),
]


@pytest.mark.parametrize("path", ["bare", "node"])
@pytest.mark.parametrize("case", GQA_BARE)
def test_bare_call_gqa(case, path, fake_comfy, monkeypatch):
    """Newer ComfyUI calls the registered function bare (set_model_optimized_attention: the
    "Model attention backend" node), with its own keywords: GQA in the flat layout (k, v with
    fewer heads of q's head dim) and in (B, H, N, D) runs on the kernels and matches the
    float64 reference; so does the node's override (no hand-back to ComfyUI's attention)."""
    import flashtriton.sdpa as sdpa_mod
    ran = []
    real_run = sdpa_mod._run
    monkeypatch.setattr(sdpa_mod, "_run", lambda *a, **kw: ran.append(1) or real_run(*a, **kw))
    node = fake_comfy.load_node()
    model = fake_comfy.Patcher({"transformer_options": {}})
    if path == "bare":
        model.set_model_optimized_attention(
            fake_comfy.attention.get_attention_function("flashtriton"))
    else:
        (model,) = node.PatchAttentionFlashtriton().patch(model)
    override = model.model_options["transformer_options"]["optimized_attention_override"]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(case["shape"], generator=g).to(DEVICE, torch.float16)
    k = torch.randn(case["kv"], generator=g).to(DEVICE, torch.float16)
    v = torch.randn(case["kv"], generator=g).to(DEVICE, torch.float16)
    skip = case.get("skip_reshape", False)
    N, M = (q.shape[2], k.shape[2]) if skip else (q.shape[1], k.shape[1])
    mask = {None: None,
            "bool3": torch.rand(2, N, M, generator=g).to(DEVICE) > 0.3,
            "float2": (torch.rand(N, M, generator=g) * 3 - 1).to(DEVICE, torch.float16)}[
                case.get("mask")]
    kw = dict(skip_reshape=skip, skip_output_reshape=case.get("skip_output_reshape", False))
    out = override(lambda *a, **kw: pytest.fail("ComfyUI's own attention ran"), q, k, v, 4,
                   mask=mask, attn_precision=torch.float32, enable_gqa=True,
                   transformer_options={}, _inside_attn_wrapper=True, **kw)
    ref = comfy_reference(q, k, v, 4, mask=mask, **kw)
    assert ran and out.shape == ref.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=0)


@pytest.mark.parametrize("call,error,words", [
    (dict(q=(1, 8, 33)), ValueError, "q's 33 channels do not split into 2 heads"),
    (dict(k=(1, 8, 24)), ValueError, "k's 24 channels do not split into heads of q's head dim 16"),
    (dict(v=(1, 8)), ValueError, "v must be a 3-D"),
    (dict(heads=None), TypeError, "heads must be a positive int"),
])
def test_bare_call_refuses_what_does_not_split(call, error, words):
    """Flat inputs that do not split into heads: an error naming the argument (no fallback
    exists for a bare call, and ComfyUI's own attention would mis-split them)."""
    args = {n: torch.randn(call.get(n, (1, 8, 32)), device=DEVICE, dtype=torch.float16)
            for n in "qkv"}
    with pytest.raises(error, match=words):
        attention_flashtriton(args["q"], args["k"], args["v"], call.get("heads", 2))
