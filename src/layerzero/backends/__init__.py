"""Built-in backends. Each subpackage exposes ``register(registry)`` that adds its :class:`BackendSpec`
(available or not, with reasons) and its :class:`KernelSpec` objects; nothing else is global.

A backend imports its optional library lazily inside ``register`` (or the kernel), so a missing library
makes the backend *unavailable with a reason*, never an import error of ``layerzero``.
"""

from __future__ import annotations

from layerzero.core.registry import KernelRegistry

BUILTIN_BACKENDS: tuple[str, ...] = ("reference", "torch_sdpa", "torch_native", "flash_attn", "flex_attention", "liger",
                                      "xformers", "flashinfer", "ipex", "triton")


def register_builtin(registry: KernelRegistry) -> None:
    """Register every built-in backend's kernels (ops must already be registered)."""
    import importlib

    for name in BUILTIN_BACKENDS:
        importlib.import_module(f"layerzero.backends.{name}").register(registry)
