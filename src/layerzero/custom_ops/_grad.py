"""Backward formulas of the training ops' custom ops (``torch.library.register_autograd``), so a compiled
training step keeps ``lz.linear``, ``lz.rms_norm`` (plain and with ``residual``), ``lz.swiglu``, ``lz.rope``,
``lz.attention`` and ``lz.embedding`` as single nodes instead of tracing LayerZero's dispatch as Python (graph
breaks). Imported by :mod:`layerzero.custom_ops._ops` (trace time only).

The formulas are the textbook ones, written with differentiable torch ops and no Python branch on tensor
values, so AOTAutograd can trace them:

- linear ``y = x W^T + b``: ``dx = dy W``, ``dW = dy^T x`` (rows flattened), ``db = sum(dy)``, in the inputs'
  dtype as PyTorch's own linear backward;
- RMSNorm (Zhang & Sennrich 2019) ``y = x r w`` with ``r = (mean(x^2) + eps)^-1/2``: ``x_hat = x r``,
  ``dw = sum(dy x_hat)``, ``dx = r (g - x_hat mean(g x_hat))`` with ``g = dy w``, in float32, then the inputs'
  dtype; with ``residual``: ``h = x + residual`` is normalized and also returned, so
  ``dx = dresidual = dh + dx(h)``;
- SwiGLU (Shazeer 2020) ``y = silu(gate) up``: ``dup = dy silu(gate)``,
  ``dgate = dy up s (1 + gate (1 - s))`` with ``s = sigmoid(gate)``, in float32, then the inputs' dtype;
- RoPE (Su et al. 2021), per position a rotation of the first R dims: ``y_r = x_r cos + P(x_r) sin`` with
  ``P`` ``rotate_half`` (NeoX: ``cat(-x2, x1)``) or ``rotate_every_two`` (GPT-J: ``(x0, x1) -> (-x1, x0)``),
  dims >= R passed through. ``P`` is a block of 90-degree rotations, so ``P^T = -P`` and
  ``dx_r = dy_r cos - P(dy_r sin)``, ``dx_pass = dy_pass``; cos/sin are gathered as the reference kernel
  (``backends/reference/rope.py``) gathers them; float32 (float64 for float64 q), then q's / k's dtype.
  Learned cos/sin: ``dcos = sum(dy_r x_r)``, ``dsin = sum(dy_r P(x_r))`` over the heads (q's and k's terms
  added), then back to the table's shape: scatter-added over ``position_ids`` into a ``[max_pos, R]`` table,
  the first S rows of a table read at positions ``0..S-1``, summed over the batch for a gathered
  ``[1, S, R]``; in the table's dtype;
- attention (Vaswani et al. 2017; semantics of ``backends/reference/attention.py``: GQA by consecutive head
  groups, top-left causal, FlashAttention windows, Gemma 2 soft-cap, bool or additive masks, fully masked rows
  give 0): without mask, window, soft-cap and ALiBi, the gradients of ``F.scaled_dot_product_attention(q, k,
  v, is_causal, scale, enable_gqa)`` recomputed under autograd (``torch.autograd.grad``; on CUDA that traces
  to SDPA's flash / memory-efficient backward, O(S) memory). Otherwise the gradients of the reference kernel
  itself, recomputed under autograd in float32 (float64 for float64 q): ``P = softmax(Z)``, ``Z =
  mask(cap(scale q k^T) - slope |i + Sk - Sq - j|)``, so ``dv = P^T dO``, ``dZ = P (dO v^T - rowsum(dO
  O))``, ``dS = dZ (1 - tanh^2(S / softcap))``, ``dq = scale dS k``, ``dk = scale dS^T q`` (GQA: summed over
  each KV head's query heads), a float mask's gradient ``dZ`` summed to its shape; one source of truth for the
  masks, windows, soft-cap, ALiBi and fully masked rows; it materializes ``[B, Hq, Sq, Sk]`` float32 scores.
  ALiBi slopes (Press et al. 2022) are a constant bias: no gradient for them (``lz.attention`` keeps calls
  with trainable slopes on the Python path). ``dropout_p > 0`` cannot be recomputed (the forward's dropout
  mask is not kept): ``lz.attention`` keeps such calls on the Python path when they need gradients, and the
  formula raises ``InvalidInputError`` if reached;
- embedding ``y = W[ids]``: ``dW = embedding_dense_backward(dy, ids, V, padding_idx)`` (PyTorch's own: rows
  scatter-added, the padding row 0), in W's dtype; no gradient for the ids.

Tests: tests/integration/test_torch_compile_ops.py and tests/integration/test_torch_compile_grad.py (compiled
training steps: no graph break, gradients equal a float64 oracle within the dtype's tolerance; ``gradcheck``
of each formula in float64; opcheck's autograd registration check on each op).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
import torch.nn.functional as F

from layerzero.core.errors import InvalidInputError, expected_got

log = logging.getLogger("layerzero")
_WARNED: list[bool] = []


def _optimized() -> bool:
    """Whether Python runs with ``-O`` (``sys.flags.optimize``; a function so tests can stand in for it)."""
    return sys.flags.optimize > 0


def _warn_if_optimized_compile() -> None:
    """Warn once per process when a backward formula is traced by ``torch.compile`` under ``python -O``: a
    known, unresolved problem gives wrong query / key gradients for some compiled blocks there
    (docs/torch_compile.md, "Known problem: python -O"), so such a training step must not run silently."""
    if _WARNED or not _optimized() or not torch.compiler.is_compiling():
        return
    _WARNED.append(True)
    log.warning(
        "torch.compile is tracing LayerZero backward formulas under python -O: compiled training blocks with "
        "RoPE and attention have given wrong query / key gradients there (an open problem, docs/"
        "torch_compile.md 'Known problem: python -O'); train without -O or without torch.compile"
    )


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    x, weight = ctx.saved_tensors
    n, k = weight.shape
    dy2 = dy.reshape(-1, n)
    dx = (dy2 @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
    dw = dy2.t() @ x.reshape(-1, k) if ctx.needs_input_grad[1] else None
    db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx, dw, db


def _rms_grads(
    h: torch.Tensor, weight: torch.Tensor, eps: float, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, dweight) of ``rms_norm(h, weight, eps)`` for the output gradient ``dy``, float32 math."""
    hf = h.float()
    r = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    h_hat = hf * r
    dyf = dy.float()
    g = dyf * weight.float()
    dh = r * (g - h_hat * (g * h_hat).mean(-1, keepdim=True))
    dw = (dyf * h_hat).reshape(-1, h.shape[-1]).sum(0)
    return dh, dw


