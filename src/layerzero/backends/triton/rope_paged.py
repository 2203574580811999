"""``triton.rope_paged_decode``: ``lz.rope_paged_attention`` for decode steps in one split kernel plus the
merge.

The split kernel of ``triton.paged_decode`` (:mod:`.paged`: FlashDecoding, the same tile size, split count,
workspace and merge kernel) whose programs first do what ``lz.qk_norm_rope`` (or ``lz.rope``) and
``lz.reshape_and_cache`` did in kernels of their own: the new token's per-head q/k RMSNorm and RoPE, and the
K/V write (split 0), the new token's K/V taken from registers by every split (``_rope_paged_kernels.py``). A
batch-1 decode layer of Qwen3 then runs two attention kernels where it ran four, with nothing between the QKV
projection and the attention. Decode only (one new token per sequence), unquantized pools, rotary dim = head
dim; the composite form serves every other call, and every call by default (:data:`PRIORITY`: measured slower
than the composite on the H200).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from layerzero.core import knobs
from layerzero.core.capture import AS_CAPTURED, capturing_now
from layerzero.core.context import SelectionContext
from layerzero.core.knobs import check_types, require
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

from . import paged
from ._common import CUDA, FLOATS, SM_MIN, LazyModule, missing
from ._launch import launch_pinned, pdl_kwargs

KERNEL_ID = "triton.rope_paged_decode"
PRIORITY = 45
"""Below ``composite.rope_paged_attention`` (52: ``lz.qk_norm_rope_cache`` then ``lz.paged_attention``), so
opt in (``lz.prefer("triton.rope_paged_decode")``): on the H200 the fused split kernel measured slower than
the composite's three kernels (benchmarks/results/history.md)."""

KNOBS = "triton.rope_paged"
"""The name :class:`RopePagedKnobs` is registered under (``layerzero.core.knobs``)."""


@dataclass(frozen=True, slots=True)
class RopePagedKnobs:
    """Launch choices of ``triton.rope_paged_decode`` of its own, registered as ``"triton.rope_paged"`` (the
    split geometry is ``triton.paged_decode``'s knobs); read once per call (part of the plan key). Raises
    ``ConfigurationError`` for a field of the wrong type or out of range."""

    num_splits: int | None = None
    """Force the KV split count (tests, benchmarks); None: ``paged.choose_split_len``'s, as
    ``triton.paged_decode``."""

    def __post_init__(self) -> None:
        check_types(self)
        n = self.num_splits
        require(n is None or n >= 1, self, "num_splits", "None or an int >= 1")


knobs.register(KNOBS, RopePagedKnobs())

_KERNELS = LazyModule("_rope_paged_kernels")
_PLANS: dict[tuple[Any, ...], _Plan] = {}
knobs.subscribe(
    paged.KNOBS, _PLANS.clear
)  # its plans hold paged._plan's choices: dropped when those knobs change
_SERIALS = itertools.count()


class _Plan(NamedTuple):
    """Launch facts of one call signature (shapes, strides, dtypes, layout, norm, interleaving):
    ``paged._plan``'s split geometry plus this kernel's own strides."""

    serial: int
    base: Any  # paged._Plan: grid, split count, workspace strides, merge launch
    ints: tuple[int, ...]  # stride_qb .. stride_lb of rope_paged_decode_split
    kw: dict[str, Any]  # its constexprs and launch config


