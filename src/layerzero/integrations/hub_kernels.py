"""Hugging Face kernel-hub kernels (the ``kernels`` package) as LayerZero kernels, loaded from local files
only.

:func:`register_hub_kernel` loads a kernel module with ``kernels.get_local_kernel(path)`` (a local kernel
repository: ``<path>/build/<variant>/`` with ``metadata.json`` and the Python package, variants such as
``torch-cpu``, ``torch-cuda`` or ``torch29-cxx11-cu128-x86_64-linux``) or ``kernels.get_kernel(repo_id,
revision=...)`` from the local Hugging Face cache (Hub offline mode for the duration of the call), picks one
of its functions and registers it with :func:`layerzero.register_kernel` through an *adapter* that maps the
op's canonical arguments (:data:`layerzero.core.custom.CANONICAL_ARGS`) to the hub function's own signature.

Nothing here touches the network unless ``local_only=False`` is passed. ``import layerzero`` and importing
this module do not import ``kernels``; :func:`register_hub_kernel` does. See ``docs/hub_kernels.md``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from layerzero.api import register_kernel
from layerzero.core.errors import BackendNotAvailableError, ConfigurationError

Adapter = Callable[..., Any]
"""``adapter(hub_fn, *canonical_args) -> op result``: calls the hub function for one LayerZero call."""


def rms_norm_functional(
    hub_fn: Callable[..., Any],
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
) -> Any:
    """rms_norm adapter for a functional hub kernel ``y = hub_fn(x, weight, eps)`` (x ``[..., H]``, weight
    ``[H]``). With ``residual`` it adds first and returns ``(hub_fn(x + residual, weight, eps), x +
    residual)``, the ``lz.rms_norm(..., residual=)`` contract."""
    h = x if residual is None else x + residual
    y = hub_fn(h, weight, eps)
    return y if residual is None else (y, h)


def rms_norm_out(
    hub_fn: Callable[..., Any],
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
) -> Any:
    """rms_norm adapter for an out-parameter hub kernel ``hub_fn(out, x, weight, eps)`` (vLLM /
    activation-kernel style: writes ``out`` like ``x``, returns nothing). Residual handled as in
    :func:`rms_norm_functional`."""
    h = x if residual is None else x + residual
    out = torch.empty_like(h)
    hub_fn(out, h, weight, eps)
    return out if residual is None else (out, h)


def swiglu_silu_and_mul(hub_fn: Callable[..., Any], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """swiglu adapter for ``kernels-community/activation``'s ``silu_and_mul(out, x)``:
    ``x = cat([gate, up], -1)`` ``[..., 2*D]``, ``out`` ``[..., D]`` = ``silu(gate) * up``."""
    out = torch.empty_like(gate)
    hub_fn(out, torch.cat([gate, up], dim=-1).contiguous())
    return out


BUILTIN_ADAPTERS: dict[str, dict[str, Adapter]] = {
    "rms_norm": {"functional": rms_norm_functional, "out": rms_norm_out},
    "swiglu": {"silu_and_mul": swiglu_silu_and_mul},
}
"""Named adapters per op: pass ``adapter="out"`` (a name) or your own callable."""

DEFAULT_ADAPTER: dict[str, str] = {"rms_norm": "functional", "swiglu": "silu_and_mul"}


def _import_kernels() -> ModuleType:
    try:
        import kernels
    except ImportError as exc:
        raise BackendNotAvailableError(
            "register_hub_kernel: the `kernels` package is not installed; pip install 'layerzero[kernels]' "
            "(or pip install kernels)"
        ) from exc
    return kernels


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Hub offline mode for the duration of a load: ``kernels`` then resolves from the local cache only
    (``HubCacheResolver``), never ``snapshot_download`` from the network."""
    from huggingface_hub import constants

    old = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = old


def _is_path(source: str | os.PathLike[str]) -> bool:
    """A local directory (a PathLike, an absolute/relative/home path, an existing directory, or anything that
    is not ``"org/name"``) rather than a Hub repo id."""
    if isinstance(source, os.PathLike):
        return True
    return source.startswith(("/", ".", "~")) or source.count("/") != 1 or Path(source).is_dir()


def load_hub_module(
    source: str | os.PathLike[str],
    *,
    revision: str | None = None,
    version: int | None = None,
    backend: str | None = None,
    local_only: bool = True,
) -> ModuleType:
    """Load a kernel-hub module from a local kernel directory or, for a repo id ``"org/name"``, from the local
    Hugging Face cache (``local_only=True``, the default) or the Hub (``local_only=False``).

    Raises:
        BackendNotAvailableError: ``kernels`` not installed; the directory does not exist; no build variant
            for this
        machine; the repo/revision is not in the local cache; importing the kernel failed (the cause is
        chained).
        ConfigurationError: a repo id without ``revision`` or ``version`` (``kernels`` requires one).
    """
    kernels = _import_kernels()
    if _is_path(source):
        path = Path(source).expanduser()
        if not path.is_dir():
            raise BackendNotAvailableError(
                f"register_hub_kernel: local kernel directory {str(path)!r} does not "
                "exist; expected <dir>/build/<variant>/metadata.json"
            )
        what, load = f"local kernel {str(path)!r}", lambda: kernels.get_local_kernel(path, backend=backend)
    else:
        if revision is None and version is None:
            raise ConfigurationError(
                f"register_hub_kernel: repo id {source!r} needs revision= or version= "
                "(kernels requires one), e.g. version=1"
            )
        what = f"hub kernel {source!r} (revision={revision!r}, version={version!r})"

        def load() -> ModuleType:
            return kernels.get_kernel(source, revision=revision, version=version, backend=backend)

    try:
        if local_only:
            with _hub_offline():
                return load()
        return load()
    except (ConfigurationError, BackendNotAvailableError):
        raise
    except Exception as exc:  # kernels raises FileNotFoundError/ValueError/ImportError/hub errors
        where = "locally (local_only=True: no download)" if local_only else ""
        raise BackendNotAvailableError(
            f"register_hub_kernel: cannot load {what} {where}: {type(exc).__name__}: {exc}".replace("  ", " ")
        ) from exc


