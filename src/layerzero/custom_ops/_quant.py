"""The quantized-weight ops of :mod:`layerzero.custom_ops` as ``torch.library`` custom ops:
``lz.dequantize``, ``lz.quantized_linear``, ``lz.fp8_linear`` and ``lz.quantize``. A ``QuantizedTensor``
(a NamedTuple, not a tensor) crosses the op boundary as its fields (:func:`_qt_args`) and is rebuilt
inside (:func:`_qt`).

Conventions (fake implementations, fresh contiguous outputs through :func:`_owned`) are those of
:mod:`layerzero.custom_ops._ops`, which imports this module and re-exports every wrapper here; it also
imports on its own (importing it registers its ops)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ._common import NS, _owned, eager


# ------------------------------------------------------------------------------------------ quantized weights
def _group_arg(group_size: Any) -> list[int] | None:
    """A QuantizedTensor's ``group_size`` (None, ``g`` or ``(bm, bk)``) as a custom-op argument: None, ``[g]``
    or ``[bm, bk]``."""
    if group_size is None:
        return None
    return [int(group_size)] if isinstance(group_size, int) else [int(v) for v in group_size]


def _group_of(group_size: list[int] | None) -> Any:
    """The inverse of :func:`_group_arg`."""
    if group_size is None:
        return None
    return group_size[0] if len(group_size) == 1 else tuple(group_size)


def _qt_args(qt: Any) -> tuple[Any, ...]:
    """A ``QuantizedTensor``'s fields as custom-op arguments (group size by :func:`_group_arg`)."""
    return (
        qt.data,
        qt.scale,
        qt.zero_point,
        qt.global_scale,
        qt.format.value,
        [int(n) for n in qt.shape],
        qt.dtype,
        qt.axis,
        _group_arg(qt.group_size),
    )


def _qt(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    global_scale: torch.Tensor | None,
    fmt: str,
    shape: list[int],
    dtype: torch.dtype,
    axis: int | None,
    group_size: list[int] | None,
) -> Any:
    """The ``QuantizedTensor`` :func:`_qt_args` took apart (validated by the eager op it is passed to)."""
    from layerzero.core.quant_format import QuantFormat, QuantizedTensor

    return QuantizedTensor(
        data,
        scale,
        zero_point,
        global_scale,
        QuantFormat(fmt),
        torch.Size(shape),
        dtype,
        axis,
        _group_of(group_size),
    )


@torch.library.custom_op(f"{NS}::dequantize", mutates_args=())
def _dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],  # noqa: UP045
    global_scale: Optional[torch.Tensor],
    fmt: str,
    shape: list[int],
    dtype: torch.dtype,  # noqa: UP045
    axis: Optional[int],
    group_size: Optional[list[int]],
) -> torch.Tensor:  # noqa: UP045
    out = eager("dequantize")(_qt(data, scale, zero_point, global_scale, fmt, shape, dtype, axis, group_size))
    return _owned(out, data, scale, zero_point, global_scale)


@_dequantize.register_fake
def _(data, scale, zero_point, global_scale, fmt, shape, dtype, axis, group_size):
    return data.new_empty(shape, dtype=dtype)


def dequantize(qt: Any) -> torch.Tensor:
    """``torch.ops.layerzero.dequantize`` with ``lz.dequantize``'s argument (a ``QuantizedTensor``)."""
    return _dequantize(*_qt_args(qt))


def _qt_linear_op(name: str) -> Any:
    """The custom op ``layerzero::<name>`` of a projection with a ``QuantizedTensor`` weight
    (``lz.quantized_linear``, ``lz.fp8_linear``): x, the weight's fields (:func:`_qt_args`) and bias; output
    ``[..., N]`` like x."""

    def impl(
        x: torch.Tensor,
        data: torch.Tensor,
        scale: torch.Tensor,
        zero_point: Optional[torch.Tensor],
        global_scale: Optional[torch.Tensor],  # noqa: UP045
        fmt: str,
        shape: list[int],
        dtype: torch.dtype,
        axis: Optional[int],  # noqa: UP045
        group_size: Optional[list[int]],
        bias: Optional[torch.Tensor],
    ) -> torch.Tensor:  # noqa: UP045
        qt = _qt(data, scale, zero_point, global_scale, fmt, shape, dtype, axis, group_size)
        return _owned(eager(name)(x, qt, bias), x, data, scale, zero_point, global_scale, bias)

    impl.__name__ = impl.__qualname__ = f"_{name}"
    op = torch.library.custom_op(f"{NS}::{name}", impl, mutates_args=())

    @op.register_fake
    def _(x, data, scale, zero_point, global_scale, fmt, shape, dtype, axis, group_size, bias):
        return x.new_empty((*x.shape[:-1], shape[0]))

    return op


_quantized_linear = _qt_linear_op("quantized_linear")
_fp8_linear = _qt_linear_op("fp8_linear")


def quantized_linear(x: torch.Tensor, qt: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.ops.layerzero.quantized_linear`` with ``lz.quantized_linear``'s arguments."""
    return _quantized_linear(x, *_qt_args(qt), bias)


def fp8_linear(x: torch.Tensor, qt: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.ops.layerzero.fp8_linear`` with ``lz.fp8_linear``'s arguments."""
    return _fp8_linear(x, *_qt_args(qt), bias)


@torch.library.custom_op(f"{NS}::quantize", mutates_args=())
def _quantize(
    x: torch.Tensor,
    fmt: str,
    axis: Optional[int],
    group_size: Optional[list[int]],  # noqa: UP045
    check_finite: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    qt = eager("quantize")(x, fmt, axis=axis, group_size=_group_of(group_size), check_finite=check_finite)
    zp = qt.zero_point if qt.zero_point is not None else x.new_empty(0, dtype=torch.uint8)
    gs = qt.global_scale if qt.global_scale is not None else x.new_empty(0, dtype=torch.float32)
    outs: list[torch.Tensor] = []
    for t in (qt.data, qt.scale, zp, gs):
        outs.append(_owned(t, x, *outs))
    return tuple(outs)


@_quantize.register_fake
def _(x, fmt, axis, group_size, check_finite):
    from layerzero.core.quant_format import QuantFormat, storage_layout

    data, scale, zp, gs = storage_layout(QuantFormat(fmt), tuple(x.shape), axis, _group_of(group_size))
    return (
        x.new_empty(data[1], dtype=data[0]),
        x.new_empty(scale[1], dtype=scale[0]),
        x.new_empty(zp[1] if zp else 0, dtype=torch.uint8),
        x.new_empty(gs[1] if gs else 0, dtype=torch.float32),
    )


def quantize(x: torch.Tensor, fmt: Any, axis: int | None, group_size: Any, check_finite: bool) -> Any:
    """``torch.ops.layerzero.quantize`` with ``lz.quantize``'s arguments (``fmt`` a QuantFormat; ``axis`` and
    ``group_size`` normalized); returns the QuantizedTensor."""
    from layerzero.core.quant_format import QuantFormat, QuantizedTensor

    data, scale, zp, gs = _quantize(x, fmt.value, axis, _group_arg(group_size), bool(check_finite))
    return QuantizedTensor(
        data,
        scale,
        zp if fmt is QuantFormat.INT4 else None,
        gs if fmt is QuantFormat.NVFP4 else None,
        fmt,
        x.shape,
        x.dtype,
        axis,
        group_size,
    )