def _rms_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    x, weight = ctx.saved_tensors
    dx, dw = _rms_grads(x, weight, ctx.eps, dy)
    return dx.to(x.dtype), dw.to(weight.dtype), None


def _add_rms_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, eps, residual = inputs
    ctx.save_for_backward(output[1], weight)  # h = x + residual
    ctx.eps, ctx.dtypes = eps, (x.dtype, residual.dtype)


def _add_rms_backward(ctx: Any, dy: torch.Tensor, dh: torch.Tensor | None) -> tuple[Any, ...]:
    h, weight = ctx.saved_tensors
    dh_norm, dw = _rms_grads(h, weight, ctx.eps, dy)
    total = dh_norm if dh is None else dh_norm + dh.float()
    return total.to(ctx.dtypes[0]), dw.to(weight.dtype), None, total.to(ctx.dtypes[1])


def _swiglu_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    gate, up = ctx.saved_tensors
    gf, uf, dyf = gate.float(), up.float(), dy.float()
    s = torch.sigmoid(gf)
    dgate = dyf * uf * s * (1 + gf * (1 - s))
    dup = dyf * gf * s
    return dgate.to(gate.dtype), dup.to(up.dtype)


def _unsupported(op: str, what: str, fix: str) -> InvalidInputError:
    return InvalidInputError(
        expected_got(f"torch.ops.layerzero.{op} backward", "a case its formula covers", what, fix)
    )


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------------------- rope
def _rope_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, cos, sin, position_ids, interleaved, layout = inputs
    learned = cos.requires_grad or sin.requires_grad
    # q and k themselves only for learned cos/sin (their gradients are sums of dy * x and dy * P(x))
    ctx.save_for_backward(cos, sin, position_ids, *((q, k) if learned else ()))
    ctx.interleaved, ctx.bshd, ctx.dtypes = interleaved, layout == "BSHD", (q.dtype, k.dtype)


