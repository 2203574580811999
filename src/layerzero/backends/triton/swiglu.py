"""``triton.swiglu``: our Triton SwiGLU (``silu(gate) * up``), CUDA only (SM >= 8.0).

Contract: identical to ``lz.swiglu`` and the reference kernel (Hugging Face ``LlamaMLP`` rounding: silu in
float32 rounded to the input dtype, product in float32 rounded once): see ``_swiglu_kernels.py``. One
elementwise pass, new output tensor, inputs never written. Rows may be strided (``stride(-1) == 1`` is
required, any row stride): the leading dims are viewed as one row dim without a copy when their strides allow
it; otherwise the input is copied to contiguous memory first and a DEBUG log says so.

Graph safety: the launch does no host synchronization and allocates with ``torch.empty`` on the current
stream, so it can be captured once the specialization (dtype, 16-divisibility of sizes and strides) was
compiled by ``lz.warmup`` or a first eager call. The column block comes from the :class:`SwigluKnobs` in force
(``"triton.swiglu"``: a graph keeps what its capture saw).
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

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, cdiv, missing, next_pow2, rows_2d
from ._launch import launch, pdl_kwargs

log = logging.getLogger("layerzero.backends.triton")
KERNEL_ID = "triton.swiglu"
PRIORITY = 45
"""Below torch_native (50, ``F.silu(gate) * up``: two elementwise launches): not yet measured on the H200;
lz.tune promotes it where its single pass is faster."""
CAPTURE_PRIORITY = 55
"""Above torch_native (50) inside a CUDA graph (launch paid once at capture): its one pass measured 0.29-0.45
of torch's two kernels at 1-16 rows on the H200 (I = 3072; ``benchmarks/results/in_graph_h200.md``)."""
GRID_Y_MAX = 65535
"""CUDA's limit on grid axis 1 (y), where the column blocks go (rows go on axis 0, CUDA x, up to 2^31 - 1):
the largest intermediate size is ``GRID_Y_MAX`` blocks (:func:`max_inter`)."""
KNOBS = "triton.swiglu"
"""The name :class:`SwigluKnobs` is registered under (``layerzero.core.knobs``)."""
_KERNELS = LazyModule("_swiglu_kernels")


@dataclass(frozen=True, slots=True)
class SwigluKnobs:
    """The column tiling of ``triton.swiglu``, registered as ``"triton.swiglu"``; read once per call (and by
    the selection check, :func:`max_inter`). Written, not measured: no GPU run has varied it
    (``benchmarks/results/knobs/triton_swiglu.md``). A compile-time constant of the kernel (a new value
    compiles a new specialization). Raises ``ConfigurationError`` for a field of the wrong type or out of
    range."""

    block: int = 1024
    """Columns per program (elements, a power of two)."""

    def __post_init__(self) -> None:
        check_types(self)
        b = self.block
        require(b >= 1 and next_pow2(b) == b, self, "block", "a power of two >= 1")


knobs.register(KNOBS, SwigluKnobs())


def max_inter(kn: SwigluKnobs | None = None) -> int:
    """Largest intermediate size: :data:`GRID_Y_MAX` column blocks of the knobs' ``block`` (``kn``, default
    those in force; 65535 x 1024 by default)."""
    return GRID_Y_MAX * (kn or knobs.get(KNOBS)).block


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020) in one Triton pass: ``out = silu(gate) * up``.

    Args:
        gate: ``[..., I]`` float16/bfloat16/float32 with ``stride(-1) == 1`` (I intermediate size >= 1).
        up: ``[..., I]`` like gate (same shape, dtype, device; ``stride(-1) == 1``).

    Returns:
        out ``[..., I]`` in gate's dtype, a new contiguous tensor.

    Raises:
        Nothing of its own (inputs are validated by ``lz.swiglu``); triton's compile/launch errors propagate
        (dispatch then falls back to the next kernel and charges the backend's health).
    """
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return out
    mod = _KERNELS.get()
    block = knobs.get(KNOBS).block
    inter = gate.shape[-1]
    g2, u2, o2 = rows_2d(gate, "gate", KERNEL_ID), rows_2d(up, "up", KERNEL_ID), out.view(-1, inter)
    launch(
        mod._swiglu_fwd,
        (g2.shape[0], cdiv(inter, block)),
        g2,
        u2,
        o2,
        g2.stride(0),
        u2.stride(0),
        o2.stride(0),
        inter,
        BLOCK=block,
        num_warps=4,
        **pdl_kwargs(g2, g2.shape[0]),
    )
    return out


def _check(ctx: SelectionContext) -> list[Reason]:
    if ctx.hidden_size is None:
        return []
    kn = knobs.get(KNOBS)
    if ctx.hidden_size > max_inter(kn):
        return [
            Reason(
                ReasonCode.HIDDEN_SIZE_UNSUPPORTED,
                f"intermediate size {ctx.hidden_size} > {max_inter(kn)} "
                f"({GRID_Y_MAX} column blocks of {kn.block})",
            )
        ]
    return []


def kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.swiglu`` KernelSpec; its callable raises ``BackendNotAvailableError`` (with ``why``)
    when ``available`` is False."""
    fn: Callable[..., Any] = swiglu if available else missing(KERNEL_ID, why)
    return KernelSpec(
        KERNEL_ID,
        "swiglu",
        fn,
        priority=PRIORITY,
        capture_priority=CAPTURE_PRIORITY,
        description="LayerZero Triton SwiGLU, one elementwise pass, float32 math, HF LlamaMLP rounding",
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
        check=_check,
    )
