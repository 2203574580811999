"""The launch of ``triton.paged_decode``: :func:`paged_decode` (the workspace, the split kernel, the merge
kernel when the splits do not merge themselves) and its plans, one per call signature (shapes, strides,
dtypes, device, layout, arguments) worked out on the first call under the knobs in force (:func:`_plan`,
cached in ``_PLANS``, dropped when the knobs change), so a later call pins its launches without re-deriving
anything. Split from :mod:`.paged` (the KernelSpecs and the canonical-args entries; it re-exports every name
here); the geometry rules a plan applies are in :mod:`._paged_geometry`. Nothing here imports triton: the
kernels are imported on the first call (``_KERNELS``)."""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import torch

from layerzero.core import knobs
from layerzero.core.capture import AS_CAPTURED, capturing_now
from layerzero.core.kv_layout import KVLayout, cache_dims, nhd_view
from layerzero.core.kv_quant import KV_QUANT_DTYPES

from ._common import LazyModule, next_pow2
from ._launch import launch_pinned, pdl_kwargs
from ._paged_common import scale_args, sm_count, split_counters
from ._paged_geometry import KNOBS, MAX_GROUP, _bad, geometry, launch_config

_KERNELS = LazyModule("_paged_kernels")


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    kv_layout: str | KVLayout = "NHD",
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
) -> Any:
    """Split-K paged decode attention (one query token per sequence) with our Triton kernels.

    Args:
        q: ``[B, Hq, D]`` float16/bfloat16/float32, last stride 1 (as for kv_cache, block_tables, seq_lens).
        kv_cache: ``[N, 2, P, Hkv, D]`` (``kv_layout="NHD"``) or ``[N, 2, Hkv, P, D]`` (``"HND"``), q's dtype
            (or float8_e4m3fn / int8 codes: a quantized cache) and device, last stride 1; K at index 0 of dim
            1, V at 1. Any page size P >= 1.
        block_tables: ``[B, M]`` int32; only the first ``ceil(seq_lens[b] / P)`` ids of row b are read.
        seq_lens: ``[B]`` int32 in ``[1, M * P]`` (KV tokens, the new one included); never read on the host.
        scale: softmax scale, default ``1 / sqrt(D)``.
        kv_layout: ``"NHD"`` or ``"HND"``.
        num_splits: force the number of KV splits (default: :func:`choose_split_len` from the shapes and SM
            count).
        block_n: KV positions per stage-1 step (power of two >= 16; default :func:`block_n_for`).
        num_warps, num_stages: stage-1 launch config (default :func:`launch_config`). Knobs for
            ``benchmarks/tune_paged_decode.py``.
        k_scale, v_scale: a quantized cache's per-tensor scales (positive floats, or 0-d / 1-element float32
            tensors on the device, read there: graph-safe); None = 1.0. Keys and values are read as
            ``code * scale`` in float32 and both dots run in float32 (``core.kv_quant.dequantize_kv``).
        return_lse: also return each row's natural-log sum-exp ``[B, Hq]`` float32
            (``triton.paged_decode_lse``).

    Returns:
        ``[B, Hq, D]`` in q's dtype (``(out, lse)`` with ``return_lse``). Cache slots past ``seq_lens[b]`` and
        unused blocks never reach it (masked loads: NaN there cannot leak).

    Raises:
        InvalidInputError: ``Hq / Hkv`` above 16, a last stride other than 1 (q, kv_cache, block_tables or
            seq_lens), ``block_n`` not a power of two >= 16
            (shapes, dtypes and index values are validated by ``lz.paged_attention`` before dispatch).
    """
    kern = _KERNELS.get()  # the @triton.jit code; triton imported fine in the backend's probe
    key = (
        q.shape,
        q.stride(),
        q.dtype,
        q.device,
        kv_cache.shape,
        kv_cache.stride(),
        kv_cache.dtype,
        block_tables.shape,
        block_tables.stride(),
        seq_lens.stride(),
        kv_layout,
        return_lse,
        num_splits,
        block_n,
        num_warps,
        num_stages,
    )
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(
            kern,
            q,
            kv_cache,
            block_tables,
            seq_lens,
            kv_layout,
            return_lse,
            num_splits,
            block_n,
            num_warps,
            num_stages,
        )
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    batch, hq, d = plan.out_shape
    out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, hq), dtype=torch.float32, device=q.device) if return_lse else out
    if batch == 0:
        return (out, lse) if return_lse else out
    # eager calls only: the split that finishes last merges, no stage 2 (one host launch less); under capture
    # (and lz.capture_selection) the two kernels, which replay faster (the knob fused_merge says why)
    captured = AS_CAPTURED.get() or capturing_now()
    fused = plan.fused_captured if captured else plan.fused_eager
    if plan.splits == 1:  # stage 1 stores the output itself: no workspace, no stage 2
        ws_out = ws_lse = out
    else:  # partial outputs [B, Hq, S, D] and their lse [B, Hq, S], float32, contiguous
        ws_out = torch.empty((batch, hq, plan.splits, d), dtype=torch.float32, device=q.device)
        ws_lse = torch.empty((batch, hq, plan.splits), dtype=torch.float32, device=q.device)
    cnt = split_counters(q, batch * plan.num_kv_heads) if fused else out
    qk_scale = (1.0 / math.sqrt(d) if scale is None else float(scale)) * kern.LOG2E
    ks, vs, qflags = scale_args(plan.quant, k_scale, v_scale)
    # every int and constexpr below is the plan's: it pins the launch (FastLaunch.pinned skips Triton's
    # binder)
    pdl = pdl_kwargs(q, batch, captured)
    launch_pinned(
        kern.paged_decode_split,
        (plan.serial, fused, bool(pdl), *qflags.values()),
        plan.grid,
        q,
        kv_cache,
        block_tables,
        seq_lens,
        ws_out,
        ws_lse,
        lse,
        out,
        cnt,
        qk_scale,
        ks,
        vs,
        *plan.split_ints,
        **(plan.fused_kw if fused else plan.split_kw),
        **qflags,
        **pdl,
    )
    if plan.splits > 1 and not fused:
        launch_pinned(
            kern.paged_decode_merge,
            (plan.serial, bool(pdl)),
            (batch, hq),
            ws_out,
            ws_lse,
            out,
            lse,
            *plan.merge_ints,
            **plan.merge_kw,
            **pdl,
        )
    return (out, lse) if return_lse else out


