"""flashtriton's environment: FLASHTRITON_LOG's values at import, and what
``python -m flashtriton.env`` says this machine runs (without a GPU, and on GPUs of each kind,
faked here)."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashtriton import _env, configs
from flashtriton.env import report

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env_vars):
    """Run ``code`` in a fresh interpreter (flashtriton from this checkout) with env_vars set."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), **env_vars)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_unknown_log_value_warns_and_the_import_goes_on():
    run = _python("import logging, flashtriton\n"
                  "from flashtriton import _env\n"
                  "log = logging.getLogger('flashtriton')\n"
                  "print(repr(_env.LOG_LEVEL), log.level, len(log.handlers))",
                  FLASHTRITON_LOG="verbose")
    assert run.returncode == 0, run.stderr
    assert "FLASHTRITON_LOG='verbose'" in run.stderr  # the variable and its value
    assert "debug, info, warning, error" in run.stderr  # what it takes
    assert "logging stays off" in run.stderr
    assert run.stdout.split() == ["''", "0", "0"]  # no level set, no handler added


def test_known_log_level_still_logs():
    run = _python("import logging, flashtriton\n"
                  "log = logging.getLogger('flashtriton')\n"
                  "print(log.level, len(log.handlers))", FLASHTRITON_LOG="Info")
    assert run.returncode == 0 and "FLASHTRITON_LOG" not in run.stderr, run.stderr
    assert run.stdout.split() == ["20", "1"]


def _line(text: str, start: str) -> str:
    [line] = [x for x in text.splitlines() if x.startswith(start)]
    return line


HOPPER_PATHS = ("TMA loads", "Gluon forward", "programmatic dependent launch",
                "cached launches")


@pytest.fixture
def switches_on(monkeypatch):
    for name in ("TMA", "GLUON", "PDL", "FAST_LAUNCH"):
        monkeypatch.setattr(_env, name, True)


@pytest.mark.parametrize("interpret", [True, False])
def test_report_without_a_gpu_claims_no_hopper_path(monkeypatch, switches_on, interpret):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(_env, "INTERPRET", interpret)
    text = report()
    assert "GPU: none" in text
    assert _line(text, "kernels:") == ("kernels: Triton interpreter on the CPU (TRITON_INTERPRET=1)"
                                       if interpret else
                                       "kernels: unavailable: no GPU and TRITON_INTERPRET is not set")
    for path in HOPPER_PATHS:
        line = _line(text, path)
        assert ": not used here (no GPU;" in line and ": on" not in line, line
    assert "FLASHTRITON_TMA=1" in _line(text, "TMA loads")  # the switch's value, though unused
    assert "FLASHTRITON_GLUON=1" in _line(text, "Gluon")
    monkeypatch.setattr(_env, "TMA", False)
    assert "FLASHTRITON_TMA=0" in _line(report(), "TMA loads")


def _fake_gpu(monkeypatch, major, minor):
    props = SimpleNamespace(name=f"fake sm_{major}{minor}", major=major, minor=minor,
                            multi_processor_count=132, total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, minor))
    monkeypatch.setattr(_env, "INTERPRET", False)


@pytest.mark.parametrize("major, minor, tma, gluon, pdl", [
    (8, 0, False, False, False),  # Ampere: none of them
    (9, 0, True, True, True),     # Hopper: all three
    (10, 0, True, False, True),   # Blackwell: TMA and PDL, the Gluon kernels are sm_90 only
])
def test_report_on_a_gpu_says_what_it_runs(monkeypatch, switches_on, major, minor, tma, gluon,
                                           pdl):
    _fake_gpu(monkeypatch, major, minor)
    text = report()
    assert f"compute capability {major}.{minor} (sm_{major}{minor})" in text
    assert _line(text, "kernels:") == "kernels: compiled Triton on the GPU"
    for path, runs in zip(HOPPER_PATHS, (tma, gluon, pdl, True)):
        line = _line(text, path)
        assert line.endswith("=1)") and (": on (" in line) == runs, line
        assert runs or f"this GPU is sm_{major}{minor}" in line, line


def test_report_on_a_gpu_follows_the_switches_and_the_interpreter(monkeypatch, switches_on):
    _fake_gpu(monkeypatch, 9, 0)
    monkeypatch.setattr(_env, "GLUON", False)
    text = report()
    assert _line(text, "Gluon") == ("Gluon forward (D=128, 256; D=64 from 2048 tokens; "
                                    "D=80, 96, 112, 192 from 1024 tokens) and "
                                    "backward (D=64, 128, 256): "
                                    "off (FLASHTRITON_GLUON=0)")  # configs' head dims
    monkeypatch.setattr(configs, "GLUON_BWD_HEAD_DIMS", (128,))
    assert _line(report(), "Gluon").startswith("Gluon forward (D=128, 256; D=64 from 2048 tokens; "
                                               "D=80, 96, 112, 192 from 1024 tokens) "
                                               "and backward (D=128)")
    assert ": on (FLASHTRITON_TMA=1)" in _line(text, "TMA loads")
    monkeypatch.setattr(_env, "INTERPRET", True)  # a GPU machine running the interpreter
    text = report()
    assert _line(text, "kernels:").startswith("kernels: Triton interpreter")
    for path in HOPPER_PATHS[1:]:  # Gluon, PDL and cached launches are compiled-only
        assert "not used here (the interpreter runs the kernels" in _line(text, path)


@pytest.mark.parametrize("major, minor", [(9, 0), (8, 0)])
def test_report_names_the_tuning_tables(monkeypatch, tmp_path, major, minor):
    # Without autotuning the report names the tables in use, the user's first, or says that
    # none is shipped for this GPU; with FLASHTRITON_AUTOTUNE=1, that the search runs.
    _fake_gpu(monkeypatch, major, minor)
    monkeypatch.setattr(_env, "AUTOTUNE", False)
    monkeypatch.setattr(_env, "TUNING_FILES", [str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    line = _line(report(), "autotuning:")
    shipped = ", then sm90.json (shipped)" if major == 9 else ""
    assert f"tuning tables: {tmp_path / 'b.json'}, then {tmp_path / 'a.json'}{shipped};" in line
    monkeypatch.setattr(_env, "TUNING_FILES", [])
    line = _line(report(), "autotuning:")
    assert ("sm90.json (shipped)" in line) == (major == 9)
    assert ("none for sm_80" in line) == (major == 8)
    monkeypatch.setattr(_env, "AUTOTUNE", True)
    assert _line(report(), "autotuning:").startswith("autotuning: on (FLASHTRITON_AUTOTUNE=1")


def test_tuning_files_are_read_from_the_environment():
    run = _python("from flashtriton import _env; print(_env.TUNING_FILES, _env.AUTOTUNE)",
                  FLASHTRITON_TUNING_FILE=os.pathsep.join(["a.json", "", "dir/b.json"]))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "['a.json', 'dir/b.json'] False"  # the interpreter: no search
