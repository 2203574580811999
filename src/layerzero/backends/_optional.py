"""Importing an optional backend library and describing the result as a :class:`BackendSpec`.

Every optional backend (liger, triton, flashinfer, xformers, ipex) probes its library the same way: import it
(and the submodules it needs) lazily, classify a failure as ``BACKEND_NOT_INSTALLED`` (the library itself is
missing) or ``BACKEND_IMPORT_FAILED`` (it is there but importing raised, exited, or a dependency is missing,
with the error text and anything the import printed), read its version from the installed distribution, and
build an unavailable :class:`BackendSpec` with that one reason. Nothing here raises for a broken library.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from layerzero.core.errors import BackendNotAvailableError
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import BackendSpec

__all__ = ["dist_version", "import_modules", "missing_kernel", "unavailable_backend", "unavailable_why"]


def import_modules(
    package: str, names: Sequence[str], install_hint: str
) -> tuple[list[ModuleType], Reason | None]:
    """Import ``names`` (full module names inside ``package``) in order: ``(modules, None)``, or
    ``([], reason)`` on the first failure — ``BACKEND_NOT_INSTALLED`` when ``package`` itself is not found,
    ``BACKEND_IMPORT_FAILED`` (with the text) when one of its submodules or dependencies is missing, or for
    any other exception or ``SystemExit`` (some libraries exit on an unsupported CPU), quoting what the import
    printed on stdout."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            modules = [importlib.import_module(name) for name in names]
    except ModuleNotFoundError as exc:
        if exc.name == package:  # the library itself; a missing submodule of it is a broken or old install
            return [], Reason(
                ReasonCode.BACKEND_NOT_INSTALLED, f"module {package!r} not found ({exc}); {install_hint}"
            )
        return [], Reason(
            ReasonCode.BACKEND_IMPORT_FAILED, f"importing {package} failed: {exc!r}; {install_hint}"
        )
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any import failure makes the backend unavailable
        said = printed.getvalue().strip()
        return [], Reason(
            ReasonCode.BACKEND_IMPORT_FAILED,
            f"importing {package} failed: {exc!r}" + (f"; it printed: {said}" if said else ""),
        )
    said = printed.getvalue().strip()
    if said:
        logging.getLogger("layerzero.backends").info("importing %s printed: %s", package, said)
    return modules, None


def dist_version(distribution: str, module: Any = None) -> str | None:
    """The installed version of ``distribution`` (pip name), else ``module.__version__``, else None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raw = getattr(module, "__version__", None)
        return None if raw is None else str(raw)


def unavailable_backend(
    backend_id: str, import_name: str, description: str, reason: Reason, version: str | None = None
) -> BackendSpec:
    """An unavailable :class:`BackendSpec` carrying ``reason`` (logged at INFO on
    ``layerzero.backends.<id>``)."""
    logging.getLogger(f"layerzero.backends.{backend_id}").info(
        "%s backend unavailable: %s", backend_id, reason.message
    )
    return BackendSpec(backend_id, import_name, version, False, (reason,), description)


def unavailable_why(backend: BackendSpec, default: str) -> str:
    """The reasons of an unavailable ``backend`` as one line (``default`` when it carries none), for
    :func:`missing_kernel` and log messages."""
    return "; ".join(r.message for r in backend.reasons) or default


def missing_kernel(kernel_id: str, why: str, install_hint: str) -> Callable[..., Any]:
    """The callable of a kernel whose backend is unusable. Selection never picks it (its backend is
    unavailable); a lock or a direct call of the spec's ``fn`` reaches it.

    Raises:
        BackendNotAvailableError: on every call, with ``why`` and ``install_hint``.
    """

    def run(*args: Any) -> Any:
        raise BackendNotAvailableError(
            f"{kernel_id} cannot run: {why}. Install it ({install_hint}) or let LayerZero pick another "
            "kernel."
        )

    run.__name__ = kernel_id.replace(".", "_") + "_missing"
    return run
