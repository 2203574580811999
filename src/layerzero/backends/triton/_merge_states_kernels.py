"""The ``@triton.jit`` code of ``triton.merge_attention_states`` (private; imported by ``_cascade_kernels``,
which re-exports it, only after ``import triton`` succeeded): ``merge_states``, grid ``(T,)``, one program per
row merges two attention states of all heads (``[H_PAD, D_PAD]``) with weights ``exp(lse - max)``
(FlashInfer's ``merge_state``). Split from ``_cascade_kernels.py`` (``paged_prefill``): ``cascade``'s
``LazyModule("_cascade_kernels")`` reaches it there. Nothing reads a device value on the host (graph-safe)."""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
LOG2E_C = tl.constexpr(1.4426950408889634)
"""ln 2 and log2(e) inside ``@triton.jit`` code: globals read there must be ``tl.constexpr`` instances."""


@triton.jit(do_not_specialize=["num_heads"])
def merge_states(
    oa_ptr,
    la_ptr,
    ob_ptr,
    lb_ptr,
    o_ptr,
    l_ptr,
    stride_at,
    stride_ah,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    stride_lat,
    stride_lbt,
    num_heads,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    H_PAD: tl.constexpr,
):
    """One row t: ``out[t] = (w_a out_a[t] + w_b out_b[t]) / (w_a + w_b)``, ``lse[t] = m + log(w_a +
    w_b)``, with ``w = exp(lse - m)``, ``m = max(lse_a,
    lse_b)`` per head; both -inf gives 0 and -inf. ``l_ptr`` is a contiguous ``[T, num_heads]`` float32; the
    lse inputs have unit stride over heads."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    h_ok = h < num_heads
    mask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    la = tl.load(la_ptr + t * stride_lat + h, mask=h_ok, other=float("-inf")).to(tl.float32)
    lb = tl.load(lb_ptr + t * stride_lbt + h, mask=h_ok, other=float("-inf")).to(tl.float32)
    mx = tl.maximum(la, lb)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wa = tl.exp2((la - mx) * LOG2E_C)
    wb = tl.exp2((lb - mx) * LOG2E_C)
    total = wa + wb
    oa = tl.load(oa_ptr + t * stride_at + h[:, None] * stride_ah + d[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    ob = tl.load(ob_ptr + t * stride_bt + h[:, None] * stride_bh + d[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    safe = tl.where(total > 0.0, total, 1.0)
    # a state of weight 0 contributes nothing, even a NaN output row
    out = (
        tl.where(wa[:, None] > 0.0, oa * wa[:, None], 0.0)
        + tl.where(wb[:, None] > 0.0, ob * wb[:, None], 0.0)
    ) / safe[:, None]
    lse = tl.where(total > 0.0, mx + tl.log2(safe) * LN2, float("-inf"))
    tl.store(
        o_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=mask
    )
    tl.store(l_ptr + t * num_heads + h, lse, mask=h_ok)
