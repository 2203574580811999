"""Micro-benchmark of :class:`layerzero.core.cache.SelectionCache`: ns per call, median of rounds.

Run: ``PYTHONPATH=src python benchmarks/bench_cache.py [--iters N] [--rounds R]``.

Keys are 4-tuples ``(op, dtype, seq bucket, flags)`` like the ones ``ops/`` builds. Timed:
``get()`` hit, ``get_or_compute()`` hit, ``get()`` hit with TTL on (one clock call), ``get()`` miss of
an absent key, and ``get()`` miss of a stale entry after ``invalidate()`` (which also drops it). Each
round times ``iters`` calls with ``time.perf_counter_ns``; the empty-loop cost is subtracted.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable

from layerzero.core.cache import SelectionCache

KEY = ("attention", "torch.float16", 2048, (True, False))
ABSENT = ("attention", "torch.float16", 4096, (True, False))


def _median_ns(
    body: Callable[[int], None], iters: int, rounds: int, setup: Callable[[], None] | None = None
) -> float:
    """Median over ``rounds`` of ns per call of ``body(iters)``; ``setup()`` runs untimed before each."""
    samples = []
    for _ in range(rounds):
        if setup is not None:
            setup()
        t0 = time.perf_counter_ns()
        body(iters)
        samples.append((time.perf_counter_ns() - t0) / iters)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    """Print one line per measurement: name and ns per call (loop overhead subtracted)."""
    parser = argparse.ArgumentParser(description="SelectionCache ns per hit/miss")
    parser.add_argument("--iters", type=int, default=200_000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=15, help="rounds (the median is reported)")
    args = parser.parse_args(argv)
    n, r = args.iters, args.rounds

    plan = object()
    cache: SelectionCache[object] = SelectionCache(max_entries=4096)
    cache.put(KEY, plan)
    ttl_cache: SelectionCache[object] = SelectionCache(max_entries=4096, ttl_s=3600.0)
    ttl_cache.put(KEY, plan)
    get, goc, ttl_get = cache.get, cache.get_or_compute, ttl_cache.get

    def loop(k: int) -> None:
        for _ in range(k):
            pass

    def hit(k: int) -> None:
        for _ in range(k):
            get(KEY)

    def goc_hit(k: int) -> None:
        for _ in range(k):
            goc(KEY, object)

    def ttl_hit(k: int) -> None:
        for _ in range(k):
            ttl_get(KEY)

    def miss(k: int) -> None:
        for _ in range(k):
            get(ABSENT)

    stale_n = min(n, 50_000)
    stale_keys = [("attention", "torch.float16", i, (True, False)) for i in range(stale_n)]
    stale_cache: SelectionCache[object] = SelectionCache(max_entries=stale_n)

    def fill_and_invalidate() -> None:
        for k in stale_keys:
            stale_cache.put(k, plan)
        stale_cache.invalidate()

    def stale(k: int) -> None:
        sget = stale_cache.get
        for key in stale_keys:
            sget(key)

    base = _median_ns(loop, n, r)
    rows = [
        ("get() hit", _median_ns(hit, n, r) - base),
        ("get_or_compute() hit", _median_ns(goc_hit, n, r) - base),
        ("get() hit, ttl_s set", _median_ns(ttl_hit, n, r) - base),
        ("get() miss, absent key", _median_ns(miss, n, r) - base),
        ("get() miss, stale entry", _median_ns(stale, stale_n, r, fill_and_invalidate) - base),
    ]
    print(
        f"python {platform.python_version()} ({sys.implementation.name}) on {platform.machine()}, "
        f"{n} calls x {r} rounds, median, empty loop ({base:.1f} ns) subtracted"
    )
    for name, ns in rows:
        print(f"  {name:26s} {ns:8.1f} ns/call")


if __name__ == "__main__":
    main()
