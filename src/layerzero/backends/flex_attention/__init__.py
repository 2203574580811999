"""FlexAttention (``torch.nn.attention.flex_attention``, torch >= 2.5) as the ``flex_attention`` backend.

Two attention kernels (see ``kernels.py`` for semantics, constraints and sources):
``flex_attention.attention`` runs flex eagerly on CPU (priority -1, below SDPA and the reference: lock/prefer
only), ``flex_attention.compiled`` runs ``torch.compile(flex_attention)`` on CUDA (priority -1, opt-in:
Inductor failed to lower it for some shapes on torch 2.11 / H200). Neither is graph-safe.

Nothing is imported at ``import layerzero`` time: :func:`register` (run on the first op call) imports
``torch.nn.attention.flex_attention``; when it is missing (torch < 2.5) or broken, the backend is registered
*unavailable* with the reason and its kernels raise ``BackendNotAvailableError`` if called directly.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec
from layerzero.core.versions import release

from .._optional import unavailable_why
from .kernels import (
    CPU_KERNEL,
    CUDA_KERNEL,
    KERNEL_IDS,
    PRIORITY,
    BlockMaskCache,
    FlexAttention,
    direct_eager,
    kernel_specs,
    missing,
)
from .paged import PAGED_KERNEL, FlexPagedAttention, paged_spec

log = logging.getLogger("layerzero.backends.flex_attention")

BACKEND_ID = "flex_attention"
MODULE = "torch.nn.attention.flex_attention"
MIN_TORCH = (2, 5)
_DESCRIPTION = (
    "PyTorch FlexAttention (torch.nn.attention.flex_attention): eager on CPU, torch.compile on CUDA"
)


@dataclass(frozen=True, slots=True)
class Probe:
    """Result of probing FlexAttention: its :class:`BackendSpec` (available or not, with reasons) and, when
    available, the module's ``(flex_attention, create_block_mask, BlockMask)``; ``None`` otherwise. ``eager``
    is the dynamo-free eager call (:func:`~.kernels.direct_eager`) or None when this torch lacks its
    pieces."""

    backend: BackendSpec
    api: tuple[Callable[..., Any], Callable[..., Any], Any] | None
    eager: Callable[..., Any] | None = None


def _torch_version(text: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; ``(0, 0)`` when unparsable."""
    parts = release(text)
    return (parts + (0, 0))[:2] if parts else (0, 0)


def probe(
    importer: Callable[[str], Any] = importlib.import_module, torch_version: str | None = None
) -> Probe:
    """Import ``torch.nn.attention.flex_attention`` now and describe the backend.

    Args:
        importer: ``importlib.import_module`` (tests inject failures).
        torch_version: the torch version string (default ``torch.__version__``).

    Returns:
        A :class:`Probe`; never raises: unavailable with ``BACKEND_VERSION_UNSUPPORTED`` (torch < 2.5),
        ``BACKEND_NOT_INSTALLED`` (module absent) or ``BACKEND_IMPORT_FAILED`` (import raised, or the API
        lacks ``flex_attention`` / ``create_block_mask`` / ``BlockMask``).
    """
    version = torch.__version__ if torch_version is None else torch_version

    def unavailable(code: ReasonCode, message: str) -> Probe:
        log.info("LayerZero backend %s unavailable: %s", BACKEND_ID, message)
        return Probe(
            BackendSpec(BACKEND_ID, MODULE, version, False, (Reason(code, message),), _DESCRIPTION), None
        )

    if _torch_version(version) < MIN_TORCH:
        return unavailable(
            ReasonCode.BACKEND_VERSION_UNSUPPORTED,
            f"FlexAttention needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, torch is {version}",
        )
    try:
        module = importer(MODULE)
    except ModuleNotFoundError as exc:
        return unavailable(ReasonCode.BACKEND_NOT_INSTALLED, f"module {MODULE!r} is not available ({exc})")
    except Exception as exc:  # noqa: BLE001 - a broken build may raise anything; the backend is then unavailable
        return unavailable(
            ReasonCode.BACKEND_IMPORT_FAILED, f"importing {MODULE!r} failed: {type(exc).__name__}: {exc}"
        )
    api = tuple(getattr(module, name, None) for name in ("flex_attention", "create_block_mask", "BlockMask"))
    if not all(api):
        return unavailable(
            ReasonCode.BACKEND_IMPORT_FAILED,
            f"module {MODULE!r} lacks flex_attention/create_block_mask/BlockMask",
        )
    eager = direct_eager(module)
    if eager is None:
        log.warning(
            "LayerZero %s: this torch lacks the private pieces of the direct eager call; CPU calls use the "
            "public eager flex_attention, which re-traces each new shape with dynamo (slow first calls)",
            BACKEND_ID,
        )
    return Probe(BackendSpec(BACKEND_ID, MODULE, version, True, (), _DESCRIPTION), api, eager)  # type: ignore[arg-type]


def register(registry: KernelRegistry, probed: Probe | None = None) -> None:
    """Add the ``flex_attention`` backend (available or not, with reasons), its two attention kernels and
    ``flex_attention.paged_attention`` (see ``paged.py``; only when ``registry`` has the ``paged_attention``
    op) to ``registry`` (the ``attention`` op must already be registered).

    Raises:
        ConfigurationError: the backend or one of its kernel ids is already registered.
    """
    p = probe() if probed is None else probed
    registry.add_backend(p.backend)
    why = unavailable_why(p.backend, "")
    if p.api is None:
        cpu_fn = cuda_fn = missing(why)
    else:
        flex, create, block_mask_cls = p.api
        cpu_fn = FlexAttention(flex, create, block_mask_cls, compiled=False, eager=p.eager)
        cuda_fn = FlexAttention(flex, create, block_mask_cls, compiled=True)
    for spec in kernel_specs(cpu_fn, cuda_fn):
        registry.add_kernel(spec)
    if (
        "paged_attention" in registry.ops
    ):  # a registry built for attention alone gets the attention kernels only
        registry.add_kernel(paged_spec(p.api, p.eager, why))


__all__ = [
    "BACKEND_ID",
    "CPU_KERNEL",
    "CUDA_KERNEL",
    "KERNEL_IDS",
    "MIN_TORCH",
    "PAGED_KERNEL",
    "PRIORITY",
    "BlockMaskCache",
    "FlexAttention",
    "FlexPagedAttention",
    "Probe",
    "direct_eager",
    "kernel_specs",
    "probe",
    "register",
]
