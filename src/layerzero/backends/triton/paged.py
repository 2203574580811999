"""``triton.paged_decode``: our Triton split-K paged decode attention for ``lz.paged_attention``.

FlashDecoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"; vLLM's
``triton_decode_attention`` is the same two-stage shape): stage 1 splits every sequence's KV over S programs
(its ``BLOCK_N``-token tiles interleaved: split s takes tiles s, s + S, ..., so a sequence far shorter than
the block table's width still spreads over every split) and runs one program per (sequence, KV head, split)
holding all the query heads of the KV head's GQA group as one tile, online softmax in float32, writing a
partial output and its log-sum-exp to a float32 workspace; stage 2 merges the S partials (with one split,
stage 1 writes the output and stage 2 is skipped; eager calls merge in stage 1: the split that finishes last
does it: :attr:`PagedDecodeKnobs.fused_merge`). Tile size, split count and launch config follow an H200 search
(``benchmarks/tune_paged_decode.py``): :class:`PagedDecodeKnobs`.

This module holds the KernelSpecs, the canonical-args entries and the selection check, and re-exports the
names of the two modules it was split into: ``_paged_geometry.py`` (the knobs, registered there, and the tile
/ split rules: pure arithmetic) and ``_paged_launch.py`` (:func:`paged_decode` and its per-call-signature
plans). The Triton code is in ``_paged_kernels.py`` (the split kernel; its helpers in ``_paged_tiles.py``, the
merge in ``_paged_merge_kernels.py``), imported on the first call (only after ``import triton`` succeeded in
the backend's probe).

Graph-safe: no host read of ``seq_lens``/``block_tables``; the grid ``(B, Hkv, S)`` and ``S`` come from shapes
only (``max_blocks * P`` is the upper bound of every seq_len), the workspace is a ``torch.empty`` per call
(the caching allocator serves it from the graph's pool under capture). Splits with no tile below a sequence's
length are empty (lse ``-inf``, weight 0). Decode only: prefill/append (``cu_seqlens_q``) is refused by
:func:`check`.
"""

from __future__ import annotations

from typing import Any

from layerzero.core.context import SelectionContext
from layerzero.core.errors import InvalidInputError, expected_got
from layerzero.core.kv_layout import KV_LAYOUTS
from layerzero.core.kv_quant import KV_QUANT_DTYPES
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec, Phase

from ._common import CUDA, FLOATS, SM_MIN, missing
from ._paged_common import sm_count, split_counters  # noqa: F401 - re-exported
from ._paged_geometry import (  # noqa: F401 - re-exported: the knobs and the geometry rules
    KERNEL_ID,
    KNOBS,
    MAX_GROUP,
    Geometry,
    PagedDecodeKnobs,
    _bad,
    block_n_for,
    choose_split_len,
    chunk_rule,
    geometry,
    launch_config,
    small_batch,
    tile_rule,
    workspace_bytes,
)
from ._paged_launch import (  # noqa: F401 - re-exported: the launch and its plans
    _KERNELS,
    _PLANS,
    _PLANS_MAX,
    _Plan,
    _plan,
    paged_decode,
)

LSE_KERNEL_ID = "triton.paged_decode_lse"
PRIORITY = 40
"""Above ``torch_sdpa.paged_attention`` (10): one fused pass over the used pages, no padded gather."""
HEAD_DIM_MAX = 256


def paged_attention(
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale=None, v_scale=None
):
    """``lz.paged_attention`` canonical-args entry (see :func:`layerzero.ops.paged.prepare`), decode only: q
    ``[B, Hq, D]`` -> ``[B, Hq, D]`` in q's dtype; ``is_causal`` changes nothing for one query token (it sees
    every key). Raises ``InvalidInputError`` for ``cu_seqlens_q`` (prefill/append; :func:`check` keeps
    selection from ever routing it here) and what :func:`paged_decode` raises."""
    _decode_only(KERNEL_ID, cu_seqlens_q)
    return paged_decode(
        q, kv_cache, block_tables, seq_lens, scale, kv_layout, k_scale=k_scale, v_scale=v_scale
    )


def paged_attention_lse(
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale=None, v_scale=None
):
    """``lz.paged_attention(..., return_lse=True)`` canonical-args entry, decode only (as
    :func:`paged_attention`): ``(out [B, Hq, D] in q's dtype, lse [B, Hq] float32)``."""
    _decode_only(LSE_KERNEL_ID, cu_seqlens_q)
    return paged_decode(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        scale,
        kv_layout,
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=True,
    )


def _decode_only(kernel_id: str, cu_seqlens_q: Any) -> None:
    """Raise ``InvalidInputError`` when ``kernel_id`` (a decode-only kernel) is called with
    ``cu_seqlens_q``."""
    if cu_seqlens_q is not None:
        raise InvalidInputError(
            expected_got(
                f"{kernel_id}: cu_seqlens_q",
                "None (decode: one query token per sequence)",
                "a tensor (prefill/append)",
                f"Prefill/append runs on another paged kernel; do not lock {kernel_id} for it.",
            )
        )


def check(ctx: SelectionContext) -> list[Reason]:
    """What the data constraints cannot say: decode only (``ctx.phase`` DECODE), GQA ratio <= 16, a paged
    layout."""
    out = []
    if ctx.phase is not Phase.DECODE:
        out.append(
            Reason(
                ReasonCode.SEQ_LEN_TOO_LONG,
                f"decode only (one query token per sequence); got phase {getattr(ctx.phase, 'value', None)} "
                f"(cu_seqlens_q given, q_len up to {ctx.seq_len_q}): prefill/append run on other kernels",
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


def kernel_specs(available: bool, why: str) -> list[KernelSpec]:
    """The Triton paged KernelSpecs: ``triton.paged_decode`` (op ``paged_attention``, CUDA SM >= 8.0,
    fp16/bf16/ fp32, head dims 1..256, NHD and HND, any page size, GQA 1..16, decode only, graph-safe,
    deterministic, priority 40), ``triton.paged_decode_lse`` (the same for op ``paged_attention_lse``), then
    the cascade kernels (``triton.paged_prefill_lse``, ``triton.merge_attention_states``: :mod:`.cascade`).
    When ``available`` is False the specs are still registered and their callables raise
    ``BackendNotAvailableError`` with ``why``."""
    from . import cascade

    common: dict[str, Any] = dict(
        priority=PRIORITY,
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        head_dim_min=1,
        head_dim_max=HEAD_DIM_MAX,
        supports_backward=False,
        supports_dropout=False,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        check=check,
        workspace=workspace_bytes,
        kv_cache_dtypes=KV_QUANT_DTYPES,
    )
    return [
        KernelSpec(
            KERNEL_ID,
            "paged_attention",
            paged_attention if available else missing(KERNEL_ID, why),
            description="Triton split-K paged decode (FlashDecoding): per (sequence, KV head, split) online "
            "softmax over the used pages, GQA group as one tile, then a log-sum-exp merge",
            **common,
        ),
        KernelSpec(
            LSE_KERNEL_ID,
            "paged_attention_lse",
            paged_attention_lse if available else missing(LSE_KERNEL_ID, why),
            description="triton.paged_decode returning each row's log-sum-exp too (the split merge's lse)",
            **common,
        ),
        *cascade.kernel_specs(available, why),
    ]
