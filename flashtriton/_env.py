"""The one place that reads flashtriton's environment variables.

| variable                        | values                       | effect                                                      |
|---------------------------------|------------------------------|-------------------------------------------------------------|
| ``TRITON_INTERPRET``            | ``1`` / unset                | run the kernels on the CPU through Triton's interpreter     |
| ``FLASHTRITON_AUTOTUNE``        | ``0`` (default) / ``1``      | ``1``: autotune each kernel's tile per tuning key instead   |
|                                 |                              | of taking it from the tuning tables (flashtriton.tuning)    |
| ``FLASHTRITON_TUNING_FILE``     | paths, ``os.pathsep``-joined | tuning tables to load (``flashtriton.tuning.save`` wrote    |
|                                 |                              | them) above the shipped one; the last named wins            |
| ``FLASHTRITON_TMA``             | ``1`` (default) / ``0``      | ``0``: no tensor-descriptor (TMA) loads on Hopper and newer |
| ``FLASHTRITON_FAST_LAUNCH``     | ``1`` (default) / ``0``      | ``0``: every launch through Triton's ``JITFunction.run``    |
| ``FLASHTRITON_PDL``             | ``1`` (default) / ``0``      | ``0``: no programmatic dependent launch of the decoding     |
|                                 |                              | kernels on Hopper and newer                                 |
| ``FLASHTRITON_GLUON``           | ``1`` (default) / ``0``      | ``0``: no Gluon kernels on Hopper (the Triton kernels run   |
|                                 |                              | every forward and backward)                                 |
| ``FLASHTRITON_COMPILE_AHEAD``   | ``1`` (default) / ``0``      | ``0``: the Gluon backward's kernels compile on the first    |
|                                 |                              | backward, not beside the first forward that needs them      |
| ``FLASHTRITON_VALIDATE``        | ``0`` (default) / ``1``      | ``1``: validation mode, every call checks the contents of   |
|                                 |                              | its index tensors on the host (one sync a call; CPU index   |
|                                 |                              | tensors are always checked): ``validation.set_validation``  |
| ``FLASHTRITON_LOG``             | ``debug`` / ``info`` / unset | log through ``logging`` (logger ``flashtriton``) to stderr; |
|                                 | (``warning``, ``error`` too) | ``debug`` logs every launch and every autotuning decision;  |
|                                 |                              | any other value: a warning at import, and logging stays off |

Read once at import; tests change them with ``monkeypatch``.
"""

import logging
import os
import warnings


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


INTERPRET: bool = _flag("TRITON_INTERPRET", False)
AUTOTUNE: bool = _flag("FLASHTRITON_AUTOTUNE", False) and not INTERPRET
TUNING_FILES: list = [p for p in os.environ.get("FLASHTRITON_TUNING_FILE", "").split(os.pathsep)
                      if p]
TMA: bool = _flag("FLASHTRITON_TMA", True)
FAST_LAUNCH: bool = _flag("FLASHTRITON_FAST_LAUNCH", True)
PDL: bool = _flag("FLASHTRITON_PDL", True)
GLUON: bool = _flag("FLASHTRITON_GLUON", True)
COMPILE_AHEAD: bool = _flag("FLASHTRITON_COMPILE_AHEAD", True)
VALIDATE: bool = _flag("FLASHTRITON_VALIDATE", False)
LOG_LEVEL: str = os.environ.get("FLASHTRITON_LOG", "").strip().lower()

logger = logging.getLogger("flashtriton")
if LOG_LEVEL and LOG_LEVEL.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
    # a typo in a variable must not stop the import: say so, and log nothing
    warnings.warn(f"FLASHTRITON_LOG={os.environ['FLASHTRITON_LOG']!r} is not one of debug, "
                  f"info, warning, error (or unset): logging stays off")
    LOG_LEVEL = ""
if LOG_LEVEL:
    logger.setLevel(LOG_LEVEL.upper())
    if not logger.handlers:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("[flashtriton %(levelname)s] %(message)s"))
        logger.addHandler(_handler)
