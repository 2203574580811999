"""``bench_variant.py`` with knobs set first, for throughput A/Bs of launch configs that have no lock or
``LLM`` option: registered knobs (``layerzero.core.knobs``: ``triton.gemv:prefetch_warps=4``,
``triton.rope:block_h_max=16``) or other module attributes (``module:ATTR=value``).

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/engine/knob_run.py NAME [target:attr=python-literal
...]``, e.g. ``knob_run.py bh16 triton.rope:block_h_max=16`` or ``knob_run.py s16
triton.paged_decode:max_splits=16`` (run from the repository root): a target that is a registered knobs name
is changed with ``configure_knobs``, any other is a module whose attribute is set. With ``--pytest`` as NAME,
the knobs are followed by ``--`` and pytest's arguments: the GPU tests run in this process under the knobs
(``knob_run.py --pytest triton.paged_decode:early_kv=True -- -q tests/engine/gpu``).
"""

from __future__ import annotations

import ast
import importlib
import runpy
import sys
from pathlib import Path

from layerzero.core.knobs import configure_knobs, registered  # registered() imports the knob modules


def main(argv: list[str]) -> None:
    """Set each ``target:attr=literal`` knob, then run ``bench_variant.py NAME`` in this process."""
    name, *knobs = argv
    rest: list[str] = []
    if "--" in knobs:
        at = knobs.index("--")
        knobs, rest = knobs[:at], knobs[at + 1 :]
    for knob in knobs:
        target, value = knob.split("=", 1)
        module, attr = target.split(":")
        if module in registered():
            configure_knobs(module, **{attr: ast.literal_eval(value)})
        else:
            setattr(importlib.import_module(module), attr, ast.literal_eval(value))
    if name == "--pytest":
        import pytest

        sys.exit(pytest.main(rest))
    sys.argv = ["bench_variant.py", name]
    runpy.run_path(str(Path(__file__).with_name("bench_variant.py")), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
