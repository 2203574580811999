"""The collectives the tensor-parallel model runs, in one place: LayerZero's collective ops
(``lz.all_reduce`` / ``lz.all_gather``: the kernel for each message size, dtype and world size chosen like
any op's, with reasons; ``docs/distributed.md``, "Collectives") on the TP group of a
:class:`~.state.ParallelState`. Every function is a no-op (returns its input) when ``state.tp_size == 1``,
so a one-rank model runs no collective and pays no call."""

from __future__ import annotations

import torch

import layerzero as lz

from .state import ParallelState

__all__ = ["all_gather", "all_reduce"]


def all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The sum of ``x`` over the TP ranks (any shape; the same shape, dtype and device on every rank), a new
    tensor (``lz.all_reduce`` never writes ``x``). One rank: ``x`` itself."""
    if state.tp_size == 1:
        return x
    return lz.all_reduce(x, group=state.group)


def all_gather(x: torch.Tensor, dim: int, state: ParallelState) -> torch.Tensor:
    """The TP ranks' ``x`` concatenated along ``dim`` in rank order: ``[..., n, ...]`` per rank (the same
    shape on every rank) -> ``[..., tp_size * n, ...]``, a new tensor. One rank: ``x`` itself."""
    if state.tp_size == 1:
        return x
    return lz.all_gather(x, dim=dim, group=state.group)
