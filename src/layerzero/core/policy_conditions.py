"""Policy ``when:`` clauses: parsing and matching the conditions a rule puts on the selection context.

A ``when:`` condition is a scalar (bool matches bool only; numbers match equal numbers), a string glob (string
values only; case-sensitive :func:`fnmatch.fnmatchcase`), a comparison (``"<=128"``, ``"!=64"``) or inclusive
range (``"64..256"``) on numbers, or a list of those (any-of); ``None`` / absent values never match. A
:class:`When` is the AND of one condition per context field, checked against a ``Mapping[str, Any]`` of
primitive values ("fields") whose kinds (:data:`FIELD_KINDS`) come from :mod:`.policy_fields`.

This is its own module because conditions are a small language of their own (a parser, a matcher and a
canonical form for the policy hash) that the rule kinds of :mod:`.policy_schema` only use; the message
helpers :func:`short` and :func:`type_name` live here, the lowest module of the policy stack. The full
reference is ``docs/policies.md``.
"""

from __future__ import annotations

import enum
import json
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any

from .errors import PolicyValidationError, did_you_mean, expected_got
from .policy_fields import FIELD_KINDS, KNOWN_FIELDS, FieldKind

_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_CMP_RE = re.compile(rf"\s*(<=|>=|==|!=|<|>)\s*({_NUM})\s*")
_RANGE_RE = re.compile(rf"\s*({_NUM})\s*\.\.\s*({_NUM})\s*")
_RANGE_ATTEMPT_RE = re.compile(r"[\s\d.eE+\-]*\.\.[\s\d.eE+\-]*")
_INT_RE = re.compile(r"[+-]?\d+")
_CMP_OPS: Mapping[str, Callable[[Any, Any], bool]] = MappingProxyType(
    {
        "<=": operator.le,
        ">=": operator.ge,
        "<": operator.lt,
        ">": operator.gt,
        "==": operator.eq,
        "!=": operator.ne,
    }
)


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (error messages must stay readable for huge inputs)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_name(value: Any) -> str:
    """YAML-ish type name of ``value`` for messages (``null``, ``bool``, ``int``, ``str``, ``list``...)."""
    return "null" if value is None else type(value).__name__


