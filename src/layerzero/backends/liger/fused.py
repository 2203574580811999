"""Liger-Kernel (Triton) ``layer_norm`` and fused linear cross-entropy, CUDA only.

Sources read (liger-kernel 0.6-0.8, ``liger_kernel/ops``):

- ``layer_norm.py``: ``LigerLayerNormFunction.apply(X, W, B, eps)``: one Triton program per row of ``[rows,
  H]`` (``calculate_settings``: H's next power of two <= 65536), mean and variance in float32, output in X's
  dtype. B is required: a zero bias stands in for ``bias=None``.
- ``fused_linear_cross_entropy.py``: ``LigerFusedLinearCrossEntropyFunction.apply(_input [BT, H], weight [V,
  H], target [BT], bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
  return_z_loss, ...)``: the projection and cross-entropy chunk by chunk (Hsu et al. 2024), the gradients
  computed during forward and scaled by ``grad_output`` in backward. The positional order changed between
  releases (``ce_weight`` arrived in 0.5), so arguments are bound by name from ``forward``'s signature; newer
  releases return a tuple (loss, z_loss, ...), older ones the loss. Its backward scales the precomputed
  gradients by one scalar: with ``reduction="none"`` a non-uniform ``grad_output`` gives wrong gradients
  (upstream issue), so ``check`` refuses ``reduction="none"`` calls that require grad
  (``BACKWARD_UNSUPPORTED``; the reduction is a context field) and the other kernels serve them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.reasons import Reason, ReasonCode

R = ReasonCode
MAX_HIDDEN = 65536
LCE_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})


def layer_norm_call(function: Any) -> Callable[..., Any]:
    """Wrap ``LigerLayerNormFunction`` as a canonical layer_norm kernel ``(x [..., H], weight [H], bias [H] |
    None, eps) -> y`` (like x)."""

    def run(x, weight, bias, eps):
        b = bias if bias is not None else torch.zeros_like(weight)
        return function.apply(x, weight, b, eps)

    run.__name__ = "liger_layer_norm"
    return run


def layer_norm_check(present: bool) -> Callable[[SelectionContext], list[Reason]]:
    def check(ctx: SelectionContext) -> list[Reason]:
        out = []
        if ctx.hidden_size is not None and ctx.hidden_size > MAX_HIDDEN:
            out.append(
                Reason(
                    R.HIDDEN_SIZE_UNSUPPORTED,
                    f"hidden size {ctx.hidden_size} > {MAX_HIDDEN} (one Triton block per row)",
                )
            )
        if ctx.param_dtype is not None and ctx.param_dtype != ctx.dtype:
            out.append(
                Reason(R.DTYPE_MISMATCH, f"weight dtype {ctx.param_dtype} differs from x's {ctx.dtype}")
            )
        if not present:
            out.append(
                Reason(
                    R.BACKEND_VERSION_UNSUPPORTED,
                    "this liger_kernel has no liger_kernel.ops.layer_norm.LigerLayerNormFunction",
                )
            )
        return out

    return check


def linear_cross_entropy_call(function: Any) -> Callable[..., Any]:
    """Wrap ``LigerFusedLinearCrossEntropyFunction`` as a canonical linear_cross_entropy kernel ``(hidden [N,
    H], weight [V, H], target [N], bias, ignore_index, reduction, label_smoothing, softcap) -> loss`` (0-dim,
    or [N] for "none"), cast to float32 (the op's contract for half-precision inputs)."""
    try:
        names = [p for p in inspect.signature(function.forward).parameters if p != "ctx"]
    except (TypeError, ValueError):
        names = [
            "_input",
            "weight",
            "target",
            "bias",
            "ce_weight",
            "ignore_index",
            "lse_square_scale",
            "label_smoothing",
            "reduction",
            "softcap",
        ]
    try:
        defaults = {
            k: p.default
            for k, p in inspect.signature(function.forward).parameters.items()
            if p.default is not inspect.Parameter.empty
        }
    except (TypeError, ValueError):
        defaults = {}

    def run(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
        given = {
            "_input": hidden,
            "input": hidden,
            "weight": weight,
            "target": target,
            "bias": bias,
            "ce_weight": None,
            "ignore_index": ignore_index,
            "lse_square_scale": 0.0,
            "label_smoothing": label_smoothing,
            "reduction": reduction,
            "softcap": softcap,
            "return_z_loss": False,
        }
        args = [given[n] if n in given else defaults.get(n) for n in names]
        out = function.apply(*args)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        return loss.float()

    run.__name__ = "liger_linear_cross_entropy"
    return run


def linear_cross_entropy_check(function: Any) -> Callable[[SelectionContext], list[Reason]]:
    """Liger before 0.4 has no softcap argument: reject softcapped calls there."""
    try:
        softcap = function is None or "softcap" in inspect.signature(function.forward).parameters
    except (TypeError, ValueError):
        softcap = False

    def check(ctx: SelectionContext) -> list[Reason]:
        out = []
        if ctx.has_softcap and not softcap:
            out.append(
                Reason(
                    R.SOFTCAP_UNSUPPORTED,
                    "this liger_kernel's LigerFusedLinearCrossEntropyFunction has "
                    "no softcap argument; upgrade liger-kernel",
                )
            )
        if ctx.requires_grad and ctx.reduction == "none":
            out.append(
                Reason(
                    R.BACKWARD_UNSUPPORTED,
                    "reduction='none' with gradients: Liger's backward scales by "
                    "one number, so a non-uniform grad_output gives wrong "
                    "gradients (upstream issue); the forward alone is served",
                )
            )
        return out

    return check
