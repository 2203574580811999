"""``GET /metrics``: Prometheus metrics named as vLLM's, prefixed ``layerzero:`` (so a vLLM dashboard ports by
a prefix rename), each labelled ``model_name``, in the server's own registry (several servers in one process
do not collide).

From the engine core's stats (read at scrape time, ``AsyncLLM.get_stats()``): gauges
``layerzero:num_requests_running``, ``layerzero:num_requests_waiting``, ``layerzero:kv_cache_usage_perc``
(0..1), counters ``layerzero:prefix_cache_queries_total`` / ``layerzero:prefix_cache_hits_total`` (tokens),
``layerzero:num_preemptions_total``, and with speculative decoding vLLM's ``spec_decode`` counters
``layerzero:spec_decode_num_drafts_total``, ``layerzero:spec_decode_num_draft_tokens_total``,
``layerzero:spec_decode_num_accepted_tokens_total`` and
``layerzero:spec_decode_num_accepted_tokens_per_pos_total{position}`` (acceptance rate = accepted / draft
tokens; mean acceptance length = 1 + accepted / drafts). From the front end, as outputs arrive: counters
``layerzero:prompt_tokens_total``, ``layerzero:generation_tokens_total``,
``layerzero:request_success_total{finished_reason}`` (one per finished completion: stop, length, abort,
error), histograms ``layerzero:time_to_first_token_seconds``, ``layerzero:inter_token_latency_seconds`` (per
output delta after the first, divided over its tokens), ``layerzero:e2e_request_latency_seconds`` and
``layerzero:request_queue_time_seconds`` (``RequestOutput.queue_time``, once per request). The
kernels serve through ``GET /v1/layerzero/kernels`` (the engine core's report: its process runs them).

LayerZero's dispatch counters come from the engine core's process (``AsyncLLM.dispatch_counters()``: its
``layerzero.telemetry.snapshot()``, read at scrape time) under ``layerzero.telemetry``'s own names
(``layerzero_kernel_calls_total{op,kernel}``, ``layerzero_selections_total{op,kernel}``,
``layerzero_cache_hits_total{op}``, ``layerzero_cache_misses_total{op}``,
``layerzero_fallbacks_total{op,kind,reason}``, ``layerzero_selection_seconds_total{op}``,
``layerzero_kernel_call_seconds{op,kernel}``, ``layerzero_perfdb_reads_total``,
``layerzero_health_trips_total{backend}``; docs/telemetry.md).
"""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["RequestClock", "ServerMetrics"]

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_ITL = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _EngineStats:
    """A collector yielding the engine core's last stats snapshot (set by :meth:`ServerMetrics.update`)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.stats: Any = None

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats
        if s is None:
            return
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", s.num_running_reqs),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting_reqs),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s.kv_cache_usage),
        ):
            g = GaugeMetricFamily(f"layerzero:{name}", doc, labels=["model_name"])
            g.add_metric([self.model], float(value))
            yield g
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("num_preemptions", "Preemptions of running requests.", s.num_preemptions),
        ):
            c = CounterMetricFamily(f"layerzero:{name}", doc, labels=["model_name"])
            c.add_metric([self.model], float(value))
            yield c
        yield from self._spec_decode(s)

    def _spec_decode(self, s: Any) -> Any:
        """vLLM's ``spec_decode`` counters (only when speculative decoding ran: a draft was verified)."""
        from prometheus_client.core import CounterMetricFamily

        if not getattr(s, "spec_decode_num_drafts", 0):
            return
        for name, doc in (
            ("num_drafts", "Speculative decoding: verification rows (a sequence's step with drafts)."),
            ("num_draft_tokens", "Speculative decoding: draft tokens verified."),
            ("num_accepted_tokens", "Speculative decoding: draft tokens accepted."),
        ):
            c = CounterMetricFamily(f"layerzero:spec_decode_{name}", doc, labels=["model_name"])
            c.add_metric([self.model], float(getattr(s, f"spec_decode_{name}")))
            yield c
        c = CounterMetricFamily(
            "layerzero:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted draft tokens per draft position.",
            labels=["model_name", "position"],
        )
        for pos, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            c.add_metric([self.model, str(pos)], float(n))
        yield c

    def describe(self) -> list:
        return []


