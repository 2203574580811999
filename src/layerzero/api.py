"""Public configuration and inspection API: locks, preferences, select / explain / which / validate.

These are re-exported as ``lz.*``. Inspection functions take the op id and exactly the arguments of the op
(``lz.explain("attention", q, k, v, is_causal=True)``) and never run a kernel.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
from collections.abc import Iterator
from typing import Any

from layerzero.core import config as _config
from layerzero.core.arguments import check_call, check_path, check_str
from layerzero.core.dispatch import trace
from layerzero.core.errors import (
    ConfigurationError,
    NoKernelFoundError,
    UnknownKernelError,
    UnknownOperationError,
    expected_got,
)
from layerzero.core.policy import Policy
from layerzero.core.reasons import Reason
from layerzero.core.report import SelectionReport
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import validate_kernel
from layerzero.core.specs import ExecutionPlan
from layerzero.ops import OPS
from layerzero.tuning import TuneReport, tune

configure = _config.configure
get_config = _config.get_config
load_config = _config.load_config
get_locks = _config.get_locks


def _op(op: Any, where: str = "op") -> tuple[Any, Any]:
    if not isinstance(op, str):
        raise UnknownOperationError(
            f"unknown op {op!r:.60}: "
            + expected_got(where, f"an op id (a str) from {sorted(OPS)}", type(op).__name__)
        )
    try:
        return OPS[op]
    except KeyError:
        close = difflib.get_close_matches(op, OPS, n=1)
        raise UnknownOperationError(
            f"unknown op {op!r:.60}. Known ops: {sorted(OPS)}."
            + (f" Did you mean {close[0]!r}?" if close else "")
        ) from None


def _kernel_id(where: str, kernel_id: Any) -> str:
    return check_str(
        where, kernel_id, "a kernel id 'backend.name' like 'torch_sdpa.math'", UnknownKernelError
    )


def _prepared(where: str, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(cache key, context builder)`` of ``lz.<op>(*args, **kwargs)``; typed errors for a bad op id or
    arguments that do not bind to the op's signature."""
    prepare, context = _op(op, f"{where}(op)")
    check_call(where, op, prepare, args, kwargs)
    key, _ = prepare(*args, **kwargs)
    return key, context


def lock(op: str, kernel_id: str) -> None:
    """Force ``op`` to run ``kernel_id`` (force, not prefer: calls whose inputs it cannot run raise
    ``NoKernelFoundError`` with its reasons; a runtime failure raises ``KernelExecutionError``).

    Raises:
        UnknownOperationError: unknown op or not a str. UnknownKernelError: unknown kernel id, not a str, or
            one
        of another op.
    """
    _op(op, "lz.lock(op)")
    _kernel_id("lz.lock(kernel_id)", kernel_id)
    RUNTIME.ensure_ready()
    RUNTIME.registry.kernel(kernel_id, op)
    _config.set_lock(op, kernel_id)


def unlock(op: str) -> None:
    """Remove the ``lz.lock`` of ``op`` (no-op when none). Raises ``UnknownOperationError`` for unknown
    ops."""
    _op(op, "lz.unlock(op)")
    _config.set_lock(op, None)


def _check_patterns(ids: tuple[str, ...]) -> None:
    from layerzero.core.policy_names import unknown_pattern_message

    RUNTIME.ensure_ready()
    known = set(RUNTIME.registry.kernels) | set(RUNTIME.registry.backends)
    for pattern in ids:
        check_str(
            "lz.prefer(*kernel_ids_or_backends)",
            pattern,
            "a kernel id, backend id or glob",
            UnknownKernelError,
        )
        if not any(fnmatch.fnmatchcase(k, pattern) for k in known):
            raise UnknownKernelError(unknown_pattern_message("lz.prefer", pattern, known))


@contextlib.contextmanager
def prefer(*kernel_ids_or_backends: str, by: float = 1000.0) -> Iterator[Policy]:
    """Inside the block, boost these kernels/backends (ids or glob patterns) by ``by`` score points.

    Prefer is not force: a preferred kernel that cannot run the inputs is skipped; the report notes the
    fallback and a WARNING is logged (strict mode raises). Scoped to this thread/asyncio task.

    Raises:
        UnknownKernelError: a name that matches no registered kernel or backend.
    """
    if not kernel_ids_or_backends:
        raise ConfigurationError("lz.prefer() needs at least one kernel id, backend id or glob pattern.")
    _check_patterns(kernel_ids_or_backends)
    with _config.scoped_policy(Policy.prefer(kernel_ids_or_backends, by=by)) as layer:
        yield layer


@contextlib.contextmanager
def disabled() -> Iterator[Policy]:
    """Inside the block every op runs its reference kernel (plain PyTorch, float32 math). Scoped to this
    thread/asyncio task; useful to bisect a numerical difference. Raises nothing itself; the ops inside raise
    as usual (reference kernels accept every valid input)."""
    with _config.scoped_policy(Policy.reference_only()) as layer:
        yield layer


