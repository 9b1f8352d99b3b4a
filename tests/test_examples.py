"""examples/: greedy generation through the paged KV cache equals transformers' generate()."""

import importlib.util
import pathlib

import pytest
import torch

from conftest import DEVICE, ON_GPU

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "generate_llama.py"


def _load():
    spec = importlib.util.spec_from_file_location("generate_llama", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_greedy_generation_matches_transformers():
    ex = _load()
    model = ex.tiny_llama().to(DEVICE)
    prompt = torch.randint(0, model.config.vocab_size, (2, 9), device=DEVICE,
                           generator=torch.Generator(DEVICE).manual_seed(5))
    ours = ex.generate(model, prompt, max_new_tokens=5, page_size=8)
    ref = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, ref)


@pytest.mark.skipif(ON_GPU and torch.cuda.device_count() < 2,
                    reason="two ranks need two GPUs (NCCL); CPU runs use gloo")
def test_ring_attention_example_matches_the_whole_sequence():
    import sys
    sys.path.insert(0, str(EXAMPLE.parent))
    import ring_attention
    errors = ring_attention.main(["--world", "2", "--seqlen", "32", "--dim", "32", "--heads", "2"])
    assert sorted(errors) == [0, 1]
    tol = 2e-2 if ON_GPU else 1e-4
    for out_err, grad_err in errors.values():
        assert out_err < tol and grad_err < tol, errors
