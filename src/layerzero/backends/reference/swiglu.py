"""Reference SwiGLU, GeGLU and ReGLU: the oracles of every swiglu / geglu / reglu kernel.

Plain PyTorch, computed in float32 (float64 when the input is float64), returned in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["geglu", "reglu", "swiglu"]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): ``out = silu(gate) * up``.

    Shapes: gate ``[..., I]`` (I intermediate size), up like gate; out like gate, in gate's dtype.

    Order of operations, written to round exactly where Hugging Face ``LlamaMLP``
    (``ACT2FN["silu"](gate) * up``) rounds::

        c = float64 if gate is float64 else float32
        s = F.silu(gate.to(c)).to(gate.dtype)          # silu in c, one rounding (HF: silu in the input dtype,
                                                       # which PyTorch computes in float32 for half/bfloat16)
        out = (s.to(c) * up.to(c)).to(gate.dtype)      # product in c, one rounding (as a half-precision mul)

    For float32 and float64 inputs this is ``F.silu(gate) * up``; for float16/bfloat16 the result equals HF's
    up to float32 ``exp`` implementation differences (within one rounding step of the input dtype).

    Args:
        gate: gate projection output ``[..., I]``, any float dtype.
        up: up projection output ``[..., I]``, gate's dtype.

    Returns:
        out ``[..., I]`` in gate's dtype (a new tensor).

    Raises:
        Nothing of its own: input validation is the ops layer's job (torch raises on shape mismatch).

    >>> swiglu(torch.tensor([0.0, 1.0]), torch.tensor([5.0, 2.0]))
    tensor([0.0000, 1.4621])
    """
    cdt = torch.float64 if gate.dtype == torch.float64 else torch.float32
    s = F.silu(gate.to(cdt)).to(gate.dtype)
    return (s.to(cdt) * up.to(cdt)).to(gate.dtype)


def _gated(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    cdt = torch.float64 if gate.dtype == torch.float64 else torch.float32
    a = act(gate.to(cdt)).to(gate.dtype)
    return (a.to(cdt) * up.to(cdt)).to(gate.dtype)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU (Shazeer 2020): ``out = gelu(gate) * up``, ``gelu`` exact (erf, ``approximate="none"``) or its
    tanh form (``"tanh"``: HF ``gelu_pytorch_tanh``, Gemma's MLP). Shapes, dtypes and rounding order as
    :func:`swiglu` (the activation in float32/float64, one rounding, the product, one rounding). Raises
    nothing of its own.

    >>> geglu(torch.tensor([0.0, 1.0]), torch.tensor([5.0, 2.0]))
    tensor([0.0000, 1.6827])
    """
    return _gated(lambda g: F.gelu(g, approximate=approximate), gate, up)


def reglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """ReGLU (Shazeer 2020): ``out = relu(gate) * up``; shapes, dtypes and rounding as :func:`swiglu`. Raises
    nothing of its own.

    >>> reglu(torch.tensor([-1.0, 1.5]), torch.tensor([5.0, 2.0]))
    tensor([0., 3.])
    """
    return _gated(F.relu, gate, up)
