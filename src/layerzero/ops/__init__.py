"""Public ops. Each op module validates its inputs (typed errors), builds the cache key, hands the call to the
dispatch runtime, and defines its op(s) once as :class:`~layerzero.core.opdef.OpDef` values (``OPDEFS``).

Importing this package imports every module of it (adding an op is one new module here plus its kernels) and
derives every list of ops from the OpDefs: :data:`OPERATION_SPECS` (what the registry holds), :data:`OPS` (op
id -> ``(prepare, context)`` for ``lz.select`` / ``lz.explain`` / ``lz.which``) and ``__all__`` (each op's
public function, re-exported by ``layerzero``), plus the KV-cache helpers of :mod:`.kv_cache`, which are no
op.
"""

from __future__ import annotations

import pkgutil
from importlib import import_module
from typing import Any

from layerzero.core.opdef import OpDef, defined

from .kv_cache import KVLayout, allocate_kv_cache


def _import_op_modules() -> tuple[OpDef, ...]:
    """Import every public module of this package (``_``-prefixed ones are shared code) and return the OpDefs
    they defined, in definition order."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            import_module(f"{__name__}.{info.name}")
    return defined()


OPDEFS: tuple[OpDef, ...] = _import_op_modules()
OPERATION_SPECS = tuple(d.spec for d in OPDEFS)
OPS: dict[str, tuple[Any, Any]] = {d.name: (d.prepare, d.context) for d in OPDEFS}
_PUBLIC = {d.public.__name__: d.public for d in OPDEFS if d.public is not None}
globals().update(_PUBLIC)


def register_builtin(registry: Any) -> None:
    """Add every op's :class:`~layerzero.core.specs.OperationSpec` and the built-in backends to ``registry``
    (a :class:`~layerzero.core.registry.KernelRegistry`; the loader of
    :data:`layerzero.core.runtime.RUNTIME`)."""
    from layerzero.backends import register_builtin as _backends

    for spec in OPERATION_SPECS:
        registry.add_op(spec)
    _backends(registry)


# what ``layerzero`` re-exports (``from .ops import *``): the KV-cache helpers and each op's public function
__all__ = ["KVLayout", "allocate_kv_cache", *sorted(_PUBLIC)]
