"""``triton.gemv``: our Triton skinny GEMM for ``lz.linear`` with 1-8 rows (decode's projections), CUDA only
(SM >= 8.0), float16/bfloat16.

Why: at M = 1 cuBLAS's tile choice reads some decode projections at a fraction of the memory bandwidth; in
CUDA graphs on an H200 this kernel took 0.27-0.8 of cuBLAS's time on Qwen3-0.6B's projections at one row,
about even at 8 rows; beyond that cuBLAS's tensor-core tiles win, so the kernel refuses more than ``max_rows``
rows (:class:`GemvKnobs`; measurements: ``benchmarks/results/knobs/triton_gemv.md``).

Contract: ``F.linear`` semantics; float32 accumulation, bias added in float32, one rounding (see
``_gemv_kernels.py``); no split-K (deterministic). x ``[..., K]`` and weight ``[N, K]`` need
``stride(-1) == 1``; x's leading dims are viewed as rows without a copy when their strides allow it.

Graph safety: no host synchronization, output allocated with ``torch.empty`` on the current stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core import knobs
from layerzero.core.context import SelectionContext
from layerzero.core.knobs import check_types, require
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

from ._common import CUDA, SM_MIN, LazyModule, cdiv, missing, next_pow2, projection_out, rows_2d
from ._launch import launch, pdl_kwargs

KERNEL_ID = "triton.gemv"
NORM_KERNEL_ID = "triton.rms_norm_linear"
SWIGLU_KERNEL_ID = "triton.swiglu_linear"
PRIORITY = 55
"""Above torch_native.linear (50) for the 1-8 rows it takes, eagerly and in graphs: faster in the engine on
the H200, batch 1 and throughput (``benchmarks/results/knobs/triton_gemv.md``). Measured on Hopper only: on
another GPU ``lz.tune`` compares it with cuBLAS."""
HALF = frozenset({torch.float16, torch.bfloat16})
KNOBS = "triton.gemv"
"""The name :class:`GemvKnobs` is registered under (``layerzero.core.knobs``)."""
_KERNELS = LazyModule("_gemv_kernels")


@dataclass(frozen=True, slots=True)
class GemvKnobs:
    """Tuning choices of ``triton.gemv`` / ``triton.rms_norm_linear`` / ``triton.swiglu_linear``, registered
    as ``"triton.gemv"``: defaults from H200 measurements (``benchmarks/results/knobs/triton_gemv.md``), read
    once per call (:func:`config`) and by the kernels' selection checks. Raises ``ConfigurationError`` for a
    field of the wrong type or out of range."""

    max_rows: int = 8
    """Most rows (M) the kernels take (a selection check): from 16 rows on, cuBLAS's tensor-core GEMM is as
    fast."""
    prefetch: bool = True
    """Use ``_gemv_prefetch`` (the weight slab loaded before the PDL wait) where :func:`prefetch_applies`:
    measured faster there in norm -> linear graphs; False: the row / dot kernels everywhere (A/B
    benchmarks)."""
    prefetch_max_k: int = 4096
    """Longest K the prefetch kernel takes: its slab lives in registers (``BN x next_pow2(K)`` elements a
    program)."""
    prefetch_slab: int = 8192
    """Elements of one prefetch program's slab (``BN x next_pow2(K)``): BN is this over next_pow2(K), 1-8."""
    prefetch_warps: int = 2
    """Warps per prefetch program: 2 made the engine's batch-1 decode graph fastest (698 against 724 µs with
    4)."""
    prefetch_long_k: tuple[int, int] = (16384, 8)
    """``(slab elements, warps)`` for the longest K (next_pow2(K) = ``prefetch_max_k``, e.g. the MLP down
    projection): measured 6 µs faster a graph there, slower on the other projections."""
    prefetch_wide: tuple[int, int] | None = None
    """``(slab elements, warps)`` of the prefetch kernel for one row of a weight wider than 16384 outputs (an
    LM head), or None: ``_gemv_dot`` there (the prefetch form measured within noise in the engine)."""
    prefetch_by_shape: tuple[tuple[tuple[int, int], tuple[int, int]], ...] = ()
    """``((N, K), (slab elements, warps))`` pairs: a weight's own prefetch config in place of
    ``prefetch_slab`` / ``prefetch_warps`` (per-projection A/B benchmarks; empty by default)."""
    trigger_first_rows: int = 1
    """Prefetch GEMVs of at most this many rows let the next kernel launch before their own PDL wait, so the
    next projection's slab streams while this one waits (the engine's batch-1 graph 671-677 -> 656-657 µs); 0:
    off."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("max_rows", "prefetch_max_k", "prefetch_slab"):
            require(getattr(self, name) >= 1, self, name, "an int >= 1")
        require(self.trigger_first_rows >= 0, self, "trigger_first_rows", "an int >= 0")
        require(self.prefetch_warps in _WARPS, self, "prefetch_warps", "a power of two in [1, 32]")
        for name, configs in (
            ("prefetch_long_k", [self.prefetch_long_k]),
            ("prefetch_wide", [self.prefetch_wide] if self.prefetch_wide else []),
            ("prefetch_by_shape", [cfg for _, cfg in self.prefetch_by_shape]),
        ):
            require(
                all(slab >= 1 and warps in _WARPS for slab, warps in configs),
                self,
                name,
                "(slab elements >= 1, warps a power of two in [1, 32]) configs",
            )


_WARPS = (1, 2, 4, 8, 16, 32)
knobs.register(KNOBS, GemvKnobs())


def prefetch_applies(m: int, n: int, k: int, kn: GemvKnobs | None = None) -> bool:
    """Whether ``_gemv_prefetch`` takes ``m`` rows of an ``[n, k]`` weight (K up to ``prefetch_max_k`` of
    ``kn``, default the knobs in force; the ``prefetch`` switch itself not read)."""
    max_k = (kn or knobs.get(KNOBS)).prefetch_max_k
    return k <= max_k and (m == 1 and n <= 16384 or m == 2 and n <= 4096 or m <= 4 and n <= 2048)


def config(
    m: int, n: int, k: int, *, prefetch: bool | None = None, kn: GemvKnobs | None = None
) -> dict[str, Any]:
    """Kernel (``"rows"`` or ``"dot"``, see ``_gemv_kernels.py``) and launch meta-parameters for ``m`` rows of
    a ``[n, k]`` weight: the best of ``benchmarks/gemv_configs.py`` on the H200 (Qwen3-0.6B shapes,
    ``benchmarks/results/gemv_configs_h200.md``). Few output columns (N <= 2048, long K: the attention output
    and MLP down projections): the row kernel with tiny column blocks, for enough programs. Wider N: the row
    kernel for one row, else ``tl.dot`` tiles (its 3-D accumulator spills beyond one row at wide tiles); the
    LM head (N > 16384) always ``tl.dot``. With the ``prefetch`` knob (or ``prefetch=True``), where it was
    faster (:func:`prefetch_applies`; one row of an LM head with ``prefetch_wide`` set): ``_gemv_prefetch``.
    ``kn``: the knobs (default: those in force, read once)."""
    kn = kn or knobs.get(KNOBS)
    wide = kn.prefetch_wide is not None and m == 1 and n > 16384 and k <= kn.prefetch_max_k
    if (kn.prefetch if prefetch is None else prefetch) and (wide or prefetch_applies(m, n, k, kn)):
        kp = next_pow2(k)
        if wide:
            slab, warps = kn.prefetch_wide
        else:
            slab, warps = (
                kn.prefetch_long_k if kp >= kn.prefetch_max_k else (kn.prefetch_slab, kn.prefetch_warps)
            )
        if kn.prefetch_by_shape:  # A/B overrides only: nothing to look up on the usual call
            slab, warps = dict(kn.prefetch_by_shape).get((n, k), (slab, warps))
        cfg = {
            "kernel": "prefetch",
            "BM": next_pow2(m),
            "BN": max(1, min(8, slab // kp)),
            "KP": kp,
            "num_warps": warps,
        }
        if m <= kn.trigger_first_rows:
            cfg["TRIGGER_FIRST"] = True
        return cfg
    if n <= 2048:
        return {
            "kernel": "rows",
            "BM": next_pow2(m),
            "BN": 2 if m <= 2 and k >= 3072 else 4,
            "BK": 512,
            "num_warps": 4,
        }
    if m == 1 and n <= 16384:
        return {"kernel": "rows", "BM": 1, "BN": 8, "BK": 512, "num_warps": 4}
    if n > 16384:
        return {"kernel": "dot", "BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4}
    return {
        "kernel": "dot",
        "BM": 16,
        "BN": 32 if n <= 4096 else 64,
        "BK": 128 if n <= 4096 else 256,
        "num_warps": 4,
        "num_stages": 4,
    }


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for at most ``max_rows`` rows (:class:`GemvKnobs`).

    Args:
        x: ``[..., K]`` float16/bfloat16 on CUDA, ``stride(-1) == 1``; M = rows (product of the leading dims)
            <= 8.
        weight: ``[N, K]`` like x (dtype, device), ``stride(-1) == 1``.
        bias: ``[N]`` like x, or None.

    Returns:
        ``[..., N]`` in x's dtype, a new contiguous tensor.

    Raises:
        Nothing of its own (``lz.linear`` validates; selection keeps M <= 8); triton's compile/launch errors
        propagate (dispatch then falls back to the next kernel and charges the backend's health).
    """
    n, k = weight.shape
    out, x2, o2 = projection_out(x, n, KERNEL_ID)
    if out.numel() == 0:
        return out
    mod = _KERNELS.get()
    m = x2.shape[0]
    cfg = config(m, n, k)  # a fresh dict per call
    kernel = cfg.pop("kernel")
    if kernel == "dot":
        cfg["UPCAST"] = mod.INTERPRETED and x.dtype == torch.bfloat16
    b = bias if bias is not None else out  # a pointer the kernel never reads (HAS_BIAS False)
    if kernel == "prefetch":  # no norm prologue: its pointers are never read (NORM False)
        launch(
            mod._gemv_prefetch,
            (cdiv(n, cfg["BN"]),),
            x2,
            weight,
            b,
            o2,
            m,
            n,
            x2.stride(0),
            weight.stride(0),
            o2.stride(0),
            out,
            out,
            out,
            0,
            0,
            0.0,
            K=k,
            HAS_BIAS=bias is not None,
            **cfg,
            **pdl_kwargs(x2, m),
        )
        return out
    launch(
        getattr(mod, _KERNEL_NAMES[kernel]),
        (cdiv(n, cfg["BN"]),),
        x2,
        weight,
        b,
        o2,
        m,
        n,
        x2.stride(0),
        weight.stride(0),
        o2.stride(0),
        K=k,
        HAS_BIAS=bias is not None,
        **cfg,
        **pdl_kwargs(x2, m),
    )
    return out


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``lz.rms_norm_linear`` in one launch of ``_gemv_prefetch`` with its norm prologue: every program
    normalizes the rows itself (after adding ``residual``, program 0 storing the sum) and multiplies its
    weight slab.

    Args:
        x: ``[..., K]`` float16/bfloat16 on CUDA, ``stride(-1) == 1``; M rows as :func:`prefetch_applies`
            allows.
        norm_weight: ``[K]`` like x. weight: ``[N, K]`` like x, ``stride(-1) == 1``. bias: ``[N]`` or None.
        residual: like x (``[..., K]``, ``stride(-1) == 1``) or None. eps: added to the mean square.

    Returns:
        y ``[..., N]`` (x's dtype, new, contiguous); with ``residual``, ``(y, x + residual)`` (the sum new,
        ``[..., K]``, contiguous).

    Raises:
        Nothing of its own (``lz.rms_norm_linear`` validates; selection keeps the rows and K in range).
    """
    n, k = weight.shape
    out, x2, o2 = projection_out(x, n, NORM_KERNEL_ID)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if out.numel() == 0:
        return out if h is None else (out, h)
    m = x2.shape[0]
    cfg = config(m, n, k, prefetch=True)
    cfg.pop("kernel")
    r2 = rows_2d(residual, "residual", NORM_KERNEL_ID) if residual is not None else x2
    h2 = h.view(m, k) if h is not None else x2
    launch(
        _KERNELS.get()._gemv_prefetch,
        (cdiv(n, cfg["BN"]),),
        x2,
        weight,
        bias if bias is not None else out,
        o2,
        m,
        n,
        x2.stride(0),
        weight.stride(0),
        o2.stride(0),
        norm_weight,
        r2,
        h2,
        r2.stride(0),
        h2.stride(0),
        float(eps),
        K=k,
        HAS_BIAS=bias is not None,
        NORM=True,
        RESIDUAL=residual is not None,
        **cfg,
        **pdl_kwargs(x2, m),
    )
    return out if h is None else (out, h)


_KERNEL_NAMES = {"rows": "_gemv_rows", "dot": "_gemv_dot"}  # _gemv_prefetch takes its own argument list


def _check(ctx: SelectionContext) -> list[Reason]:
    most = knobs.get(KNOBS).max_rows
    if ctx.batch is not None and ctx.batch > most:
        return [
            Reason(
                ReasonCode.SHAPE_MISMATCH,
                f"{ctx.batch} rows > {most}: a skinny-GEMM kernel for decode "
                "batches; cuBLAS's tensor-core GEMM is as fast or faster beyond",
            )
        ]
    return []


def kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.gemv`` KernelSpec; its callable raises ``BackendNotAvailableError`` (with ``why``) when
    ``available`` is False."""
    fn: Callable[..., Any] = gemv if available else missing(KERNEL_ID, why)
    return KernelSpec(
        KERNEL_ID,
        "linear",
        fn,
        priority=PRIORITY,
        description="LayerZero Triton skinny GEMM for 1-8 rows (decode), float32 accumulation",
        device_types=CUDA,
        dtypes=HALF,
        sm_min=SM_MIN,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
        check=_check,
    )