def select(op: str, *args: Any, **kwargs: Any) -> ExecutionPlan:
    """The :class:`ExecutionPlan` the call ``lz.<op>(*args, **kwargs)`` would run (through the cache).

    The plan is callable: ``plan(*canonical_args)`` runs the chosen kernel directly (no checks, no lookup, no
    fallback; ~0.2 µs over the kernel), e.g. for attention ``plan(q, k, v, None, True, None, 0.0)``
    (attn_mask, is_causal, scale, dropout_p). Use it only for inputs of the shapes, dtypes and flags it was
    selected for.

    Raises the op's ``InvalidInputError`` for bad arguments, ``UnknownOperationError`` for an unknown op,
    ``NoKernelFoundError`` when a lock cannot run the inputs.
    """
    key, context = _prepared("lz.select", op, args, kwargs)
    return RUNTIME.resolve(key, context)


def explain(op: str, *args: Any, **kwargs: Any) -> SelectionReport:
    """A fresh :class:`SelectionReport` for ``lz.<op>(*args, **kwargs)``: every candidate with its status,
    all its reasons and its score breakdown. ``print()`` it for a table; ``.to_dict()`` for JSON.

    Never raises for a lock that cannot run: the report then has ``chosen=None`` and says why.
    """
    key, context = _prepared("lz.explain", op, args, kwargs)
    coordinator = RUNTIME.coordinator  # lz.distributed.sync_selection: the report says rank 0 chose
    try:
        if coordinator is not None:
            return coordinator.explain(RUNTIME, key, context(key))
        return RUNTIME.select_context(context(key))[1]
    except NoKernelFoundError as exc:
        if exc.report is None:
            raise
        return exc.report


def which(op: str, *args: Any, **kwargs: Any) -> str:
    """The kernel id ``lz.<op>(*args, **kwargs)`` would run (e.g. ``"torch_sdpa.flash"``).

    Raises the same errors as :func:`select`: ``InvalidInputError``, ``UnknownOperationError``,
    ``NoKernelFoundError``.
    """
    key, context = _prepared("lz.which", op, args, kwargs)
    return RUNTIME.resolve(key, context).kernel_id


def validate(kernel_id: str, op: str, *args: Any, **kwargs: Any) -> list[Reason]:
    """Every reason ``kernel_id`` cannot run ``lz.<op>(*args, **kwargs)``, policy included; empty = it can.

    Raises ``UnknownKernelError`` for an unknown kernel (or not a str) or one of another op, and what
    :func:`select` raises for the op and its arguments.
    """
    _kernel_id("lz.validate(kernel_id)", kernel_id)
    key, context = _prepared("lz.validate", op, args, kwargs)
    RUNTIME.ensure_ready()
    ctx = context(key)
    return validate_kernel(
        RUNTIME.registry, kernel_id, ctx, RUNTIME.usable_reason, _config.effective_policy()
    )


def list_kernels(op: str | None = None) -> list[dict[str, Any]]:
    """Registered kernels (of ``op``, or all): id, op, backend, availability, priority and constraints, one
    dict per kernel. Raises ``UnknownOperationError`` for an unknown ``op`` or one that is not a str."""
    if op is not None:
        _op(op, "lz.list_kernels(op)")
    RUNTIME.ensure_ready()
    reg = RUNTIME.registry
    specs = reg.for_op(op) if op is not None else reg.kernels.values()
    out = []
    for spec in specs:
        backend = reg.backend(spec.backend)
        out.append(
            {
                "kernel_id": spec.kernel_id,
                "op": spec.op,
                "backend": spec.backend,
                "available": backend.available,
                "version": backend.version,
                "reasons": [str(r) for r in backend.reasons],
                "description": spec.description,
                **spec.constraints(),
            }
        )
    return out


def load_capabilities(path: str) -> list[str]:
    """Apply a capability-override YAML (see ``capabilities/`` and docs/backends.md): replace constraint
    fields of registered kernels, e.g. ``{version: 1, kernels: {torch_sdpa.cudnn: {head_dim_max: 256}}}``.
    Returns the kernel ids changed; cached selections are invalidated.

    Raises ``ConfigurationError`` (schema, or ``path`` not a str / os.PathLike), ``PolicyValidationError``
    (unsafe YAML), ``UnknownKernelError``.
    """
    from layerzero.core.capabilities import apply_overrides, load_overrides

    check_path("lz.load_capabilities(path)", path)
    RUNTIME.ensure_ready()
    return apply_overrides(RUNTIME.registry, load_overrides(path))


