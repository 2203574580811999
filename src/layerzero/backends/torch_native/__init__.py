"""Native PyTorch fused norms: ``torch.nn.functional.rms_norm`` (torch >= 2.4) and ``layer_norm``.

``F.rms_norm`` normalizes in float32 internally and multiplies by the weight before casting back; Hugging
Face's Llama-family RMSNorm casts before the weight multiply. The two agree exactly in float32 and to
within one rounding step in float16/bfloat16 (see docs/backends.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec, KernelSpec

FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def _rms_norm(x, weight, eps, residual):
    if residual is None:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x + residual
    return F.rms_norm(h, (h.shape[-1],), weight, eps), h


def _layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def register(registry: KernelRegistry) -> None:
    """Add the torch_native backend: fused rms_norm and layer_norm from torch.nn.functional."""
    has_rms = hasattr(F, "rms_norm")
    reasons = () if has_rms else (Reason(ReasonCode.TORCH_TOO_OLD, "torch.nn.functional.rms_norm needs torch >= 2.4"),)
    registry.add_backend(BackendSpec("torch_native", "torch", torch.__version__, True, reasons,
                                     description="torch.nn.functional fused norms"))
    devices = frozenset({"cpu", "cuda", "mps", "xpu"})
    if has_rms:
        registry.add_kernel(KernelSpec("torch_native.rms_norm", "rms_norm", _rms_norm, priority=50,
                                       description="torch.nn.functional.rms_norm", device_types=devices,
                                       dtypes=FLOATS))
    registry.add_kernel(KernelSpec("torch_native.layer_norm", "layer_norm", _layer_norm, priority=50,
                                   description="torch.nn.functional.layer_norm", device_types=devices, dtypes=FLOATS))
