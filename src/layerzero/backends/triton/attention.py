"""``triton.attention``: our Triton FlashAttention-2 forward with ALiBi computed in the kernel (op
``attention``), CUDA only (SM >= 8.0).

Why: ``lz.attention(q, k, v, alibi_slopes=...)`` on a GPU without FlashAttention 2 went to ``torch_sdpa.math``
or the reference with an explicit ``[B, Hq, Sq, Sk]`` float32 bias (O(Sq Sk) memory, several passes over it).
Here the bias ``-slope[b, h] * |i + Sk - Sq - j|`` (Press et al. 2022; flash-attn's convention, as
``lz.attention`` defines it) is computed per score tile from the ``[Hq]`` / ``[B, Hq]`` slopes inside
FlashAttention-2's online softmax (Dao 2023): O(Sq + Sk) memory, one pass over K and V per tile of query rows.
The ``@triton.jit`` code is in ``_attention_kernels.py`` (what a tile holds, the order of operations, the
masks).

Semantics are ``backends/reference/attention.py``'s: BHSD tensors (BSHD inputs arrive as transposed views: the
kernel reads any strides with a unit last one), GQA (``Hq % Hkv == 0``, consecutive query heads per KV head),
Sq != Sk, ``is_causal`` top-left (query i sees keys ``j <= i``), ``scale`` (default ``1 / sqrt(D)``), the
sliding window ``(left, right)`` top-left, the Gemma 2 soft-cap, D != Dv, head dims up to 256 (padded to a
power of two and masked); a row that sees no key returns 0. Not served: ``attn_mask`` and ``dropout_p > 0``
(``MASK_UNSUPPORTED`` / ``DROPOUT_UNSUPPORTED`` from the spec's data), calls that need gradients
(``BACKWARD_UNSUPPORTED``: forward only; eager autograd calls go to ``torch_sdpa.math`` / the reference, and
under ``torch.compile`` the custom op runs this forward without grad and ``layerzero/custom_ops/_grad.py``'s
formula supplies the backward).

Selection: it serves ALiBi calls only (``ALIBI_REQUIRED`` for every other call) until a GPU measurement
compares it with SDPA flash / cuDNN / efficient and FlashAttention on plain calls; among ALiBi kernels on CUDA
its priority (60) is above ``torch_sdpa.math`` (20) and the reference (0), below ``flash_attn2.attention``
(90, ALiBi natively).

Graph-safe: no host read of a device value; grids, the split count and the workspace come from shapes and
the :class:`AttentionKnobs` in force (``"triton.attention"``: a graph keeps what its capture saw), the
workspace allocated with ``torch.empty`` on the current stream (as the other Triton kernels allocate
outputs). The tile configuration is a table by dtype and head dim, shrunk to the GPU's shared memory
(:func:`config_for`), written from FlashAttention-2's and Triton's tutorial's choices, not yet tuned on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from layerzero.core import knobs
from layerzero.core.context import SelectionContext
from layerzero.core.errors import InvalidInputError, expected_got
from layerzero.core.knobs import check_types, require
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec, Layout, MaskKind

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, cdiv, missing, next_pow2
from ._launch import launch
from .paged import sm_count

KERNEL_ID = "triton.attention"
PRIORITY = 60
"""Above ``torch_sdpa.math`` (20) and ``reference.attention`` (0), the other CUDA kernels with ALiBi; below
``flash_attn2.attention`` (90). Only ALiBi calls reach the score (:func:`attention_check`)."""
HEAD_DIM_MAX = 256
KNOBS = "triton.attention"
"""The name :class:`AttentionKnobs` is registered under (``layerzero.core.knobs``)."""
_KERNELS = LazyModule("_attention_kernels")


@dataclass(frozen=True, slots=True)
class AttentionKnobs:
    """The split-K choices and the shared-memory budget of ``triton.attention``'s tiles, registered as
    ``"triton.attention"``; read once per call (:func:`splits_for`, :func:`config_for`). Written, not
    measured: no GPU run has tuned them yet
    (``benchmarks/results/knobs/triton_attention.md``). Raises ``ConfigurationError`` for a field of the wrong
    type or out of range."""

    max_splits: int = 16
    """Most KV splits of one call (the merge reads every split's partial output)."""
    min_split_tiles: int = 4
    """A KV split covers at least this many ``block_n`` tiles (the merge costs a pass over the partials)."""
    workspace_bytes: int = 32 << 20
    """Split-K's float32 workspace ``[B, Hq, Sq, S, Dv]`` stays under this (fewer splits otherwise)."""
    smem_use: float = 0.85
    """Fraction of the GPU's shared memory per block that :func:`config_for`'s estimate may fill (Triton adds
    layout-conversion scratch)."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("max_splits", "min_split_tiles", "workspace_bytes"):
            require(getattr(self, name) >= 1, self, name, "an int >= 1")
        require(0 < self.smem_use <= 1, self, "smem_use", "a fraction in (0, 1]")


knobs.register(KNOBS, AttentionKnobs())


class TileConfig(NamedTuple):
    """One launch configuration: ``rows`` query rows per tile (tokens x heads of a GQA group, a power of two
    >= 16), ``block_n`` keys per step, Triton's ``num_warps`` and ``num_stages``."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int


SMEM_OPTIN = {(8, 0): 166912, (8, 7): 166912, (9, 0): 232448, (10, 0): 232448, (10, 3): 232448}
"""Shared memory one program may use (bytes; CUDA's opt-in limit per block) by SM, when torch's device
properties lack ``shared_memory_per_block_optin``; other SMs (8.6, 8.9, 12.x) get :data:`SMEM_DEFAULT`."""
SMEM_DEFAULT = 101376


def smem_bytes(device: torch.device) -> int:
    """The opt-in shared memory per block of a CUDA ``device`` (A100's for the CPU interpreter)."""
    if device.type != "cuda":
        return SMEM_OPTIN[(8, 0)]
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    return int(optin) if optin else SMEM_OPTIN.get((props.major, props.minor), SMEM_DEFAULT)


def config_for(
    dtype: torch.dtype,
    head_dim: int,
    head_dim_v: int,
    rows_needed: int,
    smem: int = SMEM_OPTIN[(8, 0)],
    kn: AttentionKnobs | None = None,
) -> TileConfig:
    """The tile configuration for ``dtype`` and head dims ``(D, Dv)``, with at most ``rows_needed`` useful
    rows per tile (Sq x the heads packed per tile), on a GPU with ``smem`` bytes of shared memory per block:
    fp16/bf16 tiles of up to 128 rows x 64 keys, 3 stages, for head dims <= 128 (the Triton tutorial's and
    FlashAttention-2's forward tiles), 64 x 32 x 2 above; float32 (IEEE ``tl.dot``, twice the bytes) 64 x 32 x
    2, 32 x 32 x 1 above 128. While the estimate ``(rows D + stages block_n (D + Dv)) bytes`` exceeds
    the knobs' ``smem_use`` of ``smem`` (``kn``, default the :class:`AttentionKnobs` in force): fewer stages,
    then fewer keys, then fewer rows (SM 8.6 / 8.9 / 12.x have 99 KB, A100 163 KB, H100 227 KB). Untuned."""
    dp, dvp = max(16, next_pow2(head_dim)), max(16, next_pow2(head_dim_v))
    big = max(dp, dvp)
    if dtype == torch.float32:
        rows_max, block_n, stages, size = (64, 32, 2, 4) if big <= 128 else (32, 32, 1, 4)
    else:
        rows_max, block_n, stages, size = (128, 64, 3, 2) if big <= 128 else (64, 32, 2, 2)
    rows = min(rows_max, max(16, next_pow2(rows_needed)))
    budget = int(smem * (kn or knobs.get(KNOBS)).smem_use)
    while (rows * dp + stages * block_n * (dp + dvp)) * size > budget:
        if stages > 2:
            stages -= 1
        elif block_n > 32:
            block_n //= 2
        elif rows > 64:
            rows //= 2
        elif stages > 1:
            stages = 1
        elif rows > 16:
            rows //= 2
        elif block_n > 16:
            block_n //= 2
        else:
            break
    return TileConfig(rows, block_n, 8 if rows * big >= 128 * 128 else 4, stages)


def sub_group_for(group: int, rows: int) -> int:
    """Query heads per tile: the largest divisor of the GQA ratio ``group`` (Hq / Hkv) that is <= ``rows``
    (all of them for every usual ratio), so the heads of a tile share one KV head."""
    return max(g for g in range(1, min(group, rows) + 1) if group % g == 0)


def splits_for(
    programs: int, kv_tiles: int, sms: int, row_bytes: int, kn: AttentionKnobs | None = None
) -> int:
    """KV splits from shapes only (graph-safe): 1 when the ``programs`` tiles fill the ``sms``
    multiprocessors, else enough for about two programs per SM, at most the knobs' ``max_splits``, each at
    least ``min_split_tiles`` KV tiles long, the workspace (``row_bytes`` per split) under ``workspace_bytes``
    (``kn``, default the :class:`AttentionKnobs` in force). Pure arithmetic: raises nothing.

    >>> splits_for(8, 64, 132, 1024), splits_for(528, 64, 132, 1024)  # decode B1 Hkv8 Sk4096; a full grid
    (16, 1)
    """
    if programs >= sms:
        return 1
    kn = kn or knobs.get(KNOBS)
    return max(
        1,
        min(
            kn.max_splits,
            cdiv(2 * sms, programs),
            kv_tiles // kn.min_split_tiles,
            kn.workspace_bytes // max(1, row_bytes),
        ),
    )


def _refuse(what: str, expected: str, got: Any) -> InvalidInputError:
    return InvalidInputError(
        expected_got(
            f"{KERNEL_ID}: {what}",
            expected,
            got,
            "Call lz.attention and let it pick a kernel that serves this call.",
        )
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``lz.attention``'s canonical-args entry (BHSD): ``softmax(scale q k^T [capped] - slope |i + Sk - Sq -
    j| [masked]) v`` in one FlashAttention-2 forward (Dao 2023) with the ALiBi bias (Press et al. 2022)
    computed in the kernel.

    Args:
        q: ``[B, Hq, Sq, D]`` float16 / bfloat16 / float32 on CUDA (CPU under ``TRITON_INTERPRET=1``), any
            strides (a last stride other than 1 costs a copy).
        k: ``[B, Hkv, Sk, D]``, ``Hq % Hkv == 0``; v: ``[B, Hkv, Sk, Dv]``; q's dtype and device; D, Dv
            <= 256.
        attn_mask: must be None. dropout_p: must be 0.
        is_causal: top-left causal mask, query i sees keys ``j <= i`` (lz.attention's, also when Sq != Sk).
        scale: softmax scale, None for ``1 / sqrt(D)``.
        window: ``(left, right)``, query i sees keys ``i - left <= j <= i + right`` (-1: unbounded side), or
            None.
        softcap: ``s = softcap * tanh(s / softcap)`` on the scaled scores before the bias, or None.
        alibi_slopes: float32 ``[Hq]`` or ``[B, Hq]`` (one slope per query head, per batch row), or None.
        num_splits: force this many KV splits (tests, benchmarks; default from shapes: :func:`splits_for`).
        config: force a :class:`TileConfig` (default :func:`config_for`).

    Returns:
        ``[B, Hq, Sq, Dv]`` in q's dtype, a new tensor (BSHD memory when q is a BSHD view, else contiguous); a
        row with no visible key is 0.

    Raises:
        InvalidInputError: ``attn_mask`` given, ``dropout_p > 0``, or a head dim > 256 (``lz.attention`` never
            routes such calls here: the spec refuses them).
    """
    if attn_mask is not None:
        raise _refuse(
            "attn_mask", "None (ALiBi and masks come from alibi_slopes, is_causal and window)", "a tensor"
        )
    if dropout_p:
        raise _refuse("dropout_p", "0.0 (forward kernel without dropout)", dropout_p)
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    if max(d, dv) > HEAD_DIM_MAX:
        raise _refuse("head dims", f"<= {HEAD_DIM_MAX}", (d, dv))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    bshd = sq > 1 and q.stride(2) > q.stride(1)  # BSHD memory seen as BHSD: give the output the same order
    out = (
        torch.empty(b, sq, hq, dv, dtype=q.dtype, device=q.device).transpose(1, 2)
        if bshd
        else torch.empty(b, hq, sq, dv, dtype=q.dtype, device=q.device)
    )
    if out.numel() == 0:
        return out
    kern = _KERNELS.get()
    kn = knobs.get(KNOBS)
    group = hq // hkv
    cfg = config or config_for(q.dtype, d, dv, sq * group, smem_bytes(q.device), kn)
    sub = sub_group_for(group, cfg.rows)
    tokens = cfg.rows // sub
    token_tiles = cdiv(sq, tokens)
    programs = token_tiles * b * (hq // sub)
    if num_splits is None:
        splits = splits_for(programs, cdiv(sk, cfg.block_n), sm_count(q.device), b * hq * sq * dv * 4, kn)
    else:
        splits = max(1, int(num_splits))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    unbounded = sq + sk
    left = unbounded if window is None or window[0] < 0 else int(window[0])
    right = unbounded if window is None or window[1] < 0 else int(window[1])
    if is_causal:
        right = 0
    masked = bool(is_causal) or left < unbounded or right < unbounded
    alibi = alibi_slopes is not None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(torch.float32)
        stride_ab, stride_ah = (
            (0, slopes.stride(0)) if slopes.dim() == 1 else (slopes.stride(0), slopes.stride(1))
        )
    else:
        slopes, stride_ab, stride_ah = q, 0, 0  # never read
    cap = softcap is not None
    qk_scale = scale / float(softcap) if softcap is not None else scale * kern.LOG2E
    cap_arg = float(softcap) * kern.LOG2E if softcap is not None else 0.0
    if splits > 1:
        ws = torch.empty(b * hq * sq * splits * dv, dtype=torch.float32, device=q.device)
        ws_lse = torch.empty(b * hq * sq * splits, dtype=torch.float32, device=q.device)
    else:
        ws, ws_lse = out, out  # never written
    interpret = type(kern.attention_fwd).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 (CPU tests)
    launch(
        kern.attention_fwd,
        (programs, splits),
        q,
        k,
        v,
        out,
        slopes,
        ws,
        ws_lse,
        qk_scale,
        cap_arg,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        stride_ab,
        stride_ah,
        sq,
        sk,
        hq,
        group,
        sub,
        tokens,
        token_tiles,
        left,
        right,
        ROWS=cfg.rows,
        HEAD_DIM=d,
        HEAD_DIM_V=dv,
        D_PAD=max(16, next_pow2(d)),
        DV_PAD=max(16, next_pow2(dv)),
        BLOCK_N=cfg.block_n,
        ALIBI=alibi,
        SOFTCAP=cap,
        MASK=masked,
        SPLIT=splits > 1,
        INTERPRET=interpret,
        MAX_TILES=cdiv(sk, cfg.block_n) if interpret else 0,
        UPCAST=interpret and q.dtype == torch.bfloat16,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if splits > 1:
        launch(
            kern.attention_merge,
            (b * hq * sq,),
            ws,
            ws_lse,
            out,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            sq,
            hq,
            splits,
            HEAD_DIM_V=dv,
            DV_PAD=max(16, next_pow2(dv)),
            S_PAD=next_pow2(splits),
            num_warps=4,
        )
    return out


def attention_check(ctx: SelectionContext) -> list[Reason]:
    """What data cannot say for ``triton.attention``: it serves ``lz.attention(alibi_slopes=...)`` calls only
    (``ALIBI_REQUIRED`` otherwise), so plain calls keep SDPA flash / cuDNN / efficient, FlashAttention and the
    rest until a GPU measurement says this kernel is faster there; and head dims that are powers of two >= 16
    only (``HEAD_DIM_NOT_ALIGNED``): tiles padded along a head dim (D 72 / Dv 8, D 80) gave wrong outputs on
    an H200 (Triton 3.6) for some tile shapes, with and without a mask along the padded dim, so they are
    refused until a Triton release computes them right."""
    if not ctx.has_alibi:
        return [
            Reason(
                ReasonCode.ALIBI_REQUIRED,
                "serves ALiBi calls (alibi_slopes=...) only: not yet measured "
                "against SDPA / FlashAttention on plain attention",
            )
        ]
    padded = [d for d in (ctx.head_dim, ctx.head_dim_v) if d is not None and not _unpadded(d)]
    if padded:
        return [
            Reason(
                ReasonCode.HEAD_DIM_NOT_ALIGNED,
                f"head dims must be powers of two >= 16 (tiles without padding), got {padded[0]}: "
                "padded head-dim tiles gave wrong outputs on an H200 under Triton 3.6 "
                "(benchmarks/results/gpu_suite/README.md, 2026-11-29)",
            )
        ]
    return []


def _unpadded(d: int) -> bool:
    """``d`` fills a tile exactly: a power of two >= 16 (``tl.dot``'s smallest K / N)."""
    return d >= 16 and d & (d - 1) == 0


def kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.attention`` KernelSpec: CUDA SM >= 8.0, fp16/bf16/fp32, BHSD (BSHD as transposed views),
    head dims <= 256, GQA, causal, window, soft-cap and ALiBi; no mask, no dropout, no backward; graph-safe
    and deterministic (split-K merges in a fixed order). When ``available`` is False its callable raises
    ``BackendNotAvailableError`` with ``why``."""
    return KernelSpec(
        KERNEL_ID,
        "attention",
        attention if available else missing(KERNEL_ID, why),
        priority=PRIORITY,
        description="Triton FlashAttention-2 forward with ALiBi computed in the kernel (no bias tensor); "
        "GQA, causal, sliding window, soft-cap; ALiBi calls only",
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        layouts=frozenset({Layout.BHSD}),
        head_dim_min=1,
        head_dim_max=HEAD_DIM_MAX,
        supports_gqa=True,
        mask_kinds=frozenset({MaskKind.NONE}),
        supports_causal=True,
        supports_dropout=False,
        supports_window=True,
        supports_softcap=True,
        supports_alibi=True,
        supports_backward=False,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        check=attention_check,
    )


__all__ = [
    "HEAD_DIM_MAX",
    "KERNEL_ID",
    "KNOBS",
    "PRIORITY",
    "AttentionKnobs",
    "TileConfig",
    "attention",
    "attention_check",
    "config_for",
    "kernel_spec",
    "smem_bytes",
    "splits_for",
    "sub_group_for",
]
