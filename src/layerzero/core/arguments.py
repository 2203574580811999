"""Argument checks at the public edge: ids that must be strings, file paths, and the arguments of an op call.

Used by ``lz.lock`` / ``lz.validate`` / ``lz.register_kernel`` ... (``api.py``), ``lz.tune`` and ``lz.warmup``
so that a wrong type gets a typed LayerZero error naming the argument, expected versus got, instead of a bare
``TypeError`` from deep inside (a dict lookup, ``Path()``, an op's ``prepare``).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

from .errors import ConfigurationError, InvalidInputError, expected_got


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_str(where: str, value: Any, what: str, error: type[ConfigurationError] = ConfigurationError) -> str:
    """Return ``value`` when it is a ``str``; else raise ``error`` saying ``where`` expected ``what`` (a str).

    ``where`` names the argument (``"lz.lock(kernel_id)"``); ``what`` describes it (``"a kernel id like
    'torch_sdpa.math'"``); ``error`` is the :class:`ConfigurationError` subclass to raise (e.g.
    ``UnknownKernelError`` for kernel ids, ``UnknownOperationError`` for op ids)."""
    if not isinstance(value, str):
        raise error(expected_got(where, f"{what} (a str)", f"{type(value).__name__} {_short(value)}"))
    return value


def check_path(where: str, value: Any) -> str | os.PathLike[str]:
    """Return ``value`` when it is a ``str`` or ``os.PathLike``; else raise :class:`ConfigurationError`."""
    if isinstance(value, str | os.PathLike):
        return value
    raise ConfigurationError(
        expected_got(
            where,
            "a file path (str or os.PathLike)",
            f"{type(value).__name__} {_short(value)}",
            "Pass the path of the YAML file.",
        )
    )


@functools.lru_cache(maxsize=64)
def op_signature(prepare: Callable[..., Any]) -> inspect.Signature:
    """The signature of an op's ``prepare`` (the public ``lz.<op>`` arguments), without annotations."""
    sig = inspect.signature(prepare)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=inspect.Signature.empty)


def check_call(
    where: str, op: str, prepare: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Raise :class:`InvalidInputError` when ``lz.<op>(*args, **kwargs)`` cannot bind to the op's arguments
    (missing or extra positional arguments, an unknown keyword such as ``is_casual``); the message names
    ``where`` (e.g. ``"lz.tune('attention') case 2"``) and the op's signature. Nothing is called."""
    sig = op_signature(prepare)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        given = f"{len(args)} positional argument(s) and keywords {sorted(kwargs)}"
        raise InvalidInputError(
            expected_got(
                f"{where}: arguments of lz.{op}",
                f"lz.{op}{sig}",
                f"{given} ({exc})",
                "Check the spelling of the keywords and the number of positional arguments.",
            )
        ) from None


__all__ = ["check_call", "check_path", "check_str", "op_signature"]
