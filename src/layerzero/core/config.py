"""Configuration and the policy layers: the only process-wide mutable state of LayerZero.

``Config`` is a frozen, validated dataclass; ``configure(**options)`` swaps in a new one. The effective
policy is built from layers, later ones winning: the YAML file (``LAYERZERO_POLICY`` or ``load_config``),
the ``LAYERZERO_*`` environment, ``lz.lock`` calls, then scoped overrides (``lz.prefer``, ``lz.disabled``)
held in a ``contextvars.ContextVar`` so threads and asyncio tasks see their own. Every change bumps
:data:`epoch` and notifies listeners (dispatch invalidates its selection cache in O(1)).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from . import policy as _policy
from . import policy_scope as _scope
from .env import EnvSettings, read_env
from .errors import ConfigurationError, PolicyValidationError, expected_got
from .policy import LockRule, Policy
from .registry import KernelRegistry


def default_perfdb_path() -> str:
    """``$XDG_CACHE_HOME/layerzero/perfdb.sqlite`` (``~/.cache/...`` when unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "layerzero", "perfdb.sqlite")


@dataclass(frozen=True, slots=True)
class Config:
    """LayerZero options. Change them with ``lz.configure(**options)``; read with ``lz.get_config()``.

    - ``strict``: raise instead of falling back (a preferred kernel that cannot run, a runtime failure, or the
      reference kernel standing in for rejected faster kernels).
    - ``cache_size``: selection-cache capacity in entries; ``cache_ttl_s``: entry lifetime in seconds (None =
      no expiry).
    - ``use_perfdb``: let measured timings score kernels; ``perfdb_path``: SQLite file (None = the default in
      the user cache directory, opened on the first selection that needs it).
    - ``perf_weight``: score points the fastest measured kernel gets (others get weight x fastest/theirs);
      shipped timings score with the same weight.
    - ``use_shipped_timings``: when the PerfDB has nothing for a context's bucket, score with the timings
      shipped for this device model and library versions (``layerzero/data/timings``; docs/tuning.md);
      ``shipped_timings_dir``: a directory of such files to use instead of the package's (None = the
      package's).
    - ``shipped_tie_margin``: None (default) = each op's own margin (``OperationSpec.shipped_tie_margin``: 10%
      for ``paged_attention``, whose key cannot see the batch's length distribution; 0 for the others); a
      float in [0, 1) = that margin for every op (0.0: the strict rule). Shipped timings count kernels within
      the margin of a bucket's fastest as tied (each gets the full ``perf_weight``), so the hand priorities
      order them. The user's own PerfDB measurements (``lz.tune``, autotune) never use a margin.
    - ``autotune``: the first eager call of a new key measures its eligible kernels (checked against the
      reference) and records them in the PerfDB, like ``torch.backends.cudnn.benchmark`` (never during
      CUDA-graph capture; ``layerzero.tuning.autotune``).
    - ``log_fallbacks``: log a WARNING with reasons for every fallback (strict mode raises instead).
    - ``selection_timeout_s``: how long a thread waits for another thread's selection of the same key.
    - ``health_failure_threshold`` / ``health_cooldown_s``: a backend is skipped after this many consecutive
      runtime failures, and retried after the cooldown (seconds).
    - ``allow_selection_in_capture``: let a selection-cache miss run selection while a CUDA graph is being
      captured (default False: it raises ``CudaGraphUnsafeError``; warm up with ``lz.warmup`` first).
    - ``workspace_headroom_bytes``: memory-aware selection rejects a kernel whose declared workspace
      (``KernelSpec.workspace``, bytes) exceeds the device's free memory minus this headroom
      (``WORKSPACE_TOO_LARGE``; CUDA devices, read with ``torch.cuda.mem_get_info`` when a key is selected).
    - ``canaries``: check the first call of each new key against the reference kernel; a failure quarantines
      ``backend@version@arch`` in the PerfDB's file (``BACKEND_QUARANTINED`` from then on;
      ``core/quarantine.py``).
    """

    strict: bool = False
    cache_size: int = 4096
    cache_ttl_s: float | None = None
    use_perfdb: bool = True
    perfdb_path: str | None = None
    perf_weight: float = 1000.0
    log_fallbacks: bool = True
    selection_timeout_s: float = 30.0
    health_failure_threshold: int = 3
    health_cooldown_s: float = 30.0
    allow_selection_in_capture: bool = False
    use_shipped_timings: bool = True
    shipped_timings_dir: str | None = None
    shipped_tie_margin: float | None = None
    autotune: bool = False
    workspace_headroom_bytes: int = 256 << 20
    canaries: bool = False

    def __post_init__(self) -> None:
        for name in (
            "strict",
            "use_perfdb",
            "log_fallbacks",
            "allow_selection_in_capture",
            "use_shipped_timings",
            "autotune",
            "canaries",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(expected_got(f"config {name}", "a bool", repr(getattr(self, name))))
        _positive_int("cache_size", self.cache_size)
        _positive_int("health_failure_threshold", self.health_failure_threshold)
        h = self.workspace_headroom_bytes
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ConfigurationError(
                expected_got("config workspace_headroom_bytes", "an int >= 0 (bytes)", repr(h))
            )
        for name in ("selection_timeout_s", "health_cooldown_s", "perf_weight"):
            _positive_float(name, getattr(self, name))
        m = self.shipped_tie_margin
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0):
            raise ConfigurationError(
                expected_got(
                    "config shipped_tie_margin",
                    "None (each op's own) or a float in [0, 1) (a fraction)",
                    repr(m),
                )
            )
        if self.cache_ttl_s is not None:
            _positive_float("cache_ttl_s", self.cache_ttl_s)
        if self.perfdb_path is not None and not isinstance(self.perfdb_path, str):
            raise ConfigurationError(
                expected_got("config perfdb_path", "a str path or None", repr(self.perfdb_path))
            )
        if self.shipped_timings_dir is not None and not isinstance(self.shipped_timings_dir, str):
            raise ConfigurationError(
                expected_got(
                    "config shipped_timings_dir", "a str directory or None", repr(self.shipped_timings_dir)
                )
            )

    def to_dict(self) -> dict[str, Any]:
        """The options as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(expected_got(f"config {name}", "an int > 0", repr(value)))


def _positive_float(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigurationError(expected_got(f"config {name}", "a finite number > 0", repr(value)))


CONFIG_OPTIONS = frozenset(f.name for f in fields(Config))


class _State:
    """Process-wide state: config, policy layers, locks, epoch, listeners. Guarded by one lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.config = Config()
        self.file_policy = Policy.empty()
        self.env_policy = Policy.empty()
        self.locks: dict[str, str] = {}
        self.base_policy = Policy.empty()
        self.epoch = 0
        self.listeners: list[Callable[[], None]] = []
        self.env_loaded = False
        self.env = EnvSettings()
        self.merged_memo: tuple[tuple[int, tuple[Policy, ...]], Policy] | None = None
        self.names_checked: tuple[Policy, int] | None = None  # (base policy, registry version) last checked
        self.names_registry: Callable[[], KernelRegistry] | None = None  # see set_names_registry

    def rebuild(self) -> None:
        lock_layer = Policy.from_dict(
            {"version": 1, "locks": [{"op": op, "kernel": k} for op, k in sorted(self.locks.items())]},
            source="lz.lock",
        )
        self.base_policy = self.file_policy.merged(self.env_policy).merged(lock_layer)
        self.bump()

    def bump(self) -> None:
        self.epoch += 1
        for listener in list(self.listeners):
            listener()


