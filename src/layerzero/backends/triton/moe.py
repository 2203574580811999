"""``triton.fused_moe``: our Triton grouped-GEMM mixture of experts (vLLM's ``fused_experts`` recipe), CUDA
only.

Three steps, every one without a host synchronization (so the call can be captured in a CUDA graph):

1. :func:`moe_align` (torch ops): sort the ``P = T * K`` (token, slot) pairs by expert and pad each expert's
   group to a multiple of BLOCK_M rows (vLLM's ``moe_align_block_size``), so every BLOCK_M tile of the sorted
   rows belongs to one expert. The number of tiles is bounded from the shapes alone
   (``min(P, cdiv(P, BLOCK_M) + min(E, P))``); tiles past the last group are marked with expert ``E`` and
   exit.
2. ``_gate_up_kernel``: per tile, ``gate_up = x[tokens] @ w13[e].T`` with the gate and up halves accumulated
   side by side in float32 and ``silu(gate) * up`` in the epilogue, stored as ``h [P, I]`` in x's dtype
   (vLLM's rounding: the second GEMM reads half-precision operands).
3. ``_down_kernel``: per tile, ``y = (h @ w2[e].T) * topk_weight`` in float32 into ``y [P, H]``, then
   ``y.view(T, K, H).sum(1)`` (float32, fixed order: deterministic, no atomics) rounded to x's dtype.

Block sizes follow vLLM's default config (``get_default_config``): ``(16, 32, 64)`` for (BLOCK_M, BLOCK_N,
BLOCK_K) when T <= E (decode: few rows per expert), ``(64, 64, 32)`` otherwise; not tuned on a GPU yet.
Weights may have any strides (a program reads a [BLOCK_K, BLOCK_N] tile of an nn.Linear-layout weight).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, cdiv, missing
from ._launch import launch

KERNEL_ID = "triton.fused_moe"
PRIORITY = 60
"""Above the reference (0): the only other fused_moe kernel, a Python loop over experts with a sync per
expert."""
MAX_COLS = 65535 * 32
"""Largest H and I: column tiles of at least 32 go on grid axis 1 (CUDA y, at most 65535)."""
_KERNELS = LazyModule("_moe_kernels")


def block_sizes(num_tokens: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): vLLM's default fused-MoE config (small row tiles while T <= E)."""
    return (16, 32, 64) if num_tokens <= num_experts else (64, 64, 32)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the flat (token, slot) pairs by expert in BLOCK_M-aligned segments, with torch ops only (no
    sync).

    Args:
        topk_ids: ``[T, K]`` expert ids in ``[0, E]``; pair ``p = t * K + k``; a pair of id ``E`` (no
            expert) is in no group.
        num_experts: E.
        block_m: rows per tile.

    Returns:
        (sorted_ids ``[tiles * block_m]`` int32: pair ids grouped by expert (token order within an expert),
        each group padded with ``P`` to a multiple of block_m; block_expert ``[tiles]`` int32: the expert of
        each tile, ``E`` for tiles past the last group). ``tiles = min(P, cdiv(P, block_m) + min(E, P))``
        bounds the tiles used: each expert with c > 0 pairs takes ``cdiv(c, block_m) <= c`` and
        ``<= c // block_m + 1`` of them.

    >>> ids, experts = moe_align(torch.tensor([[2, 0], [2, 1]]), 4, 2)
    >>> ids.tolist(), experts.tolist()
    ([1, 4, 3, 4, 0, 2, 4, 4], [0, 1, 2, 4])
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs, dev = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert, token order within a group
    expert = flat[order]
    # group e is order[bounds[e]:bounds[e + 1]] (a binary search, no atomics: deterministic)
    bounds = torch.searchsorted(expert, torch.arange(num_experts + 1, device=dev))
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    seg_end = padded.cumsum(0)  # expert e's padded segment: [seg_end[e] - padded[e], seg_end[e])
    rank = torch.arange(pairs, device=dev) - bounds[expert]  # position within its group
    tiles = min(pairs, cdiv(pairs, block_m) + min(num_experts, pairs))
    # pairs of id E (no expert) sort last and go to one extra slot past the tiles, cut off below (a masked
    # scatter without a data-dependent shape: no sync)
    seg_start = torch.cat([seg_end - padded, seg_end.new_full((1,), tiles * block_m)])
    dst = torch.where(expert < num_experts, seg_start[expert] + rank, tiles * block_m)
    sorted_ids = torch.full((tiles * block_m + 1,), pairs, dtype=torch.int32, device=dev)
    sorted_ids[dst] = order.to(torch.int32)
    sorted_ids = sorted_ids[: tiles * block_m]
    starts = torch.arange(tiles, device=dev) * block_m
    block_expert = torch.searchsorted(seg_end, starts, right=True).to(
        torch.int32
    )  # first e with seg_end > start
    return sorted_ids, block_expert


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Sparse MoE experts with SwiGLU (the ``lz.fused_moe`` contract) as two Triton grouped GEMMs.

    Args:
        x: ``[T, H]`` float16/bfloat16/float32, any strides.
        w13: ``[E, 2I, H]`` (gate rows, then up rows) in x's dtype, any strides.
        w2: ``[E, H, I]`` in x's dtype, any strides.
        topk_weights: ``[T, K]`` float32.
        topk_ids: ``[T, K]`` int32/int64 in ``[0, E]`` (not checked here; ``E``: no expert, adds nothing).

    Returns:
        ``[T, H]`` in x's dtype, a new contiguous tensor.

    Raises:
        Nothing of its own (inputs are validated by ``lz.fused_moe``); triton's compile/launch errors
        propagate.
    """
    tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    mod = _KERNELS.get()
    bm, bn, bk = block_sizes(tokens, num_experts)
    sorted_ids, block_expert = moe_align(topk_ids, num_experts, bm)
    pairs, tiles = tokens * top_k, block_expert.numel()
    upcast = mod.INTERPRETED
    ieee = upcast or x.dtype == torch.float32  # float32: no TF32
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    blocks = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    launch(
        mod._gate_up_kernel,
        (tiles, cdiv(inter, bn)),
        x,
        w13,
        h,
        sorted_ids,
        block_expert,
        pairs,
        num_experts,
        x.stride(0),
        x.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        h.stride(0),
        h.stride(1),
        HIDDEN=hidden,
        INTER=inter,
        TOP_K=top_k,
        IEEE=ieee,
        UPCAST=upcast,
        **blocks,
    )
    y = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)  # a no-expert pair's row stays 0
    launch(
        mod._down_kernel,
        (tiles, cdiv(hidden, bn)),
        h,
        w2,
        y,
        topk_weights.contiguous().view(-1),
        sorted_ids,
        block_expert,
        pairs,
        num_experts,
        h.stride(0),
        h.stride(1),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        y.stride(0),
        y.stride(1),
        HIDDEN=hidden,
        INTER=inter,
        IEEE=ieee,
        UPCAST=upcast,
        **blocks,
    )
    return y.view(tokens, top_k, hidden).sum(1).to(x.dtype)


def _check(ctx: SelectionContext) -> list[Reason]:
    reasons = []
    for name, size in (("hidden size", ctx.hidden_size), ("intermediate size", ctx.intermediate_size)):
        if size is not None and size > MAX_COLS:
            reasons.append(
                Reason(
                    ReasonCode.HIDDEN_SIZE_UNSUPPORTED,
                    f"{name} {size} > {MAX_COLS} (65535 column tiles of 32)",
                )
            )
    return reasons


def kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.fused_moe`` KernelSpec; its callable raises ``BackendNotAvailableError`` (with ``why``)
    when ``available`` is False."""
    fn: Callable[..., Any] = fused_moe if available else missing(KERNEL_ID, why)
    return KernelSpec(
        KERNEL_ID,
        "fused_moe",
        fn,
        priority=PRIORITY,
        description="LayerZero Triton fused MoE: expert-sorted grouped GEMMs (vLLM fused_experts "
        "style), SwiGLU fused in the first, float32 sum over top-k",
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
        check=_check,
    )
