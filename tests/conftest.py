import os

import pytest
import torch

# Without a GPU the kernels run through Triton's interpreter; this must be set
# before flashtriton (and its @triton.jit functions) is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashtriton import runtime  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every buffer the launchers allocate starts as NaN, so unwritten elements fail."""
    real_empty_like = runtime.output_like

    def empty_like(x, head_dim=None):
        return real_empty_like(x, head_dim).fill_(float("nan"))

    def empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(runtime, "_empty_like", empty_like)
    monkeypatch.setattr(runtime, "_empty", empty)


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)
