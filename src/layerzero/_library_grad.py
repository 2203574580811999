"""Backward formulas of the training ops' custom ops (``torch.library.register_autograd``), so a compiled training
step keeps ``lz.linear``, ``lz.rms_norm`` (plain and with ``residual``) and ``lz.swiglu`` as single nodes instead of
tracing LayerZero's dispatch as Python (graph breaks). Imported by :mod:`layerzero.library` (trace time only).

The formulas are the textbook ones, written with differentiable torch ops so AOTAutograd can trace them:

- linear ``y = x W^T + b``: ``dx = dy W``, ``dW = dy^T x`` (rows flattened), ``db = sum(dy)``, in the inputs' dtype as
  PyTorch's own linear backward;
- RMSNorm (Zhang & Sennrich 2019) ``y = x r w`` with ``r = (mean(x^2) + eps)^-1/2``: ``x_hat = x r``,
  ``dw = sum(dy x_hat)``, ``dx = r (g - x_hat mean(g x_hat))`` with ``g = dy w``, in float32, then the inputs' dtype;
  with ``residual``: ``h = x + residual`` is normalized and also returned, so ``dx = dresidual = dh + dx(h)``;
- SwiGLU (Shazeer 2020) ``y = silu(gate) up``: ``dup = dy silu(gate)``,
  ``dgate = dy up s (1 + gate (1 - s))`` with ``s = sigmoid(gate)``, in float32, then the inputs' dtype.

Tests: tests/integration/test_torch_compile_ops.py (compiled training step: no graph break, gradients equal eager's
within the dtype's tolerance; opcheck's autograd registration check on each op).
"""

from __future__ import annotations

from typing import Any

import torch


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


def register(ns: str) -> None:
    """Register the backward formulas of ``ns``'s linear, rms_norm, fused_add_rms_norm and swiglu ops."""
    torch.library.register_autograd(f"{ns}::linear", _linear_backward, setup_context=_linear_setup)
    torch.library.register_autograd(f"{ns}::rms_norm", _rms_backward, setup_context=_rms_setup)
    torch.library.register_autograd(f"{ns}::fused_add_rms_norm", _add_rms_backward, setup_context=_add_rms_setup)
    torch.library.register_autograd(f"{ns}::swiglu", _swiglu_backward, setup_context=_swiglu_setup)
