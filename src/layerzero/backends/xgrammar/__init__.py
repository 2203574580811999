"""The ``xgrammar`` backend: xgrammar's ``apply_token_bitmask_inplace`` (Dong et al. 2024, "XGrammar") as a
kernel of ``lz.apply_token_bitmask``.

Nothing is imported at ``import layerzero`` time, nor when the registry is built: :func:`probe` only looks the
module up (importing xgrammar takes ~1.4 s, paid by every process's first op call otherwise); the kernel
imports it on its first call. A missing library leaves the backend registered and unavailable with
``BACKEND_NOT_INSTALLED``; an xgrammar that is found but fails to import raises in the kernel's first call, so
dispatch falls back to the next kernel (logged, the backend's health charged).

xgrammar dispatches on the device: its C++ kernel for CPU tensors, its Triton kernel for CUDA tensors. The
kernel is CUDA only (:data:`CPU_EXCLUDED`), and needs triton there. Two
differences of semantics are bridged here: xgrammar's ``indices`` name rows of the bitmask *and* of the logits
(``lz``: bitmask row ``i`` masks logits row ``indices[i]``), so a call with indices scatters the bitmask into
a ``[R_all, W]`` all-allowed bitmask first; and xgrammar leaves ids past ``32 W`` unmasked (``lz`` bans them),
so those columns of the masked rows are set to -inf after it. Not graph-safe (its launch reads device
properties per call; not tested under capture).
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec, KernelSpec

from .._optional import dist_version, missing_kernel, unavailable_backend, unavailable_why

log = logging.getLogger("layerzero.backends.xgrammar")
BACKEND_ID = "xgrammar"
MODULE = "xgrammar"
KERNEL_ID = "xgrammar.apply_token_bitmask"
KERNEL_IDS = (KERNEL_ID,)
PRIORITY = 30
"""Below ``triton.apply_token_bitmask`` (40), above ``torch_native`` (10): not yet measured on the H200."""
INSTALL_HINT = "pip install xgrammar"
_DESCRIPTION = "xgrammar's apply_token_bitmask_inplace (C++ on CPU, Triton on CUDA)"
_HALF_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
CPU_EXCLUDED = (
    "xgrammar 0.2.9's C++ CPU kernel corrupts the heap for vocabularies under 16 tokens (found by "
    "tests/correctness/test_token_bitmask.py), so the kernel is CUDA only: on CPU selection takes "
    "torch_native (DEVICE_TYPE_UNSUPPORTED says why xgrammar is not eligible)"
)
"""Why CPU is not a device type of ``xgrammar.apply_token_bitmask``."""


def probe() -> BackendSpec:
    """Describe the backend without importing xgrammar: available when its module is found, else unavailable
    with ``BACKEND_NOT_INSTALLED``; never raises."""
    try:
        found = importlib.util.find_spec(MODULE) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        why = Reason(ReasonCode.BACKEND_NOT_INSTALLED, f"module {MODULE!r} not found; {INSTALL_HINT}")
        return unavailable_backend(BACKEND_ID, MODULE, _DESCRIPTION, why)
    return BackendSpec(BACKEND_ID, MODULE, dist_version("xgrammar"), True, (), _DESCRIPTION)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    """``lz.apply_token_bitmask`` through ``xgrammar.apply_token_bitmask_inplace`` (see the module docstring
    for the two bridged differences).

    Args:
        logits: ``[R_all, V]`` float32/bfloat16/float16, ``stride(-1) == 1``; written in place.
        bitmask: ``[R, W]`` int32, ``stride(-1) == 1``.
        indices: ``[R]`` int64/int32 distinct logits rows, or None.

    Raises:
        Nothing of its own (``lz.apply_token_bitmask`` validates); xgrammar's errors propagate.
    """
    import xgrammar

    vocab, width = logits.shape[1], bitmask.shape[1]
    full = bitmask.contiguous()  # xgrammar reads a row's words up to its row stride, not W
    if indices is not None:
        full = bitmask.new_full((logits.shape[0], width), -1)
        full.index_copy_(0, indices.long(), bitmask)
    xgrammar.apply_token_bitmask_inplace(logits, full, vocab_size=min(vocab, 32 * width))
    if vocab > 32 * width:  # ids past the words: banned in the masked rows
        tail = logits[:, 32 * width :]
        if indices is None:
            tail.fill_(float("-inf"))
        else:
            tail.index_fill_(0, indices.long(), float("-inf"))


def _triton_missing() -> list[Reason]:
    """xgrammar's CUDA path is its Triton kernel: ``BACKEND_NOT_INSTALLED`` when triton cannot be found."""
    try:
        if importlib.util.find_spec("triton") is not None:
            return []
    except (ImportError, ValueError):
        pass
    return [
        Reason(
            ReasonCode.BACKEND_NOT_INSTALLED,
            "xgrammar applies the bitmask on CUDA with a Triton kernel and triton is not installed",
        )
    ]


def kernel_specs(available: bool, why: str) -> list[KernelSpec]:
    """The ``xgrammar.apply_token_bitmask`` KernelSpec, CUDA only (see :data:`CPU_EXCLUDED`); its callable
    raises ``BackendNotAvailableError`` when ``available`` is False."""
    fn = apply_token_bitmask if available else missing_kernel(KERNEL_ID, why, INSTALL_HINT)
    return [
        KernelSpec(
            KERNEL_ID,
            "apply_token_bitmask",
            fn,
            priority=PRIORITY,
            description="xgrammar.apply_token_bitmask_inplace (its Triton kernel; indices via a scattered "
            "full bitmask)",
            device_types=frozenset({"cuda"}),
            dtypes=_HALF_FLOATS,
            requires_stride_last_1=True,
            deterministic=True,
            graph_safe=False,
            supports_backward=False,
            check=lambda ctx: _triton_missing(),
        )
    ]


def register(registry: KernelRegistry) -> None:
    """Add the ``xgrammar`` backend (available or not, with reasons) and its kernel to ``registry`` (the
    ``apply_token_bitmask`` op must be registered).

    Raises:
        ConfigurationError: the backend or its kernel id is already registered.
    """
    backend = probe()
    registry.add_backend(backend)
    why = unavailable_why(backend, "xgrammar is not available")
    for spec in kernel_specs(backend.available, why):
        registry.add_kernel(spec)


__all__ = [
    "BACKEND_ID",
    "KERNEL_ID",
    "KERNEL_IDS",
    "apply_token_bitmask",
    "kernel_specs",
    "probe",
    "register",
]
