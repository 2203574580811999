"""The selection cache: key -> ExecutionPlan, on the dispatch hot path (a hit takes no lock).

* **Shards**: ``num_shards`` (power of two, default 256 or fewer), ``shard = hash(key) & (num_shards - 1)``;
  each is a ``dict``, a ``threading.Lock`` taken only by writers, and a ``version`` bumped on every write.
  Readers never lock: they see the old or the new entry object (MVCC in the small).
* **Generations**: each entry carries the generation it was computed under; :meth:`SelectionCache.invalidate`
  bumps the generation (O(1) invalidation of everything). An entry is served only while
  ``entry.generation == cache.generation``; stale entries are dropped lazily (on a read miss when the shard
  lock is free, and on insertion into a full shard).
* **Single flight** (Go ``singleflight``): on a miss one thread computes, concurrent callers for the same
  key and generation wait for its value or exception. The generation is captured before ``compute()`` and
  the value stored under it, so a value computed across an invalidation is never served afterwards.
* **Bounds**: ``max_entries`` is hard; shard ``i`` holds ``max_entries // num_shards + (i < max_entries %
  num_shards)`` entries at most (<= ``ceil(max_entries / num_shards)``, summing to ``max_entries``). A full
  shard first drops stale/expired entries, then evicts its least recently used one. Optional TTL, counted
  from the write.

Hit/miss counts and LRU recency are unlocked ``int`` bumps: exact single-threaded, approximate (lost
increments, ties) under concurrent readers. Deliberate: a lock on the hit path would cost more than the
lookup. Cost: ``benchmarks/bench_cache.py`` (about 0.2 us per hit on CPython 3.11).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, NoReturn, TypeVar

from layerzero.core.errors import (
    ConfigurationError,
    InvalidInputError,
    SelectionTimeoutError,
    expected_got,
)

__all__ = ["DEFAULT_SHARDS", "CacheStats", "SelectionCache"]

_log = logging.getLogger("layerzero.core.cache")

V = TypeVar("V")

_NUMBER = (int, float)
DEFAULT_SHARDS = 256


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a :class:`SelectionCache`'s counters.

    Attributes:
        hits: ``get()`` calls (also the fast path of ``get_or_compute``) that returned a value.
            Approximate under concurrent readers (unlocked ``+=``).
        misses: lookups that found nothing usable (absent, stale generation, or expired).
            Approximate under concurrent readers.
        evictions: live entries removed to make room in a full shard (LRU). Dropping stale or
            expired entries is not counted.
        invalidations: calls to :meth:`SelectionCache.invalidate`.
        size: live entries (current generation, not expired) at snapshot time.
        generation: the cache generation at snapshot time (starts at 0, +1 per invalidation).
    """

    hits: int
    misses: int
    evictions: int
    invalidations: int
    size: int
    generation: int


@dataclass(slots=True, eq=False)
class _Entry:
    """One cached value with its generation tag, expiry time (clock units, s) and LRU tick."""

    value: object
    generation: int
    expires_at: float | None
    last_used: int


@dataclass(slots=True, eq=False)
class _Flight:
    """An in-flight computation of one key: waiters block on ``done`` and read ``value``/``error``."""

    generation: int
    owner: int  # thread ident of the computing thread
    done: threading.Event = field(default_factory=threading.Event)
    value: object = None
    error: BaseException | None = None


@dataclass(slots=True, eq=False)
class _Shard:
    """Entries of one shard, the writers' lock, the write version, in-flight computations, capacity."""

    capacity: int
    entries: dict[Hashable, _Entry] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0
    flights: dict[Hashable, _Flight] = field(default_factory=dict)


def _fail(cls: type[Exception], what: str, expected: object, got: object, fix: str) -> NoReturn:
    raise cls(expected_got(what, expected, got, fix))


