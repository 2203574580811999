"""The engine's error helpers: LayerZero's public typed errors with the house message style
(``"<what>: expected <expected>, got <got>. <how to fix>"``)."""

from __future__ import annotations

from typing import Any

import layerzero as lz

__all__ = ["bad_config", "bad_input"]


def _message(what: str, expected: Any, got: Any, fix: str | None) -> str:
    msg = f"{what}: expected {expected}, got {got}."
    return f"{msg} {fix}" if fix else msg


def bad_input(what: str, expected: Any, got: Any, fix: str | None = None) -> lz.InvalidInputError:
    """An :class:`layerzero.InvalidInputError` (a ``ValueError``) for a bad request or parameter."""
    return lz.InvalidInputError(_message(what, expected, got, fix))


def bad_config(what: str, expected: Any, got: Any, fix: str | None = None) -> lz.ConfigurationError:
    """A :class:`layerzero.ConfigurationError` (a ``ValueError``) for a bad engine option or checkpoint."""
    return lz.ConfigurationError(_message(what, expected, got, fix))
