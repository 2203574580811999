"""The collectives the tensor-parallel model runs, in one place: ``torch.distributed`` on the TP group of a
:class:`~.state.ParallelState` for now (the integrator switches these bodies to ``lz.all_reduce`` /
``lz.all_gather`` when they land; callers do not change). Every function is a no-op (returns its input) when
``state.tp_size == 1``, so a one-rank model never touches ``torch.distributed``."""

from __future__ import annotations

import torch

from .state import ParallelState

__all__ = ["all_gather", "all_reduce"]


def all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The sum of ``x`` over the TP ranks (any shape; same shape, dtype and device on every rank), in place:
    returns ``x`` itself, now holding the sum. One rank: ``x`` unchanged."""
    if state.tp_size == 1:
        return x
    import torch.distributed as dist

    if not x.is_contiguous():
        x = x.contiguous()
    dist.all_reduce(x, group=state.group)
    return x


def all_gather(x: torch.Tensor, dim: int, state: ParallelState) -> torch.Tensor:
    """The TP ranks' ``x`` concatenated along ``dim`` in rank order: ``[..., n, ...]`` per rank (the same
    shape on every rank) -> ``[..., tp_size * n, ...]``, a new tensor. One rank: ``x`` unchanged."""
    if state.tp_size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x, group=state.group)
    return torch.cat(parts, dim=dim)
