"""The process's one dispatch runtime: ``RUNTIME`` (a :class:`~layerzero.core.dispatch.Runtime`).

Everything that dispatches, selects, tunes or reports (the ops, ``lz.select``/``lz.explain``, graphs, doctor,
the CLI, tuning) uses this one instance; tests and tools import it from here. It is cheap to create (no I/O):
the environment, the operation specs and the built-in backends are loaded on the first selection, by the
loader that the package above ``core`` installs (``layerzero/_wiring.py``, run by ``import layerzero``: it
installs ``register_builtin`` of the ops package, and the autotuner and canary of the tuning package, through
:meth:`~layerzero.core.dispatch.Runtime.install_hooks`). ``core`` names no module above it, not even by
string.
"""

from __future__ import annotations

from . import config as _config
from .dispatch import Runtime

RUNTIME = Runtime()
"""The process's dispatch runtime (registry, selection cache, health, PerfDB); loads lazily."""

_config.set_names_registry(lambda: RUNTIME.registry)  # policy names are checked against this registry


def get_runtime() -> Runtime:
    """The process's :data:`RUNTIME`."""
    return RUNTIME


__all__ = ["RUNTIME", "get_runtime"]
