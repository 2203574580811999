"""Distributed consistency: every rank runs rank 0's kernel for the same inputs (TP-invariant mode).

Reached as ``lz.distributed`` (imported on first attribute access, not by ``import layerzero``). Built on
``layerzero.core``, which never imports it: it installs a coordinator on the runtime
(:attr:`~layerzero.core.dispatch.Runtime.coordinator`) that only cache misses consult.

>>> import torch.distributed as dist, layerzero as lz
>>> dist.init_process_group("nccl")  # doctest: +SKIP
>>> with lz.distributed.sync_selection():  # doctest: +SKIP
...     out = model(batch)  # every rank runs rank 0's kernel for each op call

See ``docs/distributed.md`` for the SPMD requirement, CUDA graphs and the errors.
"""

from __future__ import annotations

from ..core.errors import DistributedMismatchError, DistributedSelectionError
from .fingerprint import fingerprint
from .symm import disable_symm_mem, enable_symm_mem
from .sync import SelectionSync, current, sync_selection, unsync

__all__ = [
    "DistributedMismatchError",
    "DistributedSelectionError",
    "SelectionSync",
    "current",
    "disable_symm_mem",
    "enable_symm_mem",
    "fingerprint",
    "sync_selection",
    "unsync",
]
