"""Write flashtriton's flash-attn interface as a Hugging Face ``kernels`` build.

    python -m flashtriton.hub_kernel OUTDIR

writes a universal (pure Python) build variant that the ``kernels`` package loads:

    OUTDIR/build/torch-universal/metadata.json
    OUTDIR/build/torch-universal/flashtriton/__init__.py

``kernels.get_local_kernel(Path(OUTDIR))`` returns the module; it exposes ``flash_attn_func``
and ``flash_attn_varlen_func`` (and ``flash_attn_with_kvcache``) from
``flashtriton.compat.flash_attn``. transformers (5.x) loads it for attention through
``kernels.get_kernel``, which takes local folders from the ``LOCAL_KERNELS`` environment
variable (``LOCAL_KERNELS=<repo id>=<OUTDIR>``, then ``attn_implementation="<repo id>"``):
docs/integrations.md gives the steps.

How the ``kernels`` loader sees the folder (kernels 0.19): it looks for variant folders in
OUTDIR and OUTDIR/build; ``torch-universal`` is accepted on every system (CPU, CUDA, ROCm...).
Each variant needs a ``metadata.json`` (id, name, version, license, python-depends, backend); the
module is imported from ``<variant>/__init__.py`` or ``<variant>/<name>/__init__.py`` under the
name ``id``. With a ``digest`` (base64 SHA-256 of every file, as kernel-builder writes it) the
loader checks the files against it instead of warning that they cannot be verified.

The build is a thin package that imports the installed flashtriton; it does not vendor it:

- flashtriton's modules import each other as ``flashtriton.*`` and register torch.library ops
  named ``flashtriton::*``; a vendored copy, imported under the kernel's id, would resolve those
  imports to an installed flashtriton anyway, or register the same op names twice;
- ``python-depends`` accepts only the names in the ``kernels`` package's own list (einops,
  helion, tvm-ffi in 0.19), so the dependency cannot be declared there. The package checks it on
  import and raises ImportError that says to install flashtriton.

The metadata's backend is ``cuda`` (what the kernels are built for; the interpreter runs them on
CPU when TRITON_INTERPRET=1) with no architecture list, so the loader's architecture check
passes on every GPU.
"""

import argparse
import base64
import hashlib
import json
import re
import sys
from pathlib import Path

import flashtriton

NAME = "flashtriton"
VARIANT = "torch-universal"
EXPORTS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")

_INIT = '''"""flashtriton's flash-attn interface, as a Hugging Face kernels build.

Written by ``python -m flashtriton.hub_kernel`` (flashtriton {version}). It imports the
installed flashtriton package: ``pip install flashtriton``.
"""

try:
    from flashtriton.compat.flash_attn import {names}
except ImportError as error:
    raise ImportError(
        "this kernel build runs the installed flashtriton package, which could not be imported "
        "(pip install flashtriton): " + str(error)
    ) from error

__all__ = [{quoted}]
'''


def _sha256(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode("ascii")


def _kernel_id(version: str) -> str:
    """The module name the loader imports the build under: unique per flashtriton version."""
    return f"_{NAME}_hub_{re.sub(r'[^0-9A-Za-z]', '_', version)}"


def write_build(outdir, *, version: int = 1) -> Path:
    """Write the universal build into ``outdir`` and return the variant folder.

    ``outdir`` (str or Path) is created if missing; it must not be a file. Files of an earlier
    build there are overwritten. ``version`` is the kernel's major version in its metadata
    (transformers asks the loader for version 1 of a kernel repo it does not know).
    """
    out = Path(outdir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"outdir: {str(out)!r} exists and is not a directory")
    variant = out / "build" / VARIANT
    package = variant / NAME
    if variant.exists() and not variant.is_dir():
        raise NotADirectoryError(f"outdir: {str(variant)!r} exists and is not a directory")
    package.mkdir(parents=True, exist_ok=True)

    init = _INIT.format(version=flashtriton.__version__, names=", ".join(EXPORTS),
                        quoted=", ".join(repr(n) for n in EXPORTS)).encode("utf-8")
    (package / "__init__.py").write_bytes(init)
    metadata = {
        "id": _kernel_id(flashtriton.__version__),
        "name": NAME,
        "version": version,
        "license": "Apache-2.0",
        "python-depends": [],
        "backend": {"type": "cuda"},
        "digest": {"algorithm": "sha256", "files": {f"{NAME}/__init__.py": _sha256(init)}},
    }
    (variant / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return variant


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashtriton.hub_kernel",
        description="Write flashtriton's flash_attn_func / flash_attn_varlen_func as a Hugging "
                    "Face kernels universal build (OUTDIR/build/torch-universal).")
    parser.add_argument("outdir", help="folder to write the build into (created if missing)")
    args = parser.parse_args(argv)
    try:
        variant = write_build(args.outdir)
    except OSError as error:
        parser.error(str(error))
    print(variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