_STATE = _State()


def add_listener(fn: Callable[[], None]) -> None:
    """Call ``fn()`` after every configuration or policy change (used to invalidate caches)."""
    with _STATE.lock:
        _STATE.listeners.append(fn)


def notify_change() -> None:
    """Bump the epoch and notify listeners (registry or health changes call this)."""
    with _STATE.lock:
        _STATE.bump()


def load_env(environ: Mapping[str, str] | None = None) -> None:
    """Read ``LAYERZERO_*`` variables into the config and the env policy layer.

    Called once, lazily, on the first selection (never at import) and by ``lz.configure(reload_env=True)``.
    Raises ``ConfigurationError`` / ``PolicyValidationError`` naming the bad variable.
    """
    env = read_env(os.environ if environ is None else environ)
    with _STATE.lock:
        _STATE.env = env
        overrides: dict[str, Any] = {}
        for name in (
            "strict",
            "use_perfdb",
            "perfdb_path",
            "cache_size",
            "cache_ttl_s",
            "use_shipped_timings",
            "autotune",
        ):
            value = getattr(env, name)
            if value is not None:
                overrides[name] = value
        if env.log_level is not None:
            logging.getLogger("layerzero").setLevel(env.log_level.level)
        if overrides:
            _STATE.config = replace(_STATE.config, **overrides)
        _STATE.env_policy = Policy.from_settings(env)
        _STATE.env_loaded = True
        _STATE.rebuild()