def rope_paged_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    position_ids: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    scale: float | None,
    interleaved: bool,
    kv_layout: Any,
    eps: float,
) -> torch.Tensor:
    """``lz.rope_paged_attention``'s canonical-args entry for decode: q ``[B, Hq, D]``, k / v ``[B, Hkv, D]``
    (one new token per sequence, last stride 1: views of a packed QKV projection are fine), ``q_weight`` /
    ``k_weight`` ``[D]`` or both None (no QK-norm), cos / sin ``[max_pos, D]`` tables (rotary dim = D) read at
    ``position_ids`` ``[B]``, kv_cache ``[N, 2, P, Hkv, D]`` (NHD) or ``[N, 2, Hkv, P, D]`` (HND) in q's
    dtype, ``slot_mapping`` ``[B]`` (-1: not written), block_tables ``[B, M]`` int32, seq_lens ``[B]`` int32
    (the new token included: it is position ``seq_lens[b] - 1``, at ``slot_mapping[b]`` in the block table).
    Returns ``[B, Hq, D]`` in q's dtype; the new k (normalized, rotated, rounded) and v are written into the
    cache.

    Raises:
        InvalidInputError: ``cu_seqlens_q`` given (prefill / append: :func:`check` keeps selection from
            routing it here), what ``triton.paged_decode`` refuses (GQA group above 16, a last stride other
            than 1).
    """
    paged._decode_only(KERNEL_ID, cu_seqlens_q)
    norm = q_weight is not None
    key = (
        q.shape,
        q.stride(),
        k.stride(),
        v.stride(),
        q.dtype,
        q.device,
        kv_cache.shape,
        kv_cache.stride(),
        block_tables.shape,
        block_tables.stride(),
        seq_lens.stride(),
        cos.stride(),
        sin.stride(),
        kv_layout,
        norm,
        bool(interleaved),
        knobs.get(KNOBS).num_splits,
    )
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k, v, cos, sin, kv_cache, block_tables, seq_lens, kv_layout, norm, interleaved)
        if len(_PLANS) >= paged._PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    base = plan.base
    batch, hq, d = base.out_shape
    out = torch.empty(base.out_shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if base.splits == 1:  # the split kernel stores the output itself
        ws_out = ws_lse = out
    else:
        ws_out = torch.empty((batch, hq, base.splits, d), dtype=torch.float32, device=q.device)
        ws_lse = torch.empty((batch, hq, base.splits), dtype=torch.float32, device=q.device)
    qk_scale = (1.0 / math.sqrt(d) if scale is None else float(scale)) * paged._KERNELS.get().LOG2E
    pdl = pdl_kwargs(q, batch, AS_CAPTURED.get() or capturing_now())
    qw = q_weight if norm else cos  # unused pointers without NORM
    kw = k_weight if norm else cos
    launch_pinned(
        _KERNELS.get().rope_paged_decode_split,
        (plan.serial, bool(pdl)),
        base.grid,
        q,
        k,
        v,
        qw,
        kw,
        cos,
        sin,
        position_ids,
        slot_mapping,
        kv_cache,
        block_tables,
        seq_lens,
        ws_out,
        ws_lse,
        qk_scale,
        float(eps),
        *plan.ints,
        **plan.kw,
        **pdl,
    )
    if base.splits > 1:
        launch_pinned(
            paged._KERNELS.get().paged_decode_merge,
            (base.serial, bool(pdl)),
            (batch, hq),
            ws_out,
            ws_lse,
            out,
            out,
            *base.merge_ints,
            **base.merge_kw,
            **pdl,
        )
    return out


def _plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_layout: Any,
    norm: bool,
    interleaved: bool,
) -> _Plan:
    """The :class:`_Plan` of a call: ``paged._plan`` (its checks and split geometry) plus the q / k / v / cos
    / sin strides (their last strides must be 1)."""
    strides = (k.stride(-1), v.stride(-1), cos.stride(-1), sin.stride(-1))
    if strides != (1, 1, 1, 1):
        raise paged._bad(
            "last strides of k, v, cos, sin",
            "1 each (contiguous last dims)",
            strides,
            "Call .contiguous() first (lz.rope_paged_attention filters this kernel out instead: "
            "STRIDE_LAST_DIM_NOT_1).",
        )
    base = paged._plan(
        paged._KERNELS.get(),
        q,
        kv_cache,
        block_tables,
        seq_lens,
        kv_layout,
        False,
        knobs.get(KNOBS).num_splits,
        None,
        None,
        None,
    )
    si = (
        base.split_ints
    )  # stride_qb, stride_qh, blk, kv, pos, head, stride_bt, split_len, page, group, splits, ..
    ints = (
        si[0],
        si[1],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        *si[2:],
    )
    # EARLY: the fused kernel writes the newest K / V itself; TRIGGER_FIRST: measured with the unfused kernels
    # only
    drop = ("WRITE_LSE", "FUSED_MERGE", "S_PAD", "EARLY", "TRIGGER_FIRST")
    kw = {n: x for n, x in base.split_kw.items() if n not in drop}
    return _Plan(next(_SERIALS), base, ints, {**kw, "NORM": norm, "INTERLEAVED": bool(interleaved)})


def check(ctx: SelectionContext) -> list[Reason]:
    """``triton.paged_decode``'s rules (decode only, GQA ratio <= 16, NHD / HND) plus: the rotary dim is the
    head dim (no pass-through dims), an unquantized pool."""
    out = paged.check(ctx)
    if ctx.rotary_dim is not None and ctx.head_dim is not None and ctx.rotary_dim != ctx.head_dim:
        out.append(
            Reason(
                ReasonCode.HEAD_DIM_MISMATCH,
                f"partial rotary (rotary dim {ctx.rotary_dim} < head dim "
                f"{ctx.head_dim}): the kernel rotates all D dims",
            )
        )
    return out


def kernel_spec(available: bool, why: str) -> KernelSpec:
    """``triton.rope_paged_decode`` (op ``rope_paged_attention``, CUDA SM >= 8.0, fp16/bf16/fp32, head dims
    2..256, NHD and HND, any page size, GQA 1..16, decode only, graph-safe, deterministic, opt in); its
    callable raises ``BackendNotAvailableError`` (with ``why``) when ``available`` is False."""
    return KernelSpec(
        KERNEL_ID,
        "rope_paged_attention",
        rope_paged_decode if available else missing(KERNEL_ID, why),
        priority=PRIORITY,
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        head_dim_min=2,
        head_dim_max=paged.HEAD_DIM_MAX,
        supports_backward=False,
        supports_dropout=False,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        check=check,
        workspace=paged.workspace_bytes,
        description="Triton split-K paged decode whose programs also do the new token's q/k norm, "
        "RoPE and KV write (TensorRT-LLM's masked MHA style), then the log-sum-exp merge",
    )
