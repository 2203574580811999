"""PyTorch scaled_dot_product_attention, one KernelSpec per sub-backend: flash, efficient, cudnn, math.

Each kernel forces its sub-backend for the call (like ``torch.nn.attention.sdpa_kernel``) and declares
constraints that mirror PyTorch's own checks (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` and
``sdp_utils_cpp.cpp``), so LayerZero rejects a sub-backend with reasons instead of letting SDPA fail or
silently run another one. See docs/backends.md for the table.
"""

from __future__ import annotations

import torch

from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec

from .kernels import kernel_specs
from .paged import kernel_specs as paged_kernel_specs


def register(registry: KernelRegistry) -> None:
    """Add the torch_sdpa backend (always available: SDPA ships with torch >= 2.5)."""
    registry.add_backend(
        BackendSpec(
            "torch_sdpa",
            "torch",
            torch.__version__,
            True,
            description="torch.nn.functional.scaled_dot_product_attention sub-backends",
        )
    )
    for spec in (*kernel_specs(), *paged_kernel_specs()):
        registry.add_kernel(spec)
