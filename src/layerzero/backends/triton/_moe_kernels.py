"""Triton fused-MoE grouped GEMMs (vLLM ``fused_moe_kernel`` style). Imported only after ``import triton``
succeeded.

Both kernels walk the same sorted layout built by ``moe.moe_align``: ``sorted_ids`` lists the flat (token,
slot) pair ids ``p = t * K + k`` grouped by expert, each expert's group padded with the sentinel ``num_pairs``
to a multiple of BLOCK_M, so one BLOCK_M tile of rows belongs to one expert (``block_expert[tile]``; ``E``
marks a tile past the last group, which returns at once). A program owns one (row tile, column tile) and loops
over the reduction dim in BLOCK_K steps; rows of padding and columns / reduction indices past the edge are
masked, so any H and I work. Products in float32 (``IEEE``: ``input_precision="ieee"`` for float32 inputs, no
TF32).

H and I are compile-time constants (``HIDDEN``/``INTER``): one compilation per model shape (every MoE layer of
a model shares it), and the reduction loops get static bounds, which Triton's interpreter needs (it cannot
take a runtime scalar as a ``range`` bound) and the GPU compiler pipelines as any ``for`` loop.

- ``_gate_up_kernel``: ``h[p] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)`` for the pairs of the tile
  (gate and up tiles accumulated side by side, SwiGLU in the epilogue), ``h`` ``[P, I]`` in x's dtype.
- ``_down_kernel``: ``y[p] = topk_weights[p] * (h[p] @ w2[e].T)``, ``y`` ``[P, H]`` float32; the caller sums
  the K rows of each token.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in float32; IEEE: full float32 products for float32 tiles (no TF32); UPCAST: float32
    operands (with IEEE; only under the interpreter, see :data:`INTERPRETED`)."""
    if UPCAST:  # Triton's interpreter multiplies bfloat16 tiles as their raw uint16 bits: give it float32
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _gate_up_kernel(
    X,
    W13,
    Hout,
    sorted_ids,
    block_expert,
    num_pairs,
    num_experts,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    stride_hp,
    stride_hi,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOP_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert + tile).to(tl.int64)
    if e >= num_experts:  # a tile past the last expert's group
        return
    pair = tl.load(sorted_ids + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs  # padding rows hold num_pairs
    token = pair // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of h: index into the gate rows and the up rows
    col_ok = cols < INTER
    w_gate = W13 + e * stride_we + cols[None, :] * stride_wn  # [1, BLOCK_N] row pointers of w13[e, :I]
    w_up = w_gate + INTER * stride_wn  # the up rows follow the gate rows
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < HIDDEN
        a = tl.load(
            X + token[:, None] * stride_xt + ks[None, :] * stride_xh,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b_mask = k_ok[:, None] & col_ok[None, :]
        bg = tl.load(w_gate + ks[:, None] * stride_wh, mask=b_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        bu = tl.load(w_up + ks[:, None] * stride_wh, mask=b_mask, other=0.0)
        acc_g = _dot(a, bg, acc_g, IEEE, UPCAST)
        acc_u = _dot(a, bu, acc_u, IEEE, UPCAST)
    h = acc_g * tl.sigmoid(acc_g) * acc_u  # silu(gate) * up in float32
    tl.store(
        Hout + pair[:, None] * stride_hp + cols[None, :] * stride_hi,
        h.to(Hout.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _down_kernel(
    Hin,
    W2,
    Y,
    weights,
    sorted_ids,
    block_expert,
    num_pairs,
    num_experts,
    stride_hp,
    stride_hi,
    stride_we,
    stride_wn,
    stride_wi,
    stride_yp,
    stride_yh,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert + tile).to(tl.int64)
    if e >= num_experts:
        return
    pair = tl.load(sorted_ids + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (hidden)
    col_ok = cols < HIDDEN
    w_rows = W2 + e * stride_we + cols[None, :] * stride_wn  # [1, BLOCK_N] row pointers of w2[e]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < INTER
        a = tl.load(
            Hin + pair[:, None] * stride_hp + ks[None, :] * stride_hi,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(w_rows + ks[:, None] * stride_wi, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, IEEE, UPCAST)
    w = tl.load(weights + pair, mask=row_ok, other=0.0)  # router weight of each pair (float32)
    tl.store(
        Y + pair[:, None] * stride_yp + cols[None, :] * stride_yh,
        acc * w[:, None],
        mask=row_ok[:, None] & col_ok[None, :],
    )


INTERPRETED = isinstance(_down_kernel, InterpretedFunction)
"""True under ``TRITON_INTERPRET=1`` (CPU tests): the dots then take float32 operands (exact for half inputs),
as the interpreter's bfloat16 matmul is wrong; compiled kernels multiply half-precision tiles natively. The
wrapper passes it as the kernels' ``UPCAST``."""
