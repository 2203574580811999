"""The gated MLP's activation through ``lz.swiglu``."""

from __future__ import annotations

import torch

import layerzero as lz

__all__ = ["silu_and_mul"]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a packed ``[T, 2I]`` projection (gate first, as the engine packs it) ->
    ``[T, I]`` (Shazeer 2020, "GLU variants"); dispatched by :func:`layerzero.swiglu`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return lz.swiglu(gate, up)
