"""The Hugging Face kernels build (python -m flashtriton.hub_kernel), loaded offline from a folder.

The build goes into tmp_path and comes back through the kernels package's local loader (its
digest check included); its functions must meet the accuracy rule (tests/accuracy.py) against
the float64 reference, and transformers must run a tiny Llama on it through LOCAL_KERNELS.
"""

import json
import sys

import pytest
import torch

from accuracy import assert_rule
from conftest import DEVICE
from flashtriton import hub_kernel
from flashtriton.compat import flash_attn
from flashtriton.reference import attention_reference

kernels = pytest.importorskip("kernels")


@pytest.fixture
def build(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "flashtriton-hub"
    variant = hub_kernel.write_build(out)
    assert variant == out / "build" / "torch-universal"
    return out


def test_layout_and_metadata(build):
    variant = build / "build" / "torch-universal"
    assert sorted(p.relative_to(variant).as_posix() for p in variant.rglob("*")) == [
        "flashtriton", "flashtriton/__init__.py", "metadata.json"]
    meta = kernels.Metadata.read_from_file(variant / "metadata.json")
    assert str(meta.name) == "flashtriton" and meta.version == 1 and meta.python_depends == []
    assert meta.digest is not None and list(meta.digest.files) == ["flashtriton/__init__.py"]


def test_loader_rejects_a_modified_build(build):
    init = build / "build" / "torch-universal" / "flashtriton" / "__init__.py"
    init.write_text(init.read_text() + "\nflash_attn_func = None\n")
    with pytest.raises(RuntimeError, match="do not match the digest"):
        kernels.get_local_kernel(build)


def test_build_without_flashtriton_says_what_to_install(build, monkeypatch):
    init = build / "build" / "torch-universal" / "flashtriton" / "__init__.py"
    monkeypatch.setitem(sys.modules, "flashtriton.compat.flash_attn", None)  # import fails
    with pytest.raises(ImportError, match="pip install flashtriton"):
        exec(compile(init.read_text(), str(init), "exec"), {"__name__": "hub_build"})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func(build, causal):
    module = kernels.get_local_kernel(build)
    dtype = torch.float32
    q, k, v = (torch.randn(2, n, 2, 16, device=DEVICE, dtype=dtype) for n in (5, 7, 7))
    out = module.flash_attn_func(q, k, v, causal=causal)
    ref = attention_reference(q.double(), k.double(), v.double(), causal=causal)
    pt = attention_reference(q, k, v, causal=causal, dtype=dtype)
    assert_rule("out", out, ref.out, pt.out, 2, dtype)


def test_flash_attn_varlen_func(build):
    module = kernels.get_local_kernel(build)
    dtype = torch.float32
    lens = [3, 6]
    cu = torch.tensor([0, 3, 9], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(sum(lens), 2, 16, device=DEVICE, dtype=dtype) for _ in range(3))
    out = module.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for b in range(len(lens)):
        s = slice(int(cu[b]), int(cu[b + 1]))
        one = [x[s].unsqueeze(0) for x in (q, k, v)]
        ref = attention_reference(*(x.double() for x in one), causal=True)
        pt = attention_reference(*one, causal=True, dtype=dtype)
        assert_rule(f"out[{b}]", out[s].unsqueeze(0), ref.out, pt.out, 2, dtype)


def test_bad_outdir(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="outdir: .*taken.* is not a directory"):
        hub_kernel.write_build(taken)
    with pytest.raises(SystemExit):
        hub_kernel.main([str(taken)])
    assert "is not a directory" in capsys.readouterr().err


def test_cli_writes_a_loadable_build(tmp_path, capsys):
    assert hub_kernel.main([str(tmp_path / "out")]) == 0
    variant = tmp_path / "out" / "build" / "torch-universal"
    assert capsys.readouterr().out.strip() == str(variant)
    assert json.loads((variant / "metadata.json").read_text())["backend"] == {"type": "cuda"}


def test_transformers_llama_on_the_local_kernel(build, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("LOCAL_KERNELS", f"flashtriton-test/flash-attn={build}")
    tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

    def model(impl, dtype):
        torch.manual_seed(0)  # the same weights for every implementation
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny)).to(DEVICE, dtype)
        m.set_attn_implementation(impl)
        return m.eval()

    ids = torch.randint(0, 128, (2, 9), device=DEVICE)
    mask = torch.ones(2, 9, dtype=torch.long, device=DEVICE)
    mask[0, :3] = 0  # left padding of the first sequence
    ref_model, pt_model = model("eager", torch.float64), model("sdpa", torch.float32)
    ours_model = model("flashtriton-test/flash-attn", torch.float32)
    calls = []
    varlen = flash_attn._attention_varlen
    monkeypatch.setattr(flash_attn, "_attention_varlen",
                        lambda *a, **kw: calls.append(1) or varlen(*a, **kw))
    with torch.no_grad():
        ours = ours_model(ids, attention_mask=mask).logits
    assert len(calls) == 2  # each layer's padded batch went through the build's varlen function
    with torch.no_grad():
        for b in range(2):
            # the references run each sequence alone, unpadded: transformers' float64 eager
            # attention turns the fully masked rows of the padding into NaN that reach the
            # real tokens
            alone = ids[b][mask[b].bool()].unsqueeze(0)
            assert_rule(f"logits[{b}]", ours[b][mask[b].bool()], ref_model(alone).logits[0],
                        pt_model(alone).logits[0], 2, torch.float32)
