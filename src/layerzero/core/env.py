"""The one module that reads ``LAYERZERO_*`` environment variables.

:func:`read_env` parses them, once, into a typed, frozen :class:`EnvSettings`; nothing is read at import
time. Every malformed value raises :class:`~layerzero.core.errors.ConfigurationError` naming the variable
with expected versus got. An unset or empty (whitespace-only) variable means "not set" and its field is
``None`` (or ``()`` for lists), so callers can tell "not set" from a value. Unknown ``LAYERZERO_*`` names
(typos) are logged as a WARNING and listed in :attr:`EnvSettings.unknown`.
(The pattern follows mini-sglang's ``env.py``.)
"""

from __future__ import annotations

import enum
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

from .errors import ConfigurationError, PolicyValidationError, did_you_mean, expected_got
from .policy_schema import check_kernel_id, check_pattern, short

_log = logging.getLogger("layerzero.env")

PREFIX = "LAYERZERO_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_OP_RE = re.compile(r"[A-Za-z0-9_]{1,100}")


class LogLevel(str, enum.Enum):
    """``LAYERZERO_LOG_LEVEL`` values (case-insensitive). ``.value`` is the :mod:`logging` level name."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"

    @property
    def level(self) -> int:
        """The numeric :mod:`logging` level (``logging.DEBUG`` ...)."""
        return int(getattr(logging, self.value))


@dataclass(frozen=True, slots=True)
class EnvSettings:
    """Typed ``LAYERZERO_*`` settings. ``None`` / ``()`` = the variable is unset or empty.

    Variable (field): meaning (type).

    - ``LAYERZERO_POLICY`` (``policy_path``): path of a YAML policy file; must exist (str)
    - ``LAYERZERO_LOCK`` (``locks``): ``op=kernel_id,...`` locks, e.g. ``attention=torch_sdpa.math`` (tuple of
      (op, kernel_id); one lock per op)
    - ``LAYERZERO_ALLOW`` (``allow``): comma list of kernel/backend globs; only these may run (tuple)
    - ``LAYERZERO_DENY`` (``deny``): comma list of kernel/backend globs that may not run (tuple)
    - ``LAYERZERO_PREFER`` (``prefer``): comma list of kernel/backend globs boosted by 1000 points (tuple)
    - ``LAYERZERO_STRICT`` (``strict``): raise instead of falling back (bool)
    - ``LAYERZERO_DISABLED`` (``disabled``): reference kernels only (bool)
    - ``LAYERZERO_LOG_LEVEL`` (``log_level``): DEBUG / INFO / WARNING / ERROR (:class:`LogLevel`)
    - ``LAYERZERO_PERFDB`` (``perfdb_path``): path of the PerfDB SQLite file; created if missing (str)
    - ``LAYERZERO_USE_PERFDB`` (``use_perfdb``): let measured timings score kernels (bool)
    - ``LAYERZERO_CACHE_SIZE`` (``cache_size``): selection-cache capacity in entries (int > 0)
    - ``LAYERZERO_CACHE_TTL_S`` (``cache_ttl_s``): cache entry lifetime in seconds (float > 0; ``none`` = no
      expiry, read as None like unset)
    - ``LAYERZERO_CAPABILITIES`` (``capabilities_path``): capability-override YAML applied when backends load
      (str)
    - ``LAYERZERO_SHIPPED_TIMINGS`` (``use_shipped_timings``): score with the timings shipped for this device
      model when the PerfDB has nothing for a bucket (bool; default on)
    - ``LAYERZERO_AUTOTUNE`` (``autotune``): measure a new key's kernels on its first eager call (bool)

    Read by the engine and the server themselves (known, not settings here): ``LAYERZERO_API_KEY``,
    ``LAYERZERO_SYMM_MEM``, ``LAYERZERO_WORKER_PROFILE``, ``LAYERZERO_PIECEWISE_MAX_TOKENS``.

    Bools accept ``1/0/true/false/yes/no/on/off`` (case-insensitive). ``unknown`` lists ``LAYERZERO_*``
    names that are not in this list (probably typos).
    """

    policy_path: str | None = None
    locks: tuple[tuple[str, str], ...] = ()
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    prefer: tuple[str, ...] = ()
    strict: bool | None = None
    disabled: bool | None = None
    log_level: LogLevel | None = None
    perfdb_path: str | None = None
    use_perfdb: bool | None = None
    cache_size: int | None = None
    cache_ttl_s: float | None = None
    capabilities_path: str | None = None
    use_shipped_timings: bool | None = None
    autotune: bool | None = None
    unknown: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the fields (for reports and ``layerzero env``)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["locks"] = [list(pair) for pair in self.locks]
        for name in ("allow", "deny", "prefer", "unknown"):
            out[name] = list(out[name])
        out["log_level"] = None if self.log_level is None else self.log_level.value
        return out


def _bad(name: str, expected: str, raw: str, fix: str | None = None) -> ConfigurationError:
    return ConfigurationError(expected_got(name, expected, short(raw), fix or f"Fix or unset {name}."))


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise _bad(name, "a bool (1/0/true/false/yes/no/on/off)", raw)


def _parse_positive_int(name: str, raw: str) -> int:
    if not re.fullmatch(r"\+?\d{1,18}", raw) or int(raw) <= 0:
        raise _bad(name, "an integer > 0", raw)
    return int(raw)


def _parse_ttl(name: str, raw: str) -> float | None:
    if raw.lower() == "none":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise _bad(name, "seconds as a finite number > 0, or 'none'", raw)
    return value


def _parse_log_level(name: str, raw: str) -> LogLevel:
    try:
        return LogLevel(raw.upper())
    except ValueError:
        raise _bad(name, f"one of {[lv.value for lv in LogLevel]}", raw) from None


def _parse_path(name: str, raw: str) -> str:
    if "\0" in raw or len(raw) > 4096:
        raise _bad(name, "a file path", raw)
    return os.path.expanduser(raw)


def _parse_policy_path(name: str, raw: str) -> str:
    path = _parse_path(name, raw)
    if not os.path.isfile(path):
        raise _bad(name, "the path of an existing YAML policy file", raw, f"Create the file or unset {name}.")
    return path


def _items(name: str, raw: str, what: str) -> list[str]:
    items = [item.strip() for item in raw.split(",")]
    for i, item in enumerate(items):
        if not item:
            raise _bad(
                name, f"a comma-separated list of {what}", raw, f"Item {i} is empty; remove the extra comma."
            )
    return items


def _parse_globs(name: str, raw: str) -> tuple[str, ...]:
    out = []
    for item in _items(name, raw, "kernel/backend globs"):
        try:
            out.append(check_pattern(item, name))
        except PolicyValidationError as exc:
            raise ConfigurationError(f"{exc} In {name}={short(raw)}.") from None
    return tuple(dict.fromkeys(out))


def _parse_locks(name: str, raw: str) -> tuple[tuple[str, str], ...]:
    locks: dict[str, str] = {}
    for item in _items(name, raw, "op=kernel_id pairs"):
        op, sep, kernel = (part.strip() for part in item.partition("="))
        if not sep or not _OP_RE.fullmatch(op):
            raise _bad(
                name, "op=kernel_id pairs like 'attention=torch_sdpa.math'", raw, f"Bad item {short(item)}."
            )
        try:
            check_kernel_id(kernel, name)
        except PolicyValidationError as exc:
            raise ConfigurationError(f"{exc} In {name}={short(raw)}.") from None
        if op in locks:
            raise _bad(name, "at most one lock per op", raw, f"Op {op!r} is locked twice.")
        locks[op] = kernel
    return tuple(locks.items())


_VARS: Mapping[str, tuple[str, Callable[[str, str], Any], str]] = MappingProxyType(
    {
        "LAYERZERO_POLICY": ("policy_path", _parse_policy_path, "path of a YAML policy file (must exist)"),
        "LAYERZERO_LOCK": ("locks", _parse_locks, "op=kernel_id locks, comma separated"),
        "LAYERZERO_ALLOW": ("allow", _parse_globs, "kernel/backend globs allowed to run, comma separated"),
        "LAYERZERO_DENY": ("deny", _parse_globs, "kernel/backend globs denied, comma separated"),
        "LAYERZERO_PREFER": (
            "prefer",
            _parse_globs,
            "kernel/backend globs boosted by 1000 points, comma separated",
        ),
        "LAYERZERO_STRICT": ("strict", _parse_bool, "raise instead of falling back (bool)"),
        "LAYERZERO_DISABLED": ("disabled", _parse_bool, "reference kernels only (bool)"),
        "LAYERZERO_LOG_LEVEL": ("log_level", _parse_log_level, "DEBUG, INFO, WARNING or ERROR"),
        "LAYERZERO_PERFDB": ("perfdb_path", _parse_path, "path of the PerfDB SQLite file"),
        "LAYERZERO_USE_PERFDB": ("use_perfdb", _parse_bool, "use measured timings when scoring (bool)"),
        "LAYERZERO_CACHE_SIZE": (
            "cache_size",
            _parse_positive_int,
            "selection-cache capacity in entries (int > 0)",
        ),
        "LAYERZERO_CACHE_TTL_S": (
            "cache_ttl_s",
            _parse_ttl,
            "cache entry lifetime in seconds (> 0) or 'none'",
        ),
        "LAYERZERO_CAPABILITIES": (
            "capabilities_path",
            _parse_policy_path,
            "path of a capability-override YAML (kernel constraints as data)",
        ),
        "LAYERZERO_SHIPPED_TIMINGS": (
            "use_shipped_timings",
            _parse_bool,
            "use the timings shipped for this device model when the PerfDB has none (bool)",
        ),
        "LAYERZERO_AUTOTUNE": (
            "autotune",
            _parse_bool,
            "measure a new key's kernels on its first eager call (bool)",
        ),
    }
)
#: Variables the engine and the server read themselves (not selection settings): known, so not warned about.
_READ_ELSEWHERE: Mapping[str, str] = MappingProxyType(
    {
        "LAYERZERO_API_KEY": "the server's API key (layerzero serve --api-key)",
        "LAYERZERO_SYMM_MEM": "0: tensor-parallel engines keep every all-reduce on NCCL (docs/parallel.md)",
        "LAYERZERO_WORKER_PROFILE": "path prefix: TP worker ranks write a cProfile of their steps",
        "LAYERZERO_PIECEWISE_MAX_TOKENS": (
            "default of CudaGraphKnobs.piecewise_max_tokens (0: off; unset: auto, 1024 tokens)"
        ),
    }
)
#: Every variable LayerZero reads, with a one-line description (for docs and ``layerzero env``).
ENV_VARS: Mapping[str, str] = MappingProxyType(
    {**{name: spec[2] for name, spec in _VARS.items()}, **_READ_ELSEWHERE}
)


def read_env(environ: Mapping[str, str] = os.environ) -> EnvSettings:
    """Parse the ``LAYERZERO_*`` variables of ``environ`` into :class:`EnvSettings`.

    Call it explicitly (it is never called at import). Empty values count as unset. Raises
    ``ConfigurationError`` naming the first malformed variable with expected versus got (for example
    ``LAYERZERO_CACHE_SIZE: expected an integer > 0, got '-3'``). Logs a WARNING for unknown
    ``LAYERZERO_*`` names.
    """
    values: dict[str, Any] = {}
    for name, (attr, parse, _doc) in _VARS.items():
        raw = environ.get(name)
        if raw is None:
            continue
        if not isinstance(raw, str):
            raise ConfigurationError(expected_got(name, "a string value", type(raw).__name__))
        if raw.strip():
            values[attr] = parse(name, raw.strip())
    unknown = tuple(
        sorted(k for k in environ if isinstance(k, str) and k.startswith(PREFIX) and k not in ENV_VARS)
    )
    for name in unknown:
        _log.warning("ignoring unknown environment variable %s.%s", name, did_you_mean(name, _VARS))
    return EnvSettings(**values, unknown=unknown)


__all__ = ["ENV_VARS", "PREFIX", "EnvSettings", "LogLevel", "read_env"]
