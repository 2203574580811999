"""Tuning knobs: each kernel module's launch-configuration choices as one frozen, typed dataclass, registered
by name.

A module that has tuning choices (tile sizes, split rules, warps, which kernel form to use) defines
``@dataclass(frozen=True, slots=True) class XKnobs`` whose field defaults are the measured choices, and at
import calls ``register("triton.paged_decode", XKnobs())``. Its launch-configuration code reads ``get(name)``
(a dict lookup) once per plan or launch decision. Users change knobs with :func:`configure_knobs`
(process-wide, until changed again or :func:`reset_knobs`) or for a block with :func:`knobs` (restored on
exit, also on an exception). Every change is checked (known field, value of the field's type, the class's own
range checks) and bumps :func:`knobs_generation`; modules that cache launch plans built from their knobs
:func:`subscribe` to drop them.

Knobs are process-wide, not per thread or context (``contextvars``): a plan built in one thread is replayed by
another, and CUDA graphs freeze whatever a capture saw, so a knob must mean one thing in the whole process.
Change them before building an engine or capturing graphs; graphs captured earlier keep the old choices.

The kernel modules register when imported, which ``import layerzero`` does not do; the package above ``core``
installs a loader (:func:`install_loader`) that imports them on the first lookup of a name not registered yet,
so ``configure_knobs("triton.gemv", ...)`` works before any op call. Measurements behind the defaults:
``benchmarks/results/knobs/<module>.md``. The serving engine's CUDA-graph knobs are not here: they are a field
of its config (``layerzero.engine.config.CudaGraphKnobs``).
"""

from __future__ import annotations

import dataclasses
import threading
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .errors import ConfigurationError, did_you_mean, expected_got

__all__ = [
    "check_types",
    "configure_knobs",
    "default_knobs",
    "get",
    "install_loader",
    "knobs",
    "knobs_generation",
    "register",
    "registered",
    "replace_knobs",
    "require",
    "reset_knobs",
    "subscribe",
]

_CURRENT: dict[str, Any] = {}
"""name -> the knobs in force (read by :func:`get`)."""
_DEFAULTS: dict[str, Any] = {}
_LISTENERS: dict[str, list[Callable[[], None]]] = {}
_HINTS: dict[type, dict[str, Any]] = {}
_LOCK = threading.RLock()
_GENERATION = [0]
_LOADER: list[Callable[[], None] | None] = [None]
"""The loader :func:`install_loader` installed, until it has run (then None)."""


def install_loader(loader: Callable[[], None]) -> None:
    """Install ``loader`` (imports the modules that register knobs), run once, on the first lookup of a name
    that is not registered (and by :func:`registered`). Installed by the package above ``core`` (``core``
    names no module above it)."""
    _LOADER[0] = loader


def _load() -> None:
    """Run the installed loader, once."""
    loader, _LOADER[0] = _LOADER[0], None
    if loader is not None:
        loader()


def register(name: str, default: Any) -> None:
    """Register ``default`` (a frozen dataclass instance) as the knobs of ``name`` (``"triton.paged_decode"``,
    ...); it is also the value in force until changed. Called once by the owning module at import; registering
    the same class again (a module reload) replaces the default and resets the value.

    Raises:
        ConfigurationError: ``default`` is not a frozen dataclass instance, a field's value does not match its
            annotation, or ``name`` is already registered with another class.
    """
    if not (
        dataclasses.is_dataclass(default)
        and not isinstance(default, type)
        and default.__dataclass_params__.frozen
    ):  # type: ignore[attr-defined]
        raise ConfigurationError(
            expected_got(
                f"knobs {name!r}",
                "a frozen dataclass instance",
                type(default).__name__,
                "Declare the class with @dataclass(frozen=True, slots=True).",
            )
        )
    check_types(default)
    with _LOCK:
        old = _DEFAULTS.get(name)
        if old is not None and _qualname(type(old)) != _qualname(type(default)):
            raise ConfigurationError(
                expected_got(
                    f"knobs {name!r}",
                    f"one class ({_qualname(type(old))})",
                    f"a second one, {_qualname(type(default))}",
                    "Register each module's knobs under its own name.",
                )
            )
        _DEFAULTS[name] = default
        _install(name, default)


