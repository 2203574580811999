"""Policies: which kernels may run, which are forced, which are preferred — from YAML, the environment or
code.

A :class:`Policy` holds four lists of rules (see :mod:`layerzero.core.policy_schema` and
``docs/policies.md``): ``locks`` force one kernel (first matching lock wins), ``allow`` restricts the
candidates, ``deny`` removes candidates, ``boosts`` add score points. Policies are immutable; layers are
combined with :meth:`Policy.merged` (the argument wins). Pushing a layer for the current thread / asyncio task
(``scoped``, ``layered``, ``current_scope_layers``) lives in :mod:`.policy_scope`.

YAML is read by :mod:`.policy_yaml` (``yaml.safe_load`` semantics only, after a guarded pre-scan: oversized
documents, deep nesting, explicit tags, duplicate keys and alias bombs are rejected with
:class:`~layerzero.core.errors.PolicyValidationError`); its names (:func:`safe_load_yaml`,
:func:`check_budget`, :data:`MAX_POLICY_BYTES`, :data:`MAX_DEPTH`, :data:`MAX_NODES`) are re-exported here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import PolicyValidationError, did_you_mean, expected_got
from .policy_schema import (
    FIELD_KINDS,
    KNOWN_FIELDS,
    RULE_SECTIONS,
    AllowRule,
    BoostRule,
    Condition,
    DenyRule,
    FieldKind,
    LockRule,
    When,
    check_pattern,
    parse_rules,
    short,
    type_name,
)
from .policy_yaml import MAX_DEPTH, MAX_NODES, MAX_POLICY_BYTES, check_budget, safe_load_yaml
from .reasons import Reason, ReasonCode

if TYPE_CHECKING:
    from .env import EnvSettings

POLICY_VERSION = 1  #: the only schema version understood
_TOP_KEYS = frozenset({"version", *RULE_SECTIONS})


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _as_tuple(value: Iterable[Any], cls: type, name: str) -> tuple[Any, ...]:
    items = tuple(value)
    for i, item in enumerate(items):
        if not isinstance(item, cls):
            raise PolicyValidationError(expected_got(f"Policy.{name}[{i}]", cls.__name__, type_name(item)))
    return items


@dataclass(frozen=True, slots=True, eq=False)
class Policy:
    """An immutable set of policy rules. Equality and ``hash()`` follow :attr:`hash` (the rules' meaning).

    ``locks``: tuple of :class:`LockRule`, first match wins. ``allow``/``deny``/``boosts``: tuples of
    :class:`AllowRule`/:class:`DenyRule`/:class:`BoostRule` (order irrelevant). ``source`` names where it
    came from (a path, ``"env"``, ``"lz.lock"``); it is not part of equality. Raises
    ``PolicyValidationError`` when a list holds something that is not a rule of its kind.
    """

    locks: tuple[LockRule, ...] = ()
    allow: tuple[AllowRule, ...] = ()
    deny: tuple[DenyRule, ...] = ()
    boosts: tuple[BoostRule, ...] = ()
    source: str = "<policy>"
    _hash: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name, cls in (
            ("locks", LockRule),
            ("allow", AllowRule),
            ("deny", DenyRule),
            ("boosts", BoostRule),
        ):
            object.__setattr__(self, name, _as_tuple(getattr(self, name), cls, name))

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def empty(cls) -> Policy:
        """A policy with no rules (everything allowed, nothing forced, no boosts)."""
        return cls(source="<empty>")

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, source: str = "<dict>", known_fields: frozenset[str] = KNOWN_FIELDS
    ) -> Policy:
        """Build a policy from plain data ``{"version": 1, "locks": [...], "allow": [...], ...}``.

        ``known_fields`` are the field names ``when:`` may use (default :data:`KNOWN_FIELDS`). Raises
        ``PolicyValidationError`` ("<source>: deny[2].when.head_dim: expected ..., got ...") for a missing or
        unknown version, unknown keys, wrong types, empty kernel lists, bad comparisons or oversized data.
        """
        try:
            check_budget(data, "policy")
            if not isinstance(data, Mapping):
                raise PolicyValidationError(
                    expected_got("policy", "a mapping with 'version: 1'", type_name(data))
                )
            for key in data:
                if key not in _TOP_KEYS:
                    raise PolicyValidationError(
                        expected_got(
                            f"top-level key {short(key)}", f"one of {sorted(_TOP_KEYS)}", "an unknown key"
                        )
                        + did_you_mean(str(key), _TOP_KEYS)
                    )
            version = data.get("version")
            if isinstance(version, bool) or version != POLICY_VERSION:
                raise PolicyValidationError(
                    expected_got(
                        "version",
                        f"{POLICY_VERSION} (required)",
                        short(version),
                        "Start the policy with 'version: 1'.",
                    )
                )
            sections = {
                name: parse_rules(name, data.get(name), source, known_fields) for name in RULE_SECTIONS
            }
        except PolicyValidationError as exc:
            raise PolicyValidationError(f"{source}: {exc}") from None
        return cls(sections["locks"], sections["allow"], sections["deny"], sections["boosts"], source)

    @classmethod
    def from_yaml(
        cls,
        text_or_path: str | bytes | os.PathLike[str],
        *,
        source: str | None = None,
        known_fields: frozenset[str] = KNOWN_FIELDS,
    ) -> Policy:
        """Parse a YAML policy. A ``str`` that names an existing file is read as a path (so is any
        ``os.PathLike``); any other ``str`` and all ``bytes`` are YAML text. See :func:`safe_load_yaml` for
        the safety limits. Raises ``PolicyValidationError`` (an empty document is an error too)."""
        data, src = safe_load_yaml(text_or_path)
        src = source or src
        if data is None:
            raise PolicyValidationError(
                expected_got(src, "a policy document", "an empty document", "Write at least 'version: 1'.")
            )
        return cls.from_dict(data, source=src, known_fields=known_fields)

    @classmethod
    def from_settings(cls, settings: EnvSettings, *, known_fields: frozenset[str] = KNOWN_FIELDS) -> Policy:
        """The environment layer from parsed :class:`~layerzero.core.env.EnvSettings`: the
        ``LAYERZERO_POLICY`` file, overridden by ``LAYERZERO_LOCK`` / ``ALLOW`` / ``DENY`` / ``PREFER`` (boost
        1000 each) and ``LAYERZERO_DISABLED`` (reference kernels only). Raises ``PolicyValidationError``."""
        base = (
            Policy.empty()
            if settings.policy_path is None
            else cls.from_yaml(pathlib.Path(settings.policy_path), known_fields=known_fields)
        )
        layer = cls(
            locks=tuple(LockRule(op, kernel, origin="LAYERZERO_LOCK") for op, kernel in settings.locks),
            allow=(AllowRule("*", settings.allow, origin="LAYERZERO_ALLOW"),) if settings.allow else (),
            deny=(DenyRule("*", settings.deny, origin="LAYERZERO_DENY"),) if settings.deny else (),
            boosts=tuple(BoostRule("*", (p,), 1000.0, origin="LAYERZERO_PREFER") for p in settings.prefer),
            source="env",
        )
        if settings.disabled:
            layer = layer.merged(cls.reference_only())
        return base.merged(layer)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, known_fields: frozenset[str] = KNOWN_FIELDS
    ) -> Policy:
        """:meth:`from_settings` of :func:`layerzero.core.env.read_env` (``os.environ`` when None). Raises
        ``ConfigurationError`` for a malformed variable, ``PolicyValidationError`` for a bad policy file."""
        from .env import read_env

        return cls.from_settings(
            read_env(os.environ if environ is None else environ), known_fields=known_fields
        )

    @classmethod
    def prefer(cls, ids: str | Iterable[str], by: float = 1000.0) -> Policy:
        """Boost each kernel id / backend id / glob in ``ids`` by ``by`` score points for every op (one rule
        per id, so a kernel matching both its id and its backend gets both). A boost never forces: a kernel
        that cannot run is skipped. Raises ``PolicyValidationError`` for no ids, bad ids or a non-finite
        ``by``."""
        items = (ids,) if isinstance(ids, str) else tuple(ids)
        if not items:
            raise PolicyValidationError(
                expected_got("Policy.prefer(ids)", "at least one kernel/backend id", "none")
            )
        rules = tuple(
            BoostRule("*", (check_pattern(i, f"Policy.prefer(ids)[{n}]"),), by, origin="Policy.prefer")
            for n, i in enumerate(items)
        )
        return cls(boosts=rules, source="prefer")

    @classmethod
    def reference_only(cls) -> Policy:
        """Allow only kernels of the ``reference`` backend, for every op (the ``LAYERZERO_DISABLED`` switch).

        Expressed as an allow rule (globs cannot negate), so other kernels get ``POLICY_NOT_ALLOWED``."""
        return cls(
            allow=(AllowRule("*", ("reference",), origin="reference_only (LayerZero disabled)"),),
            source="reference_only",
        )

    # ---- combination and queries ----------------------------------------------------------------------
    @property
    def is_empty(self) -> bool:
        """True when the policy has no rules."""
        return not (self.locks or self.allow or self.deny or self.boosts)

    def merged(self, other: Policy) -> Policy:
        """``other`` layered on top: its locks are checked first, the other lists are concatenated
        (allow/deny only narrow; boosts add). Returns ``self``/``other`` unchanged when the other is empty."""
        if not isinstance(other, Policy):
            raise PolicyValidationError(expected_got("Policy.merged(other)", "a Policy", type_name(other)))
        if other.is_empty:
            return self
        if self.is_empty:
            return other
        return Policy(
            other.locks + self.locks,
            other.allow + self.allow,
            other.deny + self.deny,
            other.boosts + self.boosts,
            f"{other.source} > {self.source}",
        )

    def lock_for(self, op: str, fields: Mapping[str, Any]) -> LockRule | None:
        """The first lock in force for ``op`` and the context ``fields``, or None."""
        for rule in self.locks:
            if rule.applies(op, fields):
                return rule
        return None

    def reasons_against(
        self, op: str, kernel_id: str, backend_id: str, fields: Mapping[str, Any]
    ) -> list[Reason]:
        """Every policy reason ``kernel_id`` (of ``backend_id``) may not run ``op`` in context ``fields``:
        ``POLICY_DENIED`` per matching deny rule, ``POLICY_NOT_ALLOWED`` per allow rule that applies but does
        not cover the kernel. Empty when permitted. Locks are not consulted (see :meth:`lock_for`)."""
        out: list[Reason] = []
        for rule in self.deny:
            if rule.matches(op, kernel_id, backend_id, fields):
                out.append(
                    Reason(
                        ReasonCode.POLICY_DENIED,
                        f"{kernel_id} is denied by {rule.origin or self.source} "
                        f"(kernels {list(rule.kernels)}{_when_text(rule.when)})",
                    )
                )
        for rule in self.allow:
            if rule.applies(op, fields) and not rule.covers(kernel_id, backend_id):
                out.append(
                    Reason(
                        ReasonCode.POLICY_NOT_ALLOWED,
                        f"{kernel_id} is not in the allow list of {rule.origin or self.source} "
                        f"(kernels {list(rule.kernels)}{_when_text(rule.when)})",
                    )
                )
        return out

    def boost(self, op: str, kernel_id: str, backend_id: str, fields: Mapping[str, Any]) -> float:
        """Sum (exact, order-independent: :func:`math.fsum`) of ``by`` over matching boost rules, in score
        points."""
        if not self.boosts:
            return 0.0
        return math.fsum(r.by for r in self.boosts if r.matches(op, kernel_id, backend_id, fields))

    def kernel_ids(self) -> set[str]:
        """Exact kernel ids (``backend.name``, no globs) the policy names, to validate against the
        registry."""
        ids = {rule.kernel for rule in self.locks}
        for rule in (*self.allow, *self.deny, *self.boosts):
            ids.update(p for p in rule.kernels if "." in p and not _is_glob(p))
        return ids

    def backend_ids(self) -> set[str]:
        """Exact backend ids (no dot, no globs) named in ``kernels`` lists."""
        return {
            p
            for rule in (*self.allow, *self.deny, *self.boosts)
            for p in rule.kernels
            if "." not in p and not _is_glob(p)
        }

    # ---- serialization and identity --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data that :meth:`from_dict` turns back into an equal policy (rules as written)."""
        return {
            "version": POLICY_VERSION,
            **{name: [r.to_data() for r in getattr(self, name)] for name in RULE_SECTIONS},
        }

    def canonical(self) -> dict[str, Any]:
        """Normal form: lock order kept (first match wins); allow/deny/boosts sorted (their order has no
        effect); kernel globs sorted; common condition spellings unified (``"==64"`` = ``64``)."""

        def ordered(rules: Sequence[Any]) -> list[Any]:
            forms = [r.canonical() for r in rules]
            return sorted(forms, key=lambda f: json.dumps(f, sort_keys=True))

        return {
            "version": POLICY_VERSION,
            "locks": [r.canonical() for r in self.locks],
            "allow": ordered(self.allow),
            "deny": ordered(self.deny),
            "boosts": ordered(self.boosts),
        }

    @property
    def hash(self) -> str:
        """sha256 hex of the canonical JSON of :meth:`canonical` (computed once, then cached). Equal rules
        give equal hashes in every process; ``source`` and rule origins are not included."""
        value = self._hash
        if value is None:
            text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
            value = hashlib.sha256(text.encode("ascii")).hexdigest()
            object.__setattr__(self, "_hash", value)
        return value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return self is other or self.hash == other.hash

    def __hash__(self) -> int:
        return hash(self.hash)


def _when_text(when: When) -> str:
    return f" when {when}" if when else ""


__all__ = [
    "FIELD_KINDS",
    "KNOWN_FIELDS",
    "MAX_DEPTH",
    "MAX_NODES",
    "MAX_POLICY_BYTES",
    "POLICY_VERSION",
    "AllowRule",
    "BoostRule",
    "Condition",
    "DenyRule",
    "FieldKind",
    "LockRule",
    "Policy",
    "When",
    "check_budget",
    "safe_load_yaml",
]
