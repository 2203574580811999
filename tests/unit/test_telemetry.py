"""``layerzero.telemetry``: the counters dispatch records (calls, sampled latency, selections, cache
hits/misses, fallbacks with reasons, PerfDB reads, breaker trips), counted by hand on CPU calls; the
Prometheus exposition (collector in a user's registry, the HTTP endpoint) parsed back; the JSON-lines
selection log; off means off."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

import layerzero as lz
import layerzero.telemetry as lzt
from layerzero.core.errors import ConfigurationError
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def fresh(fresh_telemetry):
    """Telemetry off and zeroed around every test (tests/conftest.py ``fresh_telemetry``)."""
    yield


def _rms(rows=3, h=32):
    return lz.rms_norm(torch.randn(rows, h), torch.ones(h))


def test_off_records_nothing():
    for _ in range(5):
        _rms()
    snap = lzt.snapshot()
    assert snap["calls"] == {} and snap["cache_misses"] == {} and snap["selections"] == {}


def test_calls_hits_misses_and_selections_counted_by_hand():
    lzt.enable(sample_every=4)
    for _ in range(10):
        _rms()  # one key: 1 miss + 9 hits
    for _ in range(3):
        _rms(h=48)  # a second key: 1 miss + 2 hits
    snap = lzt.snapshot()
    kernel = lz.which("rms_norm", torch.randn(3, 32), torch.ones(32))
    assert snap["calls"][kernel] == ("rms_norm", 13)
    assert snap["cache_misses"]["rms_norm"] == 2 and snap["cache_hits"]["rms_norm"] == 11
    assert snap["selections"][f"rms_norm|{kernel}"] == 2 and snap["selection_seconds"]["rms_norm"] > 0
    lat = snap["latency_us"][kernel]  # calls 4, 8 and 12 of the kernel are timed
    assert lat["count"] == 3 and lat["sum"] > 0 and sum(n for _, n in lat["buckets"]) == 3


def test_runtime_and_selection_fallbacks_carry_their_reason():
    calls = {"n": 0}

    def broken(x, weight, eps, residual):
        calls["n"] += 1
        raise RuntimeError("boom")

    lz.register_kernel(
        "rms_norm", "brokenlib.rms_norm", broken, priority=1000, device_types={"cpu"}, dtypes={torch.float32}
    )
    try:
        lzt.enable()
        _rms()
        assert calls["n"] == 1
        assert lzt.snapshot()["fallbacks"] == {"rms_norm|runtime|RuntimeError": 1}
    finally:
        lz.unregister_kernel("brokenlib.rms_norm")
    lzt.reset()
    RUNTIME.cache.invalidate()
    qkv = [torch.randn(1, 2, 4, 8) for _ in range(3)]
    with lz.prefer("torch_sdpa.flash"):  # can run: no fallback
        lz.attention(*qkv)
    assert lzt.snapshot()["fallbacks"] == {}
    RUNTIME.cache.invalidate()
    with lz.prefer("torch_sdpa.cudnn"):  # CUDA only: the preference falls back, for the device-type reason
        lz.attention(*qkv)
    ((label, n),) = lzt.snapshot()["fallbacks"].items()
    op, kind, reason = label.split("|")
    assert (op, kind, n) == ("attention", "selection", 1) and "DEVICE_TYPE_UNSUPPORTED" in reason.split(",")


def test_selection_log_has_one_json_line_per_selection(tmp_path):
    path = tmp_path / "sel.jsonl"
    lzt.enable(selection_log=path)
    _rms()
    _rms()
    _rms(h=16)
    lzt.disable()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [ln["op"] for ln in lines] == ["rms_norm", "rms_norm"]
    assert lines[0]["context"]["hidden_size"] == "32" and lines[1]["context"]["hidden_size"] == "16"
    assert all(ln["kernel"] and ln["seconds"] >= 0 and isinstance(ln["rejected"], dict) for ln in lines)


def test_prometheus_collector_in_a_user_registry():
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    reg = prometheus_client.CollectorRegistry()
    reg.register(lzt.collector())
    lzt.enable(sample_every=1)
    for _ in range(3):
        _rms()
    text = prometheus_client.generate_latest(reg).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    kernel = lz.which("rms_norm", torch.randn(3, 32), torch.ones(32))
    calls = {
        tuple(sorted(s.labels.items())): s.value
        for s in fams["layerzero_kernel_calls"].samples
        if s.name.endswith("_total")
    }
    assert calls[(("kernel", kernel), ("op", "rms_norm"))] == 3
    hist = [s for s in fams["layerzero_kernel_call_seconds"].samples if s.name.endswith("_count")]
    assert hist and hist[0].value == 3  # sample_every=1: every call timed, the selecting one included
    misses = [s for s in fams["layerzero_cache_misses"].samples if s.name.endswith("_total")]
    assert misses[0].labels == {"op": "rms_norm"} and misses[0].value == 1


def test_http_endpoint_serves_the_metrics():
    pytest.importorskip("prometheus_client")
    out = lzt.start_http_server(0, addr="127.0.0.1")
    server = out[0] if isinstance(out, tuple) else None
    if server is None:
        pytest.skip("this prometheus-client does not return its server (< 0.17): port unknown")
    try:
        lzt.enable()
        _rms()
        port = server.server_address[1]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "layerzero_kernel_calls_total" in body and 'op="rms_norm"' in body
    finally:
        server.shutdown()


@pytest.mark.parametrize("bad", [0, 3, -4, 1.0, True])
def test_sample_every_must_be_a_power_of_two(bad):
    with pytest.raises(ConfigurationError, match="sample_every"):
        lzt.enable(sample_every=bad)


def test_bad_log_path_and_port_are_typed_errors(tmp_path):
    with pytest.raises(ConfigurationError, match="selection_log"):
        lzt.enable(selection_log=tmp_path / "no" / "such" / "dir" / "x.jsonl")
    with pytest.raises(ConfigurationError, match="selection_log"):
        lzt.enable(selection_log=123)
    with pytest.raises(ConfigurationError, match="port"):
        lzt.start_http_server(70000)
    assert not lzt.is_enabled()
