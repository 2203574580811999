"""``lz.swiglu``: the SwiGLU gate of a gated MLP, ``silu(gate) * up``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec

from ._common import (
    FLOAT_DTYPES,
    check_same,
    check_tensor,
    deterministic_enabled,
    device_spec,
    fail,
    is_grad_enabled,
    scope_layers,
    scope_token_of,
    stream_capturing,
)

OP = "swiglu"


class SwigluKey(NamedTuple):
    """The selection-cache key of one ``lz.swiglu`` call (``hidden_size`` holds the intermediate size I);
    ``capture``/``scope`` close every op's key (see ``ops.attention.AttentionKey``)."""

    op: str
    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    stride_last_1: bool
    contiguous: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]




def _fast_ok(gate: Any, up: Any) -> bool:
    """The common case in a few attribute reads: two float tensors of one shape, dtype and device, I >= 1."""
    try:
        shape = gate.shape
        return (gate.dtype in FLOAT_DTYPES and len(shape) >= 1 and shape[-1] > 0 and up.shape == shape
                and up.dtype == gate.dtype and up.device == gate.device)
    except AttributeError:
        return False


def prepare(gate: torch.Tensor, up: torch.Tensor) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.swiglu`` inputs; return (cache key, canonical kernel args ``(gate, up)``).

    Raises:
        InvalidInputError: see :func:`swiglu`.
    """
    if not _fast_ok(gate, up):
        _validate(gate, up)
    # inlined flags() (like norms.prepare_rms): the stride walk is skipped for contiguous tensors (~1 us a call)
    grad = is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    contiguous = gate.is_contiguous() and up.is_contiguous()
    stride = contiguous or (gate.stride(-1) == 1 and up.stride(-1) == 1)
    layers = scope_layers()
    # the NamedTuple's own constructor: TorchDynamo mis-traces tuple.__new__(SwigluKey, ...) under torch.compile
    key = SwigluKey(OP, gate.device, gate.dtype, gate.shape[-1], stride, contiguous, grad, deterministic_enabled(),
                    gate.is_cuda and stream_capturing(), scope_token_of(layers) if layers else ())
    return key, (gate, up)


def _validate(gate: Any, up: Any) -> None:
    """The slow path: raise the typed error that says what is wrong (only reached when the fast check failed)."""
    check_tensor(OP, "gate", gate)
    check_tensor(OP, "up", up)
    if gate.dim() == 0:
        raise fail(OP, "gate rank", ">= 1 dims ([..., I])", "a 0-dim tensor")
    check_same(OP, "gate", gate, "up", up)
    if up.shape != gate.shape:
        raise fail(OP, "up shape", f"gate's shape {list(gate.shape)}", list(up.shape),
                   "Pass the two halves of one gate_up projection, e.g. gate, up = gate_up.chunk(2, -1).")
    if gate.shape[-1] == 0:
        raise fail(OP, "intermediate size (gate.shape[-1])", ">= 1", 0)


def context(key: SwigluKey) -> SelectionContext:
    """The :class:`SelectionContext` of a swiglu cache key (``hidden_size`` holds the intermediate size I)."""
    return SelectionContext(op=OP, device=device_spec(key.device), dtype=key.dtype, hidden_size=key.hidden_size,
                            stride_last_1=key.stride_last_1, contiguous=key.contiguous,
                            requires_grad=key.requires_grad, deterministic=key.deterministic,
                            graph_capture=key.capture)


SPEC = OperationSpec(OP, "SwiGLU gate of a gated MLP: silu(gate) * up", ("gate", "up"), "reference.swiglu")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer"): ``out = silu(gate) * up`` with
    ``silu(g) = g * sigmoid(g)``; the middle of Llama's MLP ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    Shapes: gate ``[..., I]`` (I = intermediate size, >= 1), up like gate; out like gate, a new tensor.
    dtype: float32/float64/float16/bfloat16 (gate and up equal); out in that dtype. Numerics follow Hugging Face
    ``LlamaMLP`` (``ACT2FN["silu"](gate) * up``): silu computed in float32 (float64 for float64) and rounded to
    the input dtype, then multiplied by up with one more rounding; every kernel keeps that order (results may
    differ from HF only by float32 ``exp``/``sigmoid`` implementation differences, within one rounding step).

    Raises:
        InvalidInputError: a non-tensor or non-float input, a 0-dim gate, up's shape/dtype/device differing from
            gate's, or an empty last dim (I = 0).

    >>> import torch, layerzero as lz
    >>> lz.swiglu(torch.zeros(2, 8), torch.ones(2, 8)).abs().max().item()
    0.0
    """
    key, args = prepare(gate, up)
    return RUNTIME.run(key, context, args)
