"""Scoped policy layers: :func:`scoped` pushes a :class:`~layerzero.core.policy.Policy` on top of the
effective policy for the current thread / asyncio task, with :mod:`contextvars` (the Hugging Face kernels
``use_kernel_mapping`` pattern); :func:`layered` merges a base policy with those layers.

This is its own module because the per-context state (one ``ContextVar``) and its lifetime rules are a
concern apart from the immutable :class:`~layerzero.core.policy.Policy` data model, which knows nothing of
scopes. :mod:`.config` reads the layers on every selection (``lz.prefer`` / ``lz.disabled`` push them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar

from .errors import PolicyValidationError, expected_got
from .policy import Policy
from .policy_conditions import type_name

_SCOPE_LAYERS: ContextVar[tuple[Policy, ...]] = ContextVar("layerzero_policy_layers", default=())


@contextlib.contextmanager
def scoped(policy_layer: Policy) -> Iterator[Policy]:
    """Push ``policy_layer`` on top of the policy for the current context (thread / asyncio task) inside the
    ``with`` block; the previous layers come back on exit, even on error. Nested scopes stack (innermost
    wins). New threads start with no layers; asyncio tasks inherit the layers active when they were
    created. Raises ``PolicyValidationError`` when ``policy_layer`` is not a :class:`Policy`.

    >>> with scoped(Policy.prefer(["torch_sdpa.flash"])):
    ...     len(current_scope_layers())
    1
    """
    if not isinstance(policy_layer, Policy):
        raise PolicyValidationError(
            expected_got(
                "scoped(policy_layer)",
                "a Policy",
                type_name(policy_layer),
                "Build one with Policy.from_dict(...) or Policy.prefer(...).",
            )
        )
    token = _SCOPE_LAYERS.set((*_SCOPE_LAYERS.get(), policy_layer))
    try:
        yield policy_layer
    finally:
        _SCOPE_LAYERS.reset(token)


current_scope_layers: Callable[[], tuple[Policy, ...]] = _SCOPE_LAYERS.get
"""The scoped layers of the current context, outermost first (the ``ContextVar.get`` itself, no Python frame).
The tuple is the same object for as long as the scope is unchanged, so callers may memoize on its identity."""


def layered(base: Policy, layers: Sequence[Policy] | None = None) -> Policy:
    """``base`` with ``layers`` (default: :func:`current_scope_layers`, outermost first) merged on top in one
    pass; equal to ``base.merged(l1).merged(l2)...`` but builds one Policy."""
    layers = current_scope_layers() if layers is None else tuple(layers)
    parts = [p for p in (*reversed(layers), base) if not p.is_empty]
    if len(parts) <= 1:
        return parts[0] if parts else base
    return Policy(
        tuple(r for p in parts for r in p.locks),
        tuple(r for p in parts for r in p.allow),
        tuple(r for p in parts for r in p.deny),
        tuple(r for p in parts for r in p.boosts),
        " > ".join(p.source for p in parts),
    )


__all__ = ["current_scope_layers", "layered", "scoped"]
