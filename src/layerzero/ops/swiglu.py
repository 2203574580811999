"""The gates of gated MLPs (Shazeer 2020, "GLU Variants Improve Transformer"): ``lz.swiglu``
(``silu(gate) * up``), ``lz.geglu`` (``gelu(gate) * up``, exact or tanh GELU) and ``lz.reglu``
(``relu(gate) * up``). One key type and one set of checks; each is its own op (its own kernels)."""

from __future__ import annotations

from typing import Any, NamedTuple

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
    check_same,
    check_tensor,
    deterministic_enabled,
    device_spec,
    exact_device,
    fail,
    inference_only,
    is_grad_enabled,
    scope_layers,
    scope_token_of,
    stream_capturing,
)

OP = "swiglu"


class SwigluKey(NamedTuple):
    """The selection-cache key of one ``lz.swiglu`` / ``lz.geglu`` / ``lz.reglu`` call (``op`` says which;
    ``hidden_size`` holds the intermediate size I); ``capture``/``scope`` close every op's key (see
    ``ops.attention.AttentionKey``)."""

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
        return (
            gate.dtype in FLOAT_DTYPES
            and len(shape) >= 1
            and shape[-1] > 0
            and up.shape == shape
            and up.dtype == gate.dtype
            and up.device == gate.device
        )
    except AttributeError:
        return False


def prepare(gate: torch.Tensor, up: torch.Tensor) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.swiglu`` inputs; return (cache key, canonical kernel args ``(gate, up)``).

    Raises:
        InvalidInputError: see :func:`swiglu`.
    """
    return _prepare(OP, gate, up)


def _prepare(op: str, gate: Any, up: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    if not _fast_ok(gate, up):
        _validate(op, gate, up)
    # inlined flags() (like norms.prepare_rms): the stride walk is skipped for contiguous tensors (~1 us a
    # call)
    grad = is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    contiguous = gate.is_contiguous() and up.is_contiguous()
    stride = contiguous or (gate.stride(-1) == 1 and up.stride(-1) == 1)
    layers = scope_layers()
    # the NamedTuple's own constructor: TorchDynamo mis-traces tuple.__new__(SwigluKey, ...) under
    # torch.compile
    key = SwigluKey(
        op,
        gate.device,
        gate.dtype,
        gate.shape[-1],
        stride,
        contiguous,
        grad,
        deterministic_enabled(),
        gate.is_cuda and stream_capturing(),
        scope_token_of(layers) if layers else (),
    )
    return key, (gate, up)


def _validate(op: str, gate: Any, up: Any) -> None:
    """The slow path: raise the typed error that says what is wrong (only reached when the fast check
    failed)."""
    check_tensor(op, "gate", gate)
    check_tensor(op, "up", up)
    if gate.dim() == 0:
        raise fail(op, "gate rank", ">= 1 dims ([..., I])", "a 0-dim tensor")
    check_same(op, "gate", gate, "up", up)
    if up.shape != gate.shape:
        raise fail(
            op,
            "up shape",
            f"gate's shape {list(gate.shape)}",
            list(up.shape),
            "Pass the two halves of one gate_up projection, e.g. gate, up = gate_up.chunk(2, -1).",
        )
    if gate.shape[-1] == 0:
        raise fail(op, "intermediate size (gate.shape[-1])", ">= 1", 0)


def context(key: SwigluKey) -> SelectionContext:
    """The :class:`SelectionContext` of a swiglu / geglu / reglu cache key (``hidden_size`` holds the
    intermediate size I)."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        hidden_size=key.hidden_size,
        stride_last_1=key.stride_last_1,
        contiguous=key.contiguous,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


SPEC = OperationSpec(OP, "SwiGLU gate of a gated MLP: silu(gate) * up", ("gate", "up"), "reference.swiglu")
GEGLU_SPEC = OperationSpec(
    "geglu",
    "GeGLU gate of a gated MLP: gelu(gate) * up (exact or tanh GELU)",
    ("gate", "up"),
    "reference.geglu",
)
REGLU_SPEC = OperationSpec(
    "reglu", "ReGLU gate of a gated MLP: relu(gate) * up", ("gate", "up"), "reference.reglu"
)
_APPROXIMATE = ("none", "tanh")


