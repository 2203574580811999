"""The ``@triton.jit`` code of ``triton.paged_decode`` (private; imported by :mod:`.paged` only after ``import
triton`` succeeded). Split-K paged decode attention after FlashDecoding (Dao, Haziza, Massa, Sizov 2023,
"Flash-Decoding for long-context inference") and vLLM's ``triton_decode_attention`` (two stages).

Stage 1, grid ``(B, Hkv, S)``: program (b, h, s) takes the ``group = Hq / Hkv`` query heads of KV head h as
one ``[GROUP_PAD, D_PAD]`` tile and runs an online softmax (float32, base 2) over the ``BLOCK_N``-position
tiles s, s + S, s + 2S, ... of sequence b below its ``seq_len`` (tiles interleaved over the splits: the split
count comes from the block table's width, an upper bound, and contiguous ranges of it left every split but the
first idle for sequences much shorter than the width, as in a CUDA graph sized for the longest one). Each
position t is gathered through ``block_tables[b, t // P]`` at offset ``t % P`` (any page size P); loads of
positions ``>= seq_len`` (block ids included) are masked, so unused pages, unused slots and padding ids in
``block_tables`` are never read. With ``ONE_PASS`` (at most 4 tiles a split, ``CHUNKS`` of them: 1, 2 or 4) a
program gathers all its tiles at once with no loop: the block ids below ``table_len`` (the table's width: the
load does not wait for ``seq_len``; ids past the sequence's blocks are read, never dereferenced), then every K
/ V tile below ``seq_len``, then the online-softmax steps of the tiles that hold positions (``pass_ids`` /
``pass_kv`` / ``attend_pass``, shared with ``_rope_paged_kernels``). It writes the normalized partial output
``[group, D]`` and its log2-sum-exp to the float32 workspace; an empty split writes only its lse, ``-inf``
(the merge drops every partial whose lse is ``-inf``, whatever its slot holds).

With one split (large batches: the grid is full without splitting) stage 1 stores the normalized output
directly in the output's dtype and stage 2 is not launched. With ``FUSED_MERGE`` (eager calls) stage 1's last
split of each (sequence, KV head) merges, and stage 2 is not launched either (see ``paged_decode_split``).

Stage 2, grid ``(B, Hq)``: merges the S partials of one (sequence, query head) with weights
``2^(lse_s - max lse)`` (empty splits weigh 0) and stores the result in the output's dtype.

This module holds stage 1 (``paged_decode_split``); its ``@triton.jit`` helpers (gathers, online-softmax
steps, the one pass) are in ``_paged_tiles.py`` and stage 2 with the merge it shares (``paged_decode_merge``,
``merge_row``) in ``_paged_merge_kernels.py``, imported here: the split kernel calls them, and the launchers
reach ``paged_decode_merge`` through this module (``LazyModule("_paged_kernels")``).

A quantized cache (float8_e4m3fn / int8 codes, ``QUANT``) is dequantized in the tile loop as ``code * scale``
with the per-tensor scales read once per program (floats or device pointers), then both dots run in float32.

Nothing here reads a device value on the host: the grid and every launch argument come from shapes, so a
launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._cache_kernels import load_scale
from ._gdc_kernels import gdc_enter
from ._paged_merge_kernels import LN2, merge_row, paged_decode_merge  # noqa: F401 - the merge: re-exported
from ._paged_tiles import _attend_tile, attend_pass, pass_ids, pass_kv, pass_newest

LOG2E = 1.4426950408889634


@triton.jit(
    do_not_specialize=["stride_bt", "split_len", "page", "group", "num_splits", "table_len", "stride_lb"]
)
def paged_decode_split(
    q_ptr,
    kv_ptr,
    bt_ptr,
    lens_ptr,
    ws_out_ptr,
    ws_lse_ptr,
    lse_out_ptr,
    o_ptr,
    cnt_ptr,
    qk_scale,  # softmax scale * log2(e)
    k_scale,
    v_scale,  # a quantized cache's scales: floats, or pointers to one float32 (K_PTR / V_PTR)
    stride_qb,
    stride_qh,
    stride_blk,
    stride_kv,
    stride_pos,
    stride_head,
    stride_bt,
    split_len,
    page,
    group,
    num_splits,  # split_len: tokens per split at most (the interpreter's bound)
    # the block table's width in tokens (M * P): ONE_PASS reads block ids below it, seq_len unknown yet
    table_len,
    stride_wb,
    stride_wh,
    stride_ws,  # workspace out [B, Hq, S, D] (contiguous); DIRECT: the output's strides
    stride_lb,  # workspace lse [B, Hq, S] (contiguous): Hq * S
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DIRECT: tl.constexpr,
    QUANT: tl.constexpr = False,
    K_PTR: tl.constexpr = False,
    V_PTR: tl.constexpr = False,
    WRITE_LSE: tl.constexpr = False,
    FUSED_MERGE: tl.constexpr = False,
    S_PAD: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    CHUNKS: tl.constexpr = 1,
    ONE_PASS: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    TRIGGER_FIRST: tl.constexpr = False,
):
    """Stage 1 (see the module docstring). Strides are in elements. ``DIRECT`` (one split): ``ws_out_ptr`` is
    the output ``[B, Hq, D]`` itself (``stride_ws`` unused), the normalized result is stored in its dtype, no
    stage 2; with ``WRITE_LSE`` its natural-log lse goes to ``lse_out_ptr`` (contiguous ``[B, Hq]`` float32).

    ``FUSED_MERGE`` (several splits): no stage 2 either. ``cnt_ptr`` is an int32 counter per (sequence, KV
    head), ``[B, Hkv]`` row-major, 0 at launch; each program stores its partial, then (CTA barrier, one
    acq_rel atomic at GPU scope: CUTLASS's serial split-K semaphore) counts itself done, and the program that
    counts last merges the group's ``num_splits`` partials into ``o_ptr`` (contiguous ``[B, Hq, D]``) as stage
    2 would, reading the workspace through L2 (``.cg``), then puts the counter back to 0 for the next launch.

    ``EARLY`` (with ``ONE_PASS``): the PDL wait comes after ``seq_len``, the block ids and every K / V
    position but the newest (``seq_len - 1``) are loaded: step metadata and cache rows of earlier steps, which
    the kernel just before (a decode step's KV write: it writes each sequence's newest position only) cannot
    have written (``_gdc_kernels``); the queries and the newest position's K / V are read after it. Then the K
    / V loads (HBM) overlap that kernel."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kv_head = kv_ptr + h * stride_head
    bt_row = bt_ptr + b * stride_bt
    if EARLY:  # the loads that cannot race with the kernel just before, then the wait
        seq_len = tl.load(lens_ptr + b)
        t0 = s * BLOCK_N
        step = num_splits * BLOCK_N
        p0, b0, p1, b1, p2, b2, p3, b3 = pass_ids(bt_row, t0, step, table_len, page, BLOCK_N, CHUNKS)
        c0, k0, v0, c1, k1, v1, c2, k2, v2, c3, k3, v3 = pass_kv(
            kv_head,
            p0,
            b0,
            p1,
            b1,
            p2,
            b2,
            p3,
            b3,
            seq_len,
            seq_len - 1,
            stride_blk,
            stride_kv,
            stride_pos,
            page,
            HEAD_DIM,
            D_PAD,
            CHUNKS,
        )
        newest = seq_len - 1
        here = (newest >= 0) & ((newest // BLOCK_N) % num_splits == s)  # this split holds the newest position
        blk_new = tl.load(bt_row + newest // page, mask=here, other=0)
        gdc_enter(
            PDL, TRIGGER_FIRST
        )  # PDL-launched: wait for the previous kernel, then read q and the newest K / V
        c0, k0, v0, c1, k1, v1, c2, k2, v2, c3, k3, v3 = pass_newest(
            kv_head,
            blk_new,
            newest,
            here,
            p0,
            p1,
            p2,
            p3,
            c0,
            k0,
            v0,
            c1,
            k1,
            v1,
            c2,
            k2,
            v2,
            c3,
            k3,
            v3,
            stride_blk,
            stride_kv,
            stride_pos,
            page,
            HEAD_DIM,
            D_PAD,
            CHUNKS,
        )
    else:
        gdc_enter(PDL, TRIGGER_FIRST)  # PDL-launched: wait for the previous kernel before any memory access
        seq_len = tl.load(lens_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < group
    d_ok = d < HEAD_DIM
    heads = h * group + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    ks = load_scale(k_scale, K_PTR)
    vs = load_scale(v_scale, V_PTR)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    # split s takes tiles s, s + S, s + 2S, ... of the sequence's own length (interleaved): however short the
    # sequence is against the block table's width (the split count comes from the width), its tiles spread
    # over the splits instead of all landing in the first one
    if (
        ONE_PASS
    ):  # the split's every tile of the table (CHUNKS: 1, 2 or 4) gathered at once, then attended if valid
        if not EARLY:  # (EARLY gathered them above)
            t0 = s * BLOCK_N
            step = num_splits * BLOCK_N
            p0, b0, p1, b1, p2, b2, p3, b3 = pass_ids(bt_row, t0, step, table_len, page, BLOCK_N, CHUNKS)
            c0, k0, v0, c1, k1, v1, c2, k2, v2, c3, k3, v3 = pass_kv(
                kv_head,
                p0,
                b0,
                p1,
                b1,
                p2,
                b2,
                p3,
                b3,
                seq_len,
                -1,
                stride_blk,
                stride_kv,
                stride_pos,
                page,
                HEAD_DIM,
                D_PAD,
                CHUNKS,
            )
        m_i, l_i, acc = attend_pass(
            q,
            c0,
            k0,
            v0,
            c1,
            k1,
            v1,
            c2,
            k2,
            v2,
            c3,
            k3,
            v3,
            t0,
            step,
            seq_len,
            m_i,
            l_i,
            acc,
            qk_scale,
            ks,
            vs,
            UPCAST,
            QUANT,
            CHUNKS,
        )
    elif (
        INTERPRET
    ):  # the CPU interpreter cannot loop over runtime bounds: a fixed trip count, empty tiles skipped
        for i in range(0, TILES_PER_SPLIT):
            t0 = (s + i * num_splits) * BLOCK_N
            if t0 < seq_len:
                m_i, l_i, acc = _attend_tile(
                    q,
                    kv_head,
                    bt_row,
                    t0,
                    seq_len,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    ks,
                    vs,
                    stride_blk,
                    stride_kv,
                    stride_pos,
                    page,
                    HEAD_DIM,
                    D_PAD,
                    BLOCK_N,
                    UPCAST,
                    QUANT,
                )
    else:
        for t0 in range(s * BLOCK_N, seq_len, num_splits * BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q,
                kv_head,
                bt_row,
                t0,
                seq_len,
                m_i,
                l_i,
                acc,
                qk_scale,
                ks,
                vs,
                stride_blk,
                stride_kv,
                stride_pos,
                page,
                HEAD_DIM,
                D_PAD,
                BLOCK_N,
                UPCAST,
                QUANT,
            )
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    if DIRECT:
        o_off = b * stride_wb + heads * stride_wh
        tl.store(
            ws_out_ptr + o_off[:, None] + d[None, :],
            out.to(ws_out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )
        if WRITE_LSE:
            tl.store(lse_out_ptr + b * stride_lb + heads, lse * LN2, mask=g_ok)  # one split: stride_lb = Hq
    else:
        w_off = b * stride_wb + heads * stride_wh + s * stride_ws
        # an empty split stores its lse (-inf) only: the merge drops the partial of such a split (merge_row
        # weighs it by its lse), and at batch 1 most splits of a short sequence are empty
        tl.store(
            ws_out_ptr + w_off[:, None] + d[None, :], out, mask=(g_ok & nonempty)[:, None] & d_ok[None, :]
        )
        tl.store(ws_lse_ptr + b * stride_lb + heads * num_splits + s, lse, mask=g_ok)
        if FUSED_MERGE:
            tl.debug_barrier()  # every thread's stores precede the release below
            cnt = cnt_ptr + b * tl.num_programs(1) + h
            done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:  # the last split of (b, h): every other one's partial is visible now
                num_heads = tl.num_programs(1) * group
                for i in range(0, GROUP_PAD):
                    if i < group:
                        hq = h * group + i
                        merge_row(
                            ws_out_ptr,
                            ws_lse_ptr,
                            o_ptr,
                            lse_out_ptr,
                            b * stride_lb + hq * num_splits,
                            b * stride_wb + hq * stride_wh,
                            (b * num_heads + hq) * HEAD_DIM,
                            b * num_heads + hq,
                            stride_ws,
                            num_splits,
                            HEAD_DIM,
                            D_PAD,
                            S_PAD,
                            WRITE_LSE,
                        )
                tl.atomic_xchg(
                    cnt, 0, sem="relaxed", scope="gpu"
                )  # ready for the next launch (kernel boundary)
