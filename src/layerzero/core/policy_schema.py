"""Policy schema: ``when:`` conditions and the four rule kinds (lock, allow, deny, boost).

Turns plain data (what ``yaml.safe_load`` returns) into frozen, validated rules and matches them against a
selection context given as a ``Mapping[str, Any]`` of primitive values ("fields"). Globs are case-sensitive
:func:`fnmatch.fnmatchcase` patterns; ``kernels`` globs match the kernel id *or* the backend id. A ``when:``
condition is a scalar (bool matches bool only; numbers match equal numbers), a string glob (string values
only), a comparison (``"<=128"``, ``"!=64"``) or inclusive range (``"64..256"``) on numbers, or a list of
those (any-of); ``None`` / absent values never match. The full reference is ``docs/policies.md``. The context
fields and their kinds (:data:`FIELD_KINDS`) are derived from ``SelectionContext`` in :mod:`.policy_fields`.
"""

from __future__ import annotations

import enum
import json
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field
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
_PATTERN_RE = re.compile(r"[A-Za-z0-9_.*?\[\]!\-]{1,200}")
_KERNEL_ID_RE = re.compile(r"[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)+")
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


def _is_number(value: Any) -> bool:
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
            return _is_number(value) and value == self.a
        if kind is ConditionKind.CMP:
            return _is_number(value) and _CMP_OPS[self.op](value, self.a)
        if kind is ConditionKind.RANGE:
            return _is_number(value) and self.a <= value <= self.b
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


def check_pattern(value: Any, path: str, what: str = "a kernel or backend glob") -> str:
    """Validate one glob (op, kernel or backend): a non-empty string of ``[A-Za-z0-9_.*?[]!-]``, at most
    200 characters. Returns it; raises ``PolicyValidationError``."""
    if not isinstance(value, str) or not _PATTERN_RE.fullmatch(value):
        raise PolicyValidationError(
            expected_got(path, f"{what} (1-200 chars of letters, digits, _ . - * ? [ ] !)", short(value))
        )
    return value


def check_kernel_id(value: Any, path: str) -> str:
    """Validate an exact kernel id ``backend.name`` (no globs). Returns it; raises
    ``PolicyValidationError``."""
    if not isinstance(value, str) or len(value) > 200 or not _KERNEL_ID_RE.fullmatch(value):
        raise PolicyValidationError(
            expected_got(
                path,
                "an exact kernel id 'backend.name' (no globs)",
                short(value),
                "A lock forces one kernel; use allow/deny/boosts for patterns.",
            )
        )
    return value