class _DispatchCounters:
    """A collector yielding the engine core's last dispatch-counter snapshot (``layerzero.telemetry``'s
    names and labels; :meth:`ServerMetrics.update_dispatch`)."""

    def __init__(self) -> None:
        self.snap: dict[str, Any] | None = None

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        s = self.snap
        if not s:
            return

        def fam(name: str, doc: str, labels: list[str], rows: Any) -> Any:
            f = CounterMetricFamily(f"layerzero_{name}", doc, labels=labels)
            for values, n in rows:
                f.add_metric([str(v) for v in values], float(n))
            return f

        calls = s.get("calls") or {}
        yield fam(
            "kernel_calls", "Kernel calls", ["op", "kernel"], [((op, k), n) for k, (op, n) in calls.items()]
        )
        sel = [(tuple(k.split("|", 1)), n) for k, n in (s.get("selections") or {}).items()]
        yield fam("selections", "Selections (cache misses that ran selection)", ["op", "kernel"], sel)
        for name, doc in (
            ("selection_seconds", "Host time spent selecting"),
            ("cache_hits", "Selection-cache hits"),
            ("cache_misses", "Selection-cache misses"),
        ):
            yield fam(name, doc, ["op"], [((op,), n) for op, n in (s.get(name) or {}).items()])
        fb = [(tuple(k.split("|", 2)), n) for k, n in (s.get("fallbacks") or {}).items()]
        yield fam(
            "fallbacks", "Fallbacks by kind (selection/runtime) and reason", ["op", "kind", "reason"], fb
        )
        yield fam("perfdb_reads", "PerfDB bucket reads", [], [((), s.get("perfdb_reads") or 0)])
        trips = [((b,), n) for b, n in (s.get("health_trips") or {}).items()]
        yield fam("health_trips", "Backend circuit-breaker trips", ["backend"], trips)
        hist = HistogramMetricFamily(
            "layerzero_kernel_call_seconds", "Sampled host time of kernel calls", labels=["op", "kernel"]
        )
        for k, row in (s.get("latency_us") or {}).items():
            cum, buckets = 0.0, []
            for bound, n in row["buckets"]:
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound / 1e6), cum))
            op = calls.get(k, ("", 0))[0]
            hist.add_metric([str(op), k], buckets, row["sum"] / 1e6)
        yield hist

    def describe(self) -> list:
        return []


class ServerMetrics:
    """The server's registry and instruments (prometheus-client, imported when the server is built)."""

    def __init__(self, model: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.model = model
        self.registry = CollectorRegistry()
        reg, lab = self.registry, ["model_name"]
        self.engine = _EngineStats(model)
        reg.register(self.engine)
        self.dispatch = _DispatchCounters()
        reg.register(self.dispatch)
        self.prompt_tokens = Counter(
            "layerzero:prompt_tokens", "Prompt tokens of started requests.", lab, registry=reg
        ).labels(model)
        self.generation_tokens = Counter(
            "layerzero:generation_tokens", "Generated tokens.", lab, registry=reg
        ).labels(model)
        self.success = Counter(
            "layerzero:request_success", "Finished completions.", [*lab, "finished_reason"], registry=reg
        )
        self.ttft = Histogram(
            "layerzero:time_to_first_token_seconds", "Time to first token.", lab, buckets=_TTFT, registry=reg
        ).labels(model)
        self.itl = Histogram(
            "layerzero:inter_token_latency_seconds", "Inter-token latency.", lab, buckets=_ITL, registry=reg
        ).labels(model)
        self.e2e = Histogram(
            "layerzero:e2e_request_latency_seconds", "Request latency.", lab, buckets=_E2E, registry=reg
        ).labels(model)
        self.queue = Histogram(
            "layerzero:request_queue_time_seconds", "Time waiting to be scheduled.", lab, buckets=_E2E,
            registry=reg,
        ).labels(model)  # fmt: skip

    def update(self, stats: Any) -> None:
        """Keep the engine's latest stats for the next scrape."""
        self.engine.stats = stats

    def update_dispatch(self, snapshot: dict[str, Any]) -> None:
        """Keep the engine core's latest dispatch counters (``AsyncLLM.dispatch_counters()``)."""
        self.dispatch.snap = snapshot

    def render(self) -> bytes:
        """The exposition text. Under ``PROMETHEUS_MULTIPROC_DIR`` (``--api-server-count`` > 1: several
        API-server processes) the front-end counters and histograms are summed over every process's files
        (prometheus-client's multiprocess mode); the engine's stats and dispatch counters are this
        process's view of the cores, which every API server shares."""
        from prometheus_client import CollectorRegistry, generate_latest

        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        reg.register(self.engine)
        reg.register(self.dispatch)
        return generate_latest(reg)

    def clock(self, prompt_tokens: int, arrival: float | None = None) -> RequestClock:
        """Start timing one request (counts its prompt tokens); ``arrival``: when its HTTP request arrived
        (``time.monotonic()``; None: now)."""
        self.prompt_tokens.inc(prompt_tokens)
        return RequestClock(self, arrival)


class RequestClock:
    """One request's times (``time.monotonic()`` seconds): arrival (``arrival``: its HTTP request's; None:
    now), the engine request's start (``started``), first token, last token; feeds the histograms as outputs
    arrive."""

    def __init__(self, metrics: ServerMetrics, arrival: float | None = None) -> None:
        self.m = metrics
        self.started = time.monotonic()
        self.arrival = self.started if arrival is None else arrival
        self.first: float | None = None
        self.last: float | None = None
        self.output_tokens = 0
        self.queue_seen = False

    def tokens(self, n: int, queue_time: float | None = None) -> None:
        """``n`` new output tokens arrived now (over all completions of the request)."""
        if queue_time is not None and not self.queue_seen:
            self.queue_seen = True
            self.m.queue.observe(queue_time)
        if n <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.m.ttft.observe(now - self.arrival)
        elif self.last is not None:
            per = (now - self.last) / n
            for _ in range(n):
                self.m.itl.observe(per)
        self.last = now
        self.output_tokens += n
        self.m.generation_tokens.inc(n)

    def finish(self, reasons: list[str]) -> float:
        """The request ended (one finish reason per completion); returns its latency in seconds."""
        e2e = time.monotonic() - self.arrival
        self.m.e2e.observe(e2e)
        for r in reasons:
            self.m.success.labels(self.m.model, r or "abort").inc()
        return e2e

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.arrival
