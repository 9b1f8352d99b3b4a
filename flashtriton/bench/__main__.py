"""python -m flashtriton.bench: the benchmark's command line (flashtriton.bench.cli)."""

from .cli import main

main()
