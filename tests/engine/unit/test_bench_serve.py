"""``layerzero bench-serve``: the metrics on a timeline worked by hand, the workload and arrivals, and
end-to-end runs against a fake OpenAI SSE server on 127.0.0.1 (http.server in a thread, stopped after each
test)."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import layerzero as lz

from ..conftest import deadline

pytestmark = pytest.mark.unit


def test_summary_of_a_timeline_worked_by_hand():
    """A: 10-token prompt, chunks at 0.10, 0.15, 0.25 s, stream ended at 0.25 s: TTFT 100 ms, ITL 50 and 100
    ms, TPOT (250 - 100) / 2 = 75 ms. B: 20-token prompt, one chunk at 0.30 s, ended at 0.30 s: TTFT 300 ms,
    no ITL, no TPOT (0 against an SLO). C: failed (HTTP 503). Over 0.5 s: 2 requests = 4 req/s, 4 output
    tokens = 8 tok/s, 34 tokens = 68 tok/s. Goodput at ttft <= 400 ms, tpot <= 50 ms: only B = 2 req/s."""
    from layerzero.engine.tools.bench_serve_report import RequestResult, summarize

    a = RequestResult(10, 3, True, 3, 0.10, [0.05, 0.10], 0.25)
    b = RequestResult(20, 1, True, 1, 0.30, [], 0.30)
    c = RequestResult(30, 5, False, error="HTTP 503 service_unavailable", detail="queue full")
    s = summarize([a, b, c], 0.5, {"ttft": 400.0, "tpot": 50.0})
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["failures"] == {"HTTP 503 service_unavailable": 1}
    assert s["failure_examples"] == {"HTTP 503 service_unavailable": "queue full"}
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 4
    approx = pytest.approx
    assert s["request_throughput"] == approx(4.0) and s["output_throughput"] == approx(8.0)
    assert s["total_token_throughput"] == approx(68.0) and s["request_goodput"] == approx(2.0)
    # TTFT [100, 300]: mean 200, median 200, p90 = 100 + 0.9 * 200 = 280, p99 = 298, std 100
    assert [s[f"{k}_ttft_ms"] for k in ("mean", "median", "p90", "p99", "std")] == approx(
        [200, 200, 280, 298, 100]
    )
    assert [s[f"{k}_tpot_ms"] for k in ("mean", "median", "p90", "p99")] == approx([75, 75, 75, 75])
    # ITL [50, 100]: p90 = 50 + 0.9 * 50 = 95, p99 = 99.5
    assert [s[f"{k}_itl_ms"] for k in ("mean", "median", "p90", "p99")] == approx([75, 75, 95, 99.5])
    assert [s[f"{k}_e2el_ms"] for k in ("mean", "median", "p90", "p99")] == approx([275, 275, 295, 299.5])
    # ttft <= 150 ms alone: only A
    assert summarize([a, b, c], 0.5, {"ttft": 150.0})["request_goodput"] == approx(2.0)
    assert "request_goodput" not in summarize([a, b, c], 0.5)
    assert summarize([c], 1.0)["mean_ttft_ms"] == 0.0  # nothing succeeded: zeros, no NaN


def test_length_distribution_and_workload():
    from layerzero.engine.tools.bench_serve import (
        SHAREGPT_INPUT,
        BenchServeConfig,
        LengthDistribution,
        make_requests,
    )

    rng = __import__("numpy").random.default_rng(0)
    assert LengthDistribution(10.4, 0.0, 1, 100).sample(rng, 3) == [10, 10, 10]  # sigma 0: round(mean)
    assert LengthDistribution(500.0, 0.0, 4, 64).sample(rng, 2) == [64, 64]  # clipped
    many = SHAREGPT_INPUT.sample(rng, 20000)
    assert min(many) >= 4 and max(many) == 1024
    # median of the lognormal: 161.31 * exp(-1 / 2) = 97.8 (clipping does not move it)
    assert sorted(many)[10000] == pytest.approx(97.8, rel=0.05)
    cfg = BenchServeConfig(num_prompts=50, token_ids=(7, 20), seed=3)
    reqs = make_requests(cfg)
    assert reqs == make_requests(cfg) and reqs != make_requests(BenchServeConfig(num_prompts=50, seed=4))
    assert all(4 <= len(p) <= 1024 and 4 <= m <= 1024 and all(7 <= t < 20 for t in p) for p, m in reqs)
    with pytest.raises(lz.InvalidInputError, match="length distribution clip"):
        LengthDistribution(10.0, 1.0, 8, 4)


def test_poisson_arrivals_are_seeded_with_the_rates_mean_gap():
    from layerzero.engine.tools.bench_serve import arrival_times

    assert arrival_times(4, math.inf, 0) == [0.0] * 4
    t = arrival_times(20000, 8.0, 1)
    assert t[0] == 0.0 and t == arrival_times(20000, 8.0, 1) and t != arrival_times(20000, 8.0, 2)
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    assert min(gaps) >= 0 and sum(gaps) / len(gaps) == pytest.approx(1 / 8.0, rel=0.03)


def test_option_parsing_and_validation():
    from layerzero.engine.tools.bench_serve import BenchServeConfig, parse_goodput, parse_rates

    assert parse_rates("1,4,16,64,inf") == [1.0, 4.0, 16.0, 64.0, math.inf]
    assert parse_goodput(["ttft:200", "tpot:50", "e2el:1e4"]) == {"ttft": 200.0, "tpot": 50.0, "e2el": 1e4}
    for bad in ("1,0", "1,x", "-2"):
        with pytest.raises(lz.InvalidInputError, match="--sweep-rates"):
            parse_rates(bad)
    for bad in (["ttft"], ["itl:5"], ["tpot:-1"], ["e2el:inf"]):
        with pytest.raises(lz.InvalidInputError, match="--goodput"):
            parse_goodput(bad)
    with pytest.raises(lz.InvalidInputError, match="token-id prompts"):
        BenchServeConfig(endpoint="/v1/chat/completions")
    with pytest.raises(lz.InvalidInputError, match="--max-concurrency"):
        BenchServeConfig(max_concurrency=0)
    with pytest.raises(lz.InvalidInputError, match="--token-id-range"):
        BenchServeConfig(token_ids=(5, 5))


class FakeServer:
    """An OpenAI completions server emitting one SSE chunk per token (``max_tokens`` of them, 2 ms apart),
    then a usage chunk and ``[DONE]``; the ``fail_at``-th POST (counting the probe) gets a 503 error object.
    Records every request body and the most requests it had in flight at once."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.bodies: list[dict] = []
        self.fail_at, self.posts, self.inflight, self.max_inflight = fail_at, 0, 0, 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _json(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
                else:
                    self._json(200, {"version": "fake-0"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.posts += 1
                    n = fake.posts
                    fake.bodies.append(body)
                    fake.inflight += 1
                    fake.max_inflight = max(fake.max_inflight, fake.inflight)
                try:
                    if n == fake.fail_at:
                        err = {
                            "message": "queue full",
                            "type": "service_unavailable",
                            "param": None,
                            "code": 503,
                        }
                        return self._json(503, {"error": err})
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for i in range(body["max_tokens"]):
                        chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f"t{i}"}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(0.002)
                    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
                    self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                finally:
                    with fake.lock:
                        fake.inflight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def fake_server():
    servers: list[FakeServer] = []

    def start(**kw):
        servers.append(FakeServer(**kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
    assert not any(s.thread.is_alive() for s in servers)


def _cfg(url: str, **kw):
    from layerzero.engine.tools.bench_serve import BenchServeConfig, LengthDistribution

    base = dict(
        base_url=url,
        num_prompts=12,
        input_len=LengthDistribution(8.0, 0.5, 2, 16),
        output_len=LengthDistribution(5.0, 0.5, 2, 8),
        token_ids=(3, 50),
        request_timeout_s=30.0,
    )
    return BenchServeConfig(**{**base, **kw})


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_run_against_a_fake_sse_server(fake_server, tmp_path, capsys, client):
    from layerzero.engine.tools.bench_serve import make_requests, run

    pytest.importorskip(client, reason=f"{client} is not installed (the dev extra installs it)")
    srv = fake_server(fail_at=3)
    cfg = _cfg(srv.url, max_concurrency=4, goodput_ms={"ttft": 10_000.0}, http_client=client)
    with deadline(60):
        res = run(cfg, tmp_path / "r.json")
    reqs = make_requests(cfg)
    probe, *sent = srv.bodies
    assert probe["max_tokens"] == 2 and len(sent) == 12 and srv.max_inflight <= 4
    assert sorted(map(json.dumps, sent)) == sorted(
        json.dumps(
            {
                "model": "fake-model",
                "prompt": p,
                "max_tokens": m,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
        )
        for p, m in reqs
    )
    failed = sent[1]  # the third POST
    ok = [b for b in sent if b is not failed]
    assert res["completed"] == 11 and res["failed"] == 1
    assert res["failures"] == {"HTTP 503 service_unavailable": 1}
    assert res["total_output_tokens"] == sum(b["max_tokens"] for b in ok)
    assert res["total_input_tokens"] == sum(len(b["prompt"]) for b in ok)
    n_itl = sum(len(x) for x in res["requests"]["itls"])
    assert n_itl == sum(b["max_tokens"] - 1 for b in ok)
    assert (
        0 < res["mean_ttft_ms"] < res["mean_e2el_ms"] and res["p99_itl_ms"] >= 1.0
    )  # >= the 2 ms sleeps, roughly
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert res["model"] == "fake-model" and res["server_version"] == {"version": "fake-0"}
    assert res["http_client"] == client
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["request_rate"] == "inf" and saved["completed"] == 11
    m = saved["machine"]
    assert {"date", "platform", "python", "cpu", "gpus", "versions"} <= set(m) and m["versions"]["numpy"]
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_client_processes_send_each_request_once_and_report_in_request_order(fake_server):
    from layerzero.engine.tools.bench_serve import make_requests, run
    from layerzero.engine.tools.bench_serve_procs import shares

    assert shares(7, 3) == [3, 2, 2] and shares(None, 2) == [None, None] and shares(4, 4) == [1, 1, 1, 1]
    srv = fake_server()
    cfg = _cfg(srv.url, num_prompts=9, max_concurrency=4, client_processes=2)
    with deadline(120):
        res = run(cfg, quiet=True)
    reqs = make_requests(cfg)
    probe, *sent = srv.bodies
    assert len(sent) == 9 and srv.max_inflight <= 4  # two shares of 2
    assert sorted((tuple(b["prompt"]), b["max_tokens"]) for b in sent) == sorted(
        (tuple(p), m) for p, m in reqs
    )
    assert res["completed"] == 9 and res["failed"] == 0
    assert res["requests"]["input_lens"] == [len(p) for p, _ in reqs]  # request i's result at index i
    assert res["requests"]["output_lens"] == [m for _, m in reqs]
    assert [len(x) for x in res["requests"]["itls"]] == [m - 1 for _, m in reqs]
    longest = max(res["requests"]["e2els"])
    assert longest <= res["duration"] < longest + 30  # the common start to the last process's end


def test_client_processes_are_checked():
    with pytest.raises(lz.InvalidInputError, match="client-processes"):
        _cfg("http://127.0.0.1:1", client_processes=0)
    with pytest.raises(lz.InvalidInputError, match="client-processes"):
        _cfg("http://127.0.0.1:1", num_prompts=2, client_processes=3)
    with pytest.raises(lz.InvalidInputError, match="max-concurrency"):
        _cfg("http://127.0.0.1:1", max_concurrency=1, client_processes=2)


def test_http_client_names_are_checked(monkeypatch):
    import importlib.util

    import layerzero as lz
    from layerzero.engine.tools.bench_serve_http import resolve_client

    with pytest.raises(lz.ConfigurationError, match="http_client"):
        resolve_client("requests")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "aiohttp" else real(n, *a))
    assert resolve_client("auto") == "httpx"  # auto falls back to httpx without aiohttp
    with pytest.raises(lz.ConfigurationError, match="pip install aiohttp"):
        resolve_client("aiohttp")


def test_sweep_writes_one_json_per_rate_and_the_plot_or_why_not(fake_server, tmp_path, monkeypatch, caplog):
    from layerzero.engine.tools.bench_serve import sweep

    srv = fake_server()
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as without matplotlib
    with deadline(60):
        out = sweep(_cfg(srv.url, num_prompts=6), [50.0, math.inf], tmp_path / "s", quiet=True)
    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert names == ["rate_50.json", "rate_inf.json", "sweep.json"]
    assert out["plot"] is None and "matplotlib is not installed" in out["plot_skipped"]
    assert "matplotlib is not installed" in caplog.text
    assert [r["completed"] for r in out["runs"]] == [6, 6] and [r["request_rate"] for r in out["runs"]] == [
        50.0,
        math.inf,
    ]


def test_sweep_draws_ttft_and_tpot_against_the_rate(fake_server, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: bench-serve skips the plot")
    from layerzero.engine.tools.bench_serve import sweep

    srv = fake_server()
    with deadline(60):
        out = sweep(_cfg(srv.url, num_prompts=3), [50.0, math.inf], tmp_path / "p", quiet=True)
    assert out["plot"] == "ttft_tpot_vs_rate.png" and out["plot_skipped"] is None
    assert (tmp_path / "p" / out["plot"]).read_bytes()[:4] == b"\x89PNG"


def test_cli_end_to_end_and_its_errors(fake_server, tmp_path, capsys):
    import socket

    from layerzero.cli import main

    srv = fake_server()
    argv = ["bench-serve", "--base-url", srv.url, "--num-prompts", "4", "--request-rate", "100"]
    argv += [
        "--input-len-mean",
        "6",
        "--output-len-mean",
        "3",
        "--max-input-len",
        "12",
        "--max-output-len",
        "6",
    ]
    argv += ["--min-len", "2", "--token-id-range", "3:40", "--goodput", "ttft:5000", "tpot:1000"]
    with deadline(60):
        assert main([*argv, "--result-json", str(tmp_path / "r.json")]) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert (
        res["completed"] == 4
        and res["request_rate"] == 100.0
        and res["goodput_slo_ms"]
        == {
            "ttft": 5000.0,
            "tpot": 1000.0,
        }
    )
    assert res["config"]["input_len"] == {"mean": 6.0, "sigma": 1.0, "low": 2, "high": 12}
    capsys.readouterr()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    for bad, match in (
        ([*argv, "--sweep-rates", "1,inf"], r"--request-rate: expected not with --sweep-rates"),
        (["bench-serve", "--base-url", closed, "--request-timeout", "5"], r"--base-url: expected an OpenAI"),
        (["bench-serve", "--token-id-range", "5"], r"--token-id-range: expected LO:HI"),
        (["bench-serve", "--goodput", "ttft"], r"--goodput: expected NAME:MS"),
    ):
        with deadline(60):
            rc = main(bad)
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("layerzero: error: ") and __import__("re").search(match, err), err


class _Proc:
    """A stand-in for a client process: only its exit code (None while it runs)."""

    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode


def test_a_client_process_that_dies_without_a_report_fails_the_run_at_once():
    import queue

    from layerzero.engine.tools.bench_serve_procs import collect

    out: queue.Queue = queue.Queue()
    out.put(("ok", "first"))
    procs = [_Proc(0), _Proc(-9)]  # the first reported and exited; the second was killed
    t0 = time.monotonic()
    got = collect(procs, out, limit_s=60.0, poll_s=0.01)
    assert next(got) == ("ok", "first")
    with pytest.raises(
        lz.ConfigurationError, match=r"1 that ended without a report \(exit codes \[-9, 0\]\)"
    ):
        next(got)
    assert time.monotonic() - t0 < 5.0  # not the 60 s limit


def test_collect_yields_late_reports_and_times_out_on_silence():
    import queue

    from layerzero.engine.tools.bench_serve_procs import collect

    out: queue.Queue = queue.Queue()
    procs = [_Proc(None), _Proc(None)]
    threading.Timer(0.05, out.put, args=(("ok", 1),)).start()
    threading.Timer(0.10, out.put, args=(("error", "boom"),)).start()
    assert list(collect(procs, out, limit_s=30.0, poll_s=0.01)) == [("ok", 1), ("error", "boom")]
    with pytest.raises(lz.ConfigurationError, match="none for 0 s"):
        list(collect([_Proc(None)], out, limit_s=0.05, poll_s=0.01))
