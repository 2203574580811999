"""FlashInfer plan cache and the paged-KV metadata conversion (block tables -> CSR).

FlashInfer splits attention into ``wrapper.plan(metadata...)`` (reads the batch's lengths on the host — a
device sync — builds a work partition and copies it into the wrapper's int workspace) and ``wrapper.run(q,
kv)`` (launches the kernels). A serving step plans once and runs once per layer, so :class:`PlanCache` keeps
the last few planned wrappers, keyed by everything the plan depends on; the first layer of a step misses and
plans, the other layers hit. See docs/paged_attention.md ("FlashInfer plan cache").

Keys hold the identity of the metadata tensors as :func:`tensor_identity`
``(data_ptr, shape, stride, _version)``: an in-place update (``seq_lens += 1``, ``block_tables[i, j] = b``,
``copy_``) bumps ``_version`` and a new tensor has another identity, both re-plan. The cache also keeps weak
references to those tensors and treats a hit whose tensors are not the very objects of the call as a miss: the
caching allocator may hand a new tensor the address, shape and version of a freed one. Writes that bypass
autograd's version counter (a custom CUDA kernel writing into ``seq_lens`` through a raw pointer) are not
seen: call ``.add_(0)`` or pass a new tensor after such writes.

Inference tensors (made under ``torch.inference_mode()``) have no version counter, so an in-place update of
one cannot be seen: a call whose metadata is an inference tensor always re-plans (correct, but one host sync
per call instead of per step), and the first such call logs a warning. Create the metadata under
``torch.no_grad()`` to reuse plans across layers (LayerZero's engine does).
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core.errors import ConfigurationError, expected_got

DEFAULT_CAPACITY = 8
"""Plans kept per backend instance: one per concurrently alive batch layout (decode + prefill, a few
shapes); each holds a FlashInfer wrapper with 8 MiB of device and 8 MiB of pinned host int workspace."""


log = logging.getLogger("layerzero.flashinfer")
_untracked = itertools.count()
_warned_inference = False


def tensor_identity(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """``(data_ptr, shape, stride, _version)`` of ``t`` (None for None): changes when ``t`` is replaced or
    updated in place through torch ops. An inference tensor (no version counter) gets a fresh identity on
    every call, so a plan keyed by it is never reused (see the module docstring)."""
    global _warned_inference
    if t is None:
        return None
    if t.is_inference():
        if not _warned_inference:
            _warned_inference = True
            log.warning(
                "LayerZero flashinfer: paged-attention metadata is an inference tensor (made under "
                "torch.inference_mode()), which has no version counter, so FlashInfer plans are not "
                "reused across calls (one plan and host sync per call). Build block tables / seq_lens "
                "under torch.no_grad() instead to reuse them."
            )
        return (t.data_ptr(), tuple(t.shape), t.stride(), "untracked", next(_untracked))
    return (t.data_ptr(), tuple(t.shape), t.stride(), t._version)


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Counters of a :class:`PlanCache`: ``hits`` (runs that reused a plan), ``misses`` (plans made),
    ``evictions`` (plans dropped by the LRU bound), ``size`` (plans held now), ``capacity``."""

    hits: int
    misses: int
    evictions: int
    size: int
    capacity: int


class _Entry:
    """One planned wrapper. ``key`` becomes None when the entry is evicted (its wrapper may be re-planned
    for another key); ``lock`` is held while the wrapper plans or runs."""

    __slots__ = ("key", "kind", "wrapper", "lock", "refs")

    def __init__(self, key: Hashable, kind: Hashable, wrapper: Any, refs: tuple[Any, ...]) -> None:
        self.key: Hashable | None = key
        self.kind = kind
        self.wrapper = wrapper
        self.lock = threading.Lock()
        self.refs = refs

    def same_tensors(self, tensors: Sequence[torch.Tensor | None]) -> bool:
        """Whether ``tensors`` are the very objects this plan was made for (weak references, so a new tensor
        that reuses a freed one's address and version counter is not mistaken for it). Raises nothing."""
        if len(tensors) != len(self.refs):
            return False
        return all(
            (t is None and r is None) or (r is not None and r() is t)
            for t, r in zip(tensors, self.refs, strict=True)
        )


