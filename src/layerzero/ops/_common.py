"""Shared pieces of the op front-ends: input checks and per-call flags.

Every check raises :class:`InvalidInputError` (a ``ValueError``) with what failed, expected vs got, and how
to fix it. Checks are written to be cheap: they run on every call, cache hit or not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from layerzero.core import config as _config
from layerzero.core.capture import AS_CAPTURED
from layerzero.core.device import DeviceSpec
from layerzero.core.errors import InvalidInputError, expected_got

_Tensor = torch.Tensor
FLOAT_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


scope_token = _config.scope_token
scope_layers = _config.scope_layers
scope_token_of = _config.scope_token_of
is_grad_enabled = torch.is_grad_enabled
deterministic_enabled = torch._C._get_deterministic_algorithms


def stream_capturing() -> bool:
    """True while a CUDA graph is being captured on the current CUDA stream (the C call behind
    ``torch.cuda.is_current_stream_capturing``, without its Python wrapper; only called for CUDA tensors), and
    inside :func:`layerzero.capture_selection` (calls select as captured)."""
    return _capturing() or _as_captured()


_capturing = (
    getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
)
_as_captured = AS_CAPTURED.get


def exact_device(t: _Tensor, *others: _Tensor | None) -> int | None:
    """The device of ``t`` as the ops' exact keys hold it (``Runtime.run_hot``): -1 for the CPU, the index for
    CUDA; None when one of ``others`` (None entries skipped) is elsewhere or ``t`` is on another device type
    (such calls take the full checks). Bool attributes and ints: cheaper than ``torch.device`` objects and
    their comparisons."""
    if t.is_cpu:
        for o in others:
            if o is not None and not o.is_cpu:
                return None
        return -1
    if not t.is_cuda:
        return None
    dev = t.get_device()
    for o in others:
        if o is not None and (not o.is_cuda or o.get_device() != dev):
            return None
    return dev


def tensors_exact_key(op: str, tensors: tuple[Any, ...], *extra: Any) -> tuple[Any, ...] | None:
    """An exact key (``Runtime.run_hot``) from every input's dtype, shape and strides (None for an absent
    optional input), ``extra`` facts as given (scalars the checks read), the device as -1 (CPU) or the CUDA
    index and the per-call flags (autograd, determinism, capture, scope): for ops whose checks read nothing
    else of their tensors. None (the full path) when an input is not a plain tensor or the inputs are not on
    one CPU or CUDA device; ``tensors[0]`` must be given."""
    for t in tensors:
        if t is not None and t.__class__ is not _Tensor:
            return None
    dev = exact_device(*tensors)
    if dev is None:
        return None
    facts = tuple(None if t is None else (t.dtype, t.shape, t.stride()) for t in tensors)
    grad = is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    layers = scope_layers()
    return (
        op,
        dev,
        facts,
        *extra,
        grad,
        deterministic_enabled(),
        dev >= 0 and stream_capturing(),
        scope_token_of(layers) if layers else (),
    )


def device_spec(device: torch.device) -> DeviceSpec:
    """The (memoized) :class:`DeviceSpec` of ``device``."""
    return DeviceSpec.detect(device)


def fail(op: str, what: str, expected: Any, got: Any, fix: str | None = None) -> InvalidInputError:
    """Build the error for a bad input of ``op`` (raise the return value)."""
    return InvalidInputError(expected_got(f"lz.{op}: {what}", expected, got, fix))


def check_tensor(op: str, name: str, t: Any, ndim: int | tuple[int, ...] | None = None) -> None:
    """``t`` is a floating tensor (of rank ``ndim`` when given)."""
    if not isinstance(t, _Tensor):
        raise fail(op, name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in FLOAT_DTYPES:
        raise fail(
            op,
            f"{name}.dtype",
            "one of float32/float64/float16/bfloat16",
            t.dtype,
            f"Cast {name} with {name}.float() or .to(torch.bfloat16).",
        )
    if ndim is not None:
        ok = t.dim() == ndim if isinstance(ndim, int) else t.dim() in ndim
        if not ok:
            raise fail(op, f"{name} rank", f"{ndim} dims", f"{t.dim()} dims (shape {tuple(t.shape)})")


def check_same(op: str, ref_name: str, ref: _Tensor, name: str, t: _Tensor, *, dtype: bool = True) -> None:
    """``t`` is on ``ref``'s device (and has its dtype when ``dtype``)."""
    if t.device != ref.device:
        raise fail(
            op,
            f"{name}.device",
            f"{ref.device} (like {ref_name})",
            t.device,
            f"Move it with {name}.to({ref_name}.device).",
        )
    if dtype and t.dtype != ref.dtype:
        raise fail(
            op,
            f"{name}.dtype",
            f"{ref.dtype} (like {ref_name})",
            t.dtype,
            f"Cast it with {name}.to({ref_name}.dtype).",
        )


