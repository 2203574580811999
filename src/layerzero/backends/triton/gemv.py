"""``triton.gemv``: our Triton skinny GEMM for ``lz.linear`` with 1-8 rows (decode's projections), CUDA only
(SM >= 8.0), float16/bfloat16.

Why: at M = 1 cuBLAS's tile choice reads some decode projections at a fraction of the memory bandwidth. Measured
inside CUDA graphs on an H200 (``benchmarks/bench_in_graph.py``, ``benchmarks/results/in_graph_h200.md``; Qwen3-0.6B
shapes, bf16): the attention output projection (K 2048 -> N 1024) 12.4 µs with cuBLAS vs 3.3 µs here, the MLP down
projection (3072 -> 1024) 6.3 vs 4.1 µs, gate/up (1024 -> 6144) 5.0 vs 4.0 µs; at 4 rows 7.9 vs 5.0 µs (output)
and even elsewhere; at 8 rows even (within 5%); beyond that cuBLAS's tensor-core tiles win, so the kernel refuses
more than :data:`MAX_ROWS` rows.

Contract: ``F.linear`` semantics; float32 accumulation, bias added in float32, one rounding (see
``_gemv_kernels.py``); no split-K (deterministic). x ``[..., K]`` and weight ``[N, K]`` need ``stride(-1) == 1``;
x's leading dims are viewed as rows without a copy when their strides allow it.

Graph safety: no host synchronization, output allocated with ``torch.empty`` on the current stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

from ._common import CUDA, SM_MIN, LazyModule, cdiv, missing, next_pow2, projection_out, rows_2d
from ._launch import launch, pdl_kwargs

KERNEL_ID = "triton.gemv"
NORM_KERNEL_ID = "triton.rms_norm_linear"
SWIGLU_KERNEL_ID = "triton.swiglu_linear"
PRIORITY = 55
"""Above torch_native.linear (50) for the 1-8 rows it takes, eagerly and in graphs (the default since 2026-11-25).
Measured on the H200 in the engine (nano-vllm workload, interleaved processes with every kernel already compiled,
``benchmarks/results/engine/h200/README.md``): preferred, 21,164 / 21,178 output tok/s against 20,802 with cuBLAS,
and batch-1 decode 725 / 726 tok/s against 578 / 591. Two earlier A/Bs had it slower in the throughput run (-19%,
then -3.7%); in this one the first process compiled kernels inside its timed run (15,381 tok/s, the sampler's
batch-size-dependent variants, since fixed), which is the likely cause of those. In graphs on an H100 too
(``benchmarks/results/in_graph_h100.md``): 0.52-0.99 of cuBLAS's time on every Qwen3-0.6B projection at 1-8 rows but
gate/up at 8 rows (1.07; 1.06 on the H200). Measured on Hopper only: on another GPU ``lz.tune`` compares it with
cuBLAS."""
MAX_ROWS = 8
"""Most rows (M) the kernel takes: from 16 rows on, cuBLAS's tensor-core GEMM is as fast or faster."""
HALF = frozenset({torch.float16, torch.bfloat16})
_KERNELS = LazyModule("_gemv_kernels")