def register_kernel(
    op: str,
    kernel_id: str,
    fn: Any,
    *,
    priority: int = 50,
    replace: bool = False,
    launch_config: Any = None,
    **constraints: Any,
) -> Any:
    """Register a custom kernel ``fn`` for ``op`` under ``kernel_id`` (``"backend.name"``) and return its
    :class:`KernelSpec`. An unknown backend id is registered as an available custom backend; cached
    selections are invalidated, so the next call can pick it.

    ``fn`` is called with the op's canonical positional arguments (attention: ``q, k, v, attn_mask, is_causal,
    scale, dropout_p``; see ``layerzero.core.custom.CANONICAL_ARGS``); with ``layouts`` unset an attention
    kernel gets the caller's layout, with ``layouts={"BHSD"}`` always ``[B, H, S, D]`` (dispatch transposes
    and charges the transform). ``constraints`` are :class:`KernelSpec` fields (``device_types``, ``dtypes``,
    ``sm_min``, ``head_dim_max``, ``mask_kinds``, ``supports_causal``, ``check``, ...). ``launch_config``
    (Triton: ``num_warps``, ``num_stages``, ``num_ctas``, ``BLOCK*``) is validated and passed to ``fn`` as
    ``launch_config=LaunchConfig(...)``; Triton itself caches the compiled binaries.

    ``None`` for a constraint means "no constraint" as in :class:`KernelSpec` (``mask_kinds=None``: every mask
    kind); ``device_types`` (torch device types: ``cpu``, ``cuda``, ``mps``, ``xpu``, ...) and ``dtypes`` have
    no such value, so ``None`` or an empty set is rejected there.

    Raises:
        UnknownOperationError: unknown op or not a str. ConfigurationError: malformed id (or not a str),
        built-in backend id, duplicate id (without ``replace=True``), ``fn`` not callable or not accepting the
        canonical arguments, unknown constraint name (the message lists the valid ones) or bad value (e.g. an
        unknown device type), invalid ``launch_config``.

    >>> import torch.nn.functional as F, layerzero as lz
    >>> def sdpa(q, k, v, m, c, s, p):
    ...     return F.scaled_dot_product_attention(q, k, v, m, p, c, scale=s)
    >>> spec = lz.register_kernel(
    ...     "attention", "mylib.sdpa", sdpa, priority=99, device_types={"cpu"}, supports_gqa=False
    ... )  # doctest: +SKIP
    """
    from layerzero.core.custom import register_custom_kernel

    _op(op, "lz.register_kernel(op)")
    check_str("lz.register_kernel(kernel_id)", kernel_id, "a kernel id 'backend.name' like 'mylib.attention'")
    RUNTIME.ensure_ready()
    return register_custom_kernel(
        RUNTIME.registry,
        op,
        kernel_id,
        fn,
        priority=priority,
        replace=replace,
        launch_config=launch_config,
        **constraints,
    )


def kernel(
    op: str,
    kernel_id: str,
    *,
    priority: int = 50,
    replace: bool = False,
    launch_config: Any = None,
    **constraints: Any,
) -> Any:
    """Decorator form of :func:`register_kernel`: ``@lz.kernel("rms_norm", "mylib.rms",
    device_types={"cpu"})`` registers the function and returns it unchanged. Raises what
    :func:`register_kernel` raises."""

    _op(op, "lz.kernel(op)")
    check_str("lz.kernel(kernel_id)", kernel_id, "a kernel id 'backend.name' like 'mylib.rms'")

    def decorate(fn: Any) -> Any:
        register_kernel(
            op, kernel_id, fn, priority=priority, replace=replace, launch_config=launch_config, **constraints
        )
        return fn

    return decorate


def unregister_kernel(kernel_id: str) -> Any:
    """Remove a kernel added with :func:`register_kernel` (and its custom backend once it has no kernels);
    returns the removed :class:`KernelSpec`; cached selections are invalidated.

    Raises:
        UnknownKernelError: unknown id or not a str. ConfigurationError: a built-in kernel (deny it with a
            policy
        instead).
    """
    from layerzero.core.custom import unregister_custom_kernel

    _kernel_id("lz.unregister_kernel(kernel_id)", kernel_id)
    RUNTIME.ensure_ready()
    return unregister_custom_kernel(RUNTIME.registry, kernel_id)


def reload() -> None:
    """Re-read the ``LAYERZERO_*`` environment (and the policy file it names); invalidates cached choices.

    A ``LAYERZERO_CAPABILITIES`` file is read and applied now (as on first use); unsetting the variable does
    not undo overrides already applied. Policy names (ops, kernels, backends) are checked on the next
    selection.

    Raises ``ConfigurationError`` / ``PolicyValidationError`` naming a malformed variable, policy file or
    capability file, ``UnknownKernelError`` for a capability override of an unregistered kernel.
    """
    from layerzero.core.capabilities import apply_overrides, load_overrides

    _config.load_env()
    path = _config.env_settings().capabilities_path
    if path:
        overrides = load_overrides(path)  # typed errors for a bad file, before anything is applied
        RUNTIME.ensure_ready()  # applies the file itself when this is the first use
        apply_overrides(RUNTIME.registry, overrides)


__all__ = [
    "configure",
    "disabled",
    "explain",
    "get_config",
    "get_locks",
    "list_kernels",
    "load_capabilities",
    "load_config",
    "lock",
    "kernel",
    "register_kernel",
    "unregister_kernel",
    "prefer",
    "reload",
    "select",
    "trace",
    "TuneReport",
    "tune",
    "unlock",
    "validate",
    "which",
]