def env_settings() -> EnvSettings:
    """The :class:`EnvSettings` read at the last (re)load of the environment."""
    ensure_env_loaded()
    return _STATE.env


def ensure_env_loaded() -> None:
    """Load the environment layer once (cheap no-op afterwards)."""
    if not _STATE.env_loaded:
        load_env()


def get_config() -> Config:
    """The current :class:`Config`. Raises ``ConfigurationError`` if a ``LAYERZERO_*`` variable read on first
    use is malformed."""
    ensure_env_loaded()
    return _STATE.config


def configure(**options: Any) -> Config:
    """Change configuration options (see :class:`Config`) and invalidate cached selections.

    Raises ``ConfigurationError`` for an unknown option (listing the known ones) or a bad value.
    Returns the new :class:`Config`.
    """
    unknown = set(options) - CONFIG_OPTIONS
    if unknown:
        raise ConfigurationError(
            f"unknown config option(s) {sorted(unknown)}: expected some of {sorted(CONFIG_OPTIONS)}."
        )
    ensure_env_loaded()
    with _STATE.lock:
        _STATE.config = replace(_STATE.config, **options)
        _STATE.bump()
        return _STATE.config


def load_config(path: str | os.PathLike[str]) -> Config:
    """Load a YAML file holding a policy document (``version``, ``locks``, ``allow``, ``deny``,
    ``boosts``; see docs/policies.md) and optionally a ``config:`` mapping of :class:`Config` options.

    The file's policy replaces the previous file layer. Its op, kernel and backend names are checked against
    the registry when the policy is first used (see :func:`effective_policy`). Raises ``ConfigurationError``
    if the ``config:`` value is not a mapping (``config: false`` and ``config: []`` too) or the file is
    missing or ``path`` is not a str / os.PathLike, ``PolicyValidationError`` if it is malformed. Returns the
    new :class:`Config`.
    """
    if not isinstance(path, str | os.PathLike):
        raise ConfigurationError(
            expected_got(
                "load_config(path)",
                "a file path (str or os.PathLike)",
                type(path).__name__,
                "Pass the path of the YAML policy file.",
            )
        )
    p = Path(path)
    if not p.is_file():
        raise ConfigurationError(expected_got("load_config path", "an existing YAML file", str(p)))
    data, _ = _policy.safe_load_yaml(p)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise PolicyValidationError(expected_got(f"{p}: top level", "a mapping", type(data).__name__))
    data = dict(data)
    options = data.pop("config", None)
    options = {} if options is None else options  # "config:" with nothing after it: no options
    if not isinstance(options, dict):
        raise ConfigurationError(
            expected_got(
                f"{p}: config",
                "a mapping of options (Config fields, e.g. 'config: {strict: true}')",
                f"{type(options).__name__} {options!r:.60}",
                "Remove the key or give it option: value pairs.",
            )
        )
    policy = Policy.from_dict(data, source=str(p)) if data else Policy.empty()
    ensure_env_loaded()
    with _STATE.lock:
        if options:
            unknown = set(options) - CONFIG_OPTIONS
            if unknown:
                raise ConfigurationError(
                    f"{p}: unknown config option(s) {sorted(unknown)}; known: {sorted(CONFIG_OPTIONS)}."
                )
            _STATE.config = replace(_STATE.config, **options)
        _STATE.file_policy = policy
        _STATE.rebuild()
        return _STATE.config


def set_lock(op: str, kernel_id: str | None) -> None:
    """Record (or with ``None`` remove) a lock; the caller validated the ids."""
    ensure_env_loaded()
    with _STATE.lock:
        if kernel_id is None:
            _STATE.locks.pop(op, None)
        else:
            _STATE.locks[op] = kernel_id
        _STATE.rebuild()


