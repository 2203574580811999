"""The context fields a policy's ``when:`` may test, and their value kinds, derived from
:class:`SelectionContext`.

:data:`FIELD_KINDS` is built from the dataclass fields of :class:`~layerzero.core.context.SelectionContext`
(their type hints say the kind: ``bool`` -> BOOL, ``int`` -> INT, ``str``, ``torch.dtype`` and str enums such
as ``Layout``/``MaskKind``/``Phase`` -> STR, ``X | None`` as X), plus its properties (``phase``,
``gqa_ratio``, from their return types) and the device fields ``SelectionContext.fields()`` adds, whose kinds
no type can say (:data:`DEVICE_FIELD_KINDS`). A new context field is therefore accepted in ``when:`` without
editing a list; ``tests/unit/test_policy.py`` checks that the names equal the keys of
``SelectionContext.fields()``.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from .context import SelectionContext


class FieldKind(str, enum.Enum):
    """The value type of a context field; decides which conditions are legal on it at load time."""

    STR = "str"
    INT = "int"
    BOOL = "bool"


#: Fields ``SelectionContext.fields()`` derives from its ``device`` (a ``DeviceSpec``): explicit kinds.
DEVICE_FIELD_KINDS: Mapping[str, FieldKind] = MappingProxyType(
    {
        "device": FieldKind.STR,
        "device_name": FieldKind.STR,
        "sm": FieldKind.INT,
        "gpu_generation": FieldKind.STR,
    }
)


def kind_of(hint: Any) -> FieldKind | None:
    """The :class:`FieldKind` of a resolved type hint (``X | None`` counts as X); None when no kind fits."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            return None
        hint = args[0]
    if hint is bool:
        return FieldKind.BOOL
    if hint is int:
        return FieldKind.INT
    if (
        hint is str
        or hint is torch.dtype
        or (isinstance(hint, type) and issubclass(hint, str) and issubclass(hint, enum.Enum))
    ):
        return FieldKind.STR
    return None


def _derive() -> dict[str, FieldKind]:
    kinds: dict[str, FieldKind] = {}
    hints = typing.get_type_hints(SelectionContext)
    for f in dataclasses.fields(SelectionContext):
        if f.name in DEVICE_FIELD_KINDS:
            continue
        kind = kind_of(hints[f.name])
        if kind is None:
            raise TypeError(
                f"SelectionContext.{f.name}: type {hints[f.name]!r} has no policy field kind; "
                "add it to layerzero.core.policy_fields"
            )
        kinds[f.name] = kind
    for name, attr in vars(SelectionContext).items():
        if isinstance(attr, property) and attr.fget is not None:
            kind = kind_of(typing.get_type_hints(attr.fget).get("return"))
            if kind is not None:
                kinds[name] = kind
    kinds.update(DEVICE_FIELD_KINDS)
    return dict(sorted(kinds.items()))


#: Value kind of every known context field (the keys of ``SelectionContext.fields()``). Read-only.
FIELD_KINDS: Mapping[str, FieldKind] = MappingProxyType(_derive())
#: Field names a rule's ``when:`` may use. Extend it by passing ``known_fields=KNOWN_FIELDS | {...}`` to the
#: loaders; names without an entry in :data:`FIELD_KINDS` accept any condition kind.
KNOWN_FIELDS: frozenset[str] = frozenset(FIELD_KINDS)

__all__ = ["DEVICE_FIELD_KINDS", "FIELD_KINDS", "KNOWN_FIELDS", "FieldKind", "kind_of"]
