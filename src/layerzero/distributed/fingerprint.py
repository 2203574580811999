"""What every rank must agree on before rank 0's kernel choices can be used everywhere, and the comparison.

A fingerprint is a flat ``{field: value}`` dict of picklable values: LayerZero, torch, CUDA/HIP and cuDNN
versions, the default device's model and SM, every registered backend's installed version and availability,
and the registered kernel ids. :func:`first_mismatch` compares each rank's fingerprint with rank 0's.
"""

from __future__ import annotations

from typing import Any

import torch

from .._version import __version__
from ..core.device import DeviceSpec
from ..core.dispatch import Runtime

__all__ = ["KERNELS", "fingerprint", "first_mismatch", "mismatch_text"]

KERNELS = "kernels"
"""The field holding the sorted registered kernel ids (compared as sets, reported as a difference)."""
KIND = "lz.fingerprint"
"""The ``kind`` field's value: a rank whose collective is another one (its calls are out of step) differs
there."""


def fingerprint(runtime: Runtime, device: torch.device | str | int | None = None) -> dict[str, Any]:
    """This process's fingerprint for :func:`layerzero.distributed.sync_selection`.

    Args:
        runtime: the runtime whose registry is described (ready: backends registered).
        device: the device whose model is compared (:meth:`DeviceSpec.detect`; None: the current CUDA device
            when CUDA is available, else the CPU).

    Returns:
        ``{"kind": "lz.fingerprint", "layerzero", "torch", "cuda", "hip", "cudnn", "device_type", "device",
        "sm": str, "backend <id> version": str, "backend <id> available": bool, ..., "kernels": tuple[str,
        ...]}``; the driver version is left out (nodes of one job may run different drivers of one CUDA
        major).
    """
    dev = DeviceSpec.detect(device)
    parts = dev.fingerprint_parts()
    out: dict[str, Any] = {
        "kind": KIND,
        "layerzero": __version__,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "hip": str(getattr(torch.version, "hip", None)),
        "cudnn": parts["cudnn"],
        "device_type": dev.device_type,
        "device": dev.name,
        "sm": parts["sm"],
    }
    reg = runtime.registry
    for backend_id in sorted(reg.backends):
        spec = reg.backends.get(backend_id)
        out[f"backend {backend_id} version"] = str(spec.version)
        out[f"backend {backend_id} available"] = bool(spec.available)
    out[KERNELS] = tuple(sorted(reg.kernels))
    return out


def first_mismatch(prints: list[dict[str, Any]]) -> tuple[int, str, Any, Any] | None:
    """The first ``(rank, field, rank 0's value, that rank's value)`` where a rank's fingerprint differs from
    rank 0's (ranks in order, fields in rank 0's order, then fields only that rank has); None when all
    agree."""
    ref = prints[0]
    for rank, fp in enumerate(prints[1:], start=1):
        if not isinstance(fp, dict):
            return rank, "kind", ref.get("kind"), f"a {type(fp).__name__} from another collective"
        for name in [*ref, *(k for k in fp if k not in ref)]:
            if ref.get(name) != fp.get(name):
                return rank, name, ref.get(name), fp.get(name)
    return None


def mismatch_text(field: str, expected: Any, got: Any) -> str:
    """``expected`` vs ``got`` of ``field`` in words (kernel lists as their difference)."""
    if field == KERNELS and isinstance(expected, tuple) and isinstance(got, tuple):
        only0 = sorted(set(expected) - set(got))
        only_r = sorted(set(got) - set(expected))
        return f"kernels registered only on rank 0: {only0}; only on that rank: {only_r}"
    return f"rank 0 has {expected!r}, that rank has {got!r}"
