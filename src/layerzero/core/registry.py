"""Registries of operations, kernels and backends.

A small generic :class:`Registry` rejects duplicates and names what is known on a miss (mini-sglang's
``utils/registry.py`` pattern). :class:`KernelRegistry` keeps kernels by id and by op, plus the backends
with their availability; every change bumps :attr:`KernelRegistry.version` so cached selections are
invalidated.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from .errors import ConfigurationError, UnknownKernelError, UnknownOperationError, did_you_mean
from .specs import BackendSpec, KernelSpec, OperationSpec

T = TypeVar("T")
_B = TypeVar("_B")

MAX_BOUND = 4096
"""Entries :meth:`KernelRegistry.bound` keeps before it starts over (one per kernel x context in use)."""


class Registry(Generic[T]):
    """A name -> item map that refuses duplicates and explains misses.

    Raises ``ConfigurationError`` on a duplicate name; ``get`` raises ``miss_error`` (a
    ``ConfigurationError`` subclass) listing the known names and a close match.
    """

    def __init__(self, kind: str, miss_error: type[ConfigurationError] = ConfigurationError) -> None:
        self._kind = kind
        self._miss_error = miss_error
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T, *, replace: bool = False) -> None:
        """Register ``item`` under ``name``; ``replace=True`` overwrites an existing entry."""
        if not replace and name in self._items:
            raise ConfigurationError(
                f"{self._kind} {name!r} is already registered. Use a new id, or pass replace=True to "
                "override it."
            )
        self._items[name] = item

    def get(self, name: str) -> T:
        """The item called ``name``; raises the registry's miss error when unknown."""
        try:
            return self._items[name]
        except KeyError:
            raise self._miss_error(
                f"unknown {self._kind} {name!r}.{did_you_mean(name, self._items)}"
            ) from None

    def remove(self, name: str) -> T:
        """Unregister and return ``name``."""
        item = self.get(name)
        del self._items[name]
        return item

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> list[T]:
        """A snapshot of the registered items, in registration order."""
        return list(self._items.values())


class KernelRegistry:
    """Operations, kernels (by id and by op) and backends. Thread-safe for writers; readers see snapshots.

    ``on_change`` is called after every mutation (dispatch uses it to invalidate the selection cache).
    """

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self.ops: Registry[OperationSpec] = Registry("operation", UnknownOperationError)
        self.kernels: Registry[KernelSpec] = Registry("kernel", UnknownKernelError)
        self.backends: Registry[BackendSpec] = Registry("backend", ConfigurationError)
        self._by_op: dict[str, tuple[KernelSpec, ...]] = {}
        self._lock = threading.RLock()
        self._on_change = on_change
        self.version = 0
        self._bound: dict[tuple[str, Any], Any] = {}

    def _changed(self) -> None:
        self.version += 1
        self._bound = {}
        if self._on_change is not None:
            self._on_change()

    def bound(self, spec: KernelSpec, ctx: Any, make: Callable[[], _B]) -> _B:
        """``make()``'s result for ``(spec, ctx)``, made once and then shared: the callable dispatch runs for
        a kernel on a context (specialized and layout-wrapped) is one object however the kernel was chosen
        (default, ``lz.lock``, ``lz.prefer``, ``lz.tune``), so state it keeps (a plan cache, a compiled
        variant) is built once and every route costs the same from its first call. Cleared on every registry
        change; bounded (cleared when it holds :data:`MAX_BOUND` entries)."""
        key = (spec.kernel_id, ctx)
        memo = self._bound
        hit = memo.get(key)
        if hit is not None and hit[0] is spec:
            return hit[1]
        value = make()
        if len(memo) >= MAX_BOUND:
            memo.clear()
        memo[key] = (spec, value)
        return value

    def add_op(self, spec: OperationSpec) -> None:
        """Register an operation."""
        with self._lock:
            self.ops.add(spec.op_id, spec)
            self._by_op.setdefault(spec.op_id, ())
            self._changed()

    def add_backend(self, spec: BackendSpec, *, replace: bool = False) -> None:
        """Register (or with ``replace=True`` update) a backend and its availability."""
        with self._lock:
            self.backends.add(spec.backend_id, spec, replace=replace)
            self._changed()

    def add_kernel(self, spec: KernelSpec, *, replace: bool = False) -> None:
        """Register a kernel for an already registered op and backend.

        Raises ``UnknownOperationError`` / ``ConfigurationError`` when its op or backend is unknown, and
        ``ConfigurationError`` on a duplicate id unless ``replace=True``.
        """
        with self._lock:
            self.ops.get(spec.op)
            if spec.backend not in self.backends:
                raise ConfigurationError(
                    f"kernel {spec.kernel_id!r} names backend {spec.backend!r}, which is not registered. "
                    "Register the BackendSpec first."
                )
            if replace and spec.kernel_id in self.kernels:
                self._drop(spec.kernel_id)
            self.kernels.add(spec.kernel_id, spec)
            self._by_op[spec.op] = (*self._by_op[spec.op], spec)
            self._changed()

    def remove_kernel(self, kernel_id: str) -> KernelSpec:
        """Unregister a kernel and return its spec."""
        with self._lock:
            spec = self._drop(kernel_id)
            self._changed()
            return spec

    def _drop(self, kernel_id: str) -> KernelSpec:
        spec = self.kernels.remove(kernel_id)
        self._by_op[spec.op] = tuple(s for s in self._by_op[spec.op] if s.kernel_id != kernel_id)
        return spec

    def for_op(self, op: str) -> tuple[KernelSpec, ...]:
        """All kernels of ``op`` in registration order (raises ``UnknownOperationError`` for unknown ops)."""
        try:
            return self._by_op[op]
        except KeyError:
            self.ops.get(op)
            raise

    def kernel(self, kernel_id: str, op: str | None = None) -> KernelSpec:
        """The spec of ``kernel_id``; with ``op``, also checks the kernel belongs to that op."""
        spec = self.kernels.get(kernel_id)
        if op is not None and spec.op != op:
            ids = [s.kernel_id for s in self.for_op(op)]
            raise UnknownKernelError(
                f"kernel {kernel_id!r} implements op {spec.op!r}, not {op!r}. Kernels of {op!r}: {ids}."
            )
        return spec

    def backend(self, backend_id: str) -> BackendSpec:
        """The spec of ``backend_id``."""
        return self.backends.get(backend_id)
