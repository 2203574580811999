"""FlashAttention 2 / 3 / 4 as three LayerZero backends: ``flash_attn2``, ``flash_attn3``, ``flash_attn4``.

One backend per library (not one backend with three kernels) because they are three separately installed
modules with their own versions and failure modes: ``layerzero doctor`` then shows for each whether it is
installed, its version and, if not, the import error; a policy can deny one (``deny: [flash_attn3]``); and
the circuit breaker of a crashing FA3 build does not take FA2 down with it. Each backend has one kernel,
``<backend>.attention``; ``lz.prefer("flash_attn*")`` matches all three.

Nothing is imported at ``import layerzero`` time: :func:`register` (run on the first op call) imports each
library inside :func:`detect.probe`; a missing one leaves its backend registered and unavailable with a
``BACKEND_NOT_INSTALLED`` reason. See ``kernels.py`` for the constraints and their sources.
"""

from __future__ import annotations

from layerzero.core.registry import KernelRegistry

from .detect import LIBRARIES, FlashVersion, Probe, probe
from .kernels import KERNEL_IDS, kernel_specs

BACKEND_IDS: tuple[str, ...] = tuple(v.value for v in FlashVersion)


def probe_all() -> dict[FlashVersion, Probe]:
    """Probe (import) the three libraries now; never raises for a missing or broken one."""
    return {v: probe(v) for v in FlashVersion}


def register(registry: KernelRegistry) -> None:
    """Add the ``flash_attn2``/``flash_attn3``/``flash_attn4`` backends (available or not, with reasons) and
    their attention kernels to ``registry`` (the ``attention`` op must already be registered).

    Raises:
        ConfigurationError: one of these backend or kernel ids is already registered.
    """
    probes = probe_all()
    for p in probes.values():
        registry.add_backend(p.backend)
    for spec in kernel_specs({v: p.function for v, p in probes.items()}):
        registry.add_kernel(spec)


__all__ = [
    "BACKEND_IDS",
    "KERNEL_IDS",
    "LIBRARIES",
    "FlashVersion",
    "Probe",
    "probe",
    "probe_all",
    "register",
]
