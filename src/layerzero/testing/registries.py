"""Small :class:`KernelRegistry` objects for routing tests: an op or two, the live runtime's always-available
kernels (reference, torch_native) and a backend faked as installed, so selection can be asked "what would run
on that GPU?" without the library (``fake_cuda_device`` supplies the device)."""

from __future__ import annotations

from collections.abc import Iterable

from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import BackendSpec, KernelSpec

__all__ = ["routing_registry"]


def routing_registry(
    ops: str | Iterable[str],
    fake: Iterable[KernelSpec] = (),
    *,
    fake_backend: str = "triton",
    fake_version: str = "3.6.0",
    base: Iterable[str] = ("reference", "torch_native"),
) -> KernelRegistry:
    """A fresh registry with ``ops`` (ids of registered ops), every kernel of theirs from the ``base``
    backends of the runtime's registry, and the ``fake`` kernel specs under a ``fake_backend`` registered as
    installed (``fake_version``).

    Raises:
        KeyError / ConfigurationError: an unknown op id, or a ``fake`` spec whose op is not in ``ops``.
    """
    RUNTIME.ensure_ready()
    reg = KernelRegistry()
    base = tuple(base)
    for op in [ops] if isinstance(ops, str) else list(ops):
        reg.add_op(RUNTIME.registry.ops.get(op))
        for spec in RUNTIME.registry.for_op(op):
            if spec.backend in base:
                if spec.backend not in reg.backends:
                    reg.add_backend(RUNTIME.registry.backend(spec.backend))
                reg.add_kernel(spec)
    fake = list(fake)
    if fake:
        reg.add_backend(
            BackendSpec(fake_backend, fake_backend, fake_version, True, (), f"fake-installed {fake_backend}")
        )
        for spec in fake:
            reg.add_kernel(spec)
    return reg
