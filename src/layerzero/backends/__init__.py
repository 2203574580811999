"""Built-in backends. Each subpackage exposes ``register(registry)`` that adds its :class:`BackendSpec`
(available or not, with reasons) and its :class:`KernelSpec` objects; nothing else is global.

A backend imports its optional library lazily inside ``register`` (or the kernel), so a missing library makes
the backend *unavailable with a reason*, never an import error of ``layerzero``. ``register`` runs on a clean
stack (:func:`~layerzero.backends._clean_stack.on_clean_stack`): a library that keeps an exception from its
import must not keep the caller's frames (a model's forward, with its tensors) alive.
"""

from __future__ import annotations

from layerzero.core.registry import KernelRegistry

BUILTIN_BACKENDS: tuple[str, ...] = (
    "reference",
    "torch_sdpa",
    "torch_native",
    "flash_attn",
    "flex_attention",
    "liger",
    "xformers",
    "flashinfer",
    "ipex",
    "triton",
    "composite",
    "torch_dist",
    "symm_mem",
    "xgrammar",
)


def register_builtin(registry: KernelRegistry) -> None:
    """Register every built-in backend's kernels (ops must already be registered)."""
    import importlib

    from ._clean_stack import on_clean_stack

    def register_all() -> None:
        for name in BUILTIN_BACKENDS:
            importlib.import_module(f"layerzero.backends.{name}").register(registry)

    on_clean_stack(register_all)
