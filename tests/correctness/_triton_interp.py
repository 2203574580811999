"""The skip mark of the Triton-interpreter tests: they need triton and ``TRITON_INTERPRET=1``
(tests/conftest.py sets it before any ``@triton.jit`` runs when no CUDA device is visible; Triton's
interpreter then runs the kernels on CPU tensors). With a CUDA GPU the compiled kernels are covered by the
named GPU test file instead."""

from __future__ import annotations

import importlib.util
import os

import pytest

__all__ = ["needs_interpreter"]


def needs_interpreter(gpu_file: str) -> pytest.MarkDecorator:
    """``skipif`` mark for a test that runs a Triton kernel under the interpreter; ``gpu_file`` is quoted in
    the reason."""
    try:
        have = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        have = False
    on = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return pytest.mark.skipif(  # tests/conftest.py marks triton_interpreter by this reason's start
        not (have and on),
        reason="needs triton and TRITON_INTERPRET=1 (the Triton interpreter "
        f"runs these on CPU tensors; with a CUDA GPU the compiled kernels are covered by {gpu_file})",
    )
