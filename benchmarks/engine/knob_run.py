"""``bench_variant.py`` with module-level knobs set first, for throughput A/Bs of launch configs that have no lock or
``LLM`` option (``triton.gemv.PREFETCH_WARPS``, ``rope.BLOCK_H_MAX``, ...).

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/engine/knob_run.py NAME [module:attr=python-literal ...]``, e.g.
``knob_run.py bh16 layerzero.backends.triton.rope:BLOCK_H_MAX=16`` (run from the repository root). With ``--pytest``
as NAME, the knobs are followed by ``--`` and pytest's arguments: the GPU tests run in this process under the knobs
(``knob_run.py --pytest layerzero.backends.triton.paged:PREFETCH_CACHED_KV="'pdl'" -- -q tests/engine/gpu``).
"""

from __future__ import annotations

import ast
import importlib
import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    """Set each ``module:attr=literal`` knob, then run ``bench_variant.py NAME`` in this process."""
    name, *knobs = argv
    rest: list[str] = []
    if "--" in knobs:
        at = knobs.index("--")
        knobs, rest = knobs[:at], knobs[at + 1:]
    for knob in knobs:
        target, value = knob.split("=", 1)
        module, attr = target.split(":")
        setattr(importlib.import_module(module), attr, ast.literal_eval(value))
    if name == "--pytest":
        import pytest

        sys.exit(pytest.main(rest))
    sys.argv = ["bench_variant.py", name]
    runpy.run_path(str(Path(__file__).with_name("bench_variant.py")), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
