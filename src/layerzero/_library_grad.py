"""Backward formulas of the training ops' custom ops (``torch.library.register_autograd``), so a compiled training
step keeps ``lz.linear``, ``lz.rms_norm`` (plain and with ``residual``), ``lz.swiglu``, ``lz.rope``,
``lz.attention`` and ``lz.embedding`` as single nodes instead of tracing LayerZero's dispatch as Python (graph
breaks). Imported by :mod:`layerzero.library` (trace time only).

The formulas are the textbook ones, written with differentiable torch ops and no Python branch on tensor values, so
AOTAutograd can trace them:

- linear ``y = x W^T + b``: ``dx = dy W``, ``dW = dy^T x`` (rows flattened), ``db = sum(dy)``, in the inputs' dtype as
  PyTorch's own linear backward;
- RMSNorm (Zhang & Sennrich 2019) ``y = x r w`` with ``r = (mean(x^2) + eps)^-1/2``: ``x_hat = x r``,
  ``dw = sum(dy x_hat)``, ``dx = r (g - x_hat mean(g x_hat))`` with ``g = dy w``, in float32, then the inputs' dtype;
  with ``residual``: ``h = x + residual`` is normalized and also returned, so ``dx = dresidual = dh + dx(h)``;
- SwiGLU (Shazeer 2020) ``y = silu(gate) up``: ``dup = dy silu(gate)``,
  ``dgate = dy up s (1 + gate (1 - s))`` with ``s = sigmoid(gate)``, in float32, then the inputs' dtype;
- RoPE (Su et al. 2021), per position a rotation of the first R dims: ``y_r = x_r cos + P(x_r) sin`` with ``P``
  ``rotate_half`` (NeoX: ``cat(-x2, x1)``) or ``rotate_every_two`` (GPT-J: ``(x0, x1) -> (-x1, x0)``), dims >= R
  passed through. ``P`` is a block of 90-degree rotations, so ``P^T = -P`` and ``dx_r = dy_r cos - P(dy_r sin)``,
  ``dx_pass = dy_pass``; cos/sin are gathered as the reference kernel (``backends/reference/rope.py``) gathers them;
  float32 (float64 for float64 q), then q's / k's dtype. No gradient for cos/sin: ``lz.rope`` keeps calls whose
  cos/sin require grad on the Python path, and the formula raises ``InvalidInputError`` if asked for one;
- attention (Vaswani et al. 2017; semantics of ``backends/reference/attention.py``: GQA by consecutive head groups,
  top-left causal, FlashAttention windows, Gemma 2 soft-cap, bool or additive masks, fully masked rows give 0):
  without mask, window, soft-cap and ALiBi, the gradients of ``F.scaled_dot_product_attention(q, k, v, is_causal, scale,
  enable_gqa)`` recomputed under autograd (``torch.autograd.grad``; on CUDA that traces to SDPA's flash /
  memory-efficient backward, O(S) memory). Otherwise the textbook formula in float32 (float64 for float64 q):
  ``P = softmax(Z)``, ``Z = mask(cap(scale q k^T) - slope |i + Sk - Sq - j|)`` (ALiBi, Press et al. 2022, a
  constant bias: no gradient for the slopes; ``lz.attention`` keeps calls with trainable slopes on the Python path),
  ``dv = P^T dO``, ``dZ = P (dO v^T - rowsum(dO O))``,
  ``dS = dZ (1 - tanh^2(S / softcap))`` (``dS = dZ`` without soft-cap), ``dq = scale dS k``, ``dk = scale dS^T q``
  (GQA: summed over each KV head's query heads), ``dmask = dZ`` summed to the float mask's shape; it materializes
  ``[B, Hq, Sq, Sk]`` float32 scores. ``dropout_p > 0`` cannot be recomputed (the forward's dropout mask is not
  kept): ``lz.attention`` keeps such calls on the Python path when they need gradients, and the formula raises
  ``InvalidInputError`` if reached;
- embedding ``y = W[ids]``: ``dW = embedding_dense_backward(dy, ids, V, padding_idx)`` (PyTorch's own: rows
  scatter-added, the padding row 0), in W's dtype; no gradient for the ids.

Tests: tests/integration/test_torch_compile_ops.py and tests/integration/test_torch_compile_grad.py (compiled
training steps: no graph break, gradients equal a float64 oracle within the dtype's tolerance; ``gradcheck`` of each
formula in float64; opcheck's autograd registration check on each op).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from layerzero.core.errors import InvalidInputError, expected_got


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


def _rms_grads(h: torch.Tensor, weight: torch.Tensor, eps: float, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    return InvalidInputError(expected_got(f"torch.ops.layerzero.{op} backward", "a case its formula covers", what, fix))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------------- rope
def _rope_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, cos, sin, position_ids, interleaved, layout = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.interleaved, ctx.bshd, ctx.dtypes = interleaved, layout == "BSHD", (q.dtype, k.dtype)


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``rotate_every_two`` (GPT-J) or ``rotate_half`` (NeoX) of the last dim, as ``backends/reference/rope.py``."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_backward(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None) -> tuple[Any, ...]:
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise _unsupported("rope", "cos/sin that require grad", "Call lz.rope (it traces such calls as Python).")
    cos, sin, position_ids = ctx.saved_tensors
    like = dq if dq is not None else dk
    seq = like.shape[1] if ctx.bshd else like.shape[2]
    cdt = _compute_dtype(like)
    if cos.dim() == 3:  # gathered [B|1, S, R]
        c, s = cos, sin
    elif position_ids is None:  # table, positions 0..S-1
        c, s = cos[:seq].unsqueeze(0), sin[:seq].unsqueeze(0)
    else:
        c, s = cos[position_ids], sin[position_ids]
    axis = 2 if ctx.bshd else 1  # broadcast [B|1, S, R] over the heads
    c, s = c.unsqueeze(axis).to(cdt), s.unsqueeze(axis).to(cdt)
    r = c.shape[-1]

    def back(dy: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        if dy is None:
            return None
        dyf = dy.to(cdt)
        d_rot = dyf[..., :r]
        d_rot = d_rot * c - _rotate(d_rot * s, ctx.interleaved)  # P^T = -P
        return torch.cat((d_rot, dyf[..., r:]), dim=-1).to(dtype)

    return back(dq, ctx.dtypes[0]), back(dk, ctx.dtypes[1]), None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------- attention
def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    q, k, v, attn_mask, is_causal, scale, dropout_p, layout, window_left, window_right, softcap, alibi = inputs
    ctx.save_for_backward(q, k, v, attn_mask, alibi)
    ctx.args = (is_causal, scale, dropout_p, layout == "BSHD", window_left, window_right, softcap)


def _attention_backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
    q, k, v, mask, alibi = ctx.saved_tensors
    is_causal, scale, dropout_p, bshd, left, right, softcap = ctx.args
    if dropout_p > 0.0:
        raise _unsupported("attention", f"dropout_p={dropout_p} with gradients",
                           "Call lz.attention (it traces calls with dropout that need gradients as Python).")
    need = ctx.needs_input_grad
    if len(need) > 11 and need[11]:
        raise _unsupported("attention", "alibi_slopes that require grad",
                           "Call lz.attention (it traces calls with trainable ALiBi slopes as Python).")
    if mask is None and softcap is None and alibi is None and (left is None or right is None):
        dq, dk, dv = _sdpa_grads(q, k, v, dout, is_causal, scale, bshd, need[:3])
        dmask = None
    else:
        dq, dk, dv, dmask = _attention_grads(q, k, v, mask, dout, is_causal, scale, bshd, left, right, softcap,
                                             alibi)
        dmask = dmask if need[3] else None
    return (dq, dk, dv, dmask, None, None, None, None, None, None, None, None)[:len(need)]


def _sdpa_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, is_causal: bool,
                scale: float | None, bshd: bool, need: tuple[bool, ...]) -> tuple[Any, ...]:
    """(dq, dk, dv) of ``F.scaled_dot_product_attention`` (top-left causal, GQA) recomputed under autograd; q
    ``[B, Hq, Sq, D]``, k ``[B, Hkv, Sk, D]``, v ``[B, Hkv, Sk, Dv]``, dout ``[B, Hq, Sq, Dv]`` (BSHD: dims 1, 2
    swapped); each gradient in its input's shape and dtype, None where ``need`` is False."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), need, strict=True)]
        qh, kh, vh = (t.transpose(1, 2) for t in leaves) if bshd else leaves
        gqa = bool(qh.shape[1] != kh.shape[1])  # a guard on symbolic head counts (they are static in practice)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(out.transpose(1, 2) if bshd else out, wanted, dout))
    return tuple(next(grads) if t.requires_grad else None for t in leaves)