def prepare_geglu(
    gate: torch.Tensor, up: torch.Tensor, *, approximate: str = "none"
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.geglu`` inputs; return (cache key, canonical kernel args ``(gate, up, approximate)``).

    Raises:
        InvalidInputError: see :func:`geglu`.
    """
    if approximate.__class__ is not str or approximate not in _APPROXIMATE:
        raise fail(
            "geglu",
            "approximate",
            "'none' (exact erf GELU, HF 'gelu') or 'tanh' (HF 'gelu_pytorch_tanh')",
            repr(approximate),
            "torch.nn.functional.gelu names them the same way.",
        )
    key, (g, u) = _prepare("geglu", gate, up)
    return key, (g, u, approximate)


def prepare_reglu(gate: torch.Tensor, up: torch.Tensor) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.reglu`` inputs; return (cache key, canonical kernel args ``(gate, up)``).

    Raises:
        InvalidInputError: see :func:`reglu`.
    """
    return _prepare("reglu", gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer"): ``out = silu(gate) * up`` with
    ``silu(g) = g * sigmoid(g)``; the middle of Llama's MLP ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    Shapes: gate ``[..., I]`` (I = intermediate size, >= 1), up like gate; out like gate, a new tensor. dtype:
    float32/float64/float16/bfloat16 (gate and up equal); out in that dtype. Numerics follow Hugging Face
    ``LlamaMLP`` (``ACT2FN["silu"](gate) * up``): silu computed in float32 (float64 for float64) and rounded
    to the input dtype, then multiplied by up with one more rounding; every kernel keeps that order (results
    may differ from HF only by float32 ``exp``/``sigmoid`` implementation differences, within one rounding
    step).

    Raises:
        InvalidInputError: a non-tensor or non-float input, a 0-dim gate, up's shape/dtype/device differing
            from gate's, or an empty last dim (I = 0).

    >>> import torch, layerzero as lz
    >>> lz.swiglu(torch.zeros(2, 8), torch.ones(2, 8)).abs().max().item()
    0.0
    """
    if (
        is_dynamo_compiling() or is_exporting()
    ):  # torch.compile, torch.export: one custom-op node (layerzero/custom_ops/_ops.py)
        return traced("swiglu")(gate, up)
    hot_key = _exact_key(gate, up)
    if hot_key is not None:
        if OBSERVERS.none:  # Runtime.run_hot inlined (core/observers.py says when that is allowed and why)
            plan = RUNTIME.cache.hot.get(hot_key)
            if plan is not None:
                try:
                    return plan.call(gate, up)
                except Exception as exc:  # noqa: BLE001 - recorded, then retried or re-raised as run_hot does
                    return RUNTIME.hot_failure(plan, exc, (gate, up))
        else:
            out = RUNTIME.run_hot(hot_key, (gate, up))
            if out is not MISS:
                return out
    key, args = prepare(gate, up)
    return RUNTIME.run(key, context, args, hot_key)


_TENSOR = torch.Tensor


def _exact_key(gate: Any, up: Any) -> tuple[Any, ...] | None:
    """The exact key of an ``lz.swiglu`` call (``Runtime.run_hot``, as ``lz.linear``'s): both tensors' dtypes,
    shapes and strides, the device as -1 (CPU) or the CUDA index, the per-call flags. Only calls that passed
    every check of :func:`prepare` file it (``Runtime.run``), and every fact those checks read is in it, so a
    hit skips them. None (the full path) for anything but two plain tensors on one CPU or CUDA device."""
    if gate.__class__ is not _TENSOR or up.__class__ is not _TENSOR:
        return None
    dev = exact_device(gate, up)
    if dev is None:
        return None
    layers = scope_layers()
    return (
        OP,
        dev,
        gate.dtype,
        up.dtype,
        gate.shape,
        gate.stride(),
        up.shape,
        up.stride(),
        is_grad_enabled() and (gate.requires_grad or up.requires_grad),
        deterministic_enabled(),
        dev >= 0 and stream_capturing(),
        scope_token_of(layers) if layers else (),
    )


def geglu(gate: torch.Tensor, up: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    """GeGLU activation (Shazeer 2020, "GLU Variants Improve Transformer"): ``out = gelu(gate) * up``, the
    middle of a gated MLP with a GELU gate (Gemma: ``approximate="tanh"``, Hugging Face ``gelu_pytorch_tanh``;
    T5 v1.1 / mT5: ``"none"``, HF ``gelu``/``gelu_new`` family). ``approximate``: ``"none"`` (exact, erf) or
    ``"tanh"``, as ``torch.nn.functional.gelu`` names them.

    Shapes: gate ``[..., I]`` (I = intermediate size, >= 1), up like gate; out like gate, a new tensor.
    dtype: float32/float64/float16/bfloat16 (gate and up equal); out in that dtype; rounding as :func:`swiglu`
    (the activation in float32, one rounding to the input dtype, then the product with one more rounding).

    Raises:
        InvalidInputError: what :func:`swiglu` raises, and ``approximate`` not ``"none"``/``"tanh"``.

    >>> import torch, layerzero as lz
    >>> lz.geglu(torch.zeros(2, 8), torch.ones(2, 8)).abs().max().item()
    0.0
    """
    if (is_dynamo_compiling() or is_exporting()) and inference_only(gate, up):
        return traced("geglu")(gate, up, approximate)
    key, args = prepare_geglu(gate, up, approximate=approximate)
    return RUNTIME.run(key, context, args)


def reglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """ReGLU activation (Shazeer 2020): ``out = relu(gate) * up``.

    Shapes: gate ``[..., I]`` (I >= 1), up like gate; out like gate, a new tensor, in the input dtype
    (float32/float64/float16/bfloat16); rounding as :func:`swiglu`.

    Raises:
        InvalidInputError: what :func:`swiglu` raises.

    >>> import torch, layerzero as lz
    >>> lz.reglu(torch.tensor([-1.0, 2.0]), torch.tensor([3.0, 3.0]))
    tensor([0., 6.])
    """
    if (is_dynamo_compiling() or is_exporting()) and inference_only(gate, up):
        return traced("reglu")(gate, up)
    key, args = prepare_reglu(gate, up)
    return RUNTIME.run(key, context, args)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(SPEC, swiglu, prepare, context, custom_ops=("swiglu",)),
    OpDef(
        GEGLU_SPEC,
        geglu,
        prepare_geglu,
        context,
        kernel_args=("gate", "up", "approximate"),
        custom_ops=("geglu",),
    ),
    OpDef(REGLU_SPEC, reglu, prepare_reglu, context, custom_ops=("reglu",)),
)
