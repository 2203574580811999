"""``lz.rms_norm`` and ``lz.layer_norm``."""

from __future__ import annotations

from typing import Any, NamedTuple, overload

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext
from layerzero.core.dispatch import MISS
from layerzero.core.observers import OBSERVERS
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import (
    FLOAT_DTYPES,
    check_eps,
    check_same,
    check_tensor,
    deterministic_enabled,
    device_spec,
    exact_device,
    fail,
    flags,
    inference_only,
    is_grad_enabled,
    scope_layers,
    scope_token,
    scope_token_of,
    stream_capturing,
)

_INF = float("inf")
_TENSOR = torch.Tensor


class NormKey(NamedTuple):
    """The selection-cache key of one ``lz.rms_norm`` / ``lz.layer_norm`` call. ``flag`` is the op's own flag:
    ``fused_residual`` for rms_norm, ``has_bias`` for layer_norm; ``capture``/``scope`` close every op's
    key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    param_dtype: torch.dtype
    hidden_size: int
    flag: bool
    stride_last_1: bool
    contiguous: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def _check_param(op: str, name: str, x: torch.Tensor, p: Any) -> None:
    check_tensor(op, name, p, 1)
    check_same(op, "x", x, name, p, dtype=False)
    if p.shape[0] != x.shape[-1]:
        raise fail(op, f"{name} shape", f"[H] with H = x.shape[-1] = {x.shape[-1]}", list(p.shape))


def prepare_rms(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, residual: torch.Tensor | None = None
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.rms_norm`` inputs; return (cache key, canonical kernel args)."""
    key, args = _prepare_rms(x, weight, eps, residual)
    return NormKey(*key), args


def _prepare_rms(x: Any, weight: Any, eps: Any, residual: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """:func:`prepare_rms` with positional arguments (the hot path). The common case (float x ``[..., H]``,
    weight ``[H]`` on x's device, float eps > 0, no residual) is a few attribute reads and its key the plain
    tuple of the :class:`NormKey` fields (equal to it and hashed alike; dispatch names it on a miss); anything
    else takes the full checks, which raise :class:`InvalidInputError`."""
    op = "rms_norm"
    if eps.__class__ is float and 0.0 < eps < _INF:
        try:
            dtype, device, shape = x.dtype, x.device, x.shape
            wdtype = weight.dtype
            fast = (
                dtype in FLOAT_DTYPES
                and wdtype in FLOAT_DTYPES
                and shape
                and weight.shape == shape[-1:]
                and weight.device == device
                and (
                    residual is None
                    or (residual.dtype is dtype and residual.shape == shape and residual.device == device)
                )
            )
        except AttributeError:
            fast = False
        if fast:
            contiguous = x.is_contiguous()
            layers = scope_layers()
            # stride_last_1 as flags() has it: x's, the weight's (1-D: contiguous) and the residual's last
            # stride 1
            stride = (contiguous or x.stride(-1) == 1) and weight.is_contiguous()
            if residual is None:
                grad = is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            else:
                stride = stride and (residual.is_contiguous() or residual.stride(-1) == 1)
                grad = is_grad_enabled() and (
                    x.requires_grad or weight.requires_grad or residual.requires_grad
                )
            return (
                op,
                device,
                dtype,
                wdtype,
                shape[-1],
                residual is not None,
                stride,
                contiguous,
                grad,
                deterministic_enabled(),
                x.is_cuda and stream_capturing(),
                scope_token_of(layers) if layers else (),
            ), (x, weight, eps, residual)
    check_tensor(op, "x", x)
    if x.dim() == 0:
        raise fail(op, "x rank", ">= 1 dims ([..., H])", "a 0-dim tensor")
    _check_param(op, "weight", x, weight)
    eps = check_eps(op, eps)
    if residual is not None:
        check_tensor(op, "residual", residual)
        check_same(op, "x", x, "residual", residual)
        if residual.shape != x.shape:
            raise fail(op, "residual shape", f"x's shape {list(x.shape)}", list(residual.shape))
    return _key(op, x, weight, residual is not None, residual), (x, weight, eps, residual)


def _key(op: str, x: torch.Tensor, weight: torch.Tensor, flag: bool, other: torch.Tensor | None) -> NormKey:
    """The norm cache key: op, device, dtypes, hidden size, the op's flag (fused residual / has bias), layout
    and per-call flags. ``other`` is the residual or the bias (None when absent)."""
    grad, det, capture, stride = flags(x, weight, other)
    return NormKey(
        op,
        x.device,
        x.dtype,
        weight.dtype,
        x.shape[-1],
        flag,
        stride,
        x.is_contiguous(),
        grad,
        det,
        capture,
        scope_token(),
    )


def _context(key: NormKey, **op_fields: Any) -> SelectionContext:
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        hidden_size=key.hidden_size,
        param_dtype=key.param_dtype,
        stride_last_1=key.stride_last_1,
        contiguous=key.contiguous,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
        **op_fields,
    )