def _attention_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     dout: torch.Tensor, is_causal: bool, scale: float | None, bshd: bool, left: int | None,
                     right: int | None, softcap: float | None, alibi: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv, dmask) of the reference attention by the textbook formula (module docstring), float32 (float64
    for float64 q); shapes as :func:`_sdpa_grads`, ``mask`` bool or q's float dtype broadcastable to
    ``[B, Hq, Sq, Sk]``, ``alibi`` slopes ``[Hq]`` / ``[B, Hq]`` (a constant bias: it moves the probabilities, not
    the formula); each gradient in its input's shape and dtype, dmask None for a bool mask."""
    cdt = _compute_dtype(q)
    qf, kf, vf, dof = (t.transpose(1, 2).to(cdt) if bshd else t.to(cdt) for t in (q, k, v, dout))
    b, hq, sq, d = qf.shape
    hkv, sk = kf.shape[1], kf.shape[2]
    group = hq // hkv
    if group > 1:
        kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * scale  # S [B, Hq, Sq, Sk]
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = capped * softcap
    offset = torch.arange(sk, device=q.device)[None, :] - torch.arange(sq, device=q.device)[:, None]  # j - i
    if alibi is not None:  # -slope * |i + Sk - Sq - j|, bottom-right aligned (the reference kernel's convention)
        slopes = alibi.to(cdt)
        slopes = slopes[None, :] if slopes.dim() == 1 else slopes
        scores = scores - slopes[:, :, None, None] * (offset - (sk - sq)).abs().to(cdt)
    allowed = offset <= 0 if is_causal else torch.ones_like(offset, dtype=torch.bool)
    if left is not None and right is not None:
        if left >= 0:
            allowed = allowed & (offset >= -left)
        if right >= 0:
            allowed = allowed & (offset <= right)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            scores = scores + mask.to(cdt)
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    dead = torch.isneginf(row_max)  # fully masked rows: P = 0, O = 0, no gradient
    weights = torch.exp(scores - torch.where(dead, torch.zeros_like(row_max), row_max))
    denom = weights.sum(dim=-1, keepdim=True)
    probs = torch.where(dead, torch.zeros_like(weights), weights / torch.where(dead, 1.0, denom))
    out = torch.matmul(probs, vf)
    dv = torch.matmul(probs.transpose(-2, -1), dof)
    dz = probs * (torch.matmul(dof, vf.transpose(-2, -1)) - (dof * out).sum(-1, keepdim=True))
    ds = dz * (1 - capped * capped) if softcap is not None else dz
    ds = ds * scale
    dq = torch.matmul(ds, kf)
    dk = torch.matmul(ds.transpose(-2, -1), qf)
    if group > 1:
        dk, dv = dk.unflatten(1, (hkv, group)).sum(2), dv.unflatten(1, (hkv, group)).sum(2)
    dq, dk, dv = (t.transpose(1, 2) if bshd else t for t in (dq, dk, dv))
    dmask = None
    if mask is not None and mask.is_floating_point():
        dmask = dz.sum_to_size(mask.shape).to(mask.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask


# ---------------------------------------------------------------------------------------------------------- embedding
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
    """Register the backward formulas of ``ns``'s linear, rms_norm, fused_add_rms_norm, swiglu, rope, attention and
    embedding ops."""
    torch.library.register_autograd(f"{ns}::linear", _linear_backward, setup_context=_linear_setup)
    torch.library.register_autograd(f"{ns}::rms_norm", _rms_backward, setup_context=_rms_setup)
    torch.library.register_autograd(f"{ns}::fused_add_rms_norm", _add_rms_backward, setup_context=_add_rms_setup)
    torch.library.register_autograd(f"{ns}::swiglu", _swiglu_backward, setup_context=_swiglu_setup)
    torch.library.register_autograd(f"{ns}::rope", _rope_backward, setup_context=_rope_setup)
    torch.library.register_autograd(f"{ns}::attention", _attention_backward, setup_context=_attention_setup)
    torch.library.register_autograd(f"{ns}::embedding", _embedding_backward, setup_context=_embedding_setup)
