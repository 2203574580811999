"""``layerzero bench-serve``: vLLM's ``bench serve`` against any OpenAI-compatible server
(``layerzero serve``, vLLM, SGLang): Poisson arrivals at a request rate (or all at once), streamed
completions, per-request TTFT / TPOT / ITL / E2EL, throughputs and goodput (definitions:
:mod:`.bench_serve_report`).

Workload (:func:`make_requests`): ``num_prompts`` requests whose prompt and output lengths follow a synthetic
ShareGPT-like distribution, :data:`SHAREGPT_INPUT` / :data:`SHAREGPT_OUTPUT`: each a lognormal whose mean is
ShareGPT's published mean (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023, Fig. 11: 161.31 input and 337.99 output tokens per request), with ``sigma = 1.0``
(a long tail: median ``mean * exp(-sigma**2 / 2)``, 98 input / 205 output tokens; an assumed spread, not a fit
of the data set), rounded and clipped to [4, 1024] (vLLM's ShareGPT filter: prompts and outputs of 4 to 1,024
tokens). Prompts are uniformly random token ids in ``token_ids`` (default [3, 500): valid in every vocabulary
the engine's tests and benchmarks use), sent as token-id lists, so no tokenizer is needed on either side; each
request asks for exactly its output length (``max_tokens`` with ``ignore_eos``, vLLM's extra, so the lengths
are the distribution's; ``ignore_eos=False`` for servers that reject it), greedy.

Arrivals (:func:`arrival_times`): exponential gaps of mean ``1 / request_rate`` (a Poisson process, seeded),
the first at 0; ``inf`` sends everything at once. ``max_concurrency`` caps the requests in flight (the others
wait for a slot). The same seed gives the same requests and arrivals at every rate of a sweep.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import bad_config, bad_input
from .bench_serve_http import Client, TransportError, resolve_client
from .bench_serve_report import (
    GOODPUT_METRICS,
    RequestResult,
    format_summary,
    machine_info,
    plot_sweep,
    summarize,
)

__all__ = [
    "SHAREGPT_INPUT",
    "SHAREGPT_OUTPUT",
    "BenchServeConfig",
    "LengthDistribution",
    "arrival_times",
    "make_requests",
    "parse_goodput",
    "parse_rates",
    "run",
    "sweep",
]


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Token counts drawn from a lognormal of mean ``mean`` and log-space spread ``sigma``, rounded and
    clipped to ``[low, high]``.

    Raises:
        InvalidInputError: a non-positive mean, a negative sigma, ``low < 1`` or ``high < low``.
    """

    mean: float
    sigma: float = 1.0
    low: int = 4
    high: int = 1024

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and self.mean > 0):
            raise bad_input("length distribution mean", "a finite number > 0", repr(self.mean))
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise bad_input("length distribution sigma", "a finite number >= 0", repr(self.sigma))
        if self.low < 1 or self.high < self.low:
            raise bad_input("length distribution clip", "1 <= low <= high", f"[{self.low}, {self.high}]")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` lengths (ints in ``[low, high]``)."""
        mu = math.log(self.mean) - self.sigma**2 / 2  # the lognormal's mean is exp(mu + sigma^2 / 2)
        raw = rng.lognormal(mu, self.sigma, n)
        return [int(v) for v in np.clip(np.rint(raw), self.low, self.high)]


SHAREGPT_INPUT = LengthDistribution(161.31, 1.0, 4, 1024)
"""Prompt lengths: ShareGPT's mean (vLLM paper, Fig. 11), sigma 1.0, clipped to vLLM's [4, 1024]."""
SHAREGPT_OUTPUT = LengthDistribution(337.99, 1.0, 4, 1024)
"""Output lengths: ShareGPT's mean (vLLM paper, Fig. 11), sigma 1.0, clipped to vLLM's [4, 1024]."""


@dataclass(frozen=True, slots=True)
class BenchServeConfig:
    """One benchmark run (the ``layerzero bench-serve`` flags of the same names).

    ``model``: the served model name (None: the first of ``GET /v1/models``). ``goodput_ms``: SLO name ->
    milliseconds (:data:`GOODPUT_METRICS`). ``token_ids``: prompts' ids are drawn from ``[lo, hi)``.
    ``http_client``: ``auto`` (aiohttp when installed, else httpx), ``aiohttp`` or ``httpx``
    (:mod:`.bench_serve_http`; the result's ``http_client`` names the one used). ``client_processes``: the
    requests are sent from this many processes (:mod:`.bench_serve_procs`: one Python process streaming
    30-40 thousand chunks a second is itself the limit of a fast server).

    Raises:
        InvalidInputError: any field out of range (the message names it).
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "/v1/completions"
    num_prompts: int = 200
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    input_len: LengthDistribution = SHAREGPT_INPUT
    output_len: LengthDistribution = SHAREGPT_OUTPUT
    token_ids: tuple[int, int] = (3, 500)
    goodput_ms: dict[str, float] = field(default_factory=dict)
    ignore_eos: bool = True
    api_key: str | None = None
    request_timeout_s: float = 600.0
    http_client: str = "auto"
    client_processes: int = 1

    def __post_init__(self) -> None:
        if not self.endpoint.startswith("/") or not self.endpoint.endswith("/completions"):
            raise bad_input("--endpoint", "a path ending in /completions", repr(self.endpoint))
        if self.endpoint.endswith("/chat/completions"):
            raise bad_input(
                "--endpoint",
                "a completions endpoint (/v1/completions)",
                repr(self.endpoint),
                "bench-serve sends token-id prompts, which only the completions API takes.",
            )
        if self.num_prompts < 1:
            raise bad_input("--num-prompts", "an int >= 1", self.num_prompts)
        if not self.request_rate > 0:
            raise bad_input("--request-rate", "a rate > 0 (req/s) or inf", self.request_rate)
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise bad_input("--max-concurrency", "an int >= 1 or none", self.max_concurrency)
        lo, hi = self.token_ids
        if not 0 <= lo < hi:
            raise bad_input("--token-id-range", "LO:HI with 0 <= LO < HI", f"{lo}:{hi}")
        for k, v in self.goodput_ms.items():
            if k not in GOODPUT_METRICS or not v > 0:
                raise bad_input("--goodput", f"NAME:MS with NAME in {GOODPUT_METRICS}, MS > 0", f"{k}:{v}")
        if not self.request_timeout_s > 0:
            raise bad_input("--request-timeout", "seconds > 0", self.request_timeout_s)
        if self.client_processes < 1 or self.client_processes > self.num_prompts:
            raise bad_input(
                "--client-processes", f"an int in [1, num_prompts={self.num_prompts}]", self.client_processes
            )
        if self.max_concurrency is not None and self.max_concurrency < self.client_processes:
            raise bad_input(
                "--max-concurrency",
                f"at least --client-processes ({self.client_processes}): each process gets a share",
                self.max_concurrency,
            )


def parse_rates(text: str) -> list[float]:
    """``"1,4,16,64,inf"`` -> ``[1.0, 4.0, 16.0, 64.0, inf]``.

    Raises:
        InvalidInputError: an entry that is not a number > 0 or ``inf``.
    """
    rates = []
    for part in text.split(","):
        try:
            r = float(part)
        except ValueError:
            r = math.nan
        if not r > 0:
            raise bad_input("--sweep-rates", "comma-separated rates > 0 (req/s) or inf", repr(part))
        rates.append(r)
    return rates


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds).

    Raises:
        InvalidInputError: an item not ``NAME:MS`` with NAME in :data:`GOODPUT_METRICS` and MS > 0.
    """
    out: dict[str, float] = {}
    for item in items or ():
        name, _, ms = item.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = math.nan
        if name not in GOODPUT_METRICS or not (value > 0 and math.isfinite(value)):
            raise bad_input("--goodput", f"NAME:MS with NAME in {GOODPUT_METRICS} and MS > 0", repr(item))
        out[name] = value
    return out


def make_requests(cfg: BenchServeConfig) -> list[tuple[list[int], int]]:
    """``cfg.num_prompts`` (prompt token ids, max_tokens) pairs, seeded by ``cfg.seed`` (see the module
    docstring)."""
    rng = np.random.default_rng([cfg.seed, 0])
    ins = cfg.input_len.sample(rng, cfg.num_prompts)
    outs = cfg.output_len.sample(rng, cfg.num_prompts)
    lo, hi = cfg.token_ids
    return [(rng.integers(lo, hi, size=n).tolist(), m) for n, m in zip(ins, outs, strict=True)]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests: a Poisson process of ``rate`` req/s (seeded),
    the first at 0; all 0 for ``rate = inf``."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng([seed, 1]).exponential(1.0 / rate, n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()]


def _fail(r: RequestResult, reason: str, detail: str) -> RequestResult:
    r.success, r.error, r.detail = False, reason, detail[:300]
    return r


async def _request(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str]) -> RequestResult:
    """Send one streamed completion and time it (never raises: failures come back with their reason)."""
    r = RequestResult(prompt_len=len(payload["prompt"]), max_tokens=payload["max_tokens"])
    chunks, usage = 0, None
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream(url, payload, headers) as (status, lines):
            if status != 200:
                body = "\n".join([line async for line in lines])
                try:
                    err = json.loads(body)["error"]
                    kind, body = err.get("type") or "", err.get("message") or body
                except (ValueError, KeyError, TypeError, AttributeError):
                    kind = ""
                return _fail(r, f"HTTP {status}" + (f" {kind}" if kind else ""), body)
            async for line in lines:
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if isinstance(obj, dict) and "error" in obj:
                    err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
                    return _fail(r, "error in stream", str(err.get("message")))
                now = time.perf_counter()
                if obj.get("choices"):
                    if chunks == 0:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last, chunks = now, chunks + 1
                if obj.get("usage"):
                    usage = obj["usage"].get("completion_tokens")
        r.latency = time.perf_counter() - t0
    except TransportError as exc:
        return _fail(r, exc.kind, str(exc))
    except ValueError as exc:  # json.JSONDecodeError: not OpenAI's SSE
        return _fail(r, "bad SSE data", str(exc))
    if chunks == 0:
        return _fail(r, "no tokens", "the stream ended without a chunk with choices")
    r.success, r.output_len = True, int(usage) if isinstance(usage, int) else chunks
    return r


def _payload(cfg: BenchServeConfig, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    p: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        p["ignore_eos"] = True
    return p


async def _discover(client: Any, cfg: BenchServeConfig, headers: dict[str, str]) -> tuple[str, Any]:
    """(the model name, the server's ``/version`` answer or why there is none); probes the endpoint with one
    short request so an unreachable or incompatible server fails before the timed run.

    Raises:
        ConfigurationError: no server, no model listed, the probe request failed.
    """
    fix = "Start one (layerzero serve --model DIR) and pass its --base-url."
    model = cfg.model
    try:
        if model is None:
            status, body = await client.get_json(cfg.base_url + "/v1/models", headers)
            if status != 200:
                raise ValueError(f"GET /v1/models answered HTTP {status}")
            model = body["data"][0]["id"]
        status, body = await client.get_json(cfg.base_url + "/version", headers)
        version: Any = body if status == 200 else f"HTTP {status}"
    except (TransportError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise bad_config(
            "--base-url", "an OpenAI-compatible server listing a model", f"{type(exc).__name__}: {exc}", fix
        ) from exc
    lo = cfg.token_ids[0]
    probe = await _request(client, cfg.base_url + cfg.endpoint, _payload(cfg, model, [lo] * 4, 2), headers)
    if not probe.success:
        raise bad_config(
            "--base-url", f"a server answering POST {cfg.endpoint}", f"{probe.error}: {probe.detail}", fix
        )
    return model, version


async def send_requests(
    client: Any,
    cfg: BenchServeConfig,
    model: str,
    reqs: list[tuple[list[int], int]],
    indices: Sequence[int],
    start: float,
    max_concurrency: int | None,
) -> list[RequestResult]:
    """Send requests ``indices`` of ``reqs`` over ``client``, each at its arrival time after ``start`` (a
    ``time.perf_counter()`` value), at most ``max_concurrency`` in flight (None: no cap); their results in the
    order of ``indices``."""
    headers = _headers(cfg)
    url = cfg.base_url + cfg.endpoint
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    arrivals = arrival_times(len(reqs), cfg.request_rate, cfg.seed)

    async def one(i: int) -> RequestResult:
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        payload = _payload(cfg, model, *reqs[i])
        if sem is None:
            return await _request(client, url, payload, headers)
        async with sem:
            return await _request(client, url, payload, headers)

    return list(await asyncio.gather(*(one(i) for i in indices)))


def _headers(cfg: BenchServeConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def discover(cfg: BenchServeConfig) -> tuple[str, Any, str]:
    """(the model name, the server's ``/version`` answer, the HTTP client used) on a connection of its own
    (see ``_discover``)."""
    kind = resolve_client(cfg.http_client)
    async with Client(kind, 1, cfg.request_timeout_s) as client:
        model, version = await _discover(client, cfg, _headers(cfg))
    return model, version, kind


async def _benchmark(cfg: BenchServeConfig, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    n_conn = cfg.max_concurrency or len(reqs)
    kind = resolve_client(cfg.http_client)
    async with Client(kind, n_conn, cfg.request_timeout_s) as client:
        model, version = await _discover(client, cfg, _headers(cfg))
        start = time.perf_counter()
        results = await send_requests(client, cfg, model, reqs, range(len(reqs)), start, cfg.max_concurrency)
        duration = time.perf_counter() - start
    return report(results, duration, cfg, model, version, kind)


def report(
    results: list[RequestResult], duration: float, cfg: BenchServeConfig, model: str, version: Any, kind: str
) -> dict[str, Any]:
    """The run's summary (``summarize``) with the per-request lists under ``requests``."""
    out = summarize(results, duration, cfg.goodput_ms or None)
    out["model"], out["server_version"], out["http_client"] = model, version, kind
    out["requests"] = {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "e2els": [r.latency for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }
    return out


def run_loop(coro: Any) -> Any:
    """``asyncio.run(coro)`` on uvloop's event loop when it is installed (as uvicorn's ``loop="auto"``: the
    client's own per-chunk cost is what limits it at tens of thousands of chunks a second) and Python has
    ``asyncio.Runner`` (3.11+), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    runner = getattr(asyncio, "Runner", None)
    if uvloop is None or runner is None:
        return asyncio.run(coro)
    with runner(loop_factory=uvloop.new_event_loop) as r:
        return r.run(coro)


def _config_dict(cfg: BenchServeConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["api_key"] = "<set>" if cfg.api_key else None  # never write a key to a result file
    d["request_rate"] = str(cfg.request_rate) if math.isinf(cfg.request_rate) else cfg.request_rate
    return d


def run(cfg: BenchServeConfig, result_json: Path | None = None, *, quiet: bool = False) -> dict[str, Any]:
    """Run one benchmark and return its result (the summary fields at the top level, ``config``,
    ``machine``, ``server_version`` and the per-request lists under ``requests``); written to
    ``result_json`` when given, its table printed unless ``quiet``.

    Raises:
        ConfigurationError: the server cannot be reached or fails the probe request.
    """
    reqs = make_requests(cfg)
    if cfg.client_processes > 1:
        from .bench_serve_procs import run_processes

        res = run_processes(cfg, reqs)
    else:
        res = run_loop(_benchmark(cfg, reqs))
    res = {
        "tool": "layerzero bench-serve",
        "request_rate": cfg.request_rate,
        "max_concurrency": cfg.max_concurrency,
        **res,
        "config": _config_dict(cfg),
        "machine": machine_info(),
    }
    if not quiet:
        print(format_summary(res, cfg.request_rate), flush=True)
    if result_json is not None:
        result_json.parent.mkdir(parents=True, exist_ok=True)
        result_json.write_text(json.dumps(_json_safe(res), indent=2) + "\n")
    return res


def sweep(
    cfg: BenchServeConfig, rates: Sequence[float], result_dir: Path, *, quiet: bool = False
) -> dict[str, Any]:
    """:func:`run` at each of ``rates`` (the same requests each time), writing ``rate_<r>.json`` per rate,
    ``sweep.json`` (the summaries) and ``ttft_tpot_vs_rate.png`` into ``result_dir``; the plot is skipped,
    with its reason in ``sweep.json`` and the log, when matplotlib is not installed."""
    from dataclasses import replace

    result_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for rate in rates:
        res = run(replace(cfg, request_rate=rate), result_dir / f"rate_{rate:g}.json", quiet=quiet)
        rows.append({k: v for k, v in res.items() if k not in ("requests", "machine", "config")})
    plot = result_dir / "ttft_tpot_vs_rate.png"
    skipped = plot_sweep(rows, plot)
    out = {
        "tool": "layerzero bench-serve --sweep-rates",
        "rates": list(rates),
        "runs": rows,
        "plot": None if skipped else plot.name,
        "plot_skipped": skipped,
        "config": _config_dict(cfg),
        "machine": machine_info(),
    }
    (result_dir / "sweep.json").write_text(json.dumps(_json_safe(out), indent=2) + "\n")
    return out


def _json_safe(obj: Any) -> Any:
    """``obj`` with infinite floats as the string ``"inf"`` (JSON has no infinity)."""
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
