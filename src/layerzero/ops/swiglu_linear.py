"""``lz.swiglu_linear``: SwiGLU then a linear projection in one call, a gated MLP's
``down_proj(silu(gate) * up)``.

Why one op: in a decode step the activation is a kernel of its own whose output only the down projection
reads; fused into that GEMM's prologue (``triton.swiglu_linear``) a decode layer runs one kernel fewer (see
``lz.rms_norm_linear`` for the norms)."""

from __future__ import annotations

from typing import Any

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.dispatch import MISS
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import check_same, check_tensor, fail, inference_only, is_grad_enabled, tensors_exact_key
from .linear import LinearKey
from .linear import context as _linear_context
from .linear import prepare as _linear_prepare

OP = "swiglu_linear"


def prepare(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.swiglu_linear`` inputs (up like gate, then ``lz.linear``'s checks of gate against the
    weight); return (cache key, canonical kernel args ``(gate, up, weight, bias)``).

    Raises:
        InvalidInputError: see :func:`swiglu_linear`.
    """
    check_tensor(OP, "gate", gate)
    check_tensor(OP, "up", up)
    check_same(OP, "gate", gate, "up", up)
    if up.shape != gate.shape:
        raise fail(
            OP,
            "up shape",
            f"gate's shape {list(gate.shape)}",
            list(up.shape),
            "gate and up are the two halves of the gate/up projection: gate_up.chunk(2, dim=-1).",
        )
    key, _ = _linear_prepare(gate, weight, bias, op=OP, x_name="gate")
    key = key._replace(
        stride_last_1=key.stride_last_1 and up.stride(-1) == 1,
        contiguous=key.contiguous and up.is_contiguous(),
        requires_grad=key.requires_grad or (is_grad_enabled() and up.requires_grad),
    )
    return key, (gate, up, weight, bias)


context = _linear_context
"""The :class:`~layerzero.core.context.SelectionContext` of a cache key (``lz.linear``'s: op
``"swiglu_linear"``, ``batch`` rows M, ``hidden_size`` in_features I, ``intermediate_size`` out_features
N)."""

SPEC = OperationSpec(
    OP,
    "SwiGLU then a linear projection (a gated MLP's down projection)",
    ("gate", "up", "weight", "bias"),
    "reference.swiglu_linear",
    key_type=LinearKey,
)


def swiglu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``lz.linear(lz.swiglu(gate, up), weight, bias)`` in one call: SwiGLU (Shazeer 2020) then the
    projection, as a Llama / Qwen MLP's ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` computes it.

    Shapes (M rows = the product of the leading dims, I intermediate size, N out_features): ``gate`` and
    ``up`` ``[..., I]`` (views of one packed ``[..., 2I]`` projection are fine: each needs ``stride(-1) == 1``
    only for the Triton kernel), ``weight`` ``[N, I]``, ``bias`` ``[N]`` or None -> ``[..., N]``, a new tensor
    in gate's dtype. All inputs share one dtype (float32/float64/float16/bfloat16) and device.

    Rounding, every kernel: the activation rounded to gate's dtype as ``lz.swiglu`` returns it (``silu(gate)``
    rounded, then the product rounded: Hugging Face ``LlamaMLP``'s order), then the projection accumulated in
    float32 (float64 for float64) and rounded once: results equal the two-op form's up to accumulation order
    (``torch_native`` is ``F.silu(gate) * up`` then ``F.linear``, bit for bit).

    Kernels: ``triton.swiglu_linear`` (CUDA fp16/bf16, decode rows as ``lz.rms_norm_linear``'s Triton kernel
    takes them, I <= 4096: the activation in the prologue of ``triton.gemv``'s prefetch kernel),
    ``torch_native`` (the default elsewhere), ``reference`` (float32 math, the oracle).

    Raises:
        InvalidInputError: inputs that are not float tensors, up not gate's shape, and everything
            ``lz.linear`` refuses of (gate, weight, bias) (named for this op).
        KernelExecutionError: the kernel failed and no fallback was allowed (lock or strict mode).

    >>> import torch, layerzero as lz
    >>> y = lz.swiglu_linear(torch.tensor([[0.0, 2.0]]), torch.tensor([[5.0, 1.0]]), torch.ones(1, 2))
    >>> round(y.item(), 4)  # silu(0) * 5 + silu(2) * 1 = 2 * sigmoid(2)
    1.7616
    """
    if (is_dynamo_compiling() or is_exporting()) and inference_only(gate, up, weight, bias):
        return traced("swiglu_linear")(gate, up, weight, bias)
    args = (gate, up, weight, bias)
    hot_key = _exact_key(*args)
    if hot_key is not None:
        out = RUNTIME.run_hot(hot_key, args)
        if out is not MISS:
            return out
    key, args = prepare(gate, up, weight, bias)
    return RUNTIME.run(key, context, args, hot_key)


def _exact_key(gate: Any, up: Any, weight: Any, bias: Any) -> tuple[Any, ...] | None:
    """The exact key of a call (``Runtime.run_hot``, as ``lz.linear``'s): every input's dtype, shape and
    strides (None for an absent bias), the device and the per-call flags
    (:func:`~._common.tensors_exact_key`); only calls that passed every check file it. None (the full path)
    for anything but plain tensors on one CPU or CUDA device."""
    return tensors_exact_key(OP, (gate, up, weight, bias))


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        swiglu_linear,
        prepare,
        context,
        kernel_args=("gate", "up", "weight", "bias"),
        custom_ops=("swiglu_linear",),
    ),
)
