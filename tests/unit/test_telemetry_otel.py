"""``layerzero.telemetry.otel_instrument``: OpenTelemetry observable counters read at collection time, checked
against ``layerzero.telemetry.snapshot()`` (the oracle) through the SDK's ``InMemoryMetricReader``; names,
units and attributes as docs/telemetry.md lists them; the missing-package error; close()."""

from __future__ import annotations

import builtins

import pytest
import torch

import layerzero as lz
import layerzero.telemetry as lzt
from layerzero.core.errors import ConfigurationError
from layerzero.core.runtime import RUNTIME
from layerzero.telemetry_otel import INSTRUMENTS

pytestmark = pytest.mark.unit

sdk_metrics = pytest.importorskip("opentelemetry.sdk.metrics")
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402


@pytest.fixture(autouse=True)
def fresh(fresh_telemetry):
    """Telemetry off and zeroed around every test (tests/conftest.py ``fresh_telemetry``)."""
    yield


@pytest.fixture
def reader():
    r = InMemoryMetricReader()
    provider = sdk_metrics.MeterProvider(metric_readers=[r])
    reg = lzt.otel_instrument(provider)
    yield r
    reg.close()
    provider.shutdown()


def _collect(reader) -> dict[str, dict]:
    """metric name -> {"unit", "scope", "points": {frozenset(attrs): value}}."""
    out: dict[str, dict] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                pts = {frozenset(p.attributes.items()): p.value for p in m.data.data_points}
                out[m.name] = {
                    "unit": m.unit,
                    "scope": sm.scope.name,
                    "points": pts,
                    "monotonic": m.data.is_monotonic,
                }
    return out


def _workload():
    lzt.enable(sample_every=2)
    for _ in range(6):
        lz.rms_norm(torch.randn(3, 32), torch.ones(32))
    for _ in range(3):
        lz.layer_norm(torch.randn(2, 16), torch.ones(16))
    RUNTIME.cache.invalidate()
    with lz.prefer("torch_sdpa.cudnn"):  # CUDA only: a selection fallback on CPU
        lz.attention(*[torch.randn(1, 2, 4, 8) for _ in range(3)])


def test_collected_metrics_equal_the_snapshot(reader):
    _workload()
    got = _collect(reader)
    snap = lzt.snapshot()
    assert all(m["scope"] == "layerzero" and m["monotonic"] for m in got.values())
    calls = {frozenset({"op": op, "kernel": k}.items()): n for k, (op, n) in snap["calls"].items()}
    assert got["layerzero.kernel.calls"]["points"] == calls and calls
    sel = {
        frozenset(dict(zip(("op", "kernel"), k.split("|"), strict=True)).items()): n
        for k, n in snap["selections"].items()
    }
    assert got["layerzero.selections"]["points"] == sel
    for name, key in (
        ("layerzero.cache.hits", "cache_hits"),
        ("layerzero.cache.misses", "cache_misses"),
        ("layerzero.selection.duration", "selection_seconds"),
    ):
        assert got[name]["points"] == {frozenset({"op": op}.items()): n for op, n in snap[key].items()}, name
    fb = {
        frozenset(dict(zip(("op", "kind", "reason"), k.split("|", 2), strict=True)).items()): n
        for k, n in snap["fallbacks"].items()
    }
    assert got["layerzero.fallbacks"]["points"] == fb and fb
    assert got["layerzero.perfdb.reads"]["points"] == {frozenset(): snap["perfdb_reads"]}
    assert snap["cache_hits"]["rms_norm"] == 5 and snap["cache_misses"]["rms_norm"] == 1


def test_latency_histogram_as_bucket_sum_count(reader):
    _workload()
    got, snap = _collect(reader), lzt.snapshot()
    assert snap["latency_us"]
    for kernel, lat in snap["latency_us"].items():
        op = snap["calls"][kernel][0]
        attrs = frozenset({"op": op, "kernel": kernel}.items())
        assert got["layerzero.kernel.call.duration.count"]["points"][attrs] == lat["count"]
        assert got["layerzero.kernel.call.duration.sum"]["points"][attrs] == pytest.approx(lat["sum"] / 1e6)
        buckets = {
            dict(k)["le"]: v
            for k, v in got["layerzero.kernel.call.duration.bucket"]["points"].items()
            if dict(k)["kernel"] == kernel
        }
        assert buckets["+Inf"] == lat["count"]
        cum = 0
        for bound, n in lat["buckets"]:
            cum += n
            assert buckets["+Inf" if bound == float("inf") else repr(bound / 1e6)] == cum


def test_names_units_and_attributes_as_documented(reader):
    _workload()
    got = _collect(reader)
    doc = open("docs/telemetry.md", encoding="utf-8").read()
    for inst in INSTRUMENTS:
        assert f"`{inst.name}`" in doc and inst.unit in doc, inst.name
        if inst.name in got:
            assert got[inst.name]["unit"] == inst.unit
            for attrs in got[inst.name]["points"]:
                assert {k for k, _ in attrs} == set(inst.attributes), inst.name


def test_values_are_read_at_collection_time(reader):
    lzt.enable()
    lz.rms_norm(torch.randn(3, 32), torch.ones(32))
    first = sum(_collect(reader)["layerzero.kernel.calls"]["points"].values())
    lz.rms_norm(torch.randn(3, 32), torch.ones(32))
    assert sum(_collect(reader)["layerzero.kernel.calls"]["points"].values()) == first + 1 == 2


def test_close_reports_nothing():
    r = InMemoryMetricReader()
    provider = sdk_metrics.MeterProvider(metric_readers=[r])
    reg = lzt.otel_instrument(provider)
    lzt.enable()
    lz.rms_norm(torch.randn(3, 32), torch.ones(32))
    assert _collect(r)["layerzero.kernel.calls"]["points"]
    reg.close()
    assert not _collect(r).get("layerzero.kernel.calls", {}).get("points")
    provider.shutdown()


def test_missing_opentelemetry_raises_naming_the_extra(monkeypatch):
    real = builtins.__import__

    def no_otel(name, *args, **kwargs):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_otel)
    with pytest.raises(ConfigurationError, match=r"pip install layerzero\[telemetry\]") as info:
        lzt.otel_instrument()
    assert isinstance(info.value, ValueError) and isinstance(info.value.__cause__, ImportError)
