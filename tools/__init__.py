"""The repository's tools (tools/README.md): run each as `python tools/NAME.py`; tests import
them as `from tools import NAME` (pyproject's pytest pythonpath)."""
