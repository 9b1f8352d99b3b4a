"""The one place that reads flashtriton's environment variables.

| variable              | values                    | effect                                                    |
|-----------------------|---------------------------|-----------------------------------------------------------|
| ``TRITON_INTERPRET``  | ``1`` / unset             | run the kernels on the CPU through Triton's interpreter   |
| ``FLASHTRITON_AUTOTUNE`` | ``1`` (default) / ``0`` | ``0`` uses the first candidate config instead of a search |

Read once at import; tests change them with ``monkeypatch`` before importing.
"""

import os


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


INTERPRET: bool = _flag("TRITON_INTERPRET", False)
AUTOTUNE: bool = _flag("FLASHTRITON_AUTOTUNE", True) and not INTERPRET
