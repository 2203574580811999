"""``triton.quantized_linear``: the fused low-bit GEMM of ``lz.quantized_linear`` (int8 / fp8 per output channel or
per tensor, int4 in groups along K), CUDA only (SM >= 8.0; fp8 weights SM >= 8.9), fp16 / bf16 activations. The
``@triton.jit`` code and its numerics are in ``_qgemm_kernels.py``.

Status: correct under the Triton interpreter (CPU tests against the float32 reference and a float64 oracle) and on
an H200 (``tests/gpu/test_gpu_quantized_linear.py``). The default for int8 and fp8 e4m3 weights on Hopper and newer
(:func:`priority_for`: measured there); opt in elsewhere (:data:`PRIORITY` below
``torch_native.quantized_linear``): ``lz.lock("quantized_linear", "triton.quantized_linear")``. The engine's
``LLM(quantization=...)`` calls ``lz.quantized_linear``, so the default or a lock reaches it.

Graph safety: no host synchronization; the output is allocated with ``torch.empty`` on the current stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.quant_format import QuantFormat
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

from ._common import CUDA, SM_MIN, LazyModule, cdiv, missing, next_pow2, projection_out
from ._launch import launch

KERNEL_ID = "triton.quantized_linear"
PRIORITY = 40
"""Below ``torch_native.quantized_linear`` (50) where no GPU measurement says otherwise (:func:`priority_for`)."""
MEASURED_PRIORITY = 55
MEASURED_FASTER = frozenset({QuantFormat.INT8.value, QuantFormat.FP8_E4M3.value})
"""Weight formats the engine ran faster with this kernel than with dequantize + cuBLAS on an H200 (bf16, Qwen3-0.6B's
shapes, ``benchmarks/results/engine/h200/README.md``, 2026-11-25; two processes, each against its own bf16 run):
int8 per channel 0.58 of bf16's tokens/s vs 0.41, fp8 e4m3 per channel 0.63 vs 0.39. int4 (groups of 128) ran
slower (0.16 vs 0.30: the row kernel's nibble decode) and fp8 e5m2 was not measured: both stay opt in."""
MEASURED_SM_MIN = (9, 0)
"""Where those measurements ran (Hopper); older GPUs keep :data:`PRIORITY` until measured (``lz.tune``)."""
HALF = frozenset({torch.float16, torch.bfloat16})
MIN_GROUP = 16
"""int4 groups of at least 16 along K (one ``tl.dot`` K tile per group at least)."""
FP8_SM_MIN = (8, 9)
"""Triton converts float8 e4m3 / e5m2 on SM >= 8.9 (Ada, Hopper)."""
ROWS_MAX = 8
"""Rows up to which the row kernel (float32 multiply-adds, small column tiles) runs instead of ``tl.dot`` tiles."""
_KERNELS = LazyModule("_qgemm_kernels")


def config(m: int, n: int, k: int, group: int | None) -> dict[str, Any]:
    """Kernel (``"rows"`` or ``"dot"``, see ``_qgemm_kernels.py``) and tiles. Up to :data:`ROWS_MAX` rows the row
    kernel (decode): ``BM`` the rows padded to a power of two, 4 output columns per program (2 for long K, as
    ``triton.gemv``: N / BN programs keep the loads in flight even for N = 1024), K tiles of 512 (the int4 group
    size when smaller). More rows: ``tl.dot`` tiles of 16 rows (up to 16) or 64, 64 columns, K tiles of 64 (the
    group size when smaller). A K tile never straddles an int4 group."""
    if m <= ROWS_MAX:
        bk = 512 if group is None else min(group, 512)
        return {"kernel": "rows", "BM": next_pow2(m), "BN": 2 if m <= 2 and k >= 3072 else 4, "BK": bk,
                "num_warps": 4}
    bk = 64 if group is None else min(group, 64)
    return {"kernel": "dot", "BM": 16 if m <= 16 else 64, "BN": 64, "BK": bk, "num_warps": 4}


def quantized_linear(x: torch.Tensor, qt: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantize(qt).T + bias`` without a float copy of the weight.

    Args:
        x: ``[..., K]`` float16/bfloat16 on CUDA (or CPU under ``TRITON_INTERPRET=1``), ``stride(-1) == 1``.
        qt: a ``QuantizedTensor`` of a ``[N, K]`` weight (``lz.quantized_linear`` validated it): int8 / fp8 with scale
            ``[N, 1]`` or ``[]``, or int4 with codes ``[N, K/2]``, scale and zero point ``[N, K/g]``.
        bias: ``[N]`` like x, or None.

    Returns:
        ``[..., N]`` in x's dtype, a new tensor.

    Raises:
        Nothing of its own (selection keeps the formats and dtypes this kernel takes); triton's compile/launch
        errors propagate (dispatch then falls back to the next kernel and charges the backend's health).
    """
    n, k = qt.shape
    out, x2, o2 = projection_out(x, n, KERNEL_ID)
    if out.numel() == 0:
        return out
    mod = _KERNELS.get()
    m = x2.shape[0]
    grouped = qt.format is QuantFormat.INT4
    cfg = config(m, n, k, qt.group_size if grouped else None)
    kernel = cfg.pop("kernel")
    scale = qt.scale.contiguous()  # scale and zero point share one row stride in the kernel
    per_channel = not grouped and scale.dim() == 2
    stride_s = scale.stride(0) if grouped or per_channel else 0
    zero = qt.zero_point.contiguous() if grouped else scale  # a pointer the kernel never reads for int8 / fp8
    b = bias if bias is not None else out  # likewise without a bias
    args = (x2, qt.data, scale, zero, b, o2, m, n, x2.stride(0), qt.data.stride(0), stride_s, o2.stride(0))
    meta = dict(K=k, G=qt.group_size if grouped else 1, GROUPED=grouped, PER_CHANNEL=per_channel,
                HAS_BIAS=bias is not None, **cfg)
    if kernel == "rows":
        launch(mod._qgemv_rows, (cdiv(n, cfg["BN"]),), *args, **meta)
    else:
        launch(mod._qgemm, (cdiv(m, cfg["BM"]), cdiv(n, cfg["BN"])), *args, UPCAST=mod.INTERPRETED, **meta)
    return out


def _check(ctx: SelectionContext) -> list[Reason]:
    out = []
    gran = ctx.quant_granularity or ""
    if gran.startswith("group:") and int(gran.split(":")[1]) % MIN_GROUP:
        out.append(Reason(ReasonCode.SHAPE_MISMATCH, f"int4 group size {gran.split(':')[1]} is not a multiple of "
                                                     f"{MIN_GROUP}"))
    fp8 = ctx.quant_format in (QuantFormat.FP8_E4M3.value, QuantFormat.FP8_E5M2.value)
    sm = ctx.device.sm if ctx.device is not None else None
    if fp8 and sm is not None and tuple(sm) < FP8_SM_MIN:
        out.append(Reason(ReasonCode.SM_TOO_OLD, f"float8 weights need SM >= {FP8_SM_MIN[0]}.{FP8_SM_MIN[1]} in "
                                                 f"Triton, this GPU is SM {sm[0]}.{sm[1]}"))
    return out


def priority_for(ctx: SelectionContext) -> int | None:
    """:data:`MEASURED_PRIORITY` (above the dequantize-then-GEMM default) for the weight formats measured faster, on
    the GPUs they were measured on; None (:data:`PRIORITY`) elsewhere."""
    sm = ctx.device.sm if ctx.device is not None else None
    if ctx.quant_format in MEASURED_FASTER and sm is not None and tuple(sm) >= MEASURED_SM_MIN:
        return MEASURED_PRIORITY
    return None


def kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.quantized_linear`` KernelSpec; its callable raises ``BackendNotAvailableError`` (with ``why``)
    when ``available`` is False."""
    fn: Callable[..., Any] = quantized_linear if available else missing(KERNEL_ID, why)
    return KernelSpec(KERNEL_ID, "quantized_linear", fn, priority=PRIORITY,
                      description="LayerZero Triton weight-only GEMM: int8 / fp8 / int4 codes decoded in registers, "
                                  "float32 accumulation (a fused low-bit GEMM)",
                      device_types=CUDA, dtypes=HALF, sm_min=SM_MIN, requires_stride_last_1=True,
                      deterministic=True, graph_safe=True, supports_backward=False, check=_check,
                      priority_for=priority_for)