def get(name: str) -> Any:
    """The knobs of ``name`` in force now (a frozen dataclass instance; cheap: one dict lookup).

    Raises:
        ConfigurationError: ``name`` is not registered (the message lists the registered names; a module
            registers its knobs when it is imported).
    """
    try:
        return _CURRENT[name]
    except KeyError:
        _load()
        if name in _CURRENT:
            return _CURRENT[name]
        raise _unknown(name) from None


def default_knobs(name: str) -> Any:
    """The registered defaults of ``name`` (what :func:`reset_knobs` restores). Raises as :func:`get`."""
    get(name)
    return _DEFAULTS[name]


def registered() -> tuple[str, ...]:
    """The registered knob names, sorted (the installed loader run first, if it has not run yet)."""
    _load()
    return tuple(sorted(_CURRENT))


def knobs_generation() -> int:
    """A counter bumped by every change of any knobs (register, configure, replace, reset, a :func:`knobs`
    block's entry and exit): a cache keyed on it is stale when it differs."""
    return _GENERATION[0]


def configure_knobs(name: str, **fields: Any) -> Any:
    """Change some fields of ``name``'s knobs (the others keep their current values), process-wide; returns
    the new instance. Plans cached from the old values are dropped; CUDA graphs already captured keep them.

    >>> from layerzero.backends.triton import paged  # registers "triton.paged_decode"
    >>> configure_knobs("triton.paged_decode", max_splits=16).max_splits
    16
    >>> reset_knobs("triton.paged_decode").max_splits
    32

    Raises:
        ConfigurationError: ``name`` is not registered; a field that the knobs do not have (the message lists
            the known fields); a value of the wrong type (expected vs got) or out of the field's range.
            Nothing changes then.
    """
    with _LOCK:
        new = _replaced(name, get(name), fields)
        _install(name, new)
        return new


def replace_knobs(name: str, value: Any) -> Any:
    """Put a whole knobs instance (of the registered class: built from :func:`get` with
    ``dataclasses.replace``, or saved earlier) in force for ``name``; returns it. Raises
    ``ConfigurationError`` as :func:`configure_knobs`, and for an instance of another class."""
    with _LOCK:
        cls = type(default_knobs(name))
        if type(value) is not cls:
            raise ConfigurationError(
                expected_got(
                    f"knobs {name!r}",
                    f"a {cls.__name__} instance",
                    type(value).__name__,
                    f"Build it with {cls.__name__}(...) or dataclasses.replace(get({name!r}), ...).",
                )
            )
        check_types(value)
        _install(name, value)
        return value


def reset_knobs(name: str | None = None) -> Any:
    """Restore ``name``'s defaults (every registered module's with None); returns the restored instance (None
    for all). Raises ``ConfigurationError`` for an unregistered name."""
    with _LOCK:
        for key in tuple(_CURRENT) if name is None else (name,):
            _install(key, default_knobs(key))
    return None if name is None else _CURRENT[name]


@contextmanager
def knobs(name: str, **fields: Any) -> Iterator[Any]:
    """``with knobs("triton.gemv", prefetch=False) as k:``: :func:`configure_knobs` for the block, then the
    knobs in force before it are put back, also when the block raises. For tests and A/B benchmarks;
    process-wide while it lasts (not per thread).

    Raises:
        ConfigurationError: as :func:`configure_knobs`, on entry (nothing changed then).
    """
    with _LOCK:
        before = get(name)
        new = configure_knobs(name, **fields)
    try:
        yield new
    finally:
        with _LOCK:
            _install(name, before)


