"""Cascade attention's Triton kernels: ``triton.paged_prefill_lse`` (op ``paged_attention_lse``: paged
attention of many query tokens per sequence, causal or not, with the lse) and
``triton.merge_attention_states``; the same prefill kernel without the lse is ``triton.paged_prefill`` (op
``paged_attention``: prefill, append and mixed steps where FlashInfer is not installed).

``paged_prefill_lse`` is FlashAttention's forward (Dao et al. 2022) over a paged cache: a work item (sequence,
tile of new tokens, KV split, KV head) holds those tokens' query rows for every query head of the KV head (the
GQA group) and reads the split's KV once. Cascade attention's shared level (Ye et al. 2024, FlashInfer's
``MultiLevelCascadeAttentionWrapper``) calls it with ``is_causal=False`` and one "sequence" per group of
requests sharing a prefix: the group's decode queries are that sequence's tokens, the prefix its KV, so the
prefix is read once per group instead of once per request. The ``@triton.jit`` code is in
``_cascade_kernels.py``.

Graph-safe: grids and arguments come from shapes, no host read of ``seq_lens`` / ``cu_seqlens_q`` /
``block_tables``. The kernel is persistent (``programs_per_sm`` programs per SM, :class:`CascadeKnobs`) and
sizes its work on the device: each program derives the items of the sequences that have rows and keys, splits
their KV so the items number about one per program, and finds its own by a prefix-sum search. The engine's
CUDA graphs call it with one "sequence" per batch row, most of them empty, and groups of 1 to 256 members:
empty sequences cost nothing and a big group's token tiles spread over many programs (H200 measurements:
benchmarks/results/engine/h200/README.md, 2026-11-25 fourth session).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from layerzero.core import knobs
from layerzero.core.context import SelectionContext
from layerzero.core.errors import InvalidInputError, expected_got
from layerzero.core.kv_layout import KV_LAYOUTS, cache_dims, nhd_view
from layerzero.core.kv_quant import KV_QUANT_DTYPES
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

from ._cascade_knobs import (  # noqa: F401 - re-exported: the knobs and the launch rules
    KNOBS,
    MAX_SEQS,
    ROWS_FEW_MAX_TOKENS,
    CascadeKnobs,
    PrefillLaunch,
    prefill_launch,
    seq_pad,
)
from ._common import CUDA, FLOATS, SM_MIN, LazyModule, missing, next_pow2
from ._launch import launch
from ._paged_common import scale_args, sm_count

PREFILL_KERNEL_ID = "triton.paged_prefill_lse"
PAGED_KERNEL_ID = "triton.paged_prefill"
MERGE_KERNEL_ID = "triton.merge_attention_states"
PREFILL_PRIORITY = 30
"""Below ``triton.paged_decode(_lse)`` (40, split-K for decode) and FlashInfer (60); above ``torch_sdpa`` (10)
and the reference."""
MAX_GROUP = 16
"""Query heads per KV head held in one tile (GQA ratio 1..16)."""
HEAD_DIM_MAX = 256
_KERNELS = LazyModule("_cascade_kernels")
_PAGED = LazyModule("_paged_kernels")  # paged_decode_merge merges the splits


def block_n_for(head_dim: int) -> int:
    """KV positions per step: 64 for head dims up to 128, 32 above (a ``[ROWS, D]`` float32 accumulator and
    the K/V tiles stay in registers / shared memory)."""
    return 64 if next_pow2(head_dim) <= 128 else 32


def paged_prefill_lse(
    q,
    kv_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    scale,
    is_causal,
    kv_layout,
    k_scale=None,
    v_scale=None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int | None = None,
    target: int | None = None,
    min_split_tiles: int | None = None,
):
    """``lz.paged_attention(..., return_lse=True)`` canonical-args entry (see
    :func:`layerzero.ops.paged.prepare`): q ``[T, Hq, D]``, cu_seqlens_q ``[B + 1]`` int32 (None: one token
    per sequence, built on the device), causal aligned bottom-right or none. Returns ``(out [T, Hq, D] in q's
    dtype, lse [T, Hq] float32)``, natural log, -inf and 0 for a row with no key. A float8_e4m3fn / int8 cache
    is read as ``code * scale`` (``k_scale`` / ``v_scale``: per-tensor, floats or one-element float32 device
    tensors, read on the device; None -> 1.0), rounded to q's dtype as ``torch_sdpa.paged_attention`` reads
    it.

    The kernel sizes its own work on the device (``_cascade_kernels.paged_prefill``): items (sequence, token
    tile, KV split, KV head) of only the sequences with rows and keys, splits sized so the items number about
    ``target`` (default: the persistent programs), at least ``min_split_tiles`` KV tiles each. Knobs (tests,
    ``benchmarks/engine/tune_cascade_prefill.py``): ``num_splits`` forces every sequence into
    ``min(num_splits, its KV tiles)`` splits; ``block_n`` KV positions per step; ``rows`` query rows per tile
    (default the knobs' ``rows`` / ``rows_few``); ``num_warps``, ``num_stages`` (default the knobs' ``launch``
    / ``launch_few`` of the tile height), ``programs_per_sm`` (default the knobs'): :func:`prefill_launch`
    (:class:`CascadeKnobs`, read once per call).

    Raises:
        InvalidInputError: more than :data:`MAX_SEQS` sequences (before any work; :func:`prefill_check` keeps
            selection from routing such calls here)."""
    t, hq, d = q.shape
    batch, width = block_tables.shape
    if batch > MAX_SEQS:
        raise InvalidInputError(
            expected_got(
                f"{PREFILL_KERNEL_ID}: sequences",
                f"<= {MAX_SEQS}",
                batch,
                "Split the call, or let LayerZero pick another paged_attention_lse "
                "kernel (this one's check refuses such contexts).",
            )
        )
    kern = _KERNELS.get()
    _, page, hkv, _ = cache_dims(kv_cache, kv_layout)
    group = hq // hkv
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    kn = knobs.get(KNOBS)
    plan = prefill_launch(
        t,
        batch,
        hq,
        d,
        group,
        rows=rows,
        num_warps=num_warps,
        num_stages=num_stages,
        programs_per_sm=programs_per_sm,
        min_split_tiles=min_split_tiles,
        kn=kn,
    )
    tokens, max_splits, min_split_tiles = plan.tokens, plan.max_splits, plan.min_split_tiles
    bn = block_n_for(d) if block_n is None else int(block_n)
    if num_splits is not None:
        max_splits, min_split_tiles, target = max(1, int(num_splits)), 1, 1 << 30
    split = max_splits > 1
    interpret = type(kern.paged_prefill).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 (CPU tests)
    ks, vs, qflags = scale_args(kv_cache.dtype in KV_QUANT_DTYPES, k_scale, v_scale)
    if t == 0 or batch == 0 or not split:  # rows no item covers keep their "no key" values (0, -inf)
        out = torch.zeros(t, hq, d, dtype=q.dtype, device=q.device)
        lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
        if t == 0 or batch == 0:
            return out, lse
    else:  # the merge writes every row (0, -inf where no split wrote a slot)
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
        lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    st = nhd_view(kv_cache, kv_layout).stride()  # [N, 2, P, Hkv, D] order whatever the layout
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    d_pad = max(16, next_pow2(d))
    # float32 partials [T, Hq, S, D] (a slot no item wrote is dropped by the merge) and base-2 lse [T, Hq, S]
    # (-inf: unused)
    if split:
        dst = torch.empty(t * hq * max_splits * d, dtype=torch.float32, device=q.device)
        dst_lse = torch.full((t * hq * max_splits,), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        dst, dst_lse = out, lse
    kv_tiles = -(-width * page // bn)
    bound = (-(-t // tokens) + batch) * max_splits * hkv  # items: sum of token tiles <= T / tokens + B
    programs = min(bound, plan.programs_per_sm * sm_count(q.device))
    launch(
        kern.paged_prefill,
        (programs,),
        q,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        dst,
        dst_lse,
        scale * kern.LOG2E,
        ks,
        vs,
        q.stride(0),
        q.stride(1),
        st[0],
        st[1],
        st[2],
        st[3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        page,
        group,
        tokens,
        hq,
        hkv,
        batch,
        target or programs,
        min_split_tiles,
        max_splits,
        ROWS=max(16, next_pow2(tokens * group)),
        HEAD_DIM=d,
        D_PAD=d_pad,
        BLOCK_N=bn,
        B_PAD=seq_pad(batch, kn),
        CAUSAL=bool(is_causal),
        INTERPRET=interpret,
        MAX_TILES=kv_tiles if interpret else 0,
        MAX_ITEMS=-(-bound // programs) if interpret else 0,
        UPCAST=interpret and q.dtype == torch.bfloat16,
        SPLIT=split,
        **qflags,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if split:
        launch(
            _PAGED.get().paged_decode_merge,
            (t, hq),
            dst,
            dst_lse,
            out,
            lse,
            out.stride(0),
            out.stride(1),
            hq * max_splits * d,
            max_splits * d,
            d,
            hq,
            max_splits,
            HEAD_DIM=d,
            D_PAD=d_pad,
            S_PAD=next_pow2(max_splits),
            WRITE_LSE=True,
            num_warps=4,
        )
    return out, lse


def paged_prefill(
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale=None, v_scale=None
):
    """``lz.paged_attention`` canonical-args entry (see :func:`layerzero.ops.paged.prepare`):
    :func:`paged_prefill_lse` without the lse, for prefill, append and mixed prefill + decode steps. q
    ``[T, Hq, D]`` -> ``[T, Hq, D]`` in q's dtype; cu_seqlens_q ``[B + 1]`` int32 (None: one token per
    sequence); causal aligned bottom-right (query i of a sequence with ``q_len`` new tokens sees its first
    ``seq_len - q_len + i + 1`` keys). float8_e4m3fn / int8 caches with per-tensor ``k_scale`` / ``v_scale``
    as :func:`paged_prefill_lse` reads them.

    Where it matters: an engine on a GPU without FlashInfer ran its prefill and mixed steps on
    ``torch_sdpa.paged_attention`` (a gather and an SDPA call per sequence per layer): 5-9 s per mixed step of
    ~8k prompt tokens on the H200 (benchmarks/results/engine/h200/2026-11-28e/).

    Raises:
        InvalidInputError: as :func:`paged_prefill_lse` (more than :data:`MAX_SEQS` sequences)."""
    return paged_prefill_lse(
        q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale, v_scale
    )[0]


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """``lz.merge_attention_states`` canonical-args entry: out ``[T, H, D]`` (any strides with a unit last
    one), lse ``[T, H]`` float32 with unit stride over heads. Returns ``(out [T, H, D] in out_a's dtype, lse
    [T, H] float32)``."""
    kern = _KERNELS.get()
    t, h, d = out_a.shape
    out = torch.empty(t, h, d, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=out_a.device)
    if t == 0:
        return out, lse
    la, lb = (x if x.stride(-1) == 1 else x.contiguous() for x in (lse_a, lse_b))
    launch(
        kern.merge_states,
        (t,),
        out_a,
        la,
        out_b,
        lb,
        out,
        lse,
        out_a.stride(0),
        out_a.stride(1),
        out_b.stride(0),
        out_b.stride(1),
        out.stride(0),
        out.stride(1),
        la.stride(0),
        lb.stride(0),
        h,
        HEAD_DIM=d,
        D_PAD=max(16, next_pow2(d)),
        H_PAD=next_pow2(h),
        num_warps=4,
    )
    return out, lse


def prefill_check(ctx: SelectionContext) -> list[Reason]:
    """What data cannot say for ``triton.paged_prefill_lse``: GQA ratio <= 16, a paged layout, a page size >=
    1, at most :data:`MAX_SEQS` sequences."""
    out = []
    if ctx.batch is not None and ctx.batch > MAX_SEQS:
        out.append(
            Reason(
                ReasonCode.SHAPE_MISMATCH,
                f"{ctx.batch} sequences > {MAX_SEQS} (per-sequence vectors in every program)",
            )
        )
    ratio = ctx.gqa_ratio
    if ratio is not None and ratio > MAX_GROUP:
        out.append(
            Reason(ReasonCode.GQA_RATIO_INVALID, f"Hq / Hkv = {ratio} > {MAX_GROUP} (one GQA group per tile)")
        )
    if ctx.kv_layout not in KV_LAYOUTS:
        out.append(Reason(ReasonCode.KV_LAYOUT_UNSUPPORTED, f"kv_layout {ctx.kv_layout!r} is not NHD or HND"))
    if ctx.page_size is not None and ctx.page_size < 1:
        out.append(Reason(ReasonCode.SHAPE_MISMATCH, f"page size {ctx.page_size} < 1"))
    return out


def merge_check(ctx: SelectionContext) -> list[Reason]:
    """``triton.merge_attention_states`` holds every head of a row in one tile: at most 256 heads x head
    dim 256."""
    if (ctx.num_heads_q or 1) * next_pow2(ctx.head_dim or 1) > 256 * 256:
        return [
            Reason(
                ReasonCode.HEAD_DIM_TOO_LARGE,
                f"{ctx.num_heads_q} heads x head dim {ctx.head_dim} > one [256, 256] tile",
            )
        ]
    return []


def kernel_specs(available: bool, why: str) -> list[KernelSpec]:
    """``[triton.paged_prefill_lse, triton.merge_attention_states, triton.paged_prefill]`` (CUDA SM >= 8.0,
    fp16/bf16/fp32, graph-safe, deterministic, priority 30: below ``triton.paged_decode`` (40), which decode
    calls get, and FlashInfer (60); above ``torch_sdpa.paged_attention`` (10)); when ``available`` is False
    their callables raise ``BackendNotAvailableError`` with ``why``."""
    common: dict[str, Any] = dict(
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        supports_backward=False,
        supports_dropout=False,
        deterministic=True,
        graph_safe=True,
    )
    prefill: dict[str, Any] = dict(
        head_dim_min=1,
        head_dim_max=HEAD_DIM_MAX,
        check=prefill_check,
        kv_cache_dtypes=KV_QUANT_DTYPES,
        **common,
    )
    return [
        KernelSpec(
            PREFILL_KERNEL_ID,
            "paged_attention_lse",
            paged_prefill_lse if available else missing(PREFILL_KERNEL_ID, why),
            priority=PREFILL_PRIORITY,
            description="Triton paged attention of many query tokens per sequence (FlashAttention forward "
            "over pages, GQA group and token tile as one tile), causal or not, with the lse: "
            "cascade attention's shared level",
            **prefill,
        ),
        KernelSpec(
            MERGE_KERNEL_ID,
            "merge_attention_states",
            merge_attention_states if available else missing(MERGE_KERNEL_ID, why),
            priority=PREFILL_PRIORITY,
            description="Triton merge of two attention states (one program per row, all heads as one tile)",
            check=merge_check,
            **common,
        ),
        KernelSpec(
            PAGED_KERNEL_ID,
            "paged_attention",
            paged_prefill if available else missing(PAGED_KERNEL_ID, why),
            priority=PREFILL_PRIORITY,
            description="triton.paged_prefill_lse without the lse: paged prefill, append and mixed steps "
            "(FlashAttention forward over pages), causal or not",
            **prefill,
        ),
    ]
