"""``lz.linear_cross_entropy``: the LM-head projection fused with cross-entropy (no full ``[N, V]``
logits)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import (
    FLOAT_DTYPES,
    check_same,
    check_tensor,
    device_spec,
    fail,
    inference_only,
    is_grad_enabled,
    scope_token,
    stream_capturing,
)

OP = "linear_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


class LinearCrossEntropyKey(NamedTuple):
    """The selection-cache key of one ``lz.linear_cross_entropy`` call: rows N bucketed to the next power of
    two (``batch``), hidden size H and vocabulary V exact; ``capture``/``scope`` close every op's key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    batch: int
    hidden_size: int
    vocab_size: int
    has_bias: bool
    has_softcap: bool
    reduction: str
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def _bucket(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def context(key: LinearCrossEntropyKey) -> SelectionContext:
    """The :class:`SelectionContext` of an ``lz.linear_cross_entropy`` cache key."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.batch,
        hidden_size=key.hidden_size,
        vocab_size=key.vocab_size,
        param_dtype=key.dtype,
        has_bias=key.has_bias,
        has_softcap=key.has_softcap,
        reduction=key.reduction,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


def prepare(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.linear_cross_entropy`` inputs; return (cache key, canonical kernel args ``(hidden [N, H],
    weight [V, H], target [N], bias, ignore_index, reduction, label_smoothing, softcap)``): leading dims of
    hidden/target are flattened into N."""
    check_tensor(OP, "hidden", hidden)
    if hidden.dim() < 2:
        raise fail(
            OP, "hidden rank", ">= 2 dims ([..., H], e.g. [B, S, H] or [N, H])", f"{hidden.dim()} dims"
        )
    if hidden.dtype not in FLOAT_DTYPES:
        raise fail(OP, "hidden.dtype", "float32/float64/float16/bfloat16", hidden.dtype)
    check_tensor(OP, "weight", weight, 2)
    check_same(OP, "hidden", hidden, "weight", weight)
    h = hidden.shape[-1]
    if weight.shape[1] != h or weight.shape[0] == 0:
        raise fail(
            OP,
            "weight shape",
            f"[V, H] with V >= 1 and H = hidden.shape[-1] = {h} (nn.Linear's weight)",
            list(weight.shape),
        )
    v = weight.shape[0]
    if not isinstance(target, torch.Tensor):
        raise fail(OP, "target", "a torch.Tensor of int64 class indices", type(target).__name__)
    if target.dtype != torch.int64:
        raise fail(OP, "target.dtype", "torch.int64 (class indices)", target.dtype, "Use target.long().")
    if target.device != hidden.device:
        raise fail(OP, "target.device", f"hidden's device {hidden.device}", target.device)
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise fail(OP, "target shape", f"hidden.shape[:-1] = {list(hidden.shape[:-1])}", list(target.shape))
    if bias is not None:
        check_tensor(OP, "bias", bias, 1)
        check_same(OP, "hidden", hidden, "bias", bias)
        if bias.shape[0] != v:
            raise fail(OP, "bias shape", f"[V] = [{v}]", list(bias.shape))
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise fail(OP, "ignore_index", "an int (rows whose target equals it add no loss)", repr(ignore_index))
    if reduction not in REDUCTIONS:
        raise fail(OP, "reduction", "'mean', 'sum' or 'none'", repr(reduction))
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not 0.0 <= label_smoothing <= 1.0
    ):
        raise fail(OP, "label_smoothing", "a float in [0, 1]", repr(label_smoothing))
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not (math.isfinite(softcap) and softcap > 0)
    ):
        raise fail(
            OP,
            "softcap",
            "None or a finite float > 0 (logits -> softcap * tanh(logits / softcap))",
            repr(softcap),
        )
    if target.device.type == "cpu" and target.numel():
        bad = (target != ignore_index) & ((target < 0) | (target >= v))
        if bool(bad.any()):
            raise fail(
                OP,
                "target values",
                f"class indices in [0, {v}) or ignore_index = {ignore_index}",
                int(target[bad][0]),
            )
    x2, t1 = hidden.reshape(-1, h), target.reshape(-1)
    grad = is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    key = LinearCrossEntropyKey(
        OP,
        hidden.device,
        hidden.dtype,
        _bucket(x2.shape[0]),
        h,
        v,
        bias is not None,
        softcap is not None,
        reduction,
        grad,
        torch.are_deterministic_algorithms_enabled(),
        hidden.is_cuda and stream_capturing(),
        scope_token(),
    )
    return key, (
        x2,
        weight,
        t1,
        bias,
        ignore_index,
        reduction,
        float(label_smoothing),
        None if softcap is None else float(softcap),
    )


