"""LayerZero telemetry: what dispatch did, as metrics a fleet can scrape.

``enable()`` turns recording on (off by default; the counters live in ``layerzero.core.telemetry``),
``snapshot()`` returns them as a dict, ``collector()`` is a Prometheus collector to register in your own
registry, and ``start_http_server(port)`` serves them on ``/metrics`` (both need ``prometheus-client``:
``pip install prometheus-client``, imported only when called), and ``otel_instrument(meter_provider)``
registers them as OpenTelemetry observable counters on a Meter named ``layerzero`` (needs
``opentelemetry-api``, imported only when called; ``layerzero/telemetry_otel.py``).
``enable(selection_log=path)`` also writes one JSON line per selection (op, kernel, the context's fields,
every rejected kernel's reason codes, fallback notes).

Metrics (prefix ``layerzero_``): ``kernel_calls_total{op,kernel}``; ``kernel_call_seconds{op,kernel}`` (a
histogram of every ``sample_every``-th call's host time: on CUDA the launch, not the device time);
``selections_total{op,kernel}`` and ``selection_seconds_total{op}``; ``cache_hits_total{op}`` /
``cache_misses_total{op}``; ``fallbacks_total{op,kind,reason}`` (``kind`` ``selection`` or ``runtime``);
``perfdb_reads_total``; ``health_trips_total{backend}``.

Cost on the cache-hit path (benchmarks/bench_dispatch.py --telemetry): one attribute read when off; one dict
increment per call when on, plus two clock reads on sampled calls.

>>> import layerzero.telemetry as lzt
>>> lzt.enable(); lzt.disable()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from layerzero.core.errors import ConfigurationError, expected_got
from layerzero.core.telemetry import LATENCY_BUCKETS_US, TELEMETRY
from layerzero.telemetry_otel import OtelRegistration, otel_instrument

__all__ = [
    "OtelRegistration",
    "collector",
    "disable",
    "enable",
    "is_enabled",
    "otel_instrument",
    "reset",
    "snapshot",
    "start_http_server",
]


def enable(*, sample_every: int = 64, selection_log: str | Path | None = None) -> None:
    """Start recording. ``sample_every``: time one call in this many per kernel (a power of two >= 1; 1 times
    every call); ``selection_log``: a file to append one JSON line per selection to (None: no log).

    Raises:
        ConfigurationError: ``sample_every`` not a power of two >= 1; ``selection_log`` not a path (or not
            writable: the ``OSError`` of opening it is chained).
    """
    if (
        isinstance(sample_every, bool)
        or not isinstance(sample_every, int)
        or sample_every < 1
        or sample_every & (sample_every - 1)
    ):
        raise ConfigurationError(
            expected_got(
                "telemetry.enable(sample_every)", "a power of two >= 1 (1, 2, 4, ...)", repr(sample_every)
            )
        )
    log = None
    if selection_log is not None:
        if not isinstance(selection_log, (str, Path)):
            raise ConfigurationError(
                expected_got(
                    "telemetry.enable(selection_log)", "a file path or None", type(selection_log).__name__
                )
            )
        try:
            log = open(selection_log, "a", encoding="utf-8")  # noqa: SIM115 - kept open while logging
        except OSError as exc:
            raise ConfigurationError(
                f"telemetry.enable(selection_log): cannot open {selection_log!s} for "
                f"appending ({exc}). Pass a writable path."
            ) from exc
    TELEMETRY.configure(True, sample_every, log)


def disable() -> None:
    """Stop recording (the counters keep their values; ``reset()`` zeroes them) and close the selection
    log."""
    TELEMETRY.configure(False, TELEMETRY.sample_mask + 1, None)


def is_enabled() -> bool:
    """Whether telemetry is recording."""
    return TELEMETRY.on


def reset() -> None:
    """Zero every counter."""
    TELEMETRY.reset()


def snapshot() -> dict[str, Any]:
    """Every counter as plain data: ``calls`` (kernel -> (op, n)), ``latency_us`` (kernel -> buckets / sum /
    count, µs), ``cache_hits`` / ``cache_misses`` (op -> n), ``selections`` ("op|kernel" -> n),
    ``selection_seconds`` (op -> s), ``fallbacks`` ("op|kind|reason" -> n), ``perfdb_reads``,
    ``health_trips``."""
    return TELEMETRY.snapshot()


class _Collector:
    """A Prometheus collector over the telemetry counters (read at scrape time)."""

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        t = TELEMETRY
        calls = CounterMetricFamily("layerzero_kernel_calls", "Kernel calls", labels=["op", "kernel"])
        for kernel, n in list(t.calls.items()):
            calls.add_metric([t.kernel_op.get(kernel, ""), kernel], n)
        yield calls
        hist = HistogramMetricFamily(
            "layerzero_kernel_call_seconds", "Sampled host time of kernel calls", labels=["op", "kernel"]
        )
        for kernel, row in list(t.latency.items()):
            cum, buckets = 0.0, []
            for bound, n in zip((*LATENCY_BUCKETS_US, float("inf")), row[:-2], strict=True):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound / 1e6), cum))
            hist.add_metric([t.kernel_op.get(kernel, ""), kernel], buckets, row[-2] / 1e6)
        yield hist
        yield _counter(
            "layerzero_selections",
            "Selections (cache misses that ran selection)",
            ["op", "kernel"],
            t.selections.items(),
        )
        yield _counter(
            "layerzero_selection_seconds",
            "Host time spent selecting",
            ["op"],
            [((op,), s) for op, s in t.selection_seconds.items()],
        )
        yield _counter(
            "layerzero_cache_hits", "Selection-cache hits", ["op"], [((op,), n) for op, n in t.hits().items()]
        )
        yield _counter(
            "layerzero_cache_misses",
            "Selection-cache misses",
            ["op"],
            [((op,), n) for op, n in t.misses.items()],
        )
        yield _counter(
            "layerzero_fallbacks",
            "Fallbacks by kind (selection/runtime) and reason",
            ["op", "kind", "reason"],
            t.fallbacks.items(),
        )
        yield _counter("layerzero_perfdb_reads", "PerfDB bucket reads", [], [((), t.perfdb_reads)])
        yield _counter(
            "layerzero_health_trips",
            "Backend circuit-breaker trips",
            ["backend"],
            [((b,), n) for b, n in t.health_trips.items()],
        )

    def describe(self) -> list[Any]:
        return []


def _counter(name: str, doc: str, labels: list[str], rows: Any) -> Any:
    from prometheus_client.core import CounterMetricFamily

    fam = CounterMetricFamily(name, doc, labels=labels)
    for values, n in list(rows):
        fam.add_metric(list(values), n)
    return fam


def collector() -> Any:
    """A Prometheus collector of LayerZero's counters: ``registry.register(layerzero.telemetry.collector())``.

    Raises:
        ConfigurationError: ``prometheus-client`` is not installed (the message says how to install it).
    """
    _need_prometheus()
    return _Collector()


def start_http_server(port: int, addr: str = "0.0.0.0", registry: Any = None) -> Any:
    """Serve the counters on ``http://addr:port/metrics`` (Prometheus text format) from a daemon thread, in a
    new ``CollectorRegistry`` holding only LayerZero's collector unless ``registry`` is given (it is then
    registered there). Returns what ``prometheus_client.start_http_server`` returns (the server and its thread
    in prometheus-client >= 0.17). Recording is not switched on here: call :func:`enable`.

    Raises:
        ConfigurationError: ``prometheus-client`` missing, or ``port`` not an int in [0, 65535] (0: any free
            port).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigurationError(
            expected_got("telemetry.start_http_server(port)", "an int in [0, 65535]", repr(port))
        )
    _need_prometheus()
    from prometheus_client import CollectorRegistry
    from prometheus_client import start_http_server as serve

    reg = registry if registry is not None else CollectorRegistry()
    reg.register(_Collector())
    return serve(port, addr=addr, registry=reg)


def _need_prometheus() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise ConfigurationError(
            "layerzero.telemetry needs prometheus-client for Prometheus export; it is not "
            "installed. Fix: pip install prometheus-client (snapshot() works without it)."
        ) from exc
