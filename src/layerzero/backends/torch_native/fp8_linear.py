"""``torch_native.fp8_linear``: ``lz.fp8_linear`` (W8A8 fp8) through ``torch._scaled_mm`` with row-wise scales
(cuBLASLt's fp8 GEMM on Hopper, oneDNN / the reference GEMM on CPU): the activation quantized per token by
this backend's ``lz.quantize`` kernel (fp8 e4m3, ``axis=0`` of the ``[M, K]`` rows), ``scale_a`` ``[M, 1]``
and ``scale_b`` ``[1, N]`` float32 applied to the float32 accumulator, bias added before the one rounding to
x's dtype."""

from __future__ import annotations

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.quant_format import QuantFormat, QuantizedTensor
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

from .quantize import quantize

__all__ = ["fp8_linear", "kernel_spec"]

KERNEL_ID = "torch_native.fp8_linear"
CUDA_ALIGN = 16
"""cuBLASLt's fp8 GEMM wants K and N (the weight's dims) multiples of 16."""


def fp8_linear(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``lz.fp8_linear`` (validated arguments): x ``[..., K]`` -> ``[..., N]`` in x's dtype."""
    k, n = x.shape[-1], qt.shape[0]
    rows = x.reshape(-1, k)
    if rows.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    xq = quantize(rows, QuantFormat.FP8_E4M3, 0, None)  # per row: scale [M, 1] float32, codes e4m3
    w = (
        qt.data if qt.data.is_contiguous() else qt.data.contiguous()
    )  # [N, K] row-major: w.t() is column-major
    sw = (
        qt.scale.to(torch.float32).reshape(1, -1).expand(1, n).contiguous()
    )  # per channel [N, 1] or per tensor []
    y = torch._scaled_mm(xq.data, w.t(), scale_a=xq.scale, scale_b=sw, bias=bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], n)


def _check(ctx: SelectionContext) -> list[Reason]:
    """CUDA: bfloat16 only (row-wise scaled fp8 GEMMs write bfloat16) and K, N multiples of 16."""
    if ctx.device.device_type != "cuda":
        return []
    out = []
    if ctx.dtype is not torch.bfloat16:
        out.append(
            Reason(
                ReasonCode.DTYPE_UNSUPPORTED,
                f"{ctx.dtype} on CUDA: torch._scaled_mm's row-wise scaled fp8 GEMM writes bfloat16 only",
            )
        )
    k, n = ctx.hidden_size, ctx.intermediate_size
    if k is None or n is None or k % CUDA_ALIGN or n % CUDA_ALIGN:
        out.append(
            Reason(
                ReasonCode.SHAPE_MISMATCH,
                f"weight [{n}, {k}]: cuBLASLt's fp8 GEMM needs K and N multiples of {CUDA_ALIGN}",
            )
        )
    return out


def kernel_spec() -> KernelSpec:
    """The ``torch_native.fp8_linear`` KernelSpec: priority 50 (above the reference's 0), CPU (any of float16
    / bfloat16 / float32) and CUDA SM >= 9.0 (bfloat16, K and N multiples of 16; Hopper's row-wise scaled fp8
    GEMM), inference only. The CUDA constraints are ``torch._scaled_mm``'s documented ones (GPU record:
    ``benchmarks/results/engine/h200/2026-11-28b/fp8_gpu.txt``)."""
    return KernelSpec(
        KERNEL_ID,
        "fp8_linear",
        fp8_linear,
        priority=50,
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        sm_min=(9, 0),
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
        check=_check,
        description="lz.fp8_linear: x quantized per token to e4m3, torch._scaled_mm with row-wise "
        "scales (cuBLASLt fp8 GEMM on Hopper)",
    )
