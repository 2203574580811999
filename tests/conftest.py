"""Test isolation for LayerZero's process-wide state, and the ``gpu`` marker's skip rule.

Every test gets:

- ``LAYERZERO_PERFDB`` pointing at a fresh SQLite file in its ``tmp_path`` (measurements never leak
  between tests or into the user's cache), ``LAYERZERO_SHIPPED_TIMINGS=0`` (the timing data shipped for this
  machine would change priority-based picks; tests of shipped timings turn it on), and no other
  ``LAYERZERO_*`` variable from the calling shell (a developer's ``LAYERZERO_STRICT=1`` must not change test
  outcomes);
- :func:`layerzero.core.config.reset_for_tests` before and after it: config back to defaults, locks and
  file/env policy layers cleared, the environment re-read and the epoch bumped (so every cached
  selection is invalidated); the level of the ``layerzero`` logger (which ``LAYERZERO_LOG_LEVEL`` sets)
  is restored afterwards; every backend's circuit breaker is closed before and after it;
- torch limited to one intra-op thread for the whole session (tiny tensors, 2 cores).

Tests marked ``gpu`` are skipped with reason "needs a CUDA GPU" when ``torch.cuda.is_available()`` is False.
On such machines, when triton is installed, ``TRITON_INTERPRET=1`` is set at import so Triton kernels run on
CPU tensors through Triton's interpreter (tests/correctness/test_triton_interpret.py). TorchInductor gets a
cache directory per ``ATEN_CPU_CAPABILITY`` value (its own cache key ignores it: see
:func:`_inductor_cache_per_cpu_isa`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator

import pytest

_PERFDB_VAR = "LAYERZERO_PERFDB"
_SHIPPED_VAR = "LAYERZERO_SHIPPED_TIMINGS"


def _triton_interpreter_for_cpu_runs() -> None:
    """Without a CUDA device, run Triton kernels on CPU tensors through Triton's interpreter: set
    ``TRITON_INTERPRET=1`` (unless the shell set it) before any ``@triton.jit`` decorator runs (LayerZero's
    kernel modules are imported lazily, on a kernel's first call, so conftest import time is early enough)."""
    import importlib.util

    if "TRITON_INTERPRET" in os.environ or importlib.util.find_spec("triton") is None:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_triton_interpreter_for_cpu_runs()


def _inductor_cache_per_cpu_isa() -> None:
    """Give TorchInductor a cache directory per forced CPU ISA (``ATEN_CPU_CAPABILITY``) and per ``python -O``
    (unless the shell set ``TORCHINDUCTOR_CACHE_DIR``). Inductor's cache key misses both: kernels compiled
    under ``ATEN_CPU_CAPABILITY=avx2`` and reloaded without it abort with "double free or corruption", and the
    reverse returns NaN (reproduced with plain torch ops, torch 2.13.0+cpu); a training block of our custom
    ops compiled under ``python -O`` generates other C++ kernels than without it, and reloaded without ``-O``
    returned wrong gradients (docs/torch_compile.md, "History"). ``make test`` runs tests under several ISAs
    and ``-O`` on one machine, the ``-O`` pass beside the main run."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    import getpass
    import tempfile

    isa = os.environ.get("ATEN_CPU_CAPABILITY", "native") or "native"
    opt = "_O" if sys.flags.optimize else ""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_lz_{isa}{opt}"
    )


_inductor_cache_per_cpu_isa()


def _scrub_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset every ``LAYERZERO_*`` variable except the PerfDB path (monkeypatch restores them later)."""
    for name in list(os.environ):
        if name.startswith("LAYERZERO_") and name != _PERFDB_VAR:
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _isolate_layerzero(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Per-test isolation of LayerZero's global state (see the module docstring)."""
    from layerzero.core import config

    lz_logger = logging.getLogger("layerzero")
    level = lz_logger.level  # LAYERZERO_LOG_LEVEL sets it on (re)load; put it back afterwards
    from layerzero.core.runtime import RUNTIME

    _scrub_env(monkeypatch)
    monkeypatch.setenv(_PERFDB_VAR, str(tmp_path / "perfdb.sqlite"))
    monkeypatch.setenv(_SHIPPED_VAR, "0")
    config.reset_for_tests()
    # a kernel failing in one test must not leave its circuit breaker open for the next
    RUNTIME.health.reset()
    yield
    # A test may have set (possibly malformed) LAYERZERO_* variables: drop them before re-reading the env.
    _scrub_env(monkeypatch)
    config.reset_for_tests()
    RUNTIME.health.reset()
    lz_logger.setLevel(level)


@pytest.fixture
def fresh_telemetry() -> Iterator[None]:
    """``layerzero.telemetry`` off and zeroed (and the selection cache empty) before a test, off and zeroed
    after."""
    import layerzero.telemetry as lzt
    from layerzero.core.runtime import RUNTIME

    lzt.disable()
    lzt.reset()
    RUNTIME.cache.invalidate()
    yield
    lzt.disable()
    lzt.reset()


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """Tests use tiny tensors: intra-op threads only add contention on the 2-core CI machine (10-100x slower
    calls), so the whole session runs torch with one thread."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


INTERPRETER_REASON = "needs triton and TRITON_INTERPRET=1"
"""How ``tests/correctness/_triton_interp.needs_interpreter``'s skip reason starts."""
SIDE_STREAM_FILES = frozenset(
    {
        "test_cascade_ops.py",
        "test_quantized_linear_int4.py",
        "test_triton_attention.py",
        "test_triton_paged_one_pass.py",
    }
)
"""Files whose Triton-interpreter tests tools/run_tests.sh runs in its side stream with the ``*_interpret.py``
files (marked ``side_stream``), not in the main run: ~75 s that balance CI's two streams (2026-11-30)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``triton_interpreter`` every test that runs a Triton kernel in the interpreter (a file
    ``*_interpret.py``, or a ``needs_interpreter`` mark): tools/run_tests.sh's forced-ISA passes leave them
    out, their kernels run in numpy, not in ATen's ISA-dispatched code; those of ``*_interpret.py`` and
    :data:`SIDE_STREAM_FILES` also ``side_stream`` (run_tests.sh's interpreter pass). Skip tests marked
    ``gpu`` when no CUDA device is visible."""
    import torch

    interp, side = pytest.mark.triton_interpreter, pytest.mark.side_stream
    for item in items:
        whole_file = item.path.name.endswith("_interpret.py")
        if whole_file or any(
            m.name == "skipif" and str(m.kwargs.get("reason", "")).startswith(INTERPRETER_REASON)
            for m in item.iter_markers()
        ):
            item.add_marker(interp)
            if whole_file or item.path.name in SIDE_STREAM_FILES:
                item.add_marker(side)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
