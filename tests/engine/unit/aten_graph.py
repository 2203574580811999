"""A CPU stand-in for ``torch.cuda.CUDAGraph`` at the ATen level, so graph logic (static buffers, padding,
what runs inside a graph and what outside) is tested without a GPU.

``capture_begin`` .. ``capture_end`` records every ATen call made meanwhile (a ``TorchDispatchMode``) with
the tensors it read and the ones it returned; ``replay`` runs the recorded calls again in order on the same
tensor objects and writes each result into the tensor the capture returned. Like a CUDA graph, a replay
reads whatever its input tensors hold now, writes the same output tensors, and runs no Python of the model:
host-side decisions taken during capture stay frozen. Unlike one, it keeps every intermediate alive (no
memory pool) and re-runs host ops too (a ``.item()`` is recomputed, and ignored)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Recorder(TorchDispatchMode):
    def __init__(self, calls: list[tuple[Any, tuple, dict, Any]]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


class AtenGraph:
    """See the module docstring; the methods ``PiecewiseGraphs`` uses of ``torch.cuda.CUDAGraph``."""

    replays = 0
    """Replays of all stand-ins so far (class-wide: a test reads how many pieces ran)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple, dict, Any]] = []
        self._mode: _Recorder | None = None
        self._captured = False

    def capture_begin(self, pool: Any = None) -> None:
        self._mode = _Recorder(self.calls)
        self._mode.__enter__()

    def capture_end(self) -> None:
        self._mode.__exit__(None, None, None)
        self._mode = None
        self._captured = True

    def pool(self) -> object:
        if not self._captured:  # as torch.cuda.CUDAGraph.pool
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return ("aten-graph-pool",)

    def replay(self) -> None:
        AtenGraph.replays += 1
        for func, args, kwargs, out in self.calls:
            new = func(*args, **kwargs)
            for old, fresh in zip(tree_leaves(out), tree_leaves(new), strict=True):
                if isinstance(old, torch.Tensor) and old.data_ptr() != fresh.data_ptr():
                    old.copy_(fresh)
