"""One definition per op: an :class:`OpDef` holds everything LayerZero knows of an op (its
:class:`~layerzero.core.specs.OperationSpec`, the public ``lz.<op>`` function, its prepare / context pair for
``lz.select`` / ``lz.explain``, the canonical kernel arguments and the names of its ``torch.library`` custom
ops), and every list of ops is derived from the OpDefs defined here (``layerzero.ops``: ``OPERATION_SPECS``,
``OPS``, ``__all__``; ``layerzero.core.custom.canonical_args``; the custom ops' eager implementations in
``layerzero.custom_ops``).

An op module of ``layerzero/ops/`` calls :func:`define` once per op when it is imported (a registry insert, no
other work); ``layerzero.ops`` imports every op module of its package, so adding an op is one new module there
plus its kernels (``tests/unit/test_add_op.py`` adds one in a copy of the package).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigurationError, UnknownOperationError, did_you_mean
from .specs import OperationSpec

__all__ = ["OpDef", "define", "get", "defined"]


@dataclass(frozen=True, slots=True)
class OpDef:
    """An op, defined once.

    ``spec``: the op id, description, tensor inputs and reference kernel (what the registry and selection
    read). ``public``: the ``lz.<op>`` function (exported from ``layerzero`` under its ``__name__``); None for
    an op reached only through another op's function (``paged_attention_lse``, through
    ``lz.paged_attention``'s ``return_lse``). ``prepare(*args, **kwargs) -> (key, canonical kernel
    args)`` and ``context(key) -> SelectionContext``: what ``lz.select`` / ``lz.explain`` / ``lz.which`` call
    with the public function's arguments. ``kernel_args``: the names of the canonical positional arguments
    every kernel of the op is called with (a registered kernel's signature is checked against them); empty
    means ``spec.inputs``. ``custom_ops``: the ``torch.ops.layerzero.<name>`` custom ops of
    ``layerzero.custom_ops`` whose eager implementation is ``public`` (what ``torch.compile`` /
    ``torch.export`` see of the op).
    """

    spec: OperationSpec
    public: Callable[..., Any] | None
    prepare: Callable[..., Any]
    context: Callable[..., Any]
    kernel_args: tuple[str, ...] = ()
    custom_ops: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The op id (``spec.op_id``)."""
        return self.spec.op_id

    @property
    def canonical_args(self) -> tuple[str, ...]:
        """``kernel_args``, or ``spec.inputs`` when the op's kernels take only its tensor inputs."""
        return self.kernel_args or self.spec.inputs


_DEFINED: dict[str, OpDef] = {}


def define(*defs: OpDef) -> tuple[OpDef, ...]:
    """Record ``defs`` (each op module calls this once at import); returns them.

    Raises:
        ConfigurationError: an op id defined twice by different definitions (two modules claiming one op), or
            a value that is not an :class:`OpDef`.
    """
    for d in defs:
        if not isinstance(d, OpDef):
            raise ConfigurationError(
                f"define: expected OpDef values, got {type(d).__name__}; build one with "
                "OpDef(spec, public, prepare, context)."
            )
        old = _DEFINED.get(d.name)
        if old is not None and old != d:
            raise ConfigurationError(
                f"op {d.name!r} is defined twice (by {_where(old)} and {_where(d)}); an op id "
                "names one op: rename one of them."
            )
        _DEFINED[d.name] = d
    return defs


def get(name: str) -> OpDef:
    """The definition of op ``name``.

    Raises:
        UnknownOperationError: no op of that id is defined (the message lists close names); ``layerzero.ops``
            defines every built-in op when it is imported (``import layerzero`` imports it).
    """
    d = _DEFINED.get(name)
    if d is None:
        raise UnknownOperationError(
            f"unknown op {name!r}.{did_you_mean(name, _DEFINED)} Import layerzero first: it "
            "defines the built-in ops."
        )
    return d


def defined() -> tuple[OpDef, ...]:
    """Every defined op, in definition order."""
    return tuple(_DEFINED.values())


def _where(d: OpDef) -> str:
    """Where an OpDef's public function (or prepare) lives, for error messages."""
    fn = d.public or d.prepare
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