PREFETCH = True
"""Use ``_gemv_prefetch`` (the weight slab loaded before the PDL wait) where it was measured faster: K <=
:data:`PREFETCH_MAX_K` and one row (N <= 16384), two rows (N <= 4096) or up to four (N <= 2048). On the H200 in
28-layer norm -> linear graphs with PDL (``benchmarks/gemv_prefetch.py``, ``benchmarks/results/gemv_prefetch_h200.md``),
one row: qkv 3.89 -> 3.10 µs, o 3.64 -> 2.11, gate/up 4.84 -> 4.22, down 4.52 -> 2.53 against the row kernel; from
4 rows of a wide N (8 of any) its per-row float32 products cost more than the loads save. False restores the row /
dot kernels everywhere (A/B benchmarks)."""
PREFETCH_MAX_K = 4096
"""Longest K the prefetch kernel takes: its slab lives in registers (``BN x next_pow2(K)`` elements per program)."""
PREFETCH_SLAB = 8192
"""Elements of one program's slab (``BN x next_pow2(K)``): BN is this over next_pow2(K), 1-8."""
PREFETCH_WARPS = 2
"""Warps per program of the prefetch kernel. 2 since 2026-11-28: the engine's batch-1 decode graph (Qwen3-0.6B, H200,
``benchmarks/engine/batch1_ab.py``, one process, variants alternating) replayed in 698-699 µs against 724-725 with 4
warps (8: 718-719; 1: 781-896; slabs of 4096 / 16384 elements with 2 warps: 738-739 / 820; 16384 with 8 warps:
700-701). A 28-layer chain of whole decode layers alone had suggested otherwise (``decode_layer_chain.py``: 8192 with 2
warps and 16384 with 8 both ~1 µs a layer faster than 4 warps, 4096 with 2 warps 2.5 slower), so the engine decides."""
PREFETCH_LONG_K = (16384, 8)
"""``(slab elements, warps)`` of the prefetch kernel for the longest K (next_pow2(K) = :data:`PREFETCH_MAX_K`, e.g. the
MLP down projection): in the same A/B the down projection (3072 -> 1024) with 16384 / 8 took the graph 698 -> 692 µs
(with 4 warps: 708); the same change for QKV, o or gate/up cost 7-9 µs each (``batch1_ab_gemv_per_projection.md``)."""
PREFETCH_WIDE: tuple[int, int] | None = None
"""``(slab elements, warps)`` of the prefetch kernel for one row of a weight wider than 16384 outputs (an LM head), or
None: ``_gemv_dot`` there. Measured on the H200 (``benchmarks/lm_head_configs.py``, ``[151936, 1024]`` bf16 in CUDA
graphs): slabs of 4096 elements (4 rows of K 1024) with one warp 70.4 µs (4.42 TB/s), ``_gemv_dot`` 71.9, cuBLAS 74.5."""
PREFETCH_BY_SHAPE: dict[tuple[int, int], tuple[int, int]] = {}
"""``(N, K)`` of a weight -> ``(slab elements, warps)`` of the prefetch kernel in place of :data:`PREFETCH_SLAB` /
:data:`PREFETCH_WARPS` (per-projection A/B benchmarks; empty by default)."""


TRIGGER_FIRST_ROWS = 1
"""Prefetch GEMVs of at most this many rows let the next kernel launch before their own PDL wait (``gdc_enter``'s
``FIRST``), so the next projection's slab streams while this one still waits (during attention, after the split
merge, which does the same: ``paged.TRIGGER_FIRST``). H200, the engine's batch-1 decode graph (Qwen3-0.6B,
``benchmarks/engine/batch1_ab.py``, 2026-11-28 seventh session): 656-657 µs against 671-677 with neither, 657-660 with
the merge and the output projection only, 666-667 with the merge alone; the projections alone 672-673. Measured at one
row only; 0 turns it off."""


def prefetch_applies(m: int, n: int, k: int) -> bool:
    """Whether ``_gemv_prefetch`` takes ``m`` rows of an ``[n, k]`` weight (see :data:`PREFETCH`; the switch itself
    not read)."""
    return k <= PREFETCH_MAX_K and (m == 1 and n <= 16384 or m == 2 and n <= 4096 or m <= 4 and n <= 2048)