def check_eps(op: str, eps: Any) -> float:
    """``eps`` is a finite number > 0."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise fail(op, "eps", "a finite float > 0", repr(eps))
    return float(eps)


def check_temperature(op: str, temperature: Any) -> float:
    """``temperature`` is a finite number >= 0 (0 = greedy)."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise fail(op, "temperature", "a finite float >= 0 (0 means greedy)", repr(temperature))
    return float(temperature)


def flags(t: _Tensor, *tensors: _Tensor | None) -> tuple[bool, bool, bool, bool]:
    """(requires_grad, deterministic, graph_capture, stride_last_1) for a call on ``t`` and ``tensors``."""
    grad = False
    if is_grad_enabled():
        grad = t.requires_grad or any(x is not None and x.requires_grad for x in tensors)
    stride = t.stride(-1) == 1 and all(x is None or x.dim() == 0 or x.stride(-1) == 1 for x in tensors)
    return grad, deterministic_enabled(), t.is_cuda and stream_capturing(), stride


INT_DTYPES = frozenset({torch.int64, torch.int32})


def check_rows(
    op: str, name: str, t: Any, logits: _Tensor, dtypes: frozenset[torch.dtype], dtype_text: str, cast: str
) -> None:
    """``t`` is a per-row tensor ``[B]`` (one value per row of ``logits`` ``[B, V]``) of one of ``dtypes``, on
    logits' device; ``cast`` names the dtype the fix suggests (``"torch.float32"``)."""
    batch = logits.shape[0]
    if not isinstance(t, _Tensor):
        raise fail(
            op,
            name,
            f"a {dtype_text} tensor [B] or None",
            type(t).__name__,
            f"Pass one value per row, e.g. torch.full(({batch},), value, dtype={cast}).",
        )
    if t.dtype not in dtypes:
        raise fail(op, f"{name}.dtype", dtype_text, t.dtype, f"Cast it with {name}.to({cast}).")
    if t.dim() != 1 or t.shape[0] != batch:
        raise fail(op, f"{name} shape", f"[B] = [{batch}] (one value per row of logits)", list(t.shape))
    check_same(op, "logits", logits, name, t, dtype=False)


def check_ids(op: str, name: str, t: Any, logits: _Tensor) -> None:
    """``t`` is an int64/int32 token-id tensor ``[B, L]`` (L >= 0) on logits' device; on the CPU its values
    are in ``[0, V]`` (V, the vocabulary size, pads ragged rows)."""
    batch, vocab = logits.shape
    if not isinstance(t, _Tensor):
        raise fail(op, name, "an int64/int32 tensor [B, L]", type(t).__name__)
    if t.dtype not in INT_DTYPES:
        raise fail(op, f"{name}.dtype", "int64 or int32", t.dtype, f"Cast it with {name}.long().")
    if t.dim() != 2 or t.shape[0] != batch:
        raise fail(
            op,
            f"{name} shape",
            f"[B, L] with B = {batch} (like logits)",
            list(t.shape),
            f"Right-pad ragged rows with the vocabulary size {vocab}; L = 0 is allowed.",
        )
    check_same(op, "logits", logits, name, t, dtype=False)
    check_cpu_values(
        op,
        name,
        t,
        lambda x: (x >= 0) & (x <= vocab),
        f"token ids in [0, {vocab}] ({vocab} = padding)",
        f"Right-pad ragged rows with the vocabulary size {vocab}.",
    )


def check_cpu_values(
    op: str, name: str, t: _Tensor, ok: Callable[[_Tensor], _Tensor], expected: str, fix: str | None = None
) -> None:
    """On a CPU tensor ``t``, raise for the first element where the elementwise check ``ok(t)`` is False.
    Tensors on other devices are not checked: reading their values would synchronize with the device."""
    if t.device.type != "cpu" or t.numel() == 0:
        return
    good = ok(t)
    if bool(good.all()):
        return
    where = tuple(int(i) for i in (~good).nonzero()[0])
    at = where[0] if len(where) == 1 else list(where)
    raise fail(op, f"{name} values", expected, f"{t[where].item()!r} at index {at}", fix)


def inference_only(*tensors: Any) -> bool:
    """True when no autograd graph is being recorded through ``tensors`` (grad mode off, or none requires
    grad): under ``torch.compile`` / ``torch.export`` an op whose custom op has no backward formula becomes a
    ``torch.ops.layerzero`` node only for such calls (``layerzero/custom_ops/_ops.py``), and calls that need
    gradients are traced as Python. The ops with formulas (``layerzero/custom_ops/_grad.py``: linear,
    rms_norm, swiglu, rope, attention, embedding) ask it only for the inputs their formula does not
    differentiate."""
    if not torch.is_grad_enabled():
        return True
    return not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
