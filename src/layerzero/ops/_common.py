"""Shared pieces of the op front-ends: input checks and per-call flags.

Every check raises :class:`InvalidInputError` (a ``ValueError``) with what failed, expected vs got, and how
to fix it. Checks are written to be cheap: they run on every call, cache hit or not.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from layerzero.core import config as _config
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
    ``torch.cuda.is_current_stream_capturing``, without its Python wrapper; only called for CUDA tensors)."""
    return _capturing()


_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


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
        raise fail(op, f"{name}.dtype", "one of float32/float64/float16/bfloat16", t.dtype,
                   f"Cast {name} with {name}.float() or .to(torch.bfloat16).")
    if ndim is not None:
        ok = t.dim() == ndim if isinstance(ndim, int) else t.dim() in ndim
        if not ok:
            raise fail(op, f"{name} rank", f"{ndim} dims", f"{t.dim()} dims (shape {tuple(t.shape)})")


def check_same(op: str, ref_name: str, ref: _Tensor, name: str, t: _Tensor, *, dtype: bool = True) -> None:
    """``t`` is on ``ref``'s device (and has its dtype when ``dtype``)."""
    if t.device != ref.device:
        raise fail(op, f"{name}.device", f"{ref.device} (like {ref_name})", t.device,
                   f"Move it with {name}.to({ref_name}.device).")
    if dtype and t.dtype != ref.dtype:
        raise fail(op, f"{name}.dtype", f"{ref.dtype} (like {ref_name})", t.dtype,
                   f"Cast it with {name}.to({ref_name}.dtype).")


def check_eps(op: str, eps: Any) -> float:
    """``eps`` is a finite number > 0."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise fail(op, "eps", "a finite float > 0", repr(eps))
    return float(eps)


def check_temperature(op: str, temperature: Any) -> float:
    """``temperature`` is a finite number >= 0 (0 = greedy)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(
            temperature) or temperature < 0:
        raise fail(op, "temperature", "a finite float >= 0 (0 means greedy)", repr(temperature))
    return float(temperature)


def flags(t: _Tensor, *tensors: _Tensor | None) -> tuple[bool, bool, bool, bool]:
    """(requires_grad, deterministic, graph_capture, stride_last_1) for a call on ``t`` and ``tensors``."""
    grad = False
    if is_grad_enabled():
        grad = t.requires_grad or any(x is not None and x.requires_grad for x in tensors)
    stride = t.stride(-1) == 1 and all(x is None or x.dim() == 0 or x.stride(-1) == 1 for x in tensors)
    return grad, deterministic_enabled(), t.is_cuda and stream_capturing(), stride
