"""Custom kernels: validate a user's callable and constraints and register it as a :class:`KernelSpec`.

The public entry points are ``lz.register_kernel``, the ``@lz.kernel`` decorator and ``lz.unregister_kernel``
(``layerzero/api.py``), which call :func:`register_custom_kernel` / :func:`unregister_custom_kernel` on the
runtime's registry. Rules:

- the kernel id is ``"backend.name"``; an unknown backend id is auto-registered as an available *custom*
  backend (its ``BackendSpec.description`` is :data:`CUSTOM_BACKEND_DESCRIPTION`); built-in backend ids are
  reserved, so custom kernels never hide inside a built-in backend and ``unregister`` can tell them apart;
- the callable must accept the op's canonical positional arguments (:data:`CANONICAL_ARGS`, the table of
  ``docs/architecture.md``), checked with :func:`inspect.signature`;
- constraint keywords are :class:`KernelSpec` fields (:data:`CONSTRAINT_FIELDS`), coerced from friendly
  spellings (``layouts={"BSHD"}``, ``dtypes={"bfloat16"}``, ``sm_min="8.0"``) and type-checked; ``None`` means
  "no constraint" as in :class:`KernelSpec` (``mask_kinds=None``: every mask kind; ``generations`` /
  ``layouts`` / ``cpu_isa`` / ``sm_*`` / ``head_dim_*`` / ``max_seq_len`` / callables: none); ``device_types``
  and ``dtypes`` have no "any" value, so ``None`` or an empty set there is rejected, as is an empty set
  anywhere but ``cpu_isa``; ``device_types`` are torch device types (:data:`KNOWN_DEVICE_TYPES` or another
  ``torch.device`` type);
- Triton kernels may pass ``launch_config`` (``num_warps`` a power of 2 in 1..32, ``num_stages`` 1..8,
  ``num_ctas`` a power of 2 in 1..16, ``BLOCK*`` sizes powers of 2 up to 2**20); the kernel is then called
  with ``launch_config=LaunchConfig(...)`` as a keyword. Compile caching is Triton's own: it caches each
  compiled binary on disk keyed by the constexpr values (block sizes), ``num_warps``/``num_stages`` and the
  argument specialization, so LayerZero adds no cache of its own and never compiles inside selection.

Every error is a :class:`ConfigurationError` (``UnknownOperationError`` for an unknown op,
``UnknownKernelError`` for unregistering an unknown id) saying what failed, expected vs got, and the fix.

Layout: this module validates the kernel id and registers / unregisters (:func:`build_kernel_spec`,
:func:`register_custom_kernel`, :func:`unregister_custom_kernel`); the coercion of constraint keywords is in
:mod:`.custom_constraints`, the calling convention (:data:`CANONICAL_ARGS`, :class:`LaunchConfig`,
:func:`check_signature`) in :mod:`.custom_signature`. Their names are re-exported here.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from .custom_constraints import CONSTRAINT_FIELDS, KNOWN_DEVICE_TYPES, coerce_constraints
from .custom_constraints import config_error as _bad
from .custom_signature import (
    ALIBI_EXTRA_ARGS,
    ATTENTION_EXTRA_ARGS,
    CANONICAL_ARGS,
    KV_SCALE_ARGS,
    LaunchConfig,
    check_signature,
)
from .registry import KernelRegistry
from .specs import BackendSpec, KernelSpec

log = logging.getLogger("layerzero.custom")

CUSTOM_BACKEND_DESCRIPTION = "custom kernels registered with lz.register_kernel"
DEFAULT_PRIORITY = 50
"""Above SDPA math (20) and the reference (0), below the fused SDPA/FlashAttention kernels (70-96)."""

_KERNEL_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z0-9_]+(?:[.\-][A-Za-z0-9_]+)*")


def is_custom_backend(registry: KernelRegistry, backend_id: str) -> bool:
    """True when ``backend_id`` was auto-registered by :func:`register_custom_kernel`."""
    return (
        backend_id in registry.backends
        and registry.backend(backend_id).description == CUSTOM_BACKEND_DESCRIPTION
    )


def build_kernel_spec(
    registry: KernelRegistry,
    op: str,
    kernel_id: str,
    fn: Callable[..., Any],
    *,
    priority: int = DEFAULT_PRIORITY,
    launch_config: Mapping[str, Any] | LaunchConfig | None = None,
    **constraints: Any,
) -> KernelSpec:
    """Validate everything and return the :class:`KernelSpec` (nothing is registered).

    Raises:
        UnknownOperationError: ``op`` is not registered.
        ConfigurationError: malformed ``kernel_id``, a built-in backend id, bad ``priority``, signature,
            constraint or ``launch_config``.
    """
    registry.ops.get(op)
    if not isinstance(kernel_id, str) or not _KERNEL_ID.fullmatch(kernel_id):
        raise _bad(
            "register_kernel: kernel_id",
            "'backend.name' (letters, digits, '_'; e.g. 'mylib.attention')",
            repr(kernel_id),
        )
    backend = kernel_id.split(".", 1)[0]
    if backend in registry.backends and not is_custom_backend(registry, backend):
        raise _bad(
            "register_kernel: backend of kernel_id",
            "a backend id that is not built in",
            repr(backend),
            "Use your own prefix, e.g. 'mylib.flash'; built-in backend ids are reserved.",
        )
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise _bad("register_kernel: priority", "an int (built-ins use 0..96)", repr(priority))
    cfg = (
        launch_config
        if isinstance(launch_config, LaunchConfig) or launch_config is None
        else (LaunchConfig.from_dict(launch_config))
    )
    fields = coerce_constraints(constraints)
    windowed = op == "attention" and (fields.get("supports_window") or fields.get("supports_softcap"))
    quant_kv = op in ("paged_attention", "reshape_and_cache") and bool(fields.get("kv_cache_dtypes"))
    alibi = op == "attention" and fields.get("supports_alibi")
    check_signature(
        op,
        fn,
        cfg,
        ALIBI_EXTRA_ARGS
        if alibi
        else ATTENTION_EXTRA_ARGS
        if windowed
        else KV_SCALE_ARGS
        if quant_kv
        else (),
    )
    call = fn if cfg is None else functools.partial(fn, launch_config=cfg)
    fields.setdefault("description", (inspect.getdoc(fn) or "custom kernel").splitlines()[0])
    return KernelSpec(kernel_id, op, call, priority=priority, **fields)


def register_custom_kernel(
    registry: KernelRegistry,
    op: str,
    kernel_id: str,
    fn: Callable[..., Any],
    *,
    priority: int = DEFAULT_PRIORITY,
    replace: bool = False,
    launch_config: Mapping[str, Any] | LaunchConfig | None = None,
    **constraints: Any,
) -> KernelSpec:
    """Validate and register a custom kernel (see the module docstring); returns its :class:`KernelSpec`.

    Raises:
        UnknownOperationError: unknown op. ConfigurationError: see :func:`build_kernel_spec`, or
        ``kernel_id`` is already registered and ``replace`` is False.
    """
    spec = build_kernel_spec(
        registry, op, kernel_id, fn, priority=priority, launch_config=launch_config, **constraints
    )
    if kernel_id in registry.kernels and not replace:
        raise _bad(
            "register_kernel: kernel_id",
            "an id not registered yet",
            repr(kernel_id),
            "Pick another id, pass replace=True, or lz.unregister_kernel() it first.",
        )
    if spec.backend not in registry.backends:
        registry.add_backend(BackendSpec(spec.backend, None, None, True, (), CUSTOM_BACKEND_DESCRIPTION))
    registry.add_kernel(spec, replace=replace)
    log.info("LayerZero custom kernel %s registered for op %s (priority %d)", kernel_id, op, priority)
    return spec


def unregister_custom_kernel(registry: KernelRegistry, kernel_id: str) -> KernelSpec:
    """Remove a custom kernel (and its custom backend once empty); returns the removed spec.

    Raises:
        UnknownKernelError: unknown id. ConfigurationError: a built-in kernel (deny it with a policy instead).
    """
    spec = registry.kernel(kernel_id)
    if not is_custom_backend(registry, spec.backend):
        raise _bad(
            "unregister_kernel: kernel_id",
            "a kernel registered with lz.register_kernel",
            repr(kernel_id),
            "Built-in kernels stay registered; disable one with a policy deny rule or lz.prefer another.",
        )
    registry.remove_kernel(kernel_id)
    if not any(s.backend == spec.backend for s in registry.kernels.values()):
        registry.backends.remove(spec.backend)
    log.info("LayerZero custom kernel %s unregistered", kernel_id)
    return spec


__all__ = [  # registration, and the names of .custom_constraints and .custom_signature re-exported
    "ALIBI_EXTRA_ARGS",
    "ATTENTION_EXTRA_ARGS",
    "CANONICAL_ARGS",
    "CONSTRAINT_FIELDS",
    "CUSTOM_BACKEND_DESCRIPTION",
    "DEFAULT_PRIORITY",
    "KNOWN_DEVICE_TYPES",
    "KV_SCALE_ARGS",
    "LaunchConfig",
    "build_kernel_spec",
    "check_signature",
    "coerce_constraints",
    "is_custom_backend",
    "register_custom_kernel",
    "unregister_custom_kernel",
]
