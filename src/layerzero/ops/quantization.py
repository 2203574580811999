"""``lz.quantize`` and ``lz.dequantize``: int8, fp8 (e4m3 / e5m2), MXFP4, NVFP4 and int4 (GPTQ / AWQ) as two
dispatched ops. The format is parsed once here into a :class:`QuantFormat`; ``axis`` / ``group_size`` are
checked and normalized (every kernel gets the same canonical arguments). Formats, layouts, scales and error
bounds: ``layerzero.core.quant_format`` and docs/quantization.md."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext, bucket
from layerzero.core.opdef import OpDef, define
from layerzero.core.quant_format import (
    FIXED_BLOCK,
    FP8_MAX,
    INT4_DEFAULT_GROUP,
    QuantFormat,
    QuantizedTensor,
    format_granularity,
    parse_quant_format,
)
from layerzero.core.quant_format import (
    storage_layout as layout,
)
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import (
    FLOAT_DTYPES,
    check_tensor,
    device_spec,
    fail,
    inference_only,
    scope_layers,
    scope_token_of,
    stream_capturing,
)

OP, DEQ = "quantize", "dequantize"
_Group = int | tuple[int, int] | None


class QuantKey(NamedTuple):
    """The selection-cache key of one ``lz.quantize`` / ``lz.dequantize`` call (``op`` says which): the
    original float dtype, the format, the scale granularity (``"tensor"``, ``"channel:<axis>"``,
    ``"group:<g>"``, ``"block:<bm>x<bk>"``), rows (all dims but the last, product bucketed to the next power
    of two) and the last dim K (exact); ``capture``/``scope`` close every op's key (see
    ``ops.attention.AttentionKey``)."""

    op: str
    device: torch.device
    dtype: torch.dtype
    quant_format: str
    granularity: str
    batch: int
    hidden_size: int
    contiguous: bool
    capture: bool
    scope: tuple[Any, ...]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _normalize(
    op: str, fmt: QuantFormat, shape: tuple[int, ...], axis: Any, group_size: Any
) -> tuple[int | None, _Group]:
    """Check ``axis`` / ``group_size`` for ``fmt`` and an x of ``shape``; return them normalized (axis >= 0,
    the fixed block sizes and int4's default filled in, a block as a tuple)."""
    name = fmt.value
    if axis is not None and group_size is not None:
        raise fail(
            op,
            "axis and group_size",
            "at most one of them",
            f"axis={axis!r}, group_size={group_size!r}",
            "axis=k gives one scale per index of dim k; group_size=g one scale per g elements of the last "
            "dim.",
        )
    if axis is not None and fmt in (QuantFormat.INT8, *FP8_MAX):
        if not _is_int(axis):
            raise fail(op, "axis", "an int (the channel dim) or None", repr(axis))
        if not shape:
            raise fail(op, "x rank for axis", ">= 1 dims (a 0-dim tensor has no channels)", "a 0-dim tensor")
        if not -len(shape) <= axis < len(shape):
            raise fail(
                op,
                "axis",
                f"a dim of x in [{-len(shape)}, {len(shape) - 1}] (x has shape {list(shape)})",
                axis,
            )
        return axis % len(shape), None
    if axis is not None:
        raise fail(
            op,
            f"axis for {name}",
            "None (its scales are per block along the last dim)",
            repr(axis),
            "Per-channel scales exist for int8 and fp8 only.",
        )
    if fmt in FIXED_BLOCK:
        block = FIXED_BLOCK[fmt]
        if group_size is not None and group_size != block:
            raise fail(
                op, f"group_size for {name}", f"None or {block} (fixed by the format)", repr(group_size)
            )
        _check_last(op, name, shape, block, "block size")
        return None, block
    if fmt is QuantFormat.INT4:
        g = INT4_DEFAULT_GROUP if group_size is None else group_size
        if not _is_int(g) or g < 1:
            raise fail(
                op,
                "group_size for int4",
                "an int >= 1 (GPTQ / AWQ use 128; K for one group per row)",
                repr(group_size),
            )
        _check_last(op, name, shape, g, "group_size")
        if shape[-1] % 2:
            raise fail(op, "x.shape[-1] for int4", "an even size (two 4-bit codes per byte)", shape[-1])
        return None, g
    if group_size is None:
        return None, None
    if _is_int(group_size) and group_size >= 1:
        _check_last(op, name, shape, group_size, "group_size")
        return None, group_size
    if (
        isinstance(group_size, (tuple, list))
        and len(group_size) == 2
        and all(_is_int(v) and v >= 1 for v in group_size)
    ):
        bm, bk = group_size
        if len(shape) < 2:
            raise fail(
                op, "x rank for a 2-D block group_size", ">= 2 dims ([..., M, K])", f"shape {list(shape)}"
            )
        _check_last(op, name, shape, bk, "group_size[1]")
        if shape[-2] % bm:
            raise fail(
                op,
                "x.shape[-2]",
                f"a multiple of group_size[0] = {bm}",
                shape[-2],
                "Pad the rows or pick a block height that divides them.",
            )
        return None, (bm, bk)
    raise fail(
        op,
        f"group_size for {name}",
        "None (per tensor), an int g >= 1 (1 x g groups along the last dim) or "
        "a pair (bm, bk) (2-D blocks, DeepSeek-V3 uses (128, 128))",
        repr(group_size),
    )


def _check_last(op: str, name: str, shape: tuple[int, ...], g: int, what: str) -> None:
    if not shape:
        raise fail(op, f"x rank for {name}", ">= 1 dims ([..., K])", "a 0-dim tensor")
    if shape[-1] % g:
        raise fail(
            op,
            f"x.shape[-1] for {name}",
            f"a multiple of the {what} {g}",
            shape[-1],
            "Pad the last dim (or pick a group size that divides it).",
        )


def _gran_name(fmt: QuantFormat, axis: int | None, group_size: _Group) -> str:
    gran = format_granularity(fmt, axis, group_size).value
    if axis is not None:
        return f"{gran}:{axis}"
    if isinstance(group_size, tuple):
        return f"{gran}:{group_size[0]}x{group_size[1]}"
    return gran if group_size is None else f"{gran}:{group_size}"


def _key(
    op: str,
    device: torch.device,
    dtype: torch.dtype,
    fmt: QuantFormat,
    axis: int | None,
    group_size: _Group,
    shape: tuple[int, ...],
    contiguous: bool,
) -> QuantKey:
    k = shape[-1] if shape else 1
    rows = 1
    for n in shape[:-1]:
        rows *= n
    layers = scope_layers()
    return QuantKey(
        op,
        device,
        dtype,
        fmt.value,
        _gran_name(fmt, axis, group_size),
        bucket(rows),
        k,
        contiguous,
        device.type == "cuda" and stream_capturing(),
        scope_token_of(layers) if layers else (),
    )


def prepare(
    x: torch.Tensor,
    format: QuantFormat | str,
    *,
    axis: int | None = None,  # noqa: A002 - the API's name
    group_size: int | tuple[int, int] | None = None,
    check_finite: bool = True,
) -> tuple[QuantKey, tuple[Any, ...]]:
    """Validate ``lz.quantize`` inputs; return (cache key, canonical kernel args
    ``(x, format, axis, group_size)``).

    Raises:
        InvalidInputError: see :func:`quantize`.
    """
    check_tensor(OP, "x", x)
    fmt = parse_quant_format(format, "lz.quantize: format")
    shape = tuple(x.shape)
    if x.numel() == 0:
        raise fail(OP, "x", "a tensor with at least one element", f"shape {list(shape)}")
    axis, group_size = _normalize(OP, fmt, shape, axis, group_size)
    if not isinstance(check_finite, bool):
        raise fail(OP, "check_finite", "True or False", repr(check_finite))
    if check_finite and not (x.is_cuda and stream_capturing()):
        finite = torch.isfinite(x)
        if not bool(finite.all()):
            where = tuple(int(i) for i in (~finite).nonzero()[0])
            raise fail(
                OP,
                "x values",
                "finite numbers (a NaN or Inf would make its whole group's scale NaN/Inf)",
                f"{x[where].item()!r} at index {list(where)}",
                "Clean the input first, or pass check_finite=False (no check, no host sync; such a group's "
                "codes are then unspecified).",
            )
    key = _key(OP, x.device, x.dtype, fmt, axis, group_size, shape, x.is_contiguous())
    return key, (x, fmt, axis, group_size)


def _expect(
    what: str, t: Any, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device, fmt: str
) -> None:
    if not isinstance(t, torch.Tensor):
        raise fail(
            DEQ,
            what,
            f"a {dtype} tensor of shape {list(shape)} ({fmt})",
            type(t).__name__,
            "Build QuantizedTensors with lz.quantize (or follow docs/quantization.md's layout table).",
        )
    if t.dtype != dtype:
        raise fail(DEQ, f"{what}.dtype", f"{dtype} ({fmt})", t.dtype)
    if tuple(t.shape) != shape:
        raise fail(DEQ, f"{what} shape", f"{list(shape)} ({fmt}, original shape and groups)", list(t.shape))
    if t.device != device:
        raise fail(DEQ, f"{what}.device", f"{device} (like qt.data)", t.device)


def prepare_dequantize(qt: QuantizedTensor) -> tuple[QuantKey, tuple[Any, ...]]:
    """Validate ``lz.dequantize``'s input; return (cache key, canonical kernel args ``(qt,)``).

    Raises:
        InvalidInputError: see :func:`dequantize`.
    """
    if not isinstance(qt, QuantizedTensor):
        raise fail(DEQ, "qt", "a QuantizedTensor (what lz.quantize returns)", type(qt).__name__)
    fmt = qt.format
    if not isinstance(fmt, QuantFormat):
        raise fail(
            DEQ,
            "qt.format",
            f"a QuantFormat, one of {[f.value for f in QuantFormat]}",
            repr(fmt),
            "Parse the name once: lz.QuantFormat('int8').",
        )
    if not isinstance(qt.dtype, torch.dtype) or qt.dtype not in FLOAT_DTYPES:
        raise fail(DEQ, "qt.dtype", "one of float32/float64/float16/bfloat16 (the original dtype)", qt.dtype)
    if not isinstance(qt.shape, (tuple, torch.Size)) or not all(_is_int(n) and n >= 0 for n in qt.shape):
        raise fail(DEQ, "qt.shape", "a torch.Size of the original tensor", repr(qt.shape))
    shape = tuple(qt.shape)
    if not all(shape) and shape:
        raise fail(DEQ, "qt.shape", "no zero dims (lz.quantize takes non-empty tensors)", list(shape))
    axis, group_size = _normalize(DEQ, fmt, shape, qt.axis, qt.group_size)
    if (axis, group_size) != (qt.axis, qt.group_size):
        raise fail(
            DEQ,
            "qt.axis / qt.group_size",
            f"normalized values axis={axis!r}, group_size={group_size!r}",
            f"axis={qt.axis!r}, group_size={qt.group_size!r}",
        )
    data = qt.data
    if not isinstance(data, torch.Tensor):
        raise fail(DEQ, "qt.data", "a torch.Tensor", type(data).__name__)
    dev, name = data.device, fmt.value
    want = layout(fmt, shape, axis, group_size)
    _expect("qt.data", data, *want[0], dev, name)
    _expect("qt.scale", qt.scale, *want[1], dev, name)
    if want[2] is not None:
        _expect("qt.zero_point", qt.zero_point, *want[2], dev, name)
    elif qt.zero_point is not None:
        raise fail(DEQ, f"qt.zero_point for {name}", "None (symmetric format)", type(qt.zero_point).__name__)
    if want[3] is not None:
        _expect("qt.global_scale", qt.global_scale, *want[3], dev, name)
    elif qt.global_scale is not None:
        raise fail(DEQ, f"qt.global_scale for {name}", "None (nvfp4 only)", type(qt.global_scale).__name__)
    key = _key(DEQ, dev, qt.dtype, fmt, axis, group_size, shape, data.is_contiguous())
    return key, (qt,)


def context(key: QuantKey) -> SelectionContext:
    """The :class:`SelectionContext` of a quantize / dequantize key (``batch``: rows bucketed,
    ``hidden_size``: K)."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.batch,
        hidden_size=key.hidden_size,
        contiguous=key.contiguous,
        graph_capture=key.capture,
        quant_format=key.quant_format,
        quant_granularity=key.granularity,
    )


SPEC = OperationSpec(
    OP,
    "quantize a float tensor: int8, fp8 e4m3/e5m2, MXFP4, NVFP4, int4 (GPTQ/AWQ)",
    ("x",),
    "reference.quantize",
    key_type=QuantKey,
)
DEQUANT_SPEC = OperationSpec(
    DEQ,
    "dequantize a QuantizedTensor back to its original dtype",
    ("qt",),
    "reference.dequantize",
    key_type=QuantKey,
)


def quantize(
    x: torch.Tensor,
    format: QuantFormat | str,
    *,
    axis: int | None = None,  # noqa: A002 - the API's name
    group_size: int | tuple[int, int] | None = None,
    check_finite: bool = True,
) -> QuantizedTensor:
    """Quantize ``x`` to ``format``; returns a :class:`~layerzero.QuantizedTensor` (``lz.dequantize`` inverts
    it).

    Shapes: x ``[..., K]`` (``[..., M, K]`` for 2-D blocks), any float dtype, not empty. Formats and scales
    (math in float32; docs/quantization.md has layouts and error bounds):

    - ``"int8"``: symmetric, codes in [-127, 127], float32 ``scale = amax / 127``; round half to even.
    - ``"fp8_e4m3"`` / ``"fp8_e5m2"``: ``torch.float8_e4m3fn`` / ``float8_e5m2`` data, ``scale = amax / 448``
      (``/ 57344``), values saturated to the format max, round to nearest even. For both:
      ``axis=None, group_size=None`` per tensor (scale ``[]``); ``axis=k`` per channel (scale like x with 1 in
      every other dim; per-token of ``[T, H]`` is ``axis=0``); ``group_size=g`` groups of g along the last dim
      (scale ``[..., K/g]``; DeepSeek-V3 activations: 128); ``group_size=(bm, bk)`` 2-D blocks over the last
      two dims (scale ``[..., M/bm, K/bk]``; DeepSeek-V3 / vLLM block-fp8 weights: ``(128, 128)``).
    - ``"mxfp4"`` (OCP MX v1.0): E2M1 codes two per byte ``[..., K/2]`` uint8, E8M0 scales ``[..., K/32]``
      uint8.
    - ``"nvfp4"`` (NVIDIA ModelOpt / TensorRT-LLM): E2M1 codes ``[..., K/2]``, E4M3 block scales
      ``[..., K/16]`` and a float32 ``global_scale = amax / (448 * 6)``.
    - ``"int4"`` (GPTQ / AWQ, weight-only): asymmetric codes 0..15 two per byte ``[..., K/2]``, float32 scales
      and uint8 zero points ``[..., K/g]``, ``group_size`` g default 128 (``layerzero.ops.gptq.to_gptq`` and
      ``layerzero.ops.awq.to_awq`` pack them into GPTQ's and AWQ's int32 layouts).

    ``check_finite`` (default True) raises for NaN/Inf in x (one reduction; a host sync on GPUs; skipped while
    a CUDA graph is captured); False skips it and a non-finite group's codes are unspecified. Not
    differentiable: x is detached.

    Raises:
        InvalidInputError: x not a float tensor or empty; an unknown format (the message lists them); axis and
            group_size both set, axis out of range or set for mxfp4/nvfp4/int4; a group size that is not an
            int >= 1 / a pair, or that does not divide its dim (fixed: 32 mxfp4, 16 nvfp4); an odd K for int4;
            NaN/Inf.

    >>> import torch, layerzero as lz
    >>> qt = lz.quantize(torch.tensor([[1.0, -2.0, 127.0]]), "int8", axis=0)
    >>> qt.data, qt.scale
    (tensor([[  1,  -2, 127]], dtype=torch.int8), tensor([[1.]]))
    """
    if (is_dynamo_compiling() or is_exporting()) and isinstance(x, torch.Tensor) and inference_only(x):
        fmt = parse_quant_format(format, "lz.quantize: format")
        axis, group_size = _normalize(OP, fmt, tuple(x.shape), axis, group_size)
        return traced("quantize")(x, fmt, axis, group_size, check_finite)
    key, args = prepare(x, format, axis=axis, group_size=group_size, check_finite=check_finite)
    return RUNTIME.run(key, context, args)


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """The float tensor a :class:`~layerzero.QuantizedTensor` stands for: ``qt.shape`` in ``qt.dtype`` (codes
    times their scales in float32, minus the zero point for int4, then one rounding to ``qt.dtype``).

    Raises:
        InvalidInputError: ``qt`` is not a QuantizedTensor, or its fields disagree with its format's layout
            (dtypes, shapes, devices, a missing ``zero_point`` for int4 / ``global_scale`` for nvfp4,
            un-normalized ``axis`` / ``group_size``).

    >>> import torch, layerzero as lz
    >>> lz.dequantize(lz.quantize(torch.tensor([0.5, -6.0, 3.0, 1.0]), "int8"))
    tensor([ 0.5197, -6.0000,  3.0236,  0.9921])
    """
    if (is_dynamo_compiling() or is_exporting()) and traceable(qt):
        return traced("dequantize")(qt)
    key, args = prepare_dequantize(qt)
    return RUNTIME.run(key, context, args)


def traceable(qt: Any) -> bool:
    """Whether ``qt`` can be taken apart into a custom op's arguments under ``torch.compile`` (a
    QuantizedTensor with tensor codes and scales and a QuantFormat; anything else takes the eager path, whose
    validation raises)."""
    return (
        isinstance(qt, QuantizedTensor)
        and isinstance(qt.format, QuantFormat)
        and isinstance(qt.data, torch.Tensor)
        and isinstance(qt.scale, torch.Tensor)
    )


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        quantize,
        prepare,
        context,
        kernel_args=("x", "format", "axis", "group_size"),
        custom_ops=("quantize",),
    ),
    OpDef(DEQUANT_SPEC, dequantize, prepare_dequantize, context, custom_ops=("dequantize",)),
)