def swiglu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``lz.swiglu_linear`` in one launch of ``_gemv_prefetch`` with its SwiGLU prologue: every program forms
    ``silu(gate) * up`` for the rows itself and multiplies its weight slab.

    Args:
        gate, up: ``[..., I]`` float16/bfloat16 on CUDA, ``stride(-1) == 1`` (e.g. the halves of a packed
            gate/up projection); M rows as :func:`prefetch_applies` allows.
        weight: ``[N, I]`` like gate, ``stride(-1) == 1``. bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in gate's dtype, new, contiguous.

    Raises:
        Nothing of its own (``lz.swiglu_linear`` validates; selection keeps the rows and I in range).
    """
    n, k = weight.shape
    out, g2, o2 = projection_out(gate, n, SWIGLU_KERNEL_ID)
    if out.numel() == 0:
        return out
    m = g2.shape[0]
    u2 = rows_2d(up, "up", SWIGLU_KERNEL_ID)
    cfg = config(m, n, k, prefetch=True)
    cfg.pop("kernel")
    launch(
        _KERNELS.get()._gemv_prefetch,
        (cdiv(n, cfg["BN"]),),
        g2,
        weight,
        bias if bias is not None else out,
        o2,
        m,
        n,
        g2.stride(0),
        weight.stride(0),
        o2.stride(0),
        out,
        u2,
        out,
        u2.stride(0),
        0,
        0.0,
        K=k,
        HAS_BIAS=bias is not None,
        SWIGLU=True,
        **cfg,
        **pdl_kwargs(g2, m),
    )
    return out


def _check_prefetch(ctx: SelectionContext) -> list[Reason]:
    m, n, k = ctx.batch, ctx.intermediate_size, ctx.hidden_size
    kn = knobs.get(KNOBS)
    if m is None or n is None or k is None or not prefetch_applies(m, n, k, kn):
        return [
            Reason(
                ReasonCode.SHAPE_MISMATCH,
                f"{m} rows of a [{n}, {k}] weight: the fused prologue + skinny GEMM "
                f"takes K <= {kn.prefetch_max_k} and 1 row (N <= 16384), 2 (N <= "
                "4096) or up to 4 (N <= 2048), where its prefetch kernel was "
                "measured faster",
            )
        ]
    return []


def swiglu_kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.swiglu_linear`` KernelSpec (op ``swiglu_linear``); its callable raises
    ``BackendNotAvailableError`` (with ``why``) when ``available`` is False."""
    fn: Callable[..., Any] = swiglu_linear if available else missing(SWIGLU_KERNEL_ID, why)
    return KernelSpec(
        SWIGLU_KERNEL_ID,
        "swiglu_linear",
        fn,
        priority=PRIORITY,
        description="LayerZero Triton SwiGLU prologue fused into the skinny GEMM, decode rows (one "
        "launch where two were)",
        device_types=CUDA,
        dtypes=HALF,
        sm_min=SM_MIN,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
        check=_check_prefetch,
    )


def norm_kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.rms_norm_linear`` KernelSpec (op ``rms_norm_linear``); its callable raises
    ``BackendNotAvailableError`` (with ``why``) when ``available`` is False."""
    fn: Callable[..., Any] = rms_norm_linear if available else missing(NORM_KERNEL_ID, why)
    return KernelSpec(
        NORM_KERNEL_ID,
        "rms_norm_linear",
        fn,
        priority=PRIORITY,
        description="LayerZero Triton RMSNorm (+ residual) prologue fused into the skinny GEMM, decode "
        "rows (one launch where two were)",
        device_types=CUDA,
        dtypes=HALF,
        sm_min=SM_MIN,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
        check=_check_prefetch,
    )
