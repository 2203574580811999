"""Capture-time keys, RNG state around the capture-time warm-up run (used by ``Runtime.prepare_capture``), and the
"select as captured" switch of :func:`layerzero.capture_selection`."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from .context import SelectionContext

__all__ = ["AS_CAPTURED", "capture_key", "capturing_now", "rng_kept"]

AS_CAPTURED: ContextVar[bool] = ContextVar("layerzero_as_captured", default=False)
"""True inside :func:`layerzero.capture_selection`: CUDA calls take the keys, hence the kernels, they would get
while a CUDA graph is captured, without capturing (read by ``ops._common.stream_capturing``)."""


def capturing_now() -> bool:
    """Whether a CUDA graph is really being captured on the current stream (not just selected as captured)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capture_key(key: Hashable) -> Hashable | None:
    """The cache key a call with ``key`` gets while a CUDA graph is being captured: the same key with its
    ``capture`` field True. Every op's key is a ``NamedTuple`` with that field (``layerzero.ops``); None for
    any other key."""
    fields = getattr(key, "_fields", None)
    if fields is None or "capture" not in fields:
        return None
    i = fields.index("capture")
    # the constructor, not _replace: TorchDynamo mis-traces NamedTuple._make/tuple.__new__ (a short tuple)
    return type(key)(*key[:i], True, *key[i + 1:])  # type: ignore[index]


@contextlib.contextmanager
def rng_kept(args: tuple[Any, ...], ctx: SelectionContext) -> Iterator[None]:
    """Restore the state of every ``torch.Generator`` in ``args`` and of the CUDA device's default generator."""
    gens = [a for a in args if isinstance(a, torch.Generator)]
    states = [g.get_state() for g in gens]
    index = ctx.device.index
    default = torch.cuda.get_rng_state(index) if index is not None and torch.cuda.is_available() else None
    try:
        yield
    finally:
        for g, st in zip(gens, states, strict=True):
            g.set_state(st)
        if default is not None:
            torch.cuda.set_rng_state(default, index)
