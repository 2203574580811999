"""The split merge of ``triton.paged_decode`` (private; imported by ``_paged_kernels`` only after
``import triton`` succeeded): :func:`merge_row`, one (sequence, query head)'s merge of its splits' partials,
which the split kernel's ``FUSED_MERGE``, ``_attention_kernels`` and stage 2 share, and
:func:`paged_decode_merge`, stage 2 (grid ``(B, Hq)``: the S partials of one (sequence, query head) weighed by
``2^(lse_s - max lse)``, empty splits weighing 0, stored in the output's dtype). ``triton.rope_paged_decode``
and ``triton.paged_prefill_lse`` launch the same stage 2. Split from ``_paged_kernels.py``, which re-exports
both (``paged``'s ``_KERNELS`` reaches ``paged_decode_merge`` there)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._gdc_kernels import gdc_enter

LN2 = tl.constexpr(0.6931471805599453)  # used inside @triton.jit: a constexpr global


@triton.jit
def merge_row(
    ws_out_ptr,
    ws_lse_ptr,
    o_ptr,
    lse_out_ptr,
    lse_row,
    ws_row,
    o_row,
    lse_out_row,
    stride_ws,
    num_splits,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Merge one (sequence, query head)'s ``num_splits`` partials (workspace lse at ``ws_lse_ptr + lse_row``,
    outputs at ``ws_out_ptr + ws_row``, split stride ``stride_ws``) with weights ``2^(lse_s - max lse)``
    (empty splits weigh 0; a slot no split wrote, cascade's device-sized splits, is loaded and dropped) into
    ``o_ptr + o_row`` in its dtype; with ``WRITE_LSE`` the merged natural-log lse to
    ``lse_out_ptr + lse_out_row`` (-inf for a row with no key). Loads go through L2 (``.cg``): the partials
    may come from other SMs of the same launch (``FUSED_MERGE``)."""
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < num_splits
    d_ok = d < HEAD_DIM
    lse = tl.load(ws_lse_ptr + lse_row + s, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits: 2^-inf = 0
    used = s_ok & (lse > float("-inf"))
    # every split's partial is loaded with the lse, not after it (a mask from the lse would put a second L2
    # round trip on the critical path); a partial no split wrote (lse -inf: an empty split, cascade's unused
    # slots) is dropped here
    parts = tl.load(
        ws_out_ptr + ws_row + s[:, None] * stride_ws + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    parts = tl.where(used[:, None], parts, 0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(o_ptr + o_row + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        tl.store(
            lse_out_ptr + lse_out_row,
            tl.where(total > 0.0, (m + tl.log2(tl.where(total > 0.0, total, 1.0))) * LN2, float("-inf")),
        )


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def paged_decode_merge(
    ws_out_ptr,
    ws_lse_ptr,
    o_ptr,
    lse_out_ptr,
    stride_ob,
    stride_oh,
    stride_wb,
    stride_wh,
    stride_ws,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr = False,
    PDL: tl.constexpr = False,
    TRIGGER_FIRST: tl.constexpr = False,
):
    """Stage 2 (see the module docstring): one program per (sequence, query head); with ``WRITE_LSE`` the
    merged natural-log lse goes to ``lse_out_ptr`` (contiguous ``[B, Hq]`` float32, -inf for a sequence with
    no key)."""
    gdc_enter(PDL, TRIGGER_FIRST)  # PDL-launched: wait for the previous kernel before any memory access
    b = tl.program_id(0)
    hq = tl.program_id(1)
    merge_row(
        ws_out_ptr,
        ws_lse_ptr,
        o_ptr,
        lse_out_ptr,
        (b * num_heads + hq) * num_splits,
        b * stride_wb + hq * stride_wh,
        b * stride_ob + hq * stride_oh,
        b * num_heads + hq,
        stride_ws,
        num_splits,
        HEAD_DIM,
        D_PAD,
        S_PAD,
        WRITE_LSE,
    )
