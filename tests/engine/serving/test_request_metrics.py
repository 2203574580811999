"""Where a request's time to first token goes (``RequestMetrics``): the core's and the front end's timestamps
on one clock across the two processes, and the server's ``request_finished`` log line that splits its
``ttft_s`` into parts; ``configure_logging`` (what makes ``layerzero serve`` print those lines)."""

from __future__ import annotations

import io
import json
import logging
import time

import httpx
import pytest

from layerzero.engine import SamplingParams
from layerzero.engine.entrypoints.openai.api_server import configure_logging

from .conftest import API_KEY, on_loop

pytestmark = pytest.mark.integration

PARTS = ["http", "input", "to_core", "queue", "engine", "to_front_end", "to_stream"]


def test_async_engine_times_cross_the_process_boundary_in_order(engine):
    async def run():
        before = time.monotonic()
        outs = [o async for o in engine.generate([5, 9, 14, 3], SamplingParams(max_tokens=3), "rm-1")]
        return before, time.monotonic(), outs

    before, after, outs = on_loop(run())
    m = outs[-1].metrics
    assert m is not None and m.first_scheduled_time is not None and m.time_in_queue is not None
    core_arrival = m.first_scheduled_time - m.time_in_queue  # stamped in the core's process
    # one monotonic clock: the core's stamps fall between the front end's
    assert before <= m.arrival_time <= core_arrival <= m.first_scheduled_time
    assert m.first_scheduled_time <= m.first_token_time <= m.first_token_received_time <= after
    parts = m.ttft_breakdown()
    assert set(parts) == {"to_core", "queue", "engine", "to_front_end"} and min(parts.values()) >= 0.0
    total = 1e3 * (m.first_token_received_time - m.arrival_time)
    assert sum(parts.values()) == pytest.approx(total, abs=0.01)


def test_server_log_line_splits_ttft_into_parts(server, caplog):
    caplog.set_level(logging.INFO, logger="layerzero.engine.server")
    body = {"model": "tiny", "prompt": [[5, 9, 14, 3, 8]], "max_tokens": 2, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    t0 = time.monotonic()
    first = None
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if first is None and line.startswith("data:"):
                    first = time.monotonic() - t0
    deadline = time.monotonic() + 10
    lines = []
    while not lines and time.monotonic() < deadline:  # written when the stream's generator closes
        lines = [json.loads(r.getMessage()) for r in caplog.records if "request_finished" in r.getMessage()]
        time.sleep(0.02)
    (line,) = [x for x in lines if x["prompt_tokens"] == 5]
    parts = line["ttft_breakdown_ms"]
    assert list(parts) == PARTS and min(parts.values()) >= 0.0
    # the parts cover the server's time to first token exactly (each rounded to 1 us)
    assert sum(parts.values()) == pytest.approx(1e3 * line["ttft_s"], abs=0.01)
    assert 0.0 < line["ttft_s"] <= first  # the client's TTFT also holds the HTTP request and the write


def test_configure_logging_prints_layerzero_records_once(monkeypatch):
    root, lz_log = logging.getLogger(), logging.getLogger("layerzero")
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(lz_log, "handlers", [])
    monkeypatch.setattr(lz_log, "level", logging.NOTSET)
    buf = io.StringIO()
    handler = configure_logging(buf)
    try:
        assert handler is not None and lz_log.level == logging.INFO
        assert configure_logging(io.StringIO()) is None  # a handler is there now: nothing added
        logging.getLogger("layerzero.engine.server").info("hello %d", 7)
        logging.getLogger("layerzero.engine.server").debug("hidden")
        assert "INFO" in buf.getvalue() and "layerzero.engine.server: hello 7" in buf.getvalue()
        assert "hidden" not in buf.getvalue()
    finally:
        lz_log.removeHandler(handler)


def test_configure_logging_leaves_a_configured_application_alone(monkeypatch):
    lz_log = logging.getLogger("layerzero")
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    monkeypatch.setattr(lz_log, "handlers", [])
    assert configure_logging(io.StringIO()) is None and lz_log.handlers == []
