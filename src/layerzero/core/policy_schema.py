"""Policy schema: the four rule kinds (lock, allow, deny, boost) and the table that parses them from data.

Turns plain data (what ``yaml.safe_load`` returns) into frozen, validated rules and matches them against a
selection context given as a ``Mapping[str, Any]`` of primitive values ("fields"). Globs are case-sensitive
:func:`fnmatch.fnmatchcase` patterns; ``kernels`` globs match the kernel id *or* the backend id. A rule's
``when:`` clause is parsed and matched by :mod:`.policy_conditions` (scalars, string globs, comparisons such
as ``"<=128"``, inclusive ranges such as ``"64..256"``, or lists of those; ``None`` / absent values never
match); its names are re-exported here. The full reference is ``docs/policies.md``. The context fields and
their kinds (:data:`FIELD_KINDS`) are derived from ``SelectionContext`` in :mod:`.policy_fields`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any

from .errors import PolicyValidationError, did_you_mean, expected_got
from .policy_conditions import (
    EMPTY_WHEN,
    FIELD_KINDS,
    KNOWN_FIELDS,
    Condition,
    ConditionKind,
    FieldKind,
    When,
    is_number,
    parse_condition,
    parse_when,
    short,
    type_name,
)

_PATTERN_RE = re.compile(r"[A-Za-z0-9_.*?\[\]!\-]{1,200}")
_KERNEL_ID_RE = re.compile(r"[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)+")


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
        if not is_number(self.by) or not math.isfinite(self.by):
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


__all__ = [  # the rules, and the condition names re-exported from .policy_conditions
    "EMPTY_WHEN",
    "FIELD_KINDS",
    "KNOWN_FIELDS",
    "RULE_SECTIONS",
    "AllowRule",
    "BoostRule",
    "Condition",
    "ConditionKind",
    "DenyRule",
    "FieldKind",
    "LockRule",
    "When",
    "check_kernel_id",
    "check_pattern",
    "parse_condition",
    "parse_rules",
    "parse_when",
    "short",
    "type_name",
]
