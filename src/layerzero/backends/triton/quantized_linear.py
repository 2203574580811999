"""``triton.quantized_linear``: the fused low-bit GEMM of ``lz.quantized_linear`` (int8 / fp8 per output
channel or per tensor, int4 in groups along K), CUDA only (SM >= 8.0; fp8 weights SM >= 8.9), fp16 / bf16
activations. The ``@triton.jit`` code and its numerics are in ``_qgemm_kernels.py`` (``tl.dot`` tiles, and the
row kernel for int8 / fp8 decode) and ``_qgemv_int4_kernels.py`` (int4 decode: each packed byte read once,
Marlin-style magic-number decode, the weight slab loaded before the PDL wait as ``triton.gemv``'s prefetch
kernel does).

Status: correct under the Triton interpreter (CPU tests against the float32 reference and a float64 oracle)
and on an H200 (``tests/gpu/test_gpu_quantized_linear.py``, the int4 decode kernel included). The default for
int8 and fp8 e4m3 weights, and for int4 at decode rows (``QuantizedLinearKnobs.int4_measured_faster``), on
Hopper and newer (:func:`priority_for`: measured there); opt in elsewhere (:data:`PRIORITY` below
``torch_native.quantized_linear``): ``lz.lock("quantized_linear",
"triton.quantized_linear")``. The engine's ``LLM(quantization=...)`` calls ``lz.quantized_linear``, so the
default or a lock reaches it.

Graph safety: no host synchronization; the output is allocated with ``torch.empty`` on the current stream. The
int4 decode kernel is PDL-launched inside CUDA graphs on SM >= 9.0 (``_launch.pdl_kwargs``) and reads the
weight (codes, scales, zero points) and the bias before its wait, as ``triton.gemv`` reads its weight:
parameters that no kernel of a forward writes (``_gdc_kernels.py`` says when that would race).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core import knobs
from layerzero.core.context import SelectionContext
from layerzero.core.knobs import check_types, require
from layerzero.core.quant_format import QuantFormat
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

from ._common import CUDA, SM_MIN, LazyModule, cdiv, missing, next_pow2, projection_out
from ._launch import launch, pdl_kwargs

KERNEL_ID = "triton.quantized_linear"
PRIORITY = 40
"""Below ``torch_native.quantized_linear`` (50) where no GPU measurement says otherwise
(:func:`priority_for`)."""
MEASURED_PRIORITY = 55
MEASURED_FASTER = frozenset({QuantFormat.INT8.value, QuantFormat.FP8_E4M3.value})
"""Weight formats the engine ran faster with this kernel than with dequantize + cuBLAS on an H200 (int4:
``QuantizedLinearKnobs.int4_measured_faster``; fp8 e5m2 was not measured and stays opt in). Numbers:
benchmarks/results/history.md."""
MEASURED_SM_MIN = (9, 0)
"""Where those measurements ran (Hopper); older GPUs keep :data:`PRIORITY` until measured (``lz.tune``)."""
HALF = frozenset({torch.float16, torch.bfloat16})
MIN_GROUP = 16
"""int4 groups of at least 16 along K, a power of two (one ``tl.dot`` K tile per group at least; Triton's
tiles are powers of two)."""
FP8_SM_MIN = (8, 9)
"""Triton converts float8 e4m3 / e5m2 on SM >= 8.9 (Ada, Hopper)."""
_KERNELS = LazyModule("_qgemm_kernels")
_INT4_KERNELS = LazyModule("_qgemv_int4_kernels")
KNOBS = "triton.quantized_linear"
"""The name :class:`QuantizedLinearKnobs` is registered under (``layerzero.core.knobs``)."""
_WARPS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True, slots=True)
class QuantizedLinearKnobs:
    """Tuning choices of ``triton.quantized_linear``, registered as ``"triton.quantized_linear"``: which
    kernel takes which rows and the int4 decode kernel's (``_qgemv_int4``) launch configs; read once per call
    (:func:`config`) and by selection (:func:`priority_for`). Measurements:
    ``benchmarks/results/knobs/triton_quantized_linear.md``. Raises ``ConfigurationError`` for a field of the
    wrong type or out of range."""

    rows_max: int = 8
    """Rows up to which the row kernel ``_qgemv_rows`` (float32 multiply-adds, small column tiles) runs
    instead of ``tl.dot`` tiles, where ``_qgemv_int4`` does not: decode's rows."""
    int4_decode: bool = True
    """Run int4 weights at up to ``int4_rows_max`` rows through ``_qgemv_int4`` (each packed byte read once,
    the slab before the PDL wait); False: ``_qgemv_rows`` for them (A/Bs:
    ``benchmarks/bench_int4_gemv.py``)."""
    int4_rows_max: int = 8
    """Most rows ``_qgemv_int4`` takes (its float32 multiply-adds grow with the rows); more take ``tl.dot``
    tiles. At 8 rows still 2.2-6.3x faster than dequantize + cuBLAS on the H200."""
    int4_chunk_k: int = 4096
    """Longest K (codes a row, a power of two) whose whole rows a program holds in registers (the slab mode,
    every load before the PDL wait); longer rows loop over chunks of this many codes."""
    int4_configs: tuple[tuple[int, int, int], ...] = (
        (1024, 8192, 2),  # Qwen3-0.6B QKV (4096 x 1024), gate/up (6144 x 1024): BN 8
        (2048, 8192, 2),  # attention output (1024 x 2048): BN 4
        (4096, 12288, 2),  # MLP down (1024 x 3072): BN 4 (24 groups of 128 as 16 + 8)
    )
    """``(K at most, slab codes, warps)`` rows of ``_qgemv_int4``, the first whose K bound holds: ~128-192
    codes a thread keep every value in registers (chosen from sm_90 code, ``bench_int4_gemv.py --grid``)."""
    int4_loop_config: tuple[int, int] = (8192, 4)
    """``(slab codes, warps)`` for K beyond the last ``int4_configs`` bound (the loop mode): 4 warps keep two
    chunks in flight in registers."""
    int4_by_shape: tuple[tuple[tuple[int, int], tuple[int, int]], ...] = ()
    """``((N, K), (slab codes, warps))`` pairs: a weight's own config in place of ``int4_configs``
    (per-projection A/Bs; empty by default)."""
    int4_bn_max: int = 16
    """Most output columns a ``_qgemv_int4`` program owns (a power of two)."""
    int4_measured_faster: bool = True
    """:func:`priority_for` makes this kernel the default for int4 weights at up to ``int4_rows_max`` rows on
    SM >= :data:`MEASURED_SM_MIN` (measured faster there than dequantize + cuBLAS); False: opt in."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("rows_max", "int4_rows_max"):
            require(getattr(self, name) >= 1, self, name, "an int >= 1")
        for name in ("int4_chunk_k", "int4_bn_max"):
            value = getattr(self, name)
            require(value >= 1 and next_pow2(value) == value, self, name, "a power of two >= 1")
        for name, configs in (
            ("int4_configs", [cfg[1:] for cfg in self.int4_configs]),
            ("int4_loop_config", [self.int4_loop_config]),
            ("int4_by_shape", [cfg for _, cfg in self.int4_by_shape]),
        ):
            require(
                all(slab >= 1 and warps in _WARPS for slab, warps in configs),
                self,
                name,
                "(slab codes >= 1, warps a power of two in [1, 32]) configs",
            )


knobs.register(KNOBS, QuantizedLinearKnobs())


def _prev_pow2(n: int) -> int:
    """Largest power of two <= ``n`` (``n`` >= 1)."""
    return 1 << (n.bit_length() - 1)


def int4_decode_applies(m: int, group: int, kn: QuantizedLinearKnobs | None = None) -> bool:
    """Whether ``_qgemv_int4`` takes ``m`` rows (M) of an int4 weight in groups of ``group`` elements along K
    (the knobs' ``int4_decode`` on, ``m <= int4_rows_max``, a power-of-two group of at least 2; ``kn``: the
    knobs, default those in force). Raises nothing."""
    kn = kn or knobs.get(KNOBS)
    return kn.int4_decode and m <= kn.int4_rows_max and group >= 2 and group & (group - 1) == 0


def int4_config(m: int, n: int, k: int, group: int, kn: QuantizedLinearKnobs | None = None) -> dict[str, Any]:
    """Launch meta-parameters of ``_qgemv_int4`` (Marlin-style int4 decode GEMV, ``_qgemv_int4_kernels.py``)
    for ``m`` rows (M) of an int4 ``[n, k]`` weight (N out_features, K in_features) in groups of ``group`` (a
    power of two dividing K): ``{"kernel": "int4", "NG": K / group groups per row, "GH": group / 2 bytes per
    group, "NGA", "NGB": the groups held at once in one or two power-of-two parts (the slab mode when NGA +
    NGB >= NG, else chunks of NGA groups), "BM": M padded to a power of two, "BN": columns per program,
    "num_warps"}`` from the knobs' ``int4_configs``, ``int4_loop_config`` and ``int4_by_shape`` (``kn``,
    default those in force). Raises nothing (a new dict per call)."""
    kn = kn or knobs.get(KNOBS)
    ng = k // group
    most = max(1, kn.int4_chunk_k // group)  # groups held at once
    if ng <= most:
        nga = _prev_pow2(ng)
        ngb = next_pow2(ng - nga) if ng > nga else 0
    else:
        nga, ngb = most, 0
    slab, warps = next(((s, w) for kmax, s, w in kn.int4_configs if k <= kmax), kn.int4_loop_config)
    if kn.int4_by_shape:  # A/B overrides only: nothing to look up on the usual call
        slab, warps = dict(kn.int4_by_shape).get((n, k), (slab, warps))
    bn = _prev_pow2(max(1, min(kn.int4_bn_max, slab // ((nga + ngb) * group))))
    return {
        "kernel": "int4",
        "NG": ng,
        "GH": group // 2,
        "NGA": nga,
        "NGB": ngb,
        "BM": next_pow2(m),
        "BN": bn,
        "num_warps": warps,
    }


def config(
    m: int, n: int, k: int, group: int | None, kn: QuantizedLinearKnobs | None = None
) -> dict[str, Any]:
    """Kernel (``"int4"``, ``"rows"`` or ``"dot"``) and tiles for ``m`` rows of a ``[n, k]`` weight
    (``group``: the int4 group size, None for int8 / fp8; ``kn``: the knobs, default those in force, read
    once). int4 where :func:`int4_decode_applies`: ``_qgemv_int4`` (:func:`int4_config`). Else up to the
    knobs' ``rows_max`` rows the row kernel ``_qgemv_rows`` (decode): ``BM`` the rows padded to a power of
    two, 4 output columns per program (2 for long K, as ``triton.gemv``: N / BN programs keep the loads in
    flight even for N = 1024), K tiles of 512 (the int4 group size when smaller). More rows: ``_qgemm``'s
    ``tl.dot`` tiles of 16 rows (up to 16) or 64, 64 columns, K tiles of 64 (the group size when smaller). A K
    tile never straddles an int4 group."""
    kn = kn or knobs.get(KNOBS)
    if group is not None and int4_decode_applies(m, group, kn):
        return int4_config(m, n, k, group, kn)
    if m <= kn.rows_max:
        bk = 512 if group is None else min(group, 512)
        return {
            "kernel": "rows",
            "BM": next_pow2(m),
            "BN": 2 if m <= 2 and k >= 3072 else 4,
            "BK": bk,
            "num_warps": 4,
        }
    bk = 64 if group is None else min(group, 64)
    return {"kernel": "dot", "BM": 16 if m <= 16 else 64, "BN": 64, "BK": bk, "num_warps": 4}


def quantized_linear(x: torch.Tensor, qt: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantize(qt).T + bias`` without a float copy of the weight (Marlin's / vLLM's weight-only
    GEMMs: codes decoded in registers; int4 in GPTQ / AWQ's asymmetric layout as ``lz.quantize`` packs it).
    Kernel by :func:`config`: int4 at up to ``int4_rows_max`` rows ``_qgemv_int4`` (PDL-launched in CUDA
    graphs on SM >= 9.0), int8 / fp8 up to ``rows_max`` rows ``_qgemv_rows`` (:class:`QuantizedLinearKnobs`),
    more rows ``_qgemm``'s
    ``tl.dot`` tiles.

    Args:
        x: ``[..., K]`` float16/bfloat16 on CUDA (or CPU under ``TRITON_INTERPRET=1``), ``stride(-1) == 1``;
            M rows = the product of the leading dims.
        qt: a ``QuantizedTensor`` of a ``[N, K]`` weight (``lz.quantized_linear`` validated it): int8 / fp8
            with scale ``[N, 1]`` or ``[]`` (float32), or int4 with codes uint8 ``[N, K/2]`` (low nibble
            first), scale float32 and zero point uint8 ``[N, K/g]``, g a power of two >= 16 (selection refuses
            others).
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
    if kernel == "int4":
        mod4 = _INT4_KERNELS.get()
        launch(
            mod4._qgemv_int4,
            (cdiv(n, cfg["BN"]),),
            *args,
            mod4.MAGIC_BITS,
            HAS_BIAS=bias is not None,
            **cfg,
            **pdl_kwargs(x2, m),
        )
        return out
    mod = _KERNELS.get()
    meta = dict(
        K=k,
        G=qt.group_size if grouped else 1,
        GROUPED=grouped,
        PER_CHANNEL=per_channel,
        HAS_BIAS=bias is not None,
        **cfg,
    )
    if kernel == "rows":
        launch(mod._qgemv_rows, (cdiv(n, cfg["BN"]),), *args, **meta)
    else:
        launch(mod._qgemm, (cdiv(m, cfg["BM"]), cdiv(n, cfg["BN"])), *args, UPCAST=mod.INTERPRETED, **meta)
    return out


def _check(ctx: SelectionContext) -> list[Reason]:
    out = []
    gran = ctx.quant_granularity or ""
    if gran.startswith("group:"):
        g = int(gran.split(":")[1])
        if g < MIN_GROUP or g & (g - 1):
            out.append(
                Reason(
                    ReasonCode.SHAPE_MISMATCH,
                    f"int4 group size {g} is not a power of two >= {MIN_GROUP} "
                    "(Triton's tiles are powers of two)",
                )
            )
    fp8 = ctx.quant_format in (QuantFormat.FP8_E4M3.value, QuantFormat.FP8_E5M2.value)
    sm = ctx.device.sm if ctx.device is not None else None
    if fp8 and sm is not None and tuple(sm) < FP8_SM_MIN:
        out.append(
            Reason(
                ReasonCode.SM_TOO_OLD,
                f"float8 weights need SM >= {FP8_SM_MIN[0]}.{FP8_SM_MIN[1]} in "
                f"Triton, this GPU is SM {sm[0]}.{sm[1]}",
            )
        )
    return out


def priority_for(ctx: SelectionContext) -> int | None:
    """:data:`MEASURED_PRIORITY` (above the dequantize-then-GEMM default) for the weight formats measured
    faster, on the GPUs they were measured on: :data:`MEASURED_FASTER`, and int4 at up to the knobs'
    ``int4_rows_max`` rows while ``int4_measured_faster`` is set; None (:data:`PRIORITY`) elsewhere."""
    sm = ctx.device.sm if ctx.device is not None else None
    if sm is None or tuple(sm) < MEASURED_SM_MIN:
        return None
    if ctx.quant_format in MEASURED_FASTER:
        return MEASURED_PRIORITY
    kn = knobs.get(KNOBS)
    if (
        kn.int4_measured_faster
        and ctx.quant_format == QuantFormat.INT4.value
        and ctx.batch is not None
        and ctx.batch <= kn.int4_rows_max
    ):
        return MEASURED_PRIORITY
    return None


def kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.quantized_linear`` KernelSpec; its callable raises ``BackendNotAvailableError`` (with
    ``why``) when ``available`` is False."""
    fn: Callable[..., Any] = quantized_linear if available else missing(KERNEL_ID, why)
    return KernelSpec(
        KERNEL_ID,
        "quantized_linear",
        fn,
        priority=PRIORITY,
        description="LayerZero Triton weight-only GEMM: int8 / fp8 / int4 codes decoded in registers, "
        "float32 accumulation (a fused low-bit GEMM)",
        device_types=CUDA,
        dtypes=HALF,
        sm_min=SM_MIN,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
        check=_check,
        priority_for=priority_for,
    )
