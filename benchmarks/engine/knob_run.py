"""``bench_variant.py`` with module-level knobs set first, for throughput A/Bs of launch configs that have no lock or
``LLM`` option (``triton.gemv.PREFETCH_WARPS``, ``rope.BLOCK_H_MAX``, ...).

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/engine/knob_run.py NAME [module:attr=python-literal ...]``, e.g.
``knob_run.py bh16 layerzero.backends.triton.rope:BLOCK_H_MAX=16`` (run from the repository root).
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
    for knob in knobs:
        target, value = knob.split("=", 1)
        module, attr = target.split(":")
        setattr(importlib.import_module(module), attr, ast.literal_eval(value))
    sys.argv = ["bench_variant.py", name]
    runpy.run_path(str(Path(__file__).with_name("bench_variant.py")), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
