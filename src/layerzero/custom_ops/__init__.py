"""LayerZero ops as ``torch.library`` custom ops (namespace ``layerzero``): what ``torch.compile`` and
``torch.export`` see of ``lz.<op>`` calls (docs/torch_compile.md).

An op reaches its custom op through one helper, :func:`traced`, and only while TorchDynamo traces or
``torch.export`` exports: ``traced("swiglu")(gate, up)``. The custom ops (:mod:`._ops`, :mod:`._paged`;
backward formulas: :mod:`._grad`) are registered when :func:`traced` first imports them, at trace time, so
eager code never pays for their registration. Their eager implementation is the op's public function, looked
up in its :class:`~layerzero.core.opdef.OpDef` (this package imports no op module; the ops import it). A
process that loads an exported program without tracing first calls :func:`register` (``import layerzero``
defines the ops those custom ops run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["register", "traced"]


def traced(name: str) -> Callable[..., Any]:
    """The wrapper of custom op ``torch.ops.layerzero.<name>`` that takes the ``lz`` op's own arguments
    (layouts as enums or strings, windows as pairs, ``QuantizedTensor`` values) and returns what the ``lz`` op
    returns.

    Shapes, dtypes, units and errors: those of the ``lz`` op it wraps (its docstring). Registers every custom
    op on first use. Raises ``AttributeError`` for a name that is no custom op of :mod:`._ops` (a programming
    error of the calling op module:
    ``tests/integration/test_torch_compile_ops.py`` runs every op under ``torch.compile``).
    """
    from . import _ops  # registers the custom ops (once; under Dynamo this import runs for real, not traced)

    return getattr(_ops, name)


def register() -> tuple[str, ...]:
    """Register every custom op of this package (idempotent) and return their names, for a process that runs
    an exported program (``torch.export.load``) before tracing anything."""
    from . import _ops

    return tuple(_ops.__all__)
