"""``triton.rms_norm``: our Triton RMSNorm with the fused residual add, CUDA only (SM >= 8.0).

Contract: identical to ``lz.rms_norm`` and the reference kernel with Hugging Face ``LlamaRMSNorm`` rounding
(normalize in float32, cast to x's dtype, multiply by the weight): see ``_norm_kernels.py``. One kernel pass
per call: with ``residual`` it returns ``(y, h)`` where ``h = x + residual`` in x's dtype, written by the same
kernel that writes y. Rows may be strided (``stride(-1) == 1`` is required, any row stride): the leading
dims are viewed as one row dim without a copy when their strides allow it; otherwise (e.g. a transposed
``[S, B, H]`` view) the input is copied to contiguous memory first and a DEBUG log says so.

Graph safety: the launch does no host synchronization and allocates with ``torch.empty`` on the current
stream, so it can be captured once the specialization (dtypes, hidden size, 16-divisibility of the row
strides) was compiled by ``lz.warmup`` or a first eager call. Which rows are tiled, and the tile, come from
the :class:`NormKnobs` in force (``"triton.norms"``: a graph keeps what its capture saw).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core import knobs
from layerzero.core.context import SelectionContext
from layerzero.core.knobs import check_types, require
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, missing, next_pow2, num_warps_for, rows_2d
from ._launch import launch, pdl_kwargs

log = logging.getLogger("layerzero.backends.triton")
KERNEL_ID = "triton.rms_norm"
PRIORITY = 45
"""Below torch_native (50): on the H200 (bf16, H=4096) the Triton launch makes it slower for decode-sized
inputs (30 vs 12-19 µs for 1-64 rows) while it wins for 8192 rows (42 vs 46 µs; fused residual 75 vs 94 µs);
lz.tune promotes it there (benchmarks/results/norm_rope_h200.md)."""
CAPTURE_PRIORITY = 55
"""Above torch_native (50) inside a CUDA graph, where the launch is paid once at capture: one fused pass
(residual add included) measured 0.47-0.69 of torch's time at 1-16 rows on the H200, Qwen3 shapes
(``[M, 1024]``, per-head ``[M, 16, 128]``; ``benchmarks/results/in_graph_h200.md``)."""
MAX_HIDDEN = 65536
KNOBS = "triton.norms"
"""The name :class:`NormKnobs` is registered under (``layerzero.core.knobs``)."""
_KERNELS = LazyModule("_norm_kernels")


@dataclass(frozen=True, slots=True)
class NormKnobs:
    """The row tiling of ``triton.rms_norm``, registered as ``"triton.norms"``; read once per call. Written,
    not measured: no GPU run has varied them (``benchmarks/results/knobs/triton_norms.md``). Both are
    compile-time constants of the kernel (a new value compiles a new specialization). Raises
    ``ConfigurationError`` for a field of the wrong type or out of range."""

    one_pass_max: int = 8192
    """Longest row kept whole in registers (elements, a power of two; compared with the row's next power of
    two); longer rows take the two-loop path."""
    tile: int = 4096
    """Tile width of the two-loop path (elements, a power of two)."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("one_pass_max", "tile"):
            value = getattr(self, name)
            require(value >= 1 and next_pow2(value) == value, self, name, "a power of two >= 1")


knobs.register(KNOBS, NormKnobs())


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019) in one Triton pass, with an optional fused residual add.

    Args:
        x: ``[..., H]`` float16/bfloat16/float32 with ``stride(-1) == 1`` (H hidden size, 1..65536).
        weight: ``[H]`` float16/bfloat16/float32 (any 1-D stride).
        eps: added to the mean square (unitless, > 0).
        residual: None or ``[..., H]`` like x (same dtype and device).

    Returns:
        y ``[..., H]`` in x's dtype (a new contiguous tensor); with ``residual`` the pair ``(y, h)`` where
        ``h = x + residual`` rounded to x's dtype and ``y = rms_norm(h)`` (vLLM's fused_add_rms_norm
        contract, without the in-place update).

    Raises:
        Nothing of its own (inputs are validated by ``lz.rms_norm``); triton's compile/launch errors propagate
        (dispatch then falls back to the next kernel and charges the backend's health).
    """
    h_dim = x.shape[-1]
    if x.numel() == 0:
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return y if residual is None else (y, torch.empty_like(y))
    mod = _KERNELS.get()
    kn = knobs.get(KNOBS)
    x2 = rows_2d(x, "x", KERNEL_ID)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, h_dim)
    if residual is not None:
        r2 = rows_2d(residual, "residual", KERNEL_ID)
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        h2 = h.view(-1, h_dim)
    else:
        r2, h, h2 = x2, None, y2  # unused pointers (HAS_RES=False)
    width = next_pow2(h_dim)
    one_pass = width <= kn.one_pass_max
    block = width if one_pass else kn.tile
    launch(
        mod._rms_norm_fwd,
        (x2.shape[0],),
        x2,
        r2,
        weight,
        y2,
        h2,
        x2.stride(0),
        r2.stride(0),
        y2.stride(0),
        h2.stride(0),
        weight.stride(0),
        h_dim,
        float(eps),
        HAS_RES=residual is not None,
        ONE_PASS=one_pass,
        BLOCK=block,
        num_warps=num_warps_for(block),
        **pdl_kwargs(x2, x2.shape[0]),
    )
    return y if residual is None else (y, h)


def _check(ctx: SelectionContext) -> list[Reason]:
    out = []
    if ctx.hidden_size is not None and ctx.hidden_size > MAX_HIDDEN:
        out.append(
            Reason(
                ReasonCode.HIDDEN_SIZE_UNSUPPORTED,
                f"hidden size {ctx.hidden_size} > {MAX_HIDDEN} (triton.rms_norm tiles rows up to 64K)",
            )
        )
    if ctx.param_dtype is not None and ctx.param_dtype not in FLOATS:
        out.append(
            Reason(
                ReasonCode.DTYPE_UNSUPPORTED,
                f"weight dtype {str(ctx.param_dtype).removeprefix('torch.')} not in "
                "[bfloat16, float16, float32]",
            )
        )
    return out


def kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.rms_norm`` KernelSpec; its callable raises ``BackendNotAvailableError`` (with ``why``)
    when ``available`` is False."""
    fn: Callable[..., Any] = rms_norm if available else missing(KERNEL_ID, why)
    return KernelSpec(
        KERNEL_ID,
        "rms_norm",
        fn,
        priority=PRIORITY,
        capture_priority=CAPTURE_PRIORITY,
        description="LayerZero Triton RMSNorm, one program per row, float32 accumulation, HF Llama "
        "rounding, fused residual add in the same pass",
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
        check=_check,
    )
