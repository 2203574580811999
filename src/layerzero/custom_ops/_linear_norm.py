"""The dense-layer ops of :mod:`layerzero.custom_ops` as ``torch.library`` custom ops: ``lz.linear``,
``lz.embedding``, ``lz.linear_cross_entropy``, ``lz.rms_norm`` (plain and with ``residual``),
``lz.layer_norm``, ``lz.rms_norm_linear``, the gated MLPs (``lz.swiglu`` / ``lz.geglu`` / ``lz.reglu``,
``lz.swiglu_linear``) and ``lz.fused_moe``.

Conventions (fake implementations, fresh contiguous outputs through :func:`_owned`) are those of
:mod:`layerzero.custom_ops._ops`, which imports this module and re-exports every wrapper here; it also
imports on its own (importing it registers its ops)."""

from __future__ import annotations

from typing import Optional

import torch

from ._common import NS, _owned, eager


# ------------------------------------------------------------------------------------------ linear, embedding
@torch.library.custom_op(f"{NS}::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
    return _owned(eager("linear")(x, weight, bias), x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(f"{NS}::embedding", mutates_args=())
def embedding(input_ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:  # noqa: UP045
    return _owned(eager("embedding")(input_ids, weight, padding_idx=padding_idx), input_ids, weight)


@embedding.register_fake
def _(input_ids, weight, padding_idx):
    return weight.new_empty((*input_ids.shape, weight.shape[1]))


@torch.library.custom_op(f"{NS}::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,  # noqa: UP045
    label_smoothing: float,
    softcap: Optional[float],
) -> torch.Tensor:  # noqa: UP045
    out = eager("linear_cross_entropy")(
        hidden,
        weight,
        target,
        bias=bias,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        softcap=softcap,
    )
    return _owned(out, hidden, weight, target, bias)


@linear_cross_entropy.register_fake
def _(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    dtype = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    return hidden.new_empty(tuple(target.shape) if reduction == "none" else (), dtype=dtype)


# -------------------------------------------------------------------------------------------- norms
@torch.library.custom_op(f"{NS}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``lz.rms_norm(x, weight, eps)`` as a custom op."""
    return _owned(eager("rms_norm")(x, weight, eps), x, weight)


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{NS}::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lz.rms_norm(x, weight, eps, residual=residual)`` -> ``(y, x + residual)`` as a custom op."""
    y, h = eager("rms_norm")(x, weight, eps, residual=residual)
    y = _owned(y, x, weight, residual)
    return y, _owned(h, x, weight, residual, y)


@fused_add_rms_norm.register_fake
def _(x, weight, eps, residual):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op(f"{NS}::layer_norm", mutates_args=())
def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045
    eps: float,
) -> torch.Tensor:
    """``lz.layer_norm`` as a custom op."""
    return _owned(eager("layer_norm")(x, weight, bias, eps), x, weight, bias)


@layer_norm.register_fake
def _(x, weight, bias, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{NS}::rms_norm_linear", mutates_args=())
def _rms_norm_linear(
    x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:  # noqa: UP045
    return _owned(
        eager("rms_norm_linear")(x, norm_weight, weight, bias, eps=eps), x, norm_weight, weight, bias
    )


@_rms_norm_linear.register_fake
def _(x, norm_weight, weight, bias, eps):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(f"{NS}::fused_add_rms_norm_linear", mutates_args=())
def _fused_add_rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,  # noqa: UP045
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, h = eager("rms_norm_linear")(x, norm_weight, weight, bias, eps=eps, residual=residual)
    inputs = (x, norm_weight, weight, bias, residual)
    y = _owned(y, *inputs)
    return y, _owned(h, *inputs, y)


@_fused_add_rms_norm_linear.register_fake
def _(x, norm_weight, weight, bias, eps, residual):
    return x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty(x.shape)


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.layerzero.rms_norm_linear`` (or ``fused_add_rms_norm_linear`` with a residual) with
    ``lz.rms_norm_linear``'s arguments."""
    if residual is None:
        return _rms_norm_linear(x, norm_weight, weight, bias, float(eps))
    return _fused_add_rms_norm_linear(x, norm_weight, weight, bias, float(eps), residual)


# -------------------------------------------------------------------------------------------- gated MLPs
@torch.library.custom_op(f"{NS}::swiglu_linear", mutates_args=())
def swiglu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:  # noqa: UP045
    """``lz.swiglu_linear`` as a custom op."""
    return _owned(eager("swiglu_linear")(gate, up, weight, bias), gate, up, weight, bias)


@swiglu_linear.register_fake
def _(gate, up, weight, bias):
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))


@torch.library.custom_op(f"{NS}::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``lz.swiglu`` as a custom op."""
    return _owned(eager("swiglu")(gate, up), gate, up)


@torch.library.custom_op(f"{NS}::geglu", mutates_args=())
def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    """``lz.geglu`` as a custom op."""
    return _owned(eager("geglu")(gate, up, approximate=approximate), gate, up)


@torch.library.custom_op(f"{NS}::reglu", mutates_args=())
def reglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``lz.reglu`` as a custom op."""
    return _owned(eager("reglu")(gate, up), gate, up)


@swiglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@geglu.register_fake
def _(gate, up, approximate):
    return gate.new_empty(gate.shape)


@reglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


# -------------------------------------------------------------------------------------------- MoE
@torch.library.custom_op(f"{NS}::fused_moe", mutates_args=())
def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """``lz.fused_moe`` as a custom op."""
    return _owned(eager("fused_moe")(x, w13, w2, topk_weights, topk_ids), x, w13, w2, topk_weights, topk_ids)


@fused_moe.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return x.new_empty(x.shape)
