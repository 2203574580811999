"""OpenTelemetry export of LayerZero's telemetry counters (``layerzero.telemetry.otel_instrument``).

Registers *asynchronous* (observable) instruments on a Meter named ``"layerzero"``: their callbacks read
:meth:`layerzero.core.telemetry.Telemetry.snapshot` (the dict ``layerzero.telemetry.snapshot()`` returns, the
one the Prometheus collector reads) when a metric reader collects, so dispatch's hot path is unchanged (it
still increments plain dicts; nothing here runs per call). ``opentelemetry-api`` is imported only when
:func:`otel_instrument` is called (``pip install layerzero[telemetry]`` installs it with the SDK).

OpenTelemetry has no asynchronous histogram, so the sampled call latency is exported as three observable
counters in the Prometheus histogram convention: ``layerzero.kernel.call.duration.bucket`` (cumulative count
per upper bound, attribute ``le`` in seconds, ``"+Inf"`` last), ``.sum`` (seconds) and ``.count``. Names,
units and attributes: :data:`INSTRUMENTS` and docs/telemetry.md ("OpenTelemetry").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from layerzero.core.errors import ConfigurationError
from layerzero.core.telemetry import TELEMETRY

__all__ = ["INSTRUMENTS", "METER_NAME", "OtelRegistration", "otel_instrument"]

METER_NAME = "layerzero"
INSTALL_HINT = "pip install layerzero[telemetry] (or: pip install opentelemetry-api opentelemetry-sdk)"

Row = tuple[dict[str, str], float]


def _calls(s: dict[str, Any]) -> Iterator[Row]:
    for kernel, (op, n) in s["calls"].items():
        yield {"op": op, "kernel": kernel}, n


def _latency(part: str) -> Callable[[dict[str, Any]], Iterator[Row]]:
    def rows(s: dict[str, Any]) -> Iterator[Row]:
        for kernel, lat in s["latency_us"].items():
            attrs = {"op": s["calls"].get(kernel, ("", 0))[0], "kernel": kernel}
            if part == "sum":
                yield attrs, lat["sum"] / 1e6
            elif part == "count":
                yield attrs, lat["count"]
            else:
                cum = 0.0
                for bound_us, n in lat["buckets"]:
                    cum += n
                    le = "+Inf" if bound_us == float("inf") else repr(bound_us / 1e6)
                    yield {**attrs, "le": le}, cum

    return rows


def _split(key_names: tuple[str, ...], snap_key: str) -> Callable[[dict[str, Any]], Iterator[Row]]:
    def rows(s: dict[str, Any]) -> Iterator[Row]:
        for key, n in s[snap_key].items():
            parts = key.split("|", len(key_names) - 1) if len(key_names) > 1 else [key]
            yield dict(zip(key_names, parts, strict=True)), n

    return rows


def _scalar(snap_key: str) -> Callable[[dict[str, Any]], Iterator[Row]]:
    def rows(s: dict[str, Any]) -> Iterator[Row]:
        yield {}, s[snap_key]

    return rows


@dataclass(frozen=True, slots=True)
class Instrument:
    """One observable counter: OTel ``name``, UCUM ``unit``, ``description``, the attribute names and how its
    points are read from a snapshot (``rows(snapshot) -> (attributes, value)``)."""

    name: str
    unit: str
    description: str
    attributes: tuple[str, ...]
    rows: Callable[[dict[str, Any]], Iterator[Row]] = field(repr=False)


INSTRUMENTS: tuple[Instrument, ...] = (
    Instrument("layerzero.kernel.calls", "{call}", "Calls served by each kernel", ("op", "kernel"), _calls),
    Instrument(
        "layerzero.kernel.call.duration.bucket",
        "{call}",
        "Sampled host time of kernel calls: cumulative count of samples <= le seconds",
        ("op", "kernel", "le"),
        _latency("bucket"),
    ),
    Instrument(
        "layerzero.kernel.call.duration.sum",
        "s",
        "Sampled host time of kernel calls: sum",
        ("op", "kernel"),
        _latency("sum"),
    ),
    Instrument(
        "layerzero.kernel.call.duration.count",
        "{call}",
        "Sampled host time of kernel calls: samples",
        ("op", "kernel"),
        _latency("count"),
    ),
    Instrument(
        "layerzero.selections",
        "{selection}",
        "Selections (cache misses that ran selection)",
        ("op", "kernel"),
        _split(("op", "kernel"), "selections"),
    ),
    Instrument(
        "layerzero.selection.duration",
        "s",
        "Host time spent selecting",
        ("op",),
        _split(("op",), "selection_seconds"),
    ),
    Instrument(
        "layerzero.cache.hits", "{lookup}", "Selection-cache hits", ("op",), _split(("op",), "cache_hits")
    ),
    Instrument(
        "layerzero.cache.misses",
        "{lookup}",
        "Selection-cache misses",
        ("op",),
        _split(("op",), "cache_misses"),
    ),
    Instrument(
        "layerzero.fallbacks",
        "{fallback}",
        "Fallbacks by kind (selection/runtime) and reason",
        ("op", "kind", "reason"),
        _split(("op", "kind", "reason"), "fallbacks"),
    ),
    Instrument("layerzero.perfdb.reads", "{read}", "PerfDB bucket reads", (), _scalar("perfdb_reads")),
    Instrument(
        "layerzero.health.trips",
        "{trip}",
        "Backend circuit-breaker trips",
        ("backend",),
        _split(("backend",), "health_trips"),
    ),
)
"""Every instrument :func:`otel_instrument` registers (all ``ObservableCounter``: monotonic, cumulative)."""


class OtelRegistration:
    """What :func:`otel_instrument` returns: the ``meter`` and its ``instruments``. OpenTelemetry cannot
    remove an instrument from a Meter; :meth:`close` makes every callback report nothing from then on."""

    def __init__(self, meter: Any) -> None:
        self.meter = meter
        self.instruments: list[Any] = []
        self.closed = False

    def close(self) -> None:
        """Stop reporting (the instruments stay registered on the meter, observing nothing)."""
        self.closed = True

    def callback(self, inst: Instrument, observation: Any) -> Callable[[Any], list[Any]]:
        def observe(options: Any = None) -> list[Any]:
            if self.closed:
                return []
            snap = TELEMETRY.snapshot()
            return [observation(value, attrs) for attrs, value in inst.rows(snap)]

        observe.__name__ = "observe_" + inst.name.replace(".", "_")
        return observe


def otel_instrument(meter_provider: Any = None) -> OtelRegistration:
    """Register LayerZero's counters as OpenTelemetry observable counters on ``meter_provider``'s Meter
    ``"layerzero"`` (the global provider, ``opentelemetry.metrics.get_meter_provider()``, when None).

    The callbacks read ``layerzero.telemetry.snapshot()`` when a reader collects (never per call); values are
    cumulative totals since the last ``layerzero.telemetry.reset()``. Recording itself is switched on by
    ``layerzero.telemetry.enable()``. Calling this twice on one provider registers the instruments twice (each
    point then appears twice): call it once per provider, or :meth:`OtelRegistration.close` the first.

    Returns:
        An :class:`OtelRegistration` (the meter, the instruments, ``close()``).

    Raises:
        ConfigurationError: ``opentelemetry-api`` is not installed (the message names the ``telemetry``
            extra).

    >>> import layerzero.telemetry as lzt
    >>> from opentelemetry.sdk.metrics import MeterProvider                      # doctest: +SKIP
    >>> from opentelemetry.sdk.metrics.export import InMemoryMetricReader        # doctest: +SKIP
    >>> reader = InMemoryMetricReader()                                          # doctest: +SKIP
    >>> lzt.enable(); lzt.otel_instrument(MeterProvider(metric_readers=[reader]))  # doctest: +SKIP
    """
    try:
        from opentelemetry import metrics
        from opentelemetry.metrics import Observation
    except ImportError as exc:
        raise ConfigurationError(
            "layerzero.telemetry.otel_instrument needs opentelemetry-api; it is not installed. "
            f"Fix: {INSTALL_HINT} (snapshot() and the Prometheus collector work without it)."
        ) from exc
    provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
    meter = provider.get_meter(METER_NAME)
    reg = OtelRegistration(meter)
    for inst in INSTRUMENTS:
        reg.instruments.append(
            meter.create_observable_counter(
                inst.name,
                callbacks=[reg.callback(inst, Observation)],
                unit=inst.unit,
                description=inst.description,
            )
        )
    return reg