def get_locks() -> dict[str, str]:
    """The locks set with ``lz.lock``, op -> kernel id (file and env locks are in the policy). Raises
    nothing."""
    return dict(_STATE.locks)


def set_names_registry(source: Callable[[], KernelRegistry]) -> None:
    """Name the registry whose ops, kernels and backends the policy's names are checked against
    (:func:`effective_policy`): ``source()`` returns it at each check. ``core/runtime.py`` passes the process
    runtime's registry (this module sits below the runtime, so it cannot import it). Until a source is set no
    check runs, as none could find anything registered then. Raises nothing."""
    _STATE.names_registry = source


def _check_names(base: Policy) -> None:
    """Check the names ``base`` uses against the runtime's registry (once per policy and registry version; not
    before the backends are loaded). Raises what :func:`~layerzero.core.policy_names.check_policy_names`
    raises."""
    source = _STATE.names_registry
    if source is None:
        return
    registry = source()
    checked = _STATE.names_checked
    if (
        base.is_empty
        or not len(registry.ops)
        or (checked is not None and checked[0] is base and checked[1] == registry.version)
    ):
        return
    from .policy_names import check_policy_names

    check_policy_names(base, registry)
    _STATE.names_checked = (base, registry.version)


def effective_policy() -> Policy:
    """The base policy with the current context's scoped layers on top (innermost last).

    Raises ``PolicyValidationError`` (policy files) or ``UnknownOperationError`` / ``UnknownKernelError``
    (``LAYERZERO_*`` variables) when the base policy names an op, kernel or backend that is not registered
    (checked once the backends are loaded, so kernels registered after the policy was loaded count)."""
    ensure_env_loaded()
    _check_names(_STATE.base_policy)
    layers = _scope.current_scope_layers()
    if not layers:
        return _STATE.base_policy
    memo_key = (_STATE.epoch, layers)
    cached = _STATE.merged_memo
    if cached is not None and cached[0] == memo_key:
        return cached[1]
    policy = _scope.layered(_STATE.base_policy, layers)
    _STATE.merged_memo = (memo_key, policy)
    return policy


def scope_token() -> tuple[Any, ...]:
    """A cheap hashable token of the scoped policy layers, part of every selection-cache key: the layers'
    content hashes (cached on each Policy), so equal scopes share cache entries and no stale id can alias."""
    layers = _scope.current_scope_layers()
    return tuple(layer.hash for layer in layers) if layers else ()


scope_layers = _scope.current_scope_layers
"""The scoped policy layers (a ``ContextVar.get``). Hot paths call it and only when it is non-empty
:func:`scope_token_of` (one call fewer than :func:`scope_token` in the common unscoped case)."""


def scope_token_of(layers: tuple[Policy, ...]) -> tuple[Any, ...]:
    """:func:`scope_token` of ``layers`` (as :data:`scope_layers` returned them)."""
    return tuple(layer.hash for layer in layers)


@contextlib.contextmanager
def scoped_policy(layer: Policy) -> Iterator[Policy]:
    """Apply ``layer`` on top of the policy inside the ``with`` block (this thread/task only)."""
    with _scope.scoped(layer):
        yield layer


def reset_for_tests() -> None:
    """Restore defaults (config, layers, locks) and re-read the environment. For tests only."""
    with _STATE.lock:
        _STATE.config = Config()
        _STATE.file_policy = Policy.empty()
        _STATE.env_policy = Policy.empty()
        _STATE.locks.clear()
        _STATE.env_loaded = False
    load_env()


def epoch() -> int:
    """Counter bumped by every configuration, policy, registry or health change."""
    return _STATE.epoch


__all__ = [
    "CONFIG_OPTIONS",
    "Config",
    "LockRule",
    "add_listener",
    "configure",
    "default_perfdb_path",
    "effective_policy",
    "ensure_env_loaded",
    "epoch",
    "get_config",
    "get_locks",
    "load_config",
    "load_env",
    "notify_change",
    "reset_for_tests",
    "scope_layers",
    "scope_token",
    "scope_token_of",
    "scoped_policy",
    "set_lock",
    "set_names_registry",
]