class _Plan(NamedTuple):
    """What one call signature of :func:`paged_decode` (shapes, strides, dtypes, device, layout, arguments)
    launches with under the knobs in force: everything but the tensors' addresses and the scales, worked out
    on its first call (``_PLANS``, dropped when the knobs change)."""

    serial: int  # unique per plan made (FastLaunch.pinned's pin: never reused, unlike id())
    out_shape: tuple[int, int, int]
    num_kv_heads: int
    splits: int
    fused_eager: bool  # eager calls merge in the split kernel (knobs fused_merge, fused_merge_max_bytes)
    fused_captured: bool  # calls under capture / lz.capture_selection() do (fused_merge_in_graphs)
    quant: bool
    grid: tuple[int, int, int]
    split_ints: tuple[int, ...]  # stride_qb .. stride_lb of the stage-1 kernel (workspace strides included)
    merge_ints: tuple[int, ...]  # stride_ob .. num_splits of stage 2
    split_kw: dict[str, Any]  # its constexprs and launch config (two kernels, or one split)
    fused_kw: dict[str, Any]  # the same with the merge fused (eager calls)
    merge_kw: dict[str, Any]  # stage 2's constexprs and launch config


_PLANS: dict[tuple[Any, ...], _Plan] = {}
_SERIALS = itertools.count()
_PLANS_MAX = 4096
"""Plans kept (a server sees a few hundred call signatures; past this many the dict starts over)."""


def _drop_plans() -> None:
    _PLANS.clear()  # the module's dict at call time (tests replace it)


knobs.subscribe(KNOBS, _drop_plans)