def config(m: int, n: int, k: int, *, prefetch: bool | None = None) -> dict[str, Any]:
    """Kernel (``"rows"`` or ``"dot"``, see ``_gemv_kernels.py``) and launch meta-parameters for ``m`` rows of a
    ``[n, k]`` weight: the best of ``benchmarks/gemv_configs.py`` on the H200 (Qwen3-0.6B shapes,
    ``benchmarks/results/gemv_configs_h200.md``). Few output columns (N <= 2048, long K: the attention output and
    MLP down projections): the row kernel with tiny column blocks, for enough programs. Wider N: the row kernel
    for one row, else ``tl.dot`` tiles (its 3-D accumulator spills beyond one row at wide tiles); the LM head
    (N > 16384) always ``tl.dot``. With :data:`PREFETCH` (or ``prefetch=True``), where it was faster
    (:func:`prefetch_applies`; one row of an LM head with :data:`PREFETCH_WIDE` set): ``_gemv_prefetch``."""
    wide = PREFETCH_WIDE is not None and m == 1 and n > 16384 and k <= PREFETCH_MAX_K
    if (PREFETCH if prefetch is None else prefetch) and (wide or prefetch_applies(m, n, k)):
        kp = next_pow2(k)
        if wide:
            slab, warps = PREFETCH_WIDE
        else:
            slab, warps = PREFETCH_LONG_K if kp >= PREFETCH_MAX_K else (PREFETCH_SLAB, PREFETCH_WARPS)
        if PREFETCH_BY_SHAPE:  # A/B overrides only: nothing to look up on the usual call
            slab, warps = PREFETCH_BY_SHAPE.get((n, k), (slab, warps))
        cfg = {"kernel": "prefetch", "BM": next_pow2(m), "BN": max(1, min(8, slab // kp)), "KP": kp,
               "num_warps": warps}
        if m <= TRIGGER_FIRST_ROWS:
            cfg["TRIGGER_FIRST"] = True
        return cfg
    if n <= 2048:
        return {"kernel": "rows", "BM": next_pow2(m), "BN": 2 if m <= 2 and k >= 3072 else 4, "BK": 512,
                "num_warps": 4}
    if m == 1 and n <= 16384:
        return {"kernel": "rows", "BM": 1, "BN": 8, "BK": 512, "num_warps": 4}
    if n > 16384:
        return {"kernel": "dot", "BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4}
    return {"kernel": "dot", "BM": 16, "BN": 32 if n <= 4096 else 64, "BK": 128 if n <= 4096 else 256,
            "num_warps": 4, "num_stages": 4}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for at most :data:`MAX_ROWS` rows.

    Args:
        x: ``[..., K]`` float16/bfloat16 on CUDA, ``stride(-1) == 1``; M = rows (product of the leading dims) <= 8.
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
        launch(mod._gemv_prefetch, (cdiv(n, cfg["BN"]),), x2, weight, b, o2, m, n, x2.stride(0), weight.stride(0),
               o2.stride(0), out, out, out, 0, 0, 0.0, K=k, HAS_BIAS=bias is not None, **cfg, **pdl_kwargs(x2, m))
        return out
    launch(getattr(mod, _KERNEL_NAMES[kernel]), (cdiv(n, cfg["BN"]),), x2, weight, b, o2, m, n,
           x2.stride(0), weight.stride(0), o2.stride(0), K=k, HAS_BIAS=bias is not None, **cfg, **pdl_kwargs(x2, m))
    return out


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor | None, eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``lz.rms_norm_linear`` in one launch of ``_gemv_prefetch`` with its norm prologue: every program normalizes
    the rows itself (after adding ``residual``, program 0 storing the sum) and multiplies its weight slab.

    Args:
        x: ``[..., K]`` float16/bfloat16 on CUDA, ``stride(-1) == 1``; M rows as :func:`prefetch_applies` allows.
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
    launch(_KERNELS.get()._gemv_prefetch, (cdiv(n, cfg["BN"]),), x2, weight, bias if bias is not None else out, o2,
           m, n, x2.stride(0), weight.stride(0), o2.stride(0), norm_weight, r2, h2, r2.stride(0), h2.stride(0),
           float(eps), K=k, HAS_BIAS=bias is not None, NORM=True, RESIDUAL=residual is not None, **cfg,
           **pdl_kwargs(x2, m))
    return out if h is None else (out, h)


_KERNEL_NAMES = {"rows": "_gemv_rows", "dot": "_gemv_dot"}  # _gemv_prefetch takes its own argument list


def _check(ctx: SelectionContext) -> list[Reason]:
    if ctx.batch is not None and ctx.batch > MAX_ROWS:
        return [Reason(ReasonCode.SHAPE_MISMATCH, f"{ctx.batch} rows > {MAX_ROWS}: a skinny-GEMM kernel for decode "
                                                  "batches; cuBLAS's tensor-core GEMM is as fast or faster beyond")]
    return []


def kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.gemv`` KernelSpec; its callable raises ``BackendNotAvailableError`` (with ``why``) when
    ``available`` is False."""
    fn: Callable[..., Any] = gemv if available else missing(KERNEL_ID, why)
    return KernelSpec(KERNEL_ID, "linear", fn, priority=PRIORITY,
                      description="LayerZero Triton skinny GEMM for 1-8 rows (decode), float32 accumulation",
                      device_types=CUDA, dtypes=HALF, sm_min=SM_MIN, requires_stride_last_1=True,
                      deterministic=True, graph_safe=True, supports_backward=False, check=_check)


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``lz.swiglu_linear`` in one launch of ``_gemv_prefetch`` with its SwiGLU prologue: every program forms
    ``silu(gate) * up`` for the rows itself and multiplies its weight slab.

    Args:
        gate, up: ``[..., I]`` float16/bfloat16 on CUDA, ``stride(-1) == 1`` (e.g. the halves of a packed gate/up
            projection); M rows as :func:`prefetch_applies` allows.
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
    launch(_KERNELS.get()._gemv_prefetch, (cdiv(n, cfg["BN"]),), g2, weight, bias if bias is not None else out, o2,
           m, n, g2.stride(0), weight.stride(0), o2.stride(0), out, u2, out, u2.stride(0), 0, 0.0, K=k,
           HAS_BIAS=bias is not None, SWIGLU=True, **cfg, **pdl_kwargs(g2, m))
    return out


def _check_prefetch(ctx: SelectionContext) -> list[Reason]:
    m, n, k = ctx.batch, ctx.intermediate_size, ctx.hidden_size
    if m is None or n is None or k is None or not prefetch_applies(m, n, k):
        return [Reason(ReasonCode.SHAPE_MISMATCH, f"{m} rows of a [{n}, {k}] weight: the fused prologue + skinny GEMM "
                                                  "takes K <= 4096 and 1 row (N <= 16384), 2 (N <= 4096) or up to "
                                                  "4 (N <= 2048), where its prefetch kernel was measured faster")]
    return []


def swiglu_kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.swiglu_linear`` KernelSpec (op ``swiglu_linear``); its callable raises
    ``BackendNotAvailableError`` (with ``why``) when ``available`` is False."""
    fn: Callable[..., Any] = swiglu_linear if available else missing(SWIGLU_KERNEL_ID, why)
    return KernelSpec(SWIGLU_KERNEL_ID, "swiglu_linear", fn, priority=PRIORITY,
                      description="LayerZero Triton SwiGLU prologue fused into the skinny GEMM, decode rows (one "
                                  "launch where two were)",
                      device_types=CUDA, dtypes=HALF, sm_min=SM_MIN, requires_stride_last_1=True,
                      deterministic=True, graph_safe=True, supports_backward=False, check=_check_prefetch)


def norm_kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.rms_norm_linear`` KernelSpec (op ``rms_norm_linear``); its callable raises
    ``BackendNotAvailableError`` (with ``why``) when ``available`` is False."""
    fn: Callable[..., Any] = rms_norm_linear if available else missing(NORM_KERNEL_ID, why)
    return KernelSpec(NORM_KERNEL_ID, "rms_norm_linear", fn, priority=PRIORITY,
                      description="LayerZero Triton RMSNorm (+ residual) prologue fused into the skinny GEMM, decode "
                                  "rows (one launch where two were)",
                      device_types=CUDA, dtypes=HALF, sm_min=SM_MIN, requires_stride_last_1=True,
                      deterministic=True, graph_safe=True, supports_backward=False, check=_check_prefetch)