class PlanCache:
    """A small thread-safe LRU of planned FlashInfer wrappers.

    :meth:`run` finds (or makes and plans) the wrapper for ``key`` and calls ``call(wrapper)`` while holding
    that wrapper's lock, so a concurrent miss cannot re-plan a wrapper another thread is running. An evicted
    wrapper of the same ``kind`` (wrapper class, KV layout, device, ...) is re-planned instead of building a
    new one: constructing a wrapper allocates 8 MiB of pinned host memory (milliseconds), a re-plan does not.

    Args:
        capacity: plans kept (>= 1).

    Raises:
        ConfigurationError: ``capacity`` < 1 (a ``ValueError``; the backend always passes a constant).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ConfigurationError(expected_got("PlanCache capacity", "an int >= 1", capacity))
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    def run(
        self,
        key: Hashable,
        kind: Hashable,
        tensors: Sequence[torch.Tensor | None],
        make: Callable[[], Any],
        plan: Callable[[Any], None],
        call: Callable[[Any], Any],
    ) -> Any:
        """``call(wrapper)`` with a wrapper planned for ``key``.

        Args:
            key: everything the plan depends on (shapes, heads, dtype, scale, causal, metadata identities).
            kind: which wrappers are interchangeable (an evicted one of this kind may be re-planned).
            tensors: the metadata tensors whose identities are in ``key`` (checked by weak reference).
            make: builds a new, unplanned wrapper. plan: plans a wrapper for ``key``. call: runs it.

        Returns:
            What ``call`` returns. Exceptions of ``make``/``plan``/``call`` propagate (a failed plan is not
            cached).
        """
        while True:
            entry = self._entry(key, kind, tensors, make, plan)
            with entry.lock:
                if entry.key == key:
                    return call(entry.wrapper)
            # evicted and re-planned for another key between lookup and lock: look up again

    def _entry(
        self,
        key: Hashable,
        kind: Hashable,
        tensors: Sequence[torch.Tensor | None],
        make: Callable[[], Any],
        plan: Callable[[Any], None],
    ) -> _Entry:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.same_tensors(tensors):
                self._entries.move_to_end(key)
                self._hits += 1
                return entry
            if entry is not None:  # same address/shape/version, different tensor objects: stale
                self._retire(self._entries.pop(key))
            self._misses += 1
            wrapper = None
            if len(self._entries) >= self.capacity:
                _, old = self._entries.popitem(last=False)
                self._evictions += 1
                self._retire(old)
                if old.kind == kind:
                    wrapper = old.wrapper
            if wrapper is None:
                wrapper = make()
            refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
            fresh = _Entry(key, kind, wrapper, refs)
            with fresh.lock:
                plan(wrapper)
            self._entries[key] = fresh
            return fresh

    @staticmethod
    def _retire(entry: _Entry) -> None:
        with entry.lock:  # waits for a run in progress on its wrapper
            entry.key = None

    def stats(self) -> PlanStats:
        """The counters now."""
        with self._lock:
            return PlanStats(self._hits, self._misses, self._evictions, len(self._entries), self.capacity)

    def clear(self) -> None:
        """Drop every plan and reset the counters."""
        with self._lock:
            for entry in self._entries.values():
                self._retire(entry)
            self._entries.clear()
            self._hits = self._misses = self._evictions = 0


def paged_csr(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM-style block tables -> FlashInfer's CSR page table, with torch ops on the tensors' device.

    Args:
        block_tables: ``[B, M]`` int32, sequence s's page j is block ``block_tables[s, j]`` (entries past
            ``ceil(seq_lens[s] / page_size)`` are padding and are not read).
        seq_lens: ``[B]`` int32, KV length of each sequence in tokens (0 allowed: no pages).
        page_size: tokens per block (P).

    Returns:
        ``(kv_indptr [B + 1], kv_indices [nnz pages], kv_last_page_len [B])``, all int32: sequence s uses
        pages ``kv_indices[kv_indptr[s]:kv_indptr[s + 1]]`` and ``kv_last_page_len[s]`` tokens of its last
        page (``(seq_len - 1) % P + 1``, 0 for an empty sequence). The boolean gather of the used entries
        reads the number of pages on the host (a device sync; FlashInfer's ``plan`` syncs anyway).

    >>> bt = torch.tensor([[7, 0], [3, 0], [5, 6], [0, 0]], dtype=torch.int32)
    >>> [t.tolist() for t in paged_csr(bt, torch.tensor([1, 16, 17, 0], dtype=torch.int32), 16)]
    [[0, 1, 2, 4, 4], [7, 3, 5, 6], [1, 16, 1, 0]]
    """
    lens = seq_lens.to(torch.int32)
    pages = (lens + (page_size - 1)) // page_size
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(pages, 0, dtype=torch.int32, out=indptr[1:])
    used = (
        torch.arange(block_tables.shape[1], device=lens.device, dtype=torch.int32)[None, :] < pages[:, None]
    )
    indices = block_tables[used].to(torch.int32)
    last = torch.where(lens > 0, (lens - 1) % page_size + 1, torch.zeros_like(lens))
    return indptr, indices, last