def _validate_config(max_entries: int, ttl_s: float | None, num_shards: int | None, clock: object) -> None:
    """Raise :class:`ConfigurationError` unless the constructor arguments are usable."""
    err = ConfigurationError
    for name, val in (("max_entries", max_entries), ("num_shards", num_shards)):
        if type(val) is not int or val <= 0:
            _fail(err, f"SelectionCache {name}", "a positive int", repr(val), f"Pass {name}=<int >= 1>.")
    if num_shards & (num_shards - 1):
        lo, hi = 1 << (num_shards.bit_length() - 1), 1 << num_shards.bit_length()
        _fail(err, "SelectionCache num_shards", "a power of two", num_shards, f"Pass {lo} or {hi}.")
    if num_shards > max_entries:
        fix = f"Pass num_shards={1 << (max_entries.bit_length() - 1)} or raise max_entries."
        _fail(err, "SelectionCache num_shards", f"<= max_entries={max_entries}", num_shards, fix)
    if ttl_s is not None and not (type(ttl_s) in _NUMBER and 0 < ttl_s < math.inf):  # type: ignore[operator]
        _fail(err, "SelectionCache ttl_s", "None or a finite number > 0 (s)", repr(ttl_s), "Pass ttl_s=None.")
    if not callable(clock):
        _fail(err, "SelectionCache clock", "a callable returning s", repr(clock), "Pass time.monotonic.")


def _check_timeout(timeout_s: object) -> None:
    if not (type(timeout_s) in _NUMBER and 0 < timeout_s <= threading.TIMEOUT_MAX):  # type: ignore[operator]
        expected = f"None or a number in (0, {threading.TIMEOUT_MAX}] s"
        fix = "Pass timeout_s=None to wait without limit, or a positive number of seconds."
        _fail(InvalidInputError, "get_or_compute timeout_s", expected, repr(timeout_s), fix)


