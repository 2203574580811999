"""Names a policy uses, checked against the registry: unknown ops, kernels and backends are errors, not
no-ops.

A rule whose op glob matches no registered op, a lock on a kernel that is not registered (or serves another
op), or a ``kernels`` entry (id, backend id or glob) that matches no registered kernel or backend would
silently never apply. Backends register lazily (on first use) and custom kernels may be registered after a
policy is loaded, so the check runs when the policy is *used*: :func:`layerzero.core.config.effective_policy`
calls :func:`check_policy_names` on the base policy (file, environment, ``lz.lock`` layers) once per change of
the policy or the registry, before any selection. A known backend that is unavailable here (flashinfer on a
CPU machine) is registered, so its names are accepted.

Errors name the rule's origin, the unknown name, the closest known one and the known names: rules from the
``LAYERZERO_*`` environment raise :class:`UnknownOperationError` / :class:`UnknownKernelError` (the
``ConfigurationError`` of environment variables, as ``lz.prefer`` does for the same mistake); rules from a
policy file or dict raise :class:`PolicyValidationError`.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from .errors import (
    ConfigurationError,
    PolicyValidationError,
    UnknownKernelError,
    UnknownOperationError,
    did_you_mean,
)

if TYPE_CHECKING:
    from .policy import Policy
    from .registry import KernelRegistry

ENV_ORIGINS = frozenset({"LAYERZERO_LOCK", "LAYERZERO_ALLOW", "LAYERZERO_DENY", "LAYERZERO_PREFER"})
"""Origins of the rules built from environment variables (``Policy.from_settings``)."""


def unknown_pattern_message(where: str, pattern: str, known: Iterable[str]) -> str:
    """``"<where>: 'x' matches no kernel or backend id. Did you mean ...? Known: [...]."`` (shared with
    ``lz.prefer``)."""
    return f"{where}: {pattern!r} matches no kernel or backend id.{did_you_mean(pattern, known)}"


def _matches(pattern: str, names: Iterable[str]) -> bool:
    return any(fnmatchcase(name, pattern) for name in names)


def _error(origin: str, message: str, kind: type[ConfigurationError]) -> Exception:
    if origin in ENV_ORIGINS:
        return kind(message + f" Fix or unset {origin}.")
    return PolicyValidationError(
        message + " Fix the policy (names are checked against the registered ops, kernels "
        "and backends: `layerzero list-kernels` or lz.list_kernels() lists them)."
    )


def check_policy_names(policy: Policy, registry: KernelRegistry) -> None:
    """Raise when a rule of ``policy`` names an op, kernel or backend that ``registry`` does not know.

    Checked: every rule's ``op`` glob matches a registered op; a lock's kernel is registered and serves an op
    the lock's glob matches; every ``kernels`` entry of allow/deny/boost rules matches a registered kernel id
    or backend id. Raises ``UnknownOperationError`` / ``UnknownKernelError`` for rules from ``LAYERZERO_*``
    variables, ``PolicyValidationError`` for the others (see the module docstring).
    """
    ops = list(registry.ops)
    kernels: dict[str, Any] = {spec.kernel_id: spec for spec in registry.kernels.values()}
    ids = [*kernels, *registry.backends]
    for rule in (*policy.locks, *policy.allow, *policy.deny, *policy.boosts):
        origin = rule.origin or policy.source
        if not _matches(rule.op, ops):
            raise _error(
                origin,
                f"{origin}: op {rule.op!r} matches no registered op.{did_you_mean(rule.op, ops)}",
                UnknownOperationError,
            )
        if hasattr(rule, "kernel"):
            spec = kernels.get(rule.kernel)
            if spec is None:
                raise _error(
                    origin,
                    f"{origin}: lock kernel {rule.kernel!r} is not a registered kernel."
                    + did_you_mean(rule.kernel, kernels),
                    UnknownKernelError,
                )
            if not fnmatchcase(spec.op, rule.op):
                raise _error(
                    origin,
                    f"{origin}: lock kernel {rule.kernel!r} serves op {spec.op!r}, which the lock's "
                    f"op {rule.op!r} does not match. Kernels of the lock's op(s): "
                    f"{sorted(k for k, s in kernels.items() if fnmatchcase(s.op, rule.op))}.",
                    UnknownKernelError,
                )
            continue
        for pattern in rule.kernels:
            if not _matches(pattern, ids):
                raise _error(origin, unknown_pattern_message(origin, pattern, ids), UnknownKernelError)


__all__ = ["ENV_ORIGINS", "check_policy_names", "unknown_pattern_message"]
