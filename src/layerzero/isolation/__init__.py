"""Process isolation: run a backend whose library conflicts with this process (built for another torch, say)
in a worker process, as an ordinary kernel. See docs/isolation.md.

>>> import layerzero as lz  # doctest: +SKIP
>>> lz.register_isolated_kernel("rms_norm", "oldlib.rms", "oldlib_kernels:rms_norm",
...                             python="/opt/oldlib-venv/bin/python", path=["/opt/kernels"])
>>> lz.lock("rms_norm", "oldlib.rms"); y = lz.rms_norm(x, w)

CPU tensors cross the boundary through POSIX shared memory (copied), CUDA tensors through CUDA IPC (shared:
the worker maps the caller's allocation; results are cloned back).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ..core.errors import ConfigurationError
from .client import IsolatedBackend

__all__ = ["IsolatedBackend", "isolated_kernel", "register"]


def isolated_kernel(target: str, *, backend: IsolatedBackend | None = None, **backend_kwargs: Any) -> Any:
    """A callable running ``target`` (``"module:function"``, imported only inside the worker) in ``backend``
    (default: a new :class:`IsolatedBackend` built from ``backend_kwargs``); ``.backend`` holds the
    backend."""
    if backend is not None and backend_kwargs:
        raise ConfigurationError(
            f"isolated_kernel: expected backend= or backend options, got both ({sorted(backend_kwargs)})."
        )
    return (backend or IsolatedBackend(**backend_kwargs)).kernel(target)


def register(
    op: str,
    kernel_id: str,
    target: str,
    *,
    python: str | os.PathLike[str] | None = None,
    path: Iterable[str | os.PathLike[str]] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
    restart: bool = True,
    backend: IsolatedBackend | None = None,
    priority: int = 50,
    replace: bool = False,
    **constraints: Any,
) -> Any:
    """Register ``target`` (``"module:function"``, run in a worker process under ``python``) as kernel
    ``kernel_id`` of ``op``; returns its :class:`KernelSpec`, whose ``fn.backend`` is the
    :class:`IsolatedBackend`. The worker starts on the first call.

    Everything of :func:`layerzero.register_kernel` applies (selection, ``lz.explain``, locks, health: a dead
    worker is a kernel failure, so an unlocked call falls back and the backend's health is charged).
    ``device_types`` defaults to ``{"cpu"}`` and may hold ``"cpu"`` and ``"cuda"`` (CUDA tensors cross through
    CUDA IPC: the worker needs a CUDA build of torch and sees the same devices). Pass one ``backend=`` to
    several registrations to share a worker; ``python``, ``path``, ``env``, ``timeout_s`` and ``restart``
    configure a new one otherwise.

    Raises:
        ConfigurationError: what ``register_kernel`` raises, ``device_types`` other than cpu / cuda, or both
            ``backend=`` and backend options. InvalidInputError: a bad ``timeout_s``.
    """
    from ..api import register_kernel

    devices = constraints.setdefault("device_types", {"cpu"})
    names = {devices} if isinstance(devices, str) else set(devices or ())
    if not names or not {str(d).lower() for d in names} <= {"cpu", "cuda"}:
        raise ConfigurationError(
            f"register_isolated_kernel: device_types: expected a non-empty subset of "
            f"{{'cpu', 'cuda'}}, got {devices!r}. Isolated kernels take CPU tensors through "
            "shared memory and CUDA tensors through CUDA IPC."
        )
    if backend is None:
        backend = IsolatedBackend(
            python=python,
            path=path,
            env=env,
            timeout_s=timeout_s,
            restart=restart,
            name=kernel_id.split(".", 1)[0] if isinstance(kernel_id, str) else "isolated",
        )
    elif python is not None or tuple(path) or env is not None:
        raise ConfigurationError("register_isolated_kernel: expected backend= or python/path/env, got both.")
    fn = backend.kernel(target)
    constraints.setdefault("description", f"{target} in an isolated worker ({backend.python})")
    return register_kernel(op, kernel_id, fn, priority=priority, replace=replace, **constraints)