def is_number(value: Any) -> bool:
    """True for an ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ConditionKind(str, enum.Enum):
    """How a :class:`Condition` matches a value."""

    EQ = "eq"  # bool or number equality
    GLOB = "glob"  # fnmatchcase on string values
    CMP = "cmp"  # "<=128" style comparison on numbers
    RANGE = "range"  # "64..256", inclusive, on numbers
    ANY = "any"  # list: any element matches


@dataclass(frozen=True, slots=True)
class Condition:
    """One parsed ``when:`` condition. Build it with :func:`parse_condition`, not directly.

    ``raw`` is the value as written (kept for :meth:`to_data` round trips); ``op`` is the comparison
    operator for CMP; ``a``/``b`` are the operand (EQ/GLOB/CMP) or the inclusive bounds (RANGE);
    ``items`` are the alternatives of ANY.
    """

    kind: ConditionKind
    raw: Any
    op: str = ""
    a: Any = None
    b: Any = None
    items: tuple[Condition, ...] = ()

    def __repr__(self) -> str:
        return f"Condition({self.to_data()!r})"

    def matches(self, value: Any) -> bool:
        """True when ``value`` (a primitive field value) satisfies this condition; ``None`` never does."""
        if value is None:
            return False
        kind = self.kind
        if kind is ConditionKind.GLOB:
            return isinstance(value, str) and fnmatchcase(value, self.a)
        if kind is ConditionKind.EQ:
            if isinstance(self.a, bool) or isinstance(value, bool):
                return isinstance(value, bool) and isinstance(self.a, bool) and value == self.a
            return is_number(value) and value == self.a
        if kind is ConditionKind.CMP:
            return is_number(value) and _CMP_OPS[self.op](value, self.a)
        if kind is ConditionKind.RANGE:
            return is_number(value) and self.a <= value <= self.b
        return any(item.matches(value) for item in self.items)

    def to_data(self) -> Any:
        """The condition as written (YAML/JSON-ready)."""
        return list(self.raw) if isinstance(self.raw, tuple) else self.raw

    def canonical(self) -> Any:
        """A JSON-ready normal form: equal semantics of common spellings give equal values."""
        if self.kind is ConditionKind.ANY:
            forms = {json.dumps(item.canonical(), sort_keys=True): item.canonical() for item in self.items}
            return forms[next(iter(forms))] if len(forms) == 1 else {"any": [forms[k] for k in sorted(forms)]}
        if (self.kind is ConditionKind.CMP and self.op == "==") or (
            self.kind is ConditionKind.RANGE and self.a == self.b
        ):
            return {"eq": self.a}
        if self.kind is ConditionKind.CMP:
            return {"cmp": self.op, "n": self.a}
        if self.kind is ConditionKind.RANGE:
            return {"range": [self.a, self.b]}
        return {self.kind.value: self.a}


def _parse_number(text: str, path: str, raw: str) -> int | float:
    try:
        number: int | float = int(text) if _INT_RE.fullmatch(text) else float(text)
    except ValueError:
        number = math.inf
    if isinstance(number, float):
        if not math.isfinite(number):
            raise PolicyValidationError(expected_got(path, "a finite number in the comparison", short(raw)))
        if number.is_integer():
            number = int(number)
    return number


def parse_condition(
    value: Any, path: str, kind: FieldKind | None = None, *, nested: bool = False
) -> Condition:
    """Parse one ``when:`` value (see the module docstring) into a :class:`Condition`.

    ``path`` names the value in errors (``"deny[2].when.head_dim"``); ``kind`` is the field's
    :class:`FieldKind` (None = untyped: any condition kind is accepted).
    Raises ``PolicyValidationError`` for null, mappings, nested or empty lists, bad comparison or range
    strings, non-finite numbers, and condition kinds that can never match a field of ``kind``.
    """
    if isinstance(value, list | tuple):
        if nested:
            raise PolicyValidationError(
                expected_got(
                    path,
                    "a scalar or comparison string",
                    "a nested list",
                    "Flatten the list: its elements are alternatives.",
                )
            )
        if not value:
            raise PolicyValidationError(expected_got(path, "a non-empty list of alternatives", "[]"))
        items = tuple(parse_condition(v, f"{path}[{i}]", kind, nested=True) for i, v in enumerate(value))
        return Condition(ConditionKind.ANY, tuple(i.raw for i in items), items=items)
    if isinstance(value, bool):
        cond = Condition(ConditionKind.EQ, value, a=value)
    elif isinstance(value, int | float):
        if not math.isfinite(value):
            raise PolicyValidationError(expected_got(path, "a finite number", short(value)))
        cond = Condition(ConditionKind.EQ, value, a=int(value) if float(value).is_integer() else value)
    elif isinstance(value, str):
        cond = _parse_string_condition(value, path)
    else:
        raise PolicyValidationError(
            expected_got(
                path,
                "a scalar, a comparison string ('<=128', '64..256') or a list of those",
                type_name(value),
                "A null condition is not allowed: a field whose value is None never matches.",
            )
        )
    _check_kind(cond, path, kind)
    return cond


def _parse_string_condition(value: str, path: str) -> Condition:
    stripped = value.strip()
    if stripped[:1] in ("<", ">", "=", "!"):
        m = _CMP_RE.fullmatch(value)
        if m is None:
            raise PolicyValidationError(
                expected_got(
                    path, "a comparison like '<=128', '>=80', '<1024', '>0', '==64' or '!=64'", short(value)
                )
            )
        return Condition(ConditionKind.CMP, value, op=m.group(1), a=_parse_number(m.group(2), path, value))
    if _RANGE_ATTEMPT_RE.fullmatch(value):
        m = _RANGE_RE.fullmatch(value)
        if m is None:
            raise PolicyValidationError(expected_got(path, "an inclusive range like '64..256'", short(value)))
        lo, hi = _parse_number(m.group(1), path, value), _parse_number(m.group(2), path, value)
        if lo > hi:
            raise PolicyValidationError(expected_got(path, "a range 'lo..hi' with lo <= hi", short(value)))
        return Condition(ConditionKind.RANGE, value, a=lo, b=hi)
    if not value:
        raise PolicyValidationError(expected_got(path, "a non-empty string glob", "''"))
    return Condition(ConditionKind.GLOB, value, a=value)


def _check_kind(cond: Condition, path: str, kind: FieldKind | None) -> None:
    if kind is None:
        return
    numeric = cond.kind in (ConditionKind.CMP, ConditionKind.RANGE) or (
        cond.kind is ConditionKind.EQ and not isinstance(cond.a, bool)
    )
    if kind is FieldKind.BOOL and not (cond.kind is ConditionKind.EQ and isinstance(cond.a, bool)):
        raise PolicyValidationError(expected_got(path, "true or false (a bool field)", short(cond.raw)))
    if kind is FieldKind.INT and not numeric:
        raise PolicyValidationError(
            expected_got(
                path,
                "a number, a comparison ('<=128') or a range ('64..256') (an int field)",
                short(cond.raw),
                "Write numbers unquoted, e.g. head_dim: 128.",
            )
        )
    if kind is FieldKind.STR and cond.kind is not ConditionKind.GLOB:
        raise PolicyValidationError(
            expected_got(
                path, "a string glob (a string field)", short(cond.raw), "Quote it, e.g. device_name: '3090'."
            )
        )


@dataclass(frozen=True, slots=True)
class When:
    """A rule's ``when:`` clause: ``(field, Condition)`` pairs sorted by field; all must match (AND).

    An empty clause always matches. Build it with :func:`parse_when`.
    """

    items: tuple[tuple[str, Condition], ...] = ()

    def matches(self, fields: Mapping[str, Any]) -> bool:
        """True when every condition matches ``fields[name]`` (an absent field counts as ``None``)."""
        for name, cond in self.items:
            if not cond.matches(fields.get(name)):
                return False
        return True

    def to_data(self) -> dict[str, Any]:
        """``{field: condition as written}``."""
        return {name: cond.to_data() for name, cond in self.items}

    def canonical(self) -> dict[str, Any]:
        """``{field: canonical condition}`` (see :meth:`Condition.canonical`)."""
        return {name: cond.canonical() for name, cond in self.items}

    def __bool__(self) -> bool:
        return bool(self.items)

    def __repr__(self) -> str:
        return f"When({self.to_data()!r})"

    def __str__(self) -> str:
        return ", ".join(f"{n}={c.to_data()!r}" for n, c in self.items)


EMPTY_WHEN = When()


def parse_when(value: Any, path: str, known_fields: frozenset[str] = KNOWN_FIELDS) -> When:
    """Parse a ``when:`` mapping (``None`` = always). Raises ``PolicyValidationError`` for a non-mapping,
    an unknown field name (listing the known ones) or a bad condition."""
    if isinstance(value, When):
        return value
    if value is None:
        return EMPTY_WHEN
    if not isinstance(value, Mapping):
        raise PolicyValidationError(expected_got(path, "a mapping of field -> condition", type_name(value)))
    items = []
    for name, cond in value.items():
        if not isinstance(name, str) or name not in known_fields:
            raise PolicyValidationError(
                expected_got(f"{path}.{str(name)[:80]}", "a known context field", short(name))
                + did_you_mean(str(name), known_fields)
            )
        items.append((name, parse_condition(cond, f"{path}.{name}", FIELD_KINDS.get(name))))
    return When(tuple(sorted(items, key=lambda item: item[0])))
