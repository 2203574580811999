"""The ``xformers`` backend: ``xformers.ops.fmha.memory_efficient_attention`` as ``xformers.attention``.

Availability means "its operators actually load", not "it imports": on a torch it was not built for (e.g.
xformers 0.0.35, built for torch 2.10, on torch 2.11) ``import xformers`` succeeds with a warning, the
C++/CUDA library does not load, and then every fmha operator refuses CUDA inputs (``common.py``: "xFormers
wasn't build with CUDA support"), the Triton split-k operator included. :func:`probe` therefore checks, in
order: the module exists (else ``BACKEND_NOT_INSTALLED``); ``xformers.ops.fmha`` imports (else
``BACKEND_IMPORT_FAILED`` with the error); ``xformers._cpp_lib`` loaded its library with CUDA
(``_cpp_library_load_exception is None`` and ``_built_with_cuda``; else ``BACKEND_IMPORT_FAILED`` with the
loader's message); and at least one of ``flash.FwOp`` / ``cutlass.FwOp`` ``.is_available()`` (else
``BACKEND_IMPORT_FAILED``). The operators that load route the kernel's check (``kernels.py``). Nothing is
imported at ``import layerzero`` time; :func:`register` runs on the first op call.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec

from .._optional import dist_version, import_modules, unavailable_backend, unavailable_why
from .kernels import INSTALL_HINT, KERNEL_ID, XformersOps, kernel_spec

log = logging.getLogger("layerzero.backends.xformers")
BACKEND_ID = "xformers"
MODULE = "xformers"
_DESCRIPTION = "xFormers memory_efficient_attention (flash / cutlass forward operators)"


@dataclass(frozen=True, slots=True)
class XformersProbe:
    """Result of :func:`probe`: the :class:`BackendSpec` and, when usable, ``memory_efficient_attention``,
    the ``LowerTriangularMask`` class and which forward operators load."""

    backend: BackendSpec
    function: Callable[..., Any] | None = None
    causal_mask: Callable[[], Any] | None = None
    ops: XformersOps | None = None


def _unavailable(code: ReasonCode, message: str, version: str | None = None) -> XformersProbe:
    return XformersProbe(
        unavailable_backend(BACKEND_ID, MODULE, _DESCRIPTION, Reason(code, message), version)
    )


def _op_available(fmha: Any, name: str) -> tuple[bool, str]:
    """``fmha.<name>.FwOp.is_available()`` without raising; the second item says why not."""
    try:
        ok = bool(getattr(fmha, name).FwOp.is_available())
        return ok, "" if ok else f"{name}.FwOp not built/loaded"
    except Exception as exc:  # noqa: BLE001 - a broken operator module means "not available", with its text
        return False, f"{name}.FwOp: {exc!r}"


def probe() -> XformersProbe:
    """Import xFormers now and describe the backend; never raises for a missing or broken library."""
    modules, why = import_modules(MODULE, (MODULE,), INSTALL_HINT)
    if why is not None:
        return XformersProbe(unavailable_backend(BACKEND_ID, MODULE, _DESCRIPTION, why))
    xf = modules[0]
    version = dist_version("xformers", xf)
    try:
        fmha = importlib.import_module("xformers.ops.fmha")
    except Exception as exc:  # noqa: BLE001
        return _unavailable(
            ReasonCode.BACKEND_IMPORT_FAILED, f"importing xformers.ops.fmha failed: {exc!r}", version
        )
    cpp = getattr(xf, "_cpp_lib", None)
    load_error = getattr(cpp, "_cpp_library_load_exception", None)
    if cpp is None or load_error is not None or not getattr(cpp, "_built_with_cuda", False):
        detail = str(load_error).strip().splitlines()[0] if load_error is not None else "built without CUDA"
        return _unavailable(
            ReasonCode.BACKEND_IMPORT_FAILED,
            f"xFormers {version} C++/CUDA extensions did not load ({detail}); every fmha operator then "
            "refuses CUDA inputs, its Triton ones included. Install an xformers wheel built for this torch",
            version,
        )
    flash, why_flash = _op_available(fmha, "flash")
    cutlass, why_cutlass = _op_available(fmha, "cutlass")
    flash3, _ = _op_available(fmha, "flash3")
    if not (flash or cutlass):
        return _unavailable(
            ReasonCode.BACKEND_IMPORT_FAILED,
            f"no xFormers forward operator can run: {why_flash}; {why_cutlass}",
            version,
        )
    function = getattr(fmha, "memory_efficient_attention", None)
    causal = getattr(getattr(fmha, "attn_bias", None), "LowerTriangularMask", None)
    if function is None or causal is None:
        return _unavailable(
            ReasonCode.BACKEND_VERSION_UNSUPPORTED,
            f"xformers {version} lacks memory_efficient_attention / attn_bias.LowerTriangularMask",
            version,
        )
    ops = XformersOps(flash=flash, cutlass=cutlass, flash3=flash3)
    log.debug("xformers %s forward operators: %s", version, ops)
    return XformersProbe(
        BackendSpec(BACKEND_ID, MODULE, version, True, (), _DESCRIPTION), function, causal, ops
    )


def register(registry: KernelRegistry) -> None:
    """Add the ``xformers`` backend (available or not, with reasons) and its ``xformers.attention`` kernel to
    ``registry`` (the ``attention`` op must already be registered).

    Raises:
        ConfigurationError: the backend or kernel id is already registered.
    """
    p = probe()
    registry.add_backend(p.backend)
    why = unavailable_why(p.backend, "xformers is not available")
    registry.add_kernel(kernel_spec(p.function, p.causal_mask, p.ops, why))


__all__ = ["BACKEND_ID", "KERNEL_ID", "XformersOps", "XformersProbe", "kernel_spec", "probe", "register"]
