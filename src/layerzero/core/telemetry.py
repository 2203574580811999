"""Telemetry state: counters and sampled latencies that dispatch records while telemetry is on.

Plain Python counters, no exporter: ``layerzero.telemetry`` turns them on and exposes them (Prometheus
collector, HTTP endpoint, JSON-lines selection log). Off (the default), dispatch pays one attribute read per
call (``TELEMETRY.on``); on, the hot path adds one dict increment per call and, on every ``sample_every``-th
call of a kernel, two ``perf_counter`` reads (the call's host time: on CUDA the launch, not the device time).

What is counted: selections per (op, kernel) and their host time; selection-cache misses per op (a lookup that
selects) and hits (calls minus misses); fallbacks per (op, kind, reason) (``kind`` ``selection``: the
reference served because faster kernels were rejected or a preferred kernel could not run, ``reason`` the
rejection codes; ``runtime``: a kernel raised and another served, ``reason`` the exception type); calls per
kernel; PerfDB bucket reads; circuit-breaker trips per backend.
"""

from __future__ import annotations

import bisect
import json
import threading
import time
from collections import Counter
from typing import IO, Any

from .observers import OBSERVERS

__all__ = ["LATENCY_BUCKETS_US", "TELEMETRY", "Telemetry"]

LATENCY_BUCKETS_US = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 10000.0, 100000.0)
"""Upper bounds (µs) of the sampled call-latency histogram (plus +Inf)."""


class Telemetry:
    """The process's counters (see the module docstring). ``sample_every`` is a power of two (a call is timed
    when its per-kernel count is a multiple of it)."""

    def __init__(self) -> None:
        self.on = False
        self.sample_mask = 63
        self._lock = threading.Lock()
        self._log: IO[str] | None = None
        self.reset()

    def reset(self) -> None:
        """Zero every counter (the switch and the log stay as they are)."""
        self.calls: dict[str, int] = {}
        self.kernel_op: dict[str, str] = {}
        self.latency: dict[str, list[float]] = {}  # kernel -> bucket counts (+Inf last), then sum, then count
        self.misses: Counter[str] = Counter()
        self.selections: Counter[tuple[str, str]] = Counter()
        self.selection_seconds: Counter[str] = Counter()
        self.fallbacks: Counter[tuple[str, str, str]] = Counter()
        self.perfdb_reads = 0
        self.health_trips: Counter[str] = Counter()

    def configure(self, on: bool, sample_every: int, log: IO[str] | None) -> None:
        """Switch recording on/off, set the sampling period, and the JSON-lines selection log (or None); a
        previous log file is closed (this object owns the open log)."""
        self.sample_mask = sample_every - 1
        with self._lock:
            old, self._log = self._log, log
        if old is not None and old is not log:
            old.close()
        if on != self.on:  # the ops' inlined hot path stays off while telemetry records (core/observers.py)
            (OBSERVERS.enter if on else OBSERVERS.leave)()
        self.on = on

    # ------------------------------------------------------------------ recording (dispatch calls these)
    def count_call(self, op: str, kernel_id: str) -> bool:
        """Count one call of ``kernel_id``; True when this call is to be timed."""
        n = self.calls.get(kernel_id, 0) + 1
        self.calls[kernel_id] = n
        if n == 1:
            self.kernel_op[kernel_id] = op
        return not n & self.sample_mask

    def observe(self, kernel_id: str, seconds: float) -> None:
        """Add one sampled call time."""
        us = seconds * 1e6
        row = self.latency.get(kernel_id)
        if row is None:
            row = self.latency[kernel_id] = [0.0] * (len(LATENCY_BUCKETS_US) + 3)
        row[bisect.bisect_left(LATENCY_BUCKETS_US, us)] += 1
        row[-2] += us
        row[-1] += 1

    def selected(self, op: str, kernel_id: str, seconds: float, report: Any) -> None:
        """Count a selection (a cache miss) and its fallback notes; write its log line when logging."""
        self.misses[op] += 1
        self.selections[(op, kernel_id)] += 1
        self.selection_seconds[op] += seconds
        rejected = {c.kernel_id: [r.code.value for r in c.reasons] for c in report.candidates if c.reasons}
        if (
            report.notes
        ):  # the reason: the codes of the kernels the notes name (the preferred or the blocked ones)
            text = " ".join(report.notes)
            codes = sorted({code for kid, codes in rejected.items() if kid in text for code in codes})
            self.fallbacks[(op, "selection", ",".join(codes) or "UNKNOWN")] += 1
        if self._log is not None:
            line = json.dumps(
                {
                    "ts": time.time(),
                    "op": op,
                    "kernel": kernel_id,
                    "seconds": round(seconds, 6),
                    "context": {k: str(v) for k, v in report.context.fields().items()},
                    "rejected": rejected,
                    "notes": list(report.notes),
                },
                sort_keys=True,
            )
            with self._lock:
                self._log.write(line + "\n")
                self._log.flush()

    def runtime_fallback(self, op: str, exc: BaseException) -> None:
        """Count a kernel that raised at run time while another one served the call."""
        self.fallbacks[(op, "runtime", type(exc).__name__)] += 1

    def hits(self) -> dict[str, int]:
        """Selection-cache hits per op: every counted call looked its key up once, and the misses selected (so
        the hot path counts calls only)."""
        calls: Counter[str] = Counter()
        for k, n in self.calls.items():
            calls[self.kernel_op.get(k, "")] += n
        return {op: max(0, n - self.misses.get(op, 0)) for op, n in calls.items()}

    def snapshot(self) -> dict[str, Any]:
        """A plain-dict copy of every counter."""
        return {
            "calls": {k: (self.kernel_op.get(k, ""), n) for k, n in self.calls.items()},
            "latency_us": {
                k: {
                    "buckets": list(zip((*LATENCY_BUCKETS_US, float("inf")), row[:-2], strict=True)),
                    "sum": row[-2],
                    "count": int(row[-1]),
                }
                for k, row in self.latency.items()
            },
            "cache_hits": self.hits(),
            "cache_misses": dict(self.misses),
            "selections": {f"{op}|{k}": n for (op, k), n in self.selections.items()},
            "selection_seconds": dict(self.selection_seconds),
            "fallbacks": {"|".join(k): n for k, n in self.fallbacks.items()},
            "perfdb_reads": self.perfdb_reads,
            "health_trips": dict(self.health_trips),
        }


TELEMETRY = Telemetry()
"""The process-wide telemetry state (``layerzero.telemetry`` configures and exports it)."""
