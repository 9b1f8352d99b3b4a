"""The floors pyproject.toml declares (Python, torch, triton) against what the code needs.

The code needs Triton 3.6: ``triton.knobs`` (runtime.py) came in 3.4, the Gluon Hopper module's
``warpgroup_mma`` in 3.5, and the Gluon kernels' ``gl.warp_specialize([(fn, args), ...])`` in
3.6 (3.5's takes the partitions as separate lists, so kernels/gluon/ does not
compile there). .ci/run runs this file and a few interpreter tests in a venv holding exactly
the declared Triton floor, with FLASHTRITON_FLOOR=1: there
test_this_triton_imports_and_compiles_every_version_gated_part is the floor's own test."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = (ROOT / "pyproject.toml").read_text()

# The triton that each torch release's Linux x86-64 wheel on PyPI requires (its Requires-Dist
# metadata, read with `pip install --dry-run --report`), and the Pythons it takes.
TORCH_TRITON = {(2, 8): (3, 4, 0), (2, 9): (3, 5, 0), (2, 10): (3, 6, 0), (2, 11): (3, 6, 0),
                (2, 12): (3, 7, 0), (2, 13): (3, 7, 1)}
TORCH_PYTHON = {(2, 8): (3, 9), (2, 9): (3, 10), (2, 10): (3, 10), (2, 11): (3, 10),
                (2, 12): (3, 10), (2, 13): (3, 10)}


def _version(text: str) -> tuple:
    """(major, minor, patch) of "2.13.0+cpu", "3.6.0", "3.10"."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return (int(m[1]), int(m[2]), int(m[3] or 0))


def _floor(name: str) -> tuple:
    [found] = re.findall(rf'"{name}>=([0-9.]+)', PYPROJECT)
    return _version(found)


def test_the_declared_floors_agree_with_each_other_and_this_machine():
    torch_floor, triton_floor = _floor("torch"), _floor("triton")
    python_floor = _version(re.search(r'requires-python = ">=([0-9.]+)"', PYPROJECT)[1])
    # torch's floor is the oldest torch whose CUDA wheel brings the triton floor (or newer):
    # an older torch pins an older triton, which the code cannot run on
    before = (torch_floor[0], torch_floor[1] - 1)
    assert torch_floor[:2] in TORCH_TRITON and before in TORCH_TRITON, (
        f"torch floor {torch_floor}: add its and its predecessor's triton pins to TORCH_TRITON")
    assert TORCH_TRITON[torch_floor[:2]] >= triton_floor > TORCH_TRITON[before], (
        f"torch>={torch_floor} with triton>={triton_floor}")
    assert python_floor[:2] >= TORCH_PYTHON[torch_floor[:2]]
    # what the tests run on satisfies the floors
    assert _version(torch.__version__) >= torch_floor
    assert _version(triton.__version__) >= triton_floor
    assert sys.version_info[:2] >= python_floor[:2]
    if os.environ.get("FLASHTRITON_FLOOR"):  # .ci/run's floor step: the floor itself
        assert _version(triton.__version__) == triton_floor, triton.__version__


def test_the_setup_commands_install_what_is_declared():
    """The README's set-up command and .ci/run pin the same torch and triton, at or above the
    floors, and CI runs the README's test command."""
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set-up: two commands"):readme.index("## Quick start")]
    ci = (ROOT / ".ci" / "run").read_text()
    for name in ("torch", "triton"):
        [pin] = set(re.findall(rf"\b{name}==([0-9.]+)", setup))
        assert set(re.findall(rf"\b{name}==([0-9.]+)", ci)) == {pin}, name
        assert _version(pin) >= _floor(name)
    assert "python -m pytest tests -n 2" in setup
    assert re.search(r"python3? -m pytest tests -n 2", ci)


# Imports every module whose imports need a recent Triton, then compiles the Gluon forward and
# backward for sm_90 (no GPU needed: Triton's wheel carries ptxas), as tools/compile_check.py
# does. Triton 3.4 fails the imports (no warpgroup_mma), 3.5 the compiles (warp_specialize).
GATED = """
import flashtriton.launch  # triton.knobs: Triton 3.4
import flashtriton.kernels.decode  # gdc_wait, gdc_launch_dependents
import flashtriton.kernels.gluon.fwd, flashtriton.kernels.gluon.bwd  # warpgroup_mma: 3.5
from tools.sass_loop import compile_gluon_bwd, compile_gluon_fwd
from flashtriton.launch import gluon_triton_misfit
if gluon_triton_misfit() is None:  # a release the Gluon kernels are written for
    for compile_ in (compile_gluon_fwd, compile_gluon_bwd):  # warp_specialize's form: 3.6
        kernel = compile_(128, causal=True)
        assert "wgmma" in kernel.asm["ptx"], compile_.__name__
    print("compiled")
else:  # any other: the routing keeps every call on the Triton kernels
    print("compiled", gluon_triton_misfit())
"""


def test_this_triton_imports_and_compiles_every_version_gated_part():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real
    run = subprocess.run([sys.executable, "-c", GATED], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, (
        f"triton {triton.__version__} cannot run flashtriton:\n{run.stderr[-3000:]}")



def test_import_without_triton_says_what_to_install():
    """A CPU build of torch brings no Triton: importing flashtriton then names the extra to
    install instead of a bare "No module named 'triton'"."""
    code = "import sys; sys.modules['triton'] = None; import flashtriton"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode != 0
    assert "flashtriton[interpreter]" in out.stderr, out.stderr[-1000:]