ANY = "*"
"""The name :func:`subscribe` takes to hear every module's changes (the package's wiring invalidates cached
selections then, as ``lz.configure`` does: a selection check may read a knob)."""


def subscribe(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` after every change of ``name``'s knobs (a module clears its cached launch plans),
    or of any module's with :data:`ANY`. The name need not be registered yet."""
    with _LOCK:
        _LISTENERS.setdefault(name, []).append(callback)


def check_types(obj: Any) -> None:
    """Check every field of the dataclass instance ``obj`` against its annotation (bool, int, float, str,
    None, ``X | Y``, ``Literal[...]``, ``tuple[X, ...]``, ``tuple[X, Y]``, ``frozenset[X]``); a knobs class
    calls it from ``__post_init__``. An int passes for a float; a bool never passes for an int.

    Raises:
        ConfigurationError: naming the class, the field, the expected type and what was got.
    """
    cls = type(obj)
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        hint = hints[f.name]
        if not _matches(value, hint):
            raise ConfigurationError(
                expected_got(
                    f"{cls.__name__}.{f.name}",
                    _type_name(hint),
                    f"{value!r} ({type(value).__name__})",
                    f"The default is {f.default!r}.",
                )
            )


def require(ok: bool, obj: Any, field: str, expected: str) -> None:
    """A knobs class's range check: unless ``ok``, raise ``ConfigurationError`` ``"<Class>.<field>: expected
    <expected>, got <value>"``."""
    if not ok:
        raise ConfigurationError(
            expected_got(
                f"{type(obj).__name__}.{field}",
                expected,
                repr(getattr(obj, field)),
                f"The default is {_field_default(obj, field)!r}.",
            )
        )


def _field_default(obj: Any, field: str) -> Any:
    return next(f.default for f in dataclasses.fields(obj) if f.name == field)


def _replaced(name: str, current: Any, fields: dict[str, Any]) -> Any:
    """``dataclasses.replace(current, **fields)`` with unknown fields reported by name."""
    known = [f.name for f in dataclasses.fields(current)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ConfigurationError(
            expected_got(
                f"knobs {name!r}",
                f"fields of {type(current).__name__}",
                f"unknown field(s) {unknown}",
                "Nothing was changed." + did_you_mean(unknown[0], known),
            )
        )
    try:
        return dataclasses.replace(current, **fields)  # runs __post_init__: type and range checks
    except TypeError as exc:  # e.g. a field declared init=False
        raise ConfigurationError(f"knobs {name!r}: {exc}") from exc


def _install(name: str, value: Any) -> None:
    with _LOCK:
        _CURRENT[name] = value
        _GENERATION[0] += 1
        listeners = list(_LISTENERS.get(name, ())) + list(_LISTENERS.get(ANY, ()))
    for callback in listeners:
        callback()


def _unknown(name: str) -> ConfigurationError:
    return ConfigurationError(
        expected_got(
            "knobs name",
            "a registered name",
            repr(name),
            "A module registers its knobs when it is imported (e.g. "
            "layerzero.backends.triton.paged)." + did_you_mean(str(name), _CURRENT),
        )
    )


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotated type ``hint`` (the forms :func:`check_types` lists)."""
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args, strict=True))
    if origin is frozenset:
        return isinstance(value, frozenset) and all(_matches(v, args[0]) for v in value)
    raise ConfigurationError(
        f"knobs: the annotation {hint!r} is not one check_types knows (bool, int, float, str, "
        "None, unions, Literal, tuples, frozensets); use one of those"
    )


def _type_name(hint: Any) -> str:
    """``hint`` as written in an annotation (``bool | 'auto'``, ``tuple[int, ...]``)."""
    if hint is type(None) or hint is None:
        return "None"
    if isinstance(hint, type):
        return hint.__name__
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (tuple, frozenset):
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    return str(hint).replace("typing.", "")