def context_rms(key: NormKey) -> SelectionContext:
    """The :class:`SelectionContext` of an rms_norm cache key."""
    return _context(key, fused_residual=key.flag)


def prepare_layer(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.layer_norm`` inputs; return (cache key, canonical kernel args)."""
    op = "layer_norm"
    check_tensor(op, "x", x)
    if x.dim() == 0:
        raise fail(op, "x rank", ">= 1 dims ([..., H])", "a 0-dim tensor")
    _check_param(op, "weight", x, weight)
    if bias is not None:
        _check_param(op, "bias", x, bias)
        if bias.dtype != weight.dtype:
            raise fail(
                op,
                "bias.dtype",
                f"weight's dtype {weight.dtype}",
                bias.dtype,
                "Cast both parameters to one dtype.",
            )
    eps = check_eps(op, eps)
    return _key(op, x, weight, bias is not None, bias), (x, weight, bias, eps)


def context_layer(key: NormKey) -> SelectionContext:
    """The :class:`SelectionContext` of a layer_norm cache key."""
    return _context(key, has_bias=key.flag)


RMS_SPEC = OperationSpec(
    "rms_norm",
    "RMSNorm with optional fused residual add",
    ("x", "weight"),
    "reference.rms_norm",
    key_type=NormKey,
)
LAYER_SPEC = OperationSpec(
    "layer_norm",
    "LayerNorm over the last dim",
    ("x", "weight", "bias"),
    "reference.layer_norm",
    key_type=NormKey,
)


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = ..., *, residual: None = ...
) -> torch.Tensor: ...
@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = ..., *, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(x, weight, eps=1e-6, *, residual=None):
    """RMSNorm (Zhang & Sennrich 2019): ``y = x / sqrt(mean(x^2, -1) + eps) * weight``.

    Shapes: x ``[..., H]`` (H = hidden size), weight ``[H]``; y like x. dtype:
    float32/float64/float16/bfloat16; y has x's dtype; math in float32 (float64 for float64). Numerics follow
    Hugging Face ``LlamaRMSNorm`` (normalize in float32, cast to x's dtype, multiply by the weight) in the
    reference kernel; fused kernels may multiply before the cast (within one rounding step in half precision).
    With ``residual`` (like x): computes ``h = x + residual`` first and returns ``(rms_norm(h), h)`` — the
    fused add + norm of vLLM/TensorRT-LLM decoder layers.

    Raises:
        InvalidInputError: non-float or 0-dim x, weight not ``[H]``, residual shape/dtype/device differs,
            eps not a finite float > 0, tensors on different devices.

    >>> import torch, layerzero as lz
    >>> lz.rms_norm(torch.ones(2, 8), torch.ones(8)).shape
    torch.Size([2, 8])
    """
    if (
        is_dynamo_compiling() or is_exporting()
    ):  # torch.compile, torch.export: one custom-op node (layerzero/custom_ops/_ops.py)
        return (
            traced("rms_norm")(x, weight, eps)
            if residual is None
            else traced("fused_add_rms_norm")(x, weight, eps, residual)
        )
    hot_key = _exact_key(x, weight, eps, residual)
    if hot_key is not None:
        if OBSERVERS.none:  # Runtime.run_hot inlined (core/observers.py says when that is allowed and why)
            plan = RUNTIME.cache.hot.get(hot_key)
            if plan is not None:
                try:
                    return plan.call(x, weight, eps, residual)
                except Exception as exc:  # noqa: BLE001 - recorded, then retried or re-raised as run_hot does
                    return RUNTIME.hot_failure(plan, exc, (x, weight, eps, residual))
        else:
            out = RUNTIME.run_hot(hot_key, (x, weight, eps, residual))
            if out is not MISS:
                return out
    key, args = _prepare_rms(x, weight, eps, residual)
    return RUNTIME.run(key, context_rms, args, hot_key)


def _exact_key(x: Any, weight: Any, eps: Any, residual: Any) -> tuple[Any, ...] | None:
    """The exact key of an ``lz.rms_norm`` call (``Runtime.run_hot``, as ``lz.attention``'s): the shapes,
    dtypes and ``eps`` as given, the device as -1 (CPU) or the CUDA index, the stride and per-call flags. Only
    calls that passed every check file it (``Runtime.run``), so a hit skips the checks and the key build:
    measured 2.8 µs per call on the AVX2 CI machine. None (the full path) for anything but plain tensors on
    one CPU or CUDA device and a float ``eps``."""
    if (
        eps.__class__ is not float
        or x.__class__ is not _TENSOR
        or weight.__class__ is not _TENSOR
        or (residual is not None and residual.__class__ is not _TENSOR)
    ):
        return None
    dev = exact_device(x, weight, residual)
    if dev is None:
        return None
    contiguous = x.is_contiguous()
    layers = scope_layers()
    scope = scope_token_of(layers) if layers else ()
    capture = dev >= 0 and stream_capturing()
    stride = contiguous or x.stride(-1) == 1
    if residual is None:
        res, grad = None, is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    else:
        res = (residual.dtype, residual.shape, residual.is_contiguous() or residual.stride(-1) == 1)
        grad = is_grad_enabled() and (x.requires_grad or weight.requires_grad or residual.requires_grad)
    return (
        "rms_norm",
        dev,
        x.dtype,
        weight.dtype,
        x.shape,
        weight.shape,
        eps,
        contiguous,
        stride,
        weight.is_contiguous(),
        res,
        grad,
        deterministic_enabled(),
        capture,
        scope,
    )


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm (Ba et al. 2016) over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias``
    (biased variance, like ``torch.nn.LayerNorm``).

    Shapes: x ``[..., H]``, weight ``[H]``, bias ``[H]`` or None; output like x, in x's dtype.

    Raises:
        InvalidInputError: non-float or 0-dim x, weight/bias not ``[H]``, different devices, bad eps.

    >>> import torch, layerzero as lz
    >>> lz.layer_norm(torch.randn(2, 8), torch.ones(8)).shape
    torch.Size([2, 8])
    """
    if (is_dynamo_compiling() or is_exporting()) and inference_only(x, weight, bias):
        return traced("layer_norm")(x, weight, bias, eps)
    key, args = prepare_layer(x, weight, bias, eps)
    return RUNTIME.run(key, context_layer, args)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        RMS_SPEC,
        rms_norm,
        prepare_rms,
        context_rms,
        kernel_args=("x", "weight", "eps", "residual"),
        custom_ops=("rms_norm", "fused_add_rms_norm"),
    ),
    OpDef(
        LAYER_SPEC,
        layer_norm,
        prepare_layer,
        context_layer,
        kernel_args=("x", "weight", "bias", "eps"),
        custom_ops=("layer_norm",),
    ),
)