def _plan(
    kern: Any,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_layout: str | KVLayout,
    return_lse: bool,
    num_splits: int | None,
    block_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
) -> _Plan:
    """The :class:`_Plan` of a call under the knobs in force (checks included: the raises of
    :func:`paged_decode`)."""
    kn = knobs.get(KNOBS)
    batch, hq, d = q.shape
    _, page, hkv, _ = cache_dims(kv_cache, kv_layout)
    group = hq // hkv
    if group > MAX_GROUP:
        raise _bad(
            "GQA group Hq / Hkv",
            f"<= {MAX_GROUP}",
            f"{hq} / {hkv} = {group}",
            "Let LayerZero pick another paged kernel (torch_sdpa.paged_attention).",
        )
    strides = (q.stride(-1), kv_cache.stride(-1), block_tables.stride(-1), seq_lens.stride(-1))
    if strides != (1, 1, 1, 1):  # the kernels index each last dim with a unit stride
        raise _bad(
            "last strides of q, kv_cache, block_tables, seq_lens",
            "1 each (contiguous last dims)",
            strides,
            "Call .contiguous() first (lz.paged_attention filters this kernel out instead: "
            "STRIDE_LAST_DIM_NOT_1).",
        )
    quant = kv_cache.dtype in KV_QUANT_DTYPES
    width, itemsize = block_tables.shape[1] * page, 4 if quant else q.element_size()
    bn, split_len, splits, chunks, one_pass = geometry(
        batch, hkv, width, d, itemsize, sm_count(q.device), num_splits=num_splits, block_n=block_n, kn=kn
    )
    interpret = (
        type(kern.paged_decode_split).__name__ == "InterpretedFunction"
    )  # TRITON_INTERPRET=1 (CPU tests)
    st = nhd_view(kv_cache, kv_layout).stride()  # [N, 2, P, Hkv, D] order whatever the layout
    d_pad = max(16, next_pow2(d))
    config = launch_config(d, kn)
    if num_warps is not None:
        config["num_warps"] = int(num_warps)
    if num_stages is not None:
        config["num_stages"] = int(num_stages)
    split_kw = dict(
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=d,
        D_PAD=d_pad,
        BLOCK_N=bn,
        INTERPRET=interpret,
        TILES_PER_SPLIT=split_len // bn if interpret else 0,
        UPCAST=quant or (interpret and q.dtype == torch.bfloat16),
        DIRECT=splits == 1,
        WRITE_LSE=return_lse,
        FUSED_MERGE=False,
        S_PAD=1,
        CHUNKS=chunks,
        ONE_PASS=one_pass,
        EARLY=one_pass and kn.early_kv,
        TRIGGER_FIRST=one_pass and "split" in kn.trigger_first,
        **config,
    )
    kv_bytes = batch * hkv * splits * split_len * d * 2 * kv_cache.element_size()  # the most a call can read
    fused = splits > 1 and (
        kv_bytes <= kn.fused_merge_max_bytes if kn.fused_merge == "auto" else kn.fused_merge
    )
    # the workspace's strides (contiguous [B, Hq, S, D]); one split: the output's own ([B, Hq, D], contiguous)
    ws_strides = (hq * d, d, 0) if splits == 1 else (hq * splits * d, splits * d, d)
    return _Plan(
        next(_SERIALS),
        (batch, hq, d),
        hkv,
        splits,
        fused,
        fused and kn.fused_merge_in_graphs,
        quant,
        (batch, hkv, splits),
        (
            q.stride(0),
            q.stride(1),
            st[0],
            st[1],
            st[2],
            st[3],
            block_tables.stride(0),
            split_len,
            page,
            group,
            splits,
            width,
            *ws_strides,
            hq * splits,
        ),
        (hq * d, d, *ws_strides, hq, splits),
        split_kw,
        {**split_kw, "FUSED_MERGE": True, "S_PAD": next_pow2(splits)},
        dict(
            HEAD_DIM=d,
            D_PAD=d_pad,
            S_PAD=next_pow2(splits),
            WRITE_LSE=return_lse,
            num_warps=kn.merge_warps,
            TRIGGER_FIRST=one_pass and "merge" in kn.trigger_first,
        ),
    )