class SelectionCache(Generic[V]):
    """Sharded, generation-tagged LRU(+TTL) cache of selection results with single-flight misses.

    Keys are hashable tuples built by the caller (ops/dispatch); they must contain everything that can
    change the answer. Values are opaque (``ExecutionPlan`` objects); ``None`` is not a valid value
    because :meth:`get` returns ``None`` for a miss.

    Args:
        max_entries: hard bound on stored entries (count, not bytes); >= ``num_shards``.
        ttl_s: time to live of an entry in seconds of ``clock``, counted from its write (a hit does not
            refresh it); ``None`` (default) disables expiry and every clock call on the hit path.
        num_shards: number of shards, a power of two <= ``max_entries``. Default ``None``: 256
            (:data:`DEFAULT_SHARDS`), or the largest power of two <= ``max_entries`` for a smaller cache.
        clock: monotonic clock returning seconds; injectable for tests. Read only when ``ttl_s`` is set.

    Raises:
        ConfigurationError: a size is not a positive int, ``num_shards`` is not a power of two or exceeds
            ``max_entries``, ``ttl_s`` is not a positive finite number, or ``clock`` is not callable.

    Thread safety: every method may be called from any thread. Reads are lock-free; writes take one
    shard lock; :meth:`invalidate` takes a small generation lock.

    >>> cache: SelectionCache[str] = SelectionCache(max_entries=64, num_shards=4)
    >>> cache.get(("rms_norm", "float16", 4096))
    >>> cache.get_or_compute(("rms_norm", "float16", 4096), lambda: "plan")
    'plan'
    >>> _ = cache.invalidate(); cache.get(("rms_norm", "float16", 4096)) is None
    True
    """

    __slots__ = (
        "_shards", "_maps", "_mask", "_generation", "_gen_lock", "_tick", "_ttl", "_clock",
        "_stores", "_misses", "_evictions", "_invalidations", "_max_entries", "hot",
    )  # fmt: skip

    def __init__(
        self,
        max_entries: int = 4096,
        ttl_s: float | None = None,
        num_shards: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_shards is None and type(max_entries) is int and max_entries > 0:
            num_shards = min(DEFAULT_SHARDS, 1 << (max_entries.bit_length() - 1))
        _validate_config(max_entries, ttl_s, num_shards, clock)
        base, extra = divmod(max_entries, num_shards)
        self._shards = tuple(_Shard(base + (i < extra)) for i in range(num_shards))
        self._maps = tuple(s.entries for s in self._shards)
        self._mask = num_shards - 1
        self._max_entries = max_entries
        self._generation = 0
        self._gen_lock = threading.Lock()
        self._tick = 0  # LRU clock, +1 per hit and per store (unlocked: ties possible under races)
        self._stores = 0
        self._ttl: float | None = None if ttl_s is None else float(ttl_s)
        self._clock = clock
        self._misses = 0
        self._evictions = 0
        self._invalidations = 0
        self.hot: dict[Hashable, V] = {}
        """A plain dict in front of the shards, for the dispatch hot path (``Runtime.run``): key -> value of
        the current generation, filled by the caller after a :meth:`get` hit (under the hit's key and, for an
        op with an exact key, that one too: ``Runtime.run_hot``), replaced by a new empty dict on every
        :meth:`invalidate` / :meth:`clear` (so a reader that holds the old dict writes into a discarded one).
        Not LRU-tracked: at most ``max_entries`` keys, then it starts over. Unused with a TTL."""

    # ------------------------------------------------------------------ hot path

    def get(self, key: Hashable) -> V | None:
        """Return the value cached for ``key`` under the current generation, or ``None`` (lock-free).

        A hit needs ``entry.generation == self.generation`` and, only when TTL is on,
        ``clock() < entry.expires_at``. A hit refreshes the entry's LRU recency.

        Raises:
            InvalidInputError: ``key`` is not hashable.
        """
        try:
            entry = self._maps[hash(key) & self._mask].get(key)
        except TypeError:
            raise InvalidInputError(self._unhashable(key)) from None
        if (
            entry is not None
            and entry.generation == self._generation
            and (entry.expires_at is None or self._clock() < entry.expires_at)
        ):
            # One counter is both the LRU clock and the hit count (hits = ticks - stores): one
            # unlocked int bump instead of two, or of an itertools.count call.
            entry.last_used = self._tick = self._tick + 1
            return entry.value  # type: ignore[return-value]
        self._misses += 1
        if entry is not None:
            self._drop_if_unchanged(key, entry)
        return None

    def get_or_compute(self, key: Hashable, compute: Callable[[], V], *, timeout_s: float | None = 30.0) -> V:
        """Return the cached value for ``key``, computing it at most once per generation on a miss.

        Single flight: the first thread that misses ``key`` runs ``compute()`` (outside any lock);
        threads missing the same key under the same generation meanwhile wait for that result and get
        the same value, or the same exception re-raised. Exceptions are not cached. The generation is
        captured before ``compute()`` runs; if :meth:`invalidate` happens during it, the value is still
        returned to this call and its waiters but is not stored, and callers arriving after the
        invalidation start a fresh computation instead of joining the old one.

        Args:
            key: hashable tuple (see class docstring).
            compute: zero-argument callable returning the value (not ``None``).
            timeout_s: how long a *waiting* thread waits for another thread's compute, in seconds;
                ``None`` waits without limit. The computing thread itself is never interrupted.
                Checked on a miss only (every key's first call is one), to keep hits cheap.

        Raises:
            InvalidInputError: ``key`` is unhashable, ``timeout_s`` is not ``None`` or a positive number,
                ``compute`` is not callable, or ``compute()`` returned ``None``.
            SelectionTimeoutError: waited longer than ``timeout_s`` for another thread, or ``compute()``
                re-entered ``get_or_compute`` for the same key in the same thread (it would wait on
                itself forever).
            Exception: whatever ``compute()`` raised (in the computing thread and every waiter).
        """
        try:  # the hit path of get(), inlined: a method call would add ~100 ns
            shard_map = self._maps[hash(key) & self._mask]
        except TypeError:
            raise InvalidInputError(self._unhashable(key)) from None
        entry = shard_map.get(key)
        if (
            entry is not None
            and entry.generation == self._generation
            and (entry.expires_at is None or self._clock() < entry.expires_at)
        ):
            entry.last_used = self._tick = self._tick + 1
            return entry.value  # type: ignore[return-value]
        self._misses += 1
        if timeout_s is not None:
            _check_timeout(timeout_s)
        if not callable(compute):
            _fail(InvalidInputError, "get_or_compute compute", "a callable", repr(compute), "Pass one.")
        shard = self._shards[hash(key) & self._mask]
        me = threading.get_ident()
        with shard.lock:
            gen = self._generation
            entry = shard.entries.get(key)
            if entry is not None and self._live(entry, gen):
                return entry.value  # type: ignore[return-value]  # stored by another thread meanwhile
            flight = shard.flights.get(key)
            leader = flight is None or flight.generation != gen
            if leader:
                flight = shard.flights[key] = _Flight(gen, me)
        if leader:
            return self._lead(shard, key, flight, compute)
        return self._follow(key, flight, me, timeout_s)

    # ------------------------------------------------------------------ writes

    def put(self, key: Hashable, value: V, generation: int | None = None) -> None:
        """Store ``value`` for ``key`` tagged with ``generation`` (default: the current one).

        A value tagged with an older generation is not stored: it could never be served.

        Raises:
            InvalidInputError: ``key`` is unhashable, ``value`` is ``None``, or ``generation`` is not an
                int in ``[0, self.generation]``.
        """
        current = self._generation
        if generation is None:
            generation = current
        elif type(generation) is not int or not 0 <= generation <= current:
            fix, expected = (
                "Pass the cache.generation read before computing, or omit it.",
                f"an int in [0, {current}]",
            )
            _fail(InvalidInputError, "SelectionCache.put generation", expected, repr(generation), fix)
        if value is None:
            _fail(
                InvalidInputError, "SelectionCache.put value", "not None", None, "None means a miss in get()."
            )
        try:
            shard = self._shards[hash(key) & self._mask]
        except TypeError:
            raise InvalidInputError(self._unhashable(key)) from None
        if generation != current:
            _log.debug("not storing %r: generation %d is older than current %d", key, generation, current)
            return
        with shard.lock:
            self._store(shard, key, value, generation)

    def invalidate(self) -> int:
        """Make every stored entry stale in O(1) (bump the generation); return the new generation.

        Call it whenever the policy, config or kernel registry changes. Stale entries are dropped lazily.
        """
        with self._gen_lock:
            self._generation += 1
            self._invalidations += 1
            self.hot = {}
            return self._generation

    def clear(self) -> None:
        """Remove every entry now (the generation and the counters are kept; in-flight computes finish)."""
        self.hot = {}
        for shard in self._shards:
            with shard.lock:
                if shard.entries:
                    shard.entries.clear()
                    shard.version += 1

    def promote(self, hot: dict[Hashable, V], key: Hashable, value: V) -> None:
        """Put ``key -> value`` (just read by :meth:`get`) in ``hot``, the :attr:`hot` dict read *before* that
        :meth:`get`: if an invalidation happened in between, ``hot`` is already discarded and nothing stale is
        served. No-op with a TTL (expiry is checked on the sharded path only)."""
        if self._ttl is not None:
            return
        if len(hot) >= self._max_entries:
            hot.clear()
        hot[key] = value

    # ------------------------------------------------------------------ introspection

    @property
    def generation(self) -> int:
        """The current generation (0 at construction, +1 per :meth:`invalidate`)."""
        return self._generation

    @property
    def max_entries(self) -> int:
        """The bound on stored entries (count)."""
        return self._max_entries

    @property
    def num_shards(self) -> int:
        """The number of shards (a power of two)."""
        return self._mask + 1

    def shard_versions(self) -> tuple[int, ...]:
        """Each shard's write version (bumped on every insert, removal or eviction), shard order."""
        return tuple(s.version for s in self._shards)

    def __len__(self) -> int:
        """Number of live entries (current generation, not expired); a moment's snapshot."""
        gen = self._generation
        count = 0
        for shard in self._shards:
            with shard.lock:
                count += sum(1 for e in shard.entries.values() if self._live(e, gen))
        return count

    def stats(self) -> CacheStats:
        """A :class:`CacheStats` snapshot (hits/misses approximate under concurrency)."""
        return CacheStats(
            hits=max(0, self._tick - self._stores),
            misses=self._misses,
            evictions=self._evictions,
            invalidations=self._invalidations,
            size=len(self),
            generation=self._generation,
        )

    def __repr__(self) -> str:
        args = f"max_entries={self._max_entries}, ttl_s={self._ttl}, num_shards={self._mask + 1}"
        return f"SelectionCache({args}, generation={self._generation})"

    # ------------------------------------------------------------------ internals

    def _live(self, entry: _Entry, gen: int) -> bool:
        return entry.generation == gen and (entry.expires_at is None or self._clock() < entry.expires_at)

    def _lead(self, shard: _Shard, key: Hashable, flight: _Flight, compute: Callable[[], V]) -> V:
        gen = flight.generation
        try:
            value = compute()
            if value is None:
                _fail(
                    InvalidInputError,
                    "get_or_compute compute()",
                    "a value, not None",
                    None,
                    "Return one or raise.",
                )
        except BaseException as exc:
            flight.error = exc
            with shard.lock:
                if shard.flights.get(key) is flight:
                    del shard.flights[key]
            flight.done.set()
            raise
        flight.value = value
        try:
            with shard.lock:
                if gen == self._generation:
                    self._store(shard, key, value, gen)
                else:
                    _log.debug("not storing %r: invalidated while computing (generation %d)", key, gen)
                if shard.flights.get(key) is flight:
                    del shard.flights[key]
        finally:
            flight.done.set()
        return value

    def _follow(self, key: Hashable, flight: _Flight, me: int, timeout_s: float | None) -> V:
        if flight.owner == me:
            what = f"get_or_compute({key!r}) called again from its own compute() in the same thread"
            got = "a recursive lookup that would wait on itself forever"
            fix = "Compute dependencies without looking up the key being computed."
            _fail(SelectionTimeoutError, what, "compute() not to look up its own key", got, fix)
        if not flight.done.wait(timeout_s):
            fix = "Raise timeout_s (or pass None), or find why selection is slow (PerfDB, JIT, a hung probe)."
            what, expected = (
                f"waiting for another thread's selection of {key!r}",
                f"a result within {timeout_s} s",
            )
            _fail(SelectionTimeoutError, what, expected, "none (still computing)", fix)
        if flight.error is not None:
            raise flight.error
        return flight.value  # type: ignore[return-value]

    def _store(self, shard: _Shard, key: Hashable, value: object, gen: int) -> None:
        """Insert under ``shard.lock`` (held by the caller), making room first if the shard is full."""
        entries = shard.entries
        if key not in entries and len(entries) >= shard.capacity:
            self._make_room(shard, gen)
        ttl = self._ttl
        expires_at = None if ttl is None else self._clock() + ttl
        self._stores += 1
        self._tick = tick = self._tick + 1
        entries[key] = _Entry(value, gen, expires_at, tick)
        shard.version += 1

    def _make_room(self, shard: _Shard, gen: int) -> None:
        entries = shard.entries
        dead = [k for k, e in entries.items() if not self._live(e, gen)]
        for k in dead:
            del entries[k]
        if len(entries) >= shard.capacity:
            victim = min(entries, key=lambda k: entries[k].last_used)
            del entries[victim]
            self._evictions += 1
            _log.debug("evicted least recently used %r (shard capacity %d)", victim, shard.capacity)

    def _drop_if_unchanged(self, key: Hashable, entry: _Entry) -> None:
        """Remove a stale/expired entry if its shard lock is free right now (readers never block)."""
        shard = self._shards[hash(key) & self._mask]
        if shard.lock.acquire(blocking=False):
            try:
                if shard.entries.get(key) is entry:
                    del shard.entries[key]
                    shard.version += 1
            finally:
                shard.lock.release()

    @staticmethod
    def _unhashable(key: object) -> str:
        return expected_got(
            "SelectionCache key", "a hashable tuple", f"{type(key).__name__} {key!r:.80}",
            "Build keys from hashable parts (dtype, shape tuples, ints, strs), not tensors or lists.",
        )  # fmt: skip