def _resolve_adapter(op: str, adapter: str | Adapter | None) -> Adapter:
    if callable(adapter):
        return adapter
    name = adapter if adapter is not None else DEFAULT_ADAPTER.get(op)
    choices = BUILTIN_ADAPTERS.get(op, {})
    if name is None or name not in choices:
        raise ConfigurationError(
            f"register_hub_kernel: adapter for op {op!r}: expected a callable adapter(hub_fn, "
            f"*canonical_args) or one of {sorted(choices)}, got {adapter!r}"
        )
    return choices[name]


def register_hub_kernel(
    op: str,
    kernel_id: str,
    repo_id_or_path: str | os.PathLike[str],
    function_name: str,
    *,
    revision: str | None = None,
    version: int | None = None,
    local_only: bool = True,
    adapter: str | Adapter | None = None,
    backend: str | None = None,
    priority: int = 50,
    replace: bool = False,
    **constraints: Any,
) -> Any:
    """Register function ``function_name`` of a kernel-hub kernel as LayerZero kernel ``kernel_id`` of ``op``;
    returns its :class:`~layerzero.core.specs.KernelSpec` (``lz.explain`` / ``lz.which`` then list it).

    Args:
        op: a LayerZero op (``"rms_norm"``, ``"swiglu"``, ...).
        kernel_id: ``"backend.name"``, e.g. ``"hub_rms.rms_norm"`` (a new custom backend).
        repo_id_or_path: a local kernel directory (``<dir>/build/<variant>/``) or a Hub repo id
            ``"org/name"``.
        function_name: attribute of the loaded module (``"rms_norm"``, ``"silu_and_mul"``).
        revision / version: for a repo id (one of them is required by ``kernels``).
        local_only: True (default): never download; the repo must be in the local HF cache.
        adapter: ``adapter(hub_fn, *canonical_args)`` (canonical args of ``op``: rms_norm
            ``x [..., H], weight [H], eps, residual``; swiglu ``gate, up [..., D]``), or a built-in name
            (:data:`BUILTIN_ADAPTERS`): rms_norm ``"functional"`` (default, ``hub_fn(x, weight, eps) -> y``)
            or ``"out"`` (``hub_fn(out, x, weight, eps)``); swiglu ``"silu_and_mul"`` (default,
            ``hub_fn(out, cat([gate, up]))``).
        backend: ``kernels`` backend name (``"cpu"``, ``"cuda"``, ...), default: detected by ``kernels``.
        priority, replace, constraints: as :func:`layerzero.register_kernel` (``device_types``, ``dtypes``,
            ...).

    Raises:
        BackendNotAvailableError: ``kernels`` missing, or the kernel is not present locally (the reason says
            which).
        ConfigurationError: no ``function_name`` in the module (lists its functions), unknown adapter, or what
        ``register_kernel`` raises (bad id, duplicate, bad constraint). UnknownOperationError: unknown op.

    >>> spec = lz.register_hub_kernel("rms_norm", "hub_rms.rms_norm", "/opt/kernels/rmsnorm", "rms_norm",
    ...                               device_types={"cuda"}, dtypes={"float16", "bfloat16"})  # doctest: +SKIP
    """
    run = _resolve_adapter(op, adapter)
    module = load_hub_module(
        repo_id_or_path, revision=revision, version=version, backend=backend, local_only=local_only
    )
    hub_fn = getattr(module, function_name, None)
    if not callable(hub_fn):
        names = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and not inspect.ismodule(v)
        )
        raise ConfigurationError(
            f"register_hub_kernel: {module.__name__} has no function {function_name!r}; it has {names}"
        )
    from layerzero.core.custom import CANONICAL_ARGS

    params = CANONICAL_ARGS.get(op)
    if params is None:
        return register_kernel(op, kernel_id, hub_fn, priority=priority, replace=replace, **constraints)
    fn = _bind(run, hub_fn, params, f"{module.__name__}.{function_name}")
    return register_kernel(op, kernel_id, fn, priority=priority, replace=replace, **constraints)


def _bind(run: Adapter, hub_fn: Callable[..., Any], params: tuple[str, ...], name: str) -> Callable[..., Any]:
    """A kernel callable with exactly the op's canonical positional parameters (``register_kernel`` checks the
    signature), calling ``run(hub_fn, *args)``."""

    def kernel(*args: Any) -> Any:
        return run(hub_fn, *args)

    kernel.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params]
    )
    kernel.__name__ = kernel.__qualname__ = f"hub:{name}"
    kernel.__doc__ = f"LayerZero adapter around kernel-hub function {name}"
    return kernel