SPEC = OperationSpec(
    OP,
    "LM-head projection fused with cross-entropy (hidden @ weight.T -> CE, no full logits)",
    ("hidden", "weight", "target"),
    "reference.linear_cross_entropy",
    key_type=LinearCrossEntropyKey,
)


def _custom_op_scalars(ignore_index: Any, reduction: Any, label_smoothing: Any, softcap: Any) -> bool:
    """Whether the scalar arguments fit the custom op's schema (else the call is traced as Python, whose
    validation raises the typed error)."""

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    return (
        isinstance(ignore_index, int)
        and not isinstance(ignore_index, bool)
        and reduction in REDUCTIONS
        and number(label_smoothing)
        and (softcap is None or number(softcap))
    )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of a linear projection: ``F.cross_entropy(hidden @ weight.T (+ bias), target, ...)``, the
    language-model head and its loss in one call, computed without the full ``[N, V]`` logits by fused kernels
    (Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction``, Hsu et al. 2024; the chunked torch_native
    kernel).

    Shapes: hidden ``[..., H]`` (e.g. ``[B, S, H]``; its N = prod(leading dims) rows), weight ``[V, H]`` (V
    vocabulary, ``nn.Linear(H, V).weight``), target ``[...]`` = hidden.shape[:-1] int64 class indices in
    ``[0, V)`` or ``ignore_index``, bias ``[V]`` or None. dtype: hidden float32/float64/float16/bfloat16,
    weight and bias the same. Logits are soft-capped first when ``softcap`` is set (Gemma 2:
    ``softcap * tanh(z / softcap)``); ``label_smoothing`` ε mixes ``(1 - ε) * NLL + ε * mean_j(-log p_j)``
    (PyTorch's definition); rows with ``target == ignore_index`` add nothing and ``"mean"`` divides by the
    other rows (all rows ignored: NaN, like PyTorch).

    Returns: a 0-dim loss (``"mean"`` / ``"sum"``, in nats) or ``[...]`` per-row losses (``"none"``, ignored
    rows 0), in float32 for half-precision inputs and in hidden's dtype otherwise (math in float32; float64
    for float64). Differentiable with respect to hidden, weight and bias.

    Raises:
        InvalidInputError: hidden not a float tensor of >= 2 dims; weight not ``[V, H]`` of hidden's dtype and
            device; target not int64 of shape hidden.shape[:-1] (on CPU: a class index outside ``[0, V)``);
            bias not ``[V]``; reduction not mean/sum/none; label_smoothing outside [0, 1]; softcap not None or
            a finite float > 0; ignore_index not an int.

    >>> import torch, layerzero as lz
    >>> h, w = torch.zeros(2, 4), torch.zeros(8, 4)
    >>> round(float(lz.linear_cross_entropy(h, w, torch.tensor([1, 5]))), 4)   # uniform over 8 classes: ln 8
    2.0794
    """
    if (
        (is_dynamo_compiling() or is_exporting())
        and inference_only(hidden, weight, bias)
        and _custom_op_scalars(ignore_index, reduction, label_smoothing, softcap)
    ):  # custom op (custom_ops/_ops.py)
        return traced("linear_cross_entropy")(
            hidden,
            weight,
            target,
            bias,
            ignore_index,
            reduction,
            float(label_smoothing),
            None if softcap is None else float(softcap),
        )
    key, args = prepare(
        hidden,
        weight,
        target,
        bias=bias,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        softcap=softcap,
    )
    out = RUNTIME.run(key, context, args)
    if reduction == "none":
        return out.reshape(target.shape)
    return out


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        linear_cross_entropy,
        prepare,
        context,
        kernel_args=(
            "hidden",
            "weight",
            "target",
            "bias",
            "ignore_index",
            "reduction",
            "label_smoothing",
            "softcap",
        ),
        custom_ops=("linear_cross_entropy",),
    ),
)
