"""The process's one dispatch runtime: ``RUNTIME`` (a :class:`~layerzero.core.dispatch.Runtime`).

Everything that dispatches, selects, tunes or reports (the ops, ``lz.select``/``lz.explain``, graphs, doctor,
the CLI, tuning) uses this one instance; tests and tools import it from here. It is cheap to create (no I/O):
the environment, the operation specs and the built-in backends are loaded on the first selection, through
:func:`load_builtin`. ``core`` imports no backend, so the loader imports ``layerzero.ops`` (which registers the
op specs and the backends) by name, at that first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .context import SelectionContext
from .dispatch import Runtime
from .registry import KernelRegistry


def load_builtin(registry: KernelRegistry) -> None:
    """Register every built-in :class:`~layerzero.core.specs.OperationSpec` and backend in ``registry``."""
    import_module("layerzero.ops").register_builtin(registry)


def autotune(runtime: Runtime, ctx: SelectionContext, args: tuple[Any, ...]) -> None:
    """The online autotuner (``lz.configure(autotune=True)``): ``layerzero.tuning.autotune.autotune_context``,
    imported by name on first use (``core`` never imports ``tuning`` statically)."""
    import_module("layerzero.tuning.autotune").autotune_context(runtime, ctx, args)


def canary(runtime: Runtime, ctx: SelectionContext, args: tuple[Any, ...], out: Any) -> str | None:
    """The canary check (``lz.configure(canaries=True)``): ``layerzero.tuning.canary.check``, imported by name on
    first use."""
    return import_module("layerzero.tuning.canary").check(runtime, ctx, args, out)


RUNTIME = Runtime(load_builtin, autotuner=autotune, canary=canary)
"""The process's dispatch runtime (registry, selection cache, health, PerfDB); loads lazily."""


def get_runtime() -> Runtime:
    """The process's :data:`RUNTIME`."""
    return RUNTIME


__all__ = ["RUNTIME", "autotune", "canary", "get_runtime", "load_builtin"]