def _table_grad(g: torch.Tensor, table: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """The gradient of a cos or sin ``table`` from ``g``, that of its gathered form ``[B or 1, S, R]``
    (already summed over the heads): scatter-added over ``position_ids`` into a ``[max_pos, R]`` table, the
    first S rows of a table read at positions ``0..S-1``, summed over the batch for a gathered ``[1, S, R]``;
    in the table's dtype."""
    batch = table.shape[0] if table.dim() == 3 else 1 if position_ids is None else position_ids.shape[0]
    if batch == 1 and g.shape[0] != 1:  # one row of positions or tables broadcast over the batch
        g = g.sum(0, keepdim=True)
    if table.dim() == 3:
        return g.to(table.dtype)
    out = torch.zeros(table.shape, dtype=g.dtype, device=g.device)
    if position_ids is None:
        out[: g.shape[1]] = g[0]
    else:
        out.index_add_(0, position_ids.reshape(-1).long(), g.reshape(-1, g.shape[-1]))
    return out.to(table.dtype)


def _rope_backward(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None) -> tuple[Any, ...]:
    from layerzero.backends.reference.rope import _gather, rotate_every_two, rotate_half

    _warn_if_optimized_compile()
    cos, sin, position_ids, *xs = ctx.saved_tensors
    like = dq if dq is not None else dk
    cdt = _compute_dtype(like)
    seq = like.shape[1] if ctx.bshd else like.shape[2]
    axis = 2 if ctx.bshd else 1  # broadcast [B|1, S, R] over the heads
    c = _gather(cos, position_ids, seq, "cos").unsqueeze(axis).to(cdt)
    s = _gather(sin, position_ids, seq, "sin").unsqueeze(axis).to(cdt)
    rotate, r = rotate_every_two if ctx.interleaved else rotate_half, c.shape[-1]

    def back(dy: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        if dy is None:
            return None
        dyf = dy.to(cdt)
        d_rot = dyf[..., :r] * c - rotate(dyf[..., :r] * s)  # P^T = -P
        return torch.cat((d_rot, dyf[..., r:]), dim=-1).to(dtype)

    dcos = dsin = None
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:  # learned cos/sin: y_r = x_r cos + P(x_r) sin
        gc = gs = 0
        for dy, x in zip((dq, dk), xs, strict=True):
            if dy is None:
                continue
            dyr, xr = dy[..., :r].to(cdt), x[..., :r].to(cdt)
            gc = gc + (dyr * xr).sum(axis)  # summed over the heads: [B, S, R]
            gs = gs + (dyr * rotate(xr)).sum(axis)
        dcos = _table_grad(gc, cos, position_ids) if ctx.needs_input_grad[2] else None
        dsin = _table_grad(gs, sin, position_ids) if ctx.needs_input_grad[3] else None
    return back(dq, ctx.dtypes[0]), back(dk, ctx.dtypes[1]), dcos, dsin, None, None, None


# -------------------------------------------------------------------------------------------------- attention
def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    q, k, v, attn_mask, is_causal, scale, dropout_p, layout, window_left, window_right, softcap, alibi = (
        inputs
    )
    ctx.save_for_backward(q, k, v, attn_mask, alibi)
    ctx.args = (is_causal, scale, dropout_p, layout == "BSHD", window_left, window_right, softcap)


def _attention_backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
    _warn_if_optimized_compile()
    q, k, v, mask, alibi = ctx.saved_tensors
    is_causal, scale, dropout_p, bshd, left, right, softcap = ctx.args
    if dropout_p > 0.0:
        raise _unsupported(
            "attention",
            f"dropout_p={dropout_p} with gradients",
            "Call lz.attention (it traces calls with dropout that need gradients as Python).",
        )
    need = ctx.needs_input_grad
    if len(need) > 11 and need[11]:
        raise _unsupported(
            "attention",
            "alibi_slopes that require grad",
            "Call lz.attention (it traces calls with trainable ALiBi slopes as Python).",
        )
    layout = "BSHD" if bshd else "BHSD"
    if mask is None and softcap is None and alibi is None and (left is None or right is None):

        def fn(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor, _: Any) -> torch.Tensor:
            qh, kh, vh = (t.transpose(1, 2) for t in (q_, k_, v_)) if bshd else (q_, k_, v_)
            gqa = bool(qh.shape[1] != kh.shape[1])  # a guard on symbolic head counts (static in practice)
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale, enable_gqa=gqa)
            return out.transpose(1, 2) if bshd else out
    else:
        from layerzero.backends.reference.attention import attention as reference

        window = None if left is None or right is None else (left, right)

        def fn(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor, m_: Any) -> torch.Tensor:
            return reference(
                q_,
                k_,
                v_,
                attn_mask=m_,
                is_causal=is_causal,
                scale=scale,
                layout=layout,
                window=window,
                softcap=softcap,
                alibi_slopes=alibi,
            )

    float_mask = mask is not None and mask.is_floating_point()
    grads = _recompute_grads(fn, (q, k, v, mask), (*need[:3], float_mask and need[3]), dout)
    return (*grads, None, None, None, None, None, None, None, None)[
        : len(need)
    ]  # 11 or 12 inputs (alibi defaulted)


def _recompute_grads(
    fn: Any, inputs: tuple[Any, ...], need: tuple[bool, ...], dout: torch.Tensor
) -> tuple[Any, ...]:
    """The gradients of ``fn(*inputs)`` for the output gradient ``dout``, recomputing ``fn`` under autograd:
    one per input, None where ``need`` is False (tensors only). ``fn``: F.scaled_dot_product_attention (its
    own fused backward) or the reference attention kernel (``backends/reference/attention.py``, whose masks,
    windows, soft-cap, ALiBi and fully masked rows the forward kernels follow; it materializes
    ``[B, Hq, Sq, Sk]`` float32 scores)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() if n else t for t, n in zip(inputs, need, strict=True)]
        wanted = [t for t, n in zip(leaves, need, strict=True) if n]
        if not wanted:
            return (None,) * len(inputs)
        got = iter(torch.autograd.grad(fn(*leaves), wanted, dout))
    return tuple(next(got) if n else None for n in need)


# -------------------------------------------------------------------------------------------------- embedding
def _embedding_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    input_ids, weight, padding_idx = inputs
    ctx.save_for_backward(input_ids)
    rows = weight.shape[0]
    ctx.rows = rows
    ctx.padding_idx = -1 if padding_idx is None else (padding_idx + rows if padding_idx < 0 else padding_idx)


def _embedding_backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    (input_ids,) = ctx.saved_tensors
    dw = torch.ops.aten.embedding_dense_backward(dy, input_ids, ctx.rows, ctx.padding_idx, False)
    return None, dw, None


def register(ns: str) -> None:
    """Register the backward formulas of ``ns``'s linear, rms_norm, fused_add_rms_norm, swiglu, rope,
    attention and embedding ops."""
    torch.library.register_autograd(f"{ns}::linear", _linear_backward, setup_context=_linear_setup)
    torch.library.register_autograd(f"{ns}::rms_norm", _rms_backward, setup_context=_rms_setup)
    torch.library.register_autograd(
        f"{ns}::fused_add_rms_norm", _add_rms_backward, setup_context=_add_rms_setup
    )
    torch.library.register_autograd(f"{ns}::swiglu", _swiglu_backward, setup_context=_swiglu_setup)
    torch.library.register_autograd(f"{ns}::rope", _rope_backward, setup_context=_rope_setup)
    torch.library.register_autograd(f"{ns}::attention", _attention_backward, setup_context=_attention_setup)
    torch.library.register_autograd(f"{ns}::embedding", _embedding_backward, setup_context=_embedding_setup)