def _patterns(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise PolicyValidationError(
            expected_got(
                path,
                "a list of kernel/backend globs",
                type_name(value),
                "Write kernels: ['torch_sdpa.flash'] (a list).",
            )
        )
    if not value:
        raise PolicyValidationError(expected_got(path, "a non-empty list of kernel/backend globs", "[]"))
    checked = (check_pattern(p, f"{path}[{i}]") for i, p in enumerate(value))
    return tuple(dict.fromkeys(checked))


def _init_rule(rule: Any, path: str, known_fields: frozenset[str]) -> None:
    """Validate and normalize a rule being constructed (``op``, ``when`` and, if present, ``kernels``)."""
    check_pattern(rule.op, f"{path}.op", "an op id or glob")
    object.__setattr__(rule, "when", parse_when(rule.when, f"{path}.when", known_fields))
    if hasattr(rule, "kernels"):
        object.__setattr__(rule, "kernels", _patterns(rule.kernels, f"{path}.kernels"))


def _data(base: dict[str, Any], when: When) -> dict[str, Any]:
    if when:
        base["when"] = when.to_data()
    return base


# Rules take init-only ``path`` (names the rule in errors: "deny[2]") and ``known_fields``; ``when`` may be a
# dict.
@dataclass(frozen=True, slots=True)
class LockRule:
    """Force ``kernel`` (an exact id) for ops matching the glob ``op`` when ``when`` matches.

    ``origin`` says where the rule came from (``"file.yaml: locks[0]"``); it is not part of equality.
    Raises ``PolicyValidationError`` on construction for a bad op glob, kernel id or ``when``.
    """

    op: str
    kernel: str
    when: When = EMPTY_WHEN
    origin: str = field(default="", compare=False)
    path: InitVar[str] = "lock"
    known_fields: InitVar[frozenset[str]] = KNOWN_FIELDS

    def __post_init__(self, path: str, known_fields: frozenset[str]) -> None:
        _init_rule(self, path, known_fields)
        check_kernel_id(self.kernel, f"{path}.kernel")

    def applies(self, op: str, fields: Mapping[str, Any]) -> bool:
        """True when this lock is in force for ``op`` and ``fields``."""
        return fnmatchcase(op, self.op) and self.when.matches(fields)

    def matches(self, op: str, kernel_id: str, backend_id: str, fields: Mapping[str, Any]) -> bool:
        """True when this lock is in force and names ``kernel_id`` (``backend_id`` is unused)."""
        return kernel_id == self.kernel and self.applies(op, fields)

    def to_data(self) -> dict[str, Any]:
        """YAML/JSON-ready form (``when`` omitted when empty)."""
        return _data({"op": self.op, "kernel": self.kernel}, self.when)

    def canonical(self) -> dict[str, Any]:
        """Normal form used by :attr:`Policy.hash <layerzero.core.policy.Policy.hash>`."""
        return {"op": self.op, "kernel": self.kernel, "when": self.when.canonical()}


class _PatternRule:
    """Shared behaviour of the rules holding kernel/backend globs (allow, deny, boost)."""

    __slots__ = ()
    op: str
    kernels: tuple[str, ...]
    when: When

    def applies(self, op: str, fields: Mapping[str, Any]) -> bool:
        """True when the rule's op glob and ``when`` match (whatever the kernel)."""
        return fnmatchcase(op, self.op) and self.when.matches(fields)

    def covers(self, kernel_id: str, backend_id: str) -> bool:
        """True when a glob of ``kernels`` matches ``kernel_id`` or ``backend_id``."""
        return any(fnmatchcase(kernel_id, p) or fnmatchcase(backend_id, p) for p in self.kernels)

    def matches(self, op: str, kernel_id: str, backend_id: str, fields: Mapping[str, Any]) -> bool:
        """True when the rule applies to ``op``/``fields`` and covers the kernel."""
        return self.covers(kernel_id, backend_id) and self.applies(op, fields)

    def to_data(self) -> dict[str, Any]:
        """YAML/JSON-ready form (``when`` omitted when empty)."""
        base: dict[str, Any] = {"op": self.op, "kernels": list(self.kernels)}
        if isinstance(self, BoostRule):
            base["by"] = self.by
        return _data(base, self.when)

    def canonical(self) -> dict[str, Any]:
        """Normal form used by the policy hash: kernel globs sorted, ``when`` canonical."""
        out: dict[str, Any] = {"op": self.op, "kernels": sorted(self.kernels), "when": self.when.canonical()}
        if isinstance(self, BoostRule):
            out["by"] = int(self.by) if self.by.is_integer() else self.by
        return out


@dataclass(frozen=True, slots=True)
class _GlobRule(_PatternRule):
    op: str
    kernels: tuple[str, ...]
    when: When = EMPTY_WHEN
    origin: str = field(default="", compare=False)
    path: InitVar[str] = "rule"
    known_fields: InitVar[frozenset[str]] = KNOWN_FIELDS

    def __post_init__(self, path: str, known_fields: frozenset[str]) -> None:
        _init_rule(self, path, known_fields)


@dataclass(frozen=True, slots=True)
class AllowRule(_GlobRule):
    """``AllowRule(op, kernels, when={}, origin="")``: where it applies to an op and context, kernels matching
    none of ``kernels`` are excluded (``POLICY_NOT_ALLOWED``); several applying allow rules intersect.
    Raises ``PolicyValidationError``."""

    path: InitVar[str] = "allow"
    known_fields: InitVar[frozenset[str]] = KNOWN_FIELDS


@dataclass(frozen=True, slots=True)
class DenyRule(_GlobRule):
    """``DenyRule(op, kernels, when={}, origin="")``: kernels matching ``kernels`` are excluded
    (``POLICY_DENIED``) where the rule applies. Raises ``PolicyValidationError``."""

    path: InitVar[str] = "deny"
    known_fields: InitVar[frozenset[str]] = KNOWN_FIELDS


@dataclass(frozen=True, slots=True)
class BoostRule(_PatternRule):
    """Add ``by`` score points (a finite number, may be negative; stored as float) to matching kernels;
    boosts of all matching rules sum. A boost never forces: a boosted kernel that cannot run is skipped.
    Raises ``PolicyValidationError``."""

    op: str
    kernels: tuple[str, ...]
    by: float
    when: When = EMPTY_WHEN
    origin: str = field(default="", compare=False)
    path: InitVar[str] = "boost"
    known_fields: InitVar[frozenset[str]] = KNOWN_FIELDS

    def __post_init__(self, path: str, known_fields: frozenset[str]) -> None:
        _init_rule(self, path, known_fields)
        if not _is_number(self.by) or not math.isfinite(self.by):
            raise PolicyValidationError(
                expected_got(f"{path}.by", "a finite number of score points", short(self.by))
            )
        object.__setattr__(self, "by", float(self.by))


_RULE_KEYS: Mapping[str, tuple[type, tuple[str, ...], frozenset[str]]] = MappingProxyType(
    {
        "locks": (LockRule, ("op", "kernel", "when"), frozenset({"kernel"})),
        "allow": (AllowRule, ("op", "kernels", "when"), frozenset({"kernels"})),
        "deny": (DenyRule, ("op", "kernels", "when"), frozenset({"kernels"})),
        "boosts": (BoostRule, ("op", "kernels", "by", "when"), frozenset({"kernels", "by"})),
    }
)
RULE_SECTIONS: tuple[str, ...] = tuple(_RULE_KEYS)


def parse_rules(section: str, value: Any, source: str, known_fields: frozenset[str] = KNOWN_FIELDS) -> tuple:
    """Parse one top-level list (``locks``/``allow``/``deny``/``boosts``) into rule objects.

    ``None`` counts as an empty list; ``op`` defaults to ``"*"``. Each rule's ``origin`` is
    ``"<source>: <section>[i]"``. Raises ``PolicyValidationError`` with the path of the first bad entry.
    """
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise PolicyValidationError(expected_got(section, "a list of rules", type_name(value)))
    cls, keys, required = _RULE_KEYS[section]
    rules = []
    for i, entry in enumerate(value):
        path = f"{section}[{i}]"
        if not isinstance(entry, Mapping):
            raise PolicyValidationError(expected_got(path, "a mapping (one rule)", type_name(entry)))
        unknown = [k for k in entry if k not in keys]
        if unknown:
            raise PolicyValidationError(
                expected_got(f"{path}.{str(unknown[0])[:80]}", f"one of {sorted(keys)}", "an unknown key")
                + did_you_mean(str(unknown[0]), keys)
            )
        missing = sorted(required - set(entry))
        if missing:
            raise PolicyValidationError(expected_got(path, f"the key(s) {missing}", f"keys {sorted(entry)}"))
        args = [entry.get(k, "*") if k == "op" else entry.get(k) for k in keys]
        rules.append(cls(*args, f"{source}: {path}", path, known_fields))
    return tuple(rules)
