"""Time to first token of sequential streamed ``/v1/completions`` requests against a running server (one at a
time, ``--gap-ms`` apart (50), so each meets an idle engine: the server's own latency, as issue 37's 1 req/s
target reads it). Prompts are token ids (``--prompt-len``; ``--prompts shared``: only the last id differs
between requests, so the prefix cache serves the rest as it would offline; ``unique``: no two share a first
id). TTFT is the time to the first SSE ``data:`` line (ms). The first 3 requests are dropped (warm-up).

    python benchmarks/serving/ttft_sequential.py --port 8000 --requests 63 --max-tokens 1 --prompt-len 160

The same prompts offline: ``--offline MODEL`` (``LLM.generate``, ``max_tokens=1``, warm-up on, ``--device``,
the same gaps: an engine idle for a while starts its next step on cooler CPU caches and clocks).
Where the server's time goes: ``--server-log FILE`` (the server's stderr) adds the medians of its
``request_finished`` lines' ``ttft_s`` and ``ttft_breakdown_ms`` parts (``RequestMetrics``); the client's TTFT
minus the server's is the HTTP request, the response's first write and the client. Offline runs report the
medians of the same engine parts (``RequestMetrics.ttft_breakdown``)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def _prompt(i: int, n: int, unique: bool = False) -> list[int]:
    """Request ``i``'s ``n`` prompt ids in [3, 403): all but the last shared by every request, or (``unique``)
    different from the first id on (no prefix-cache hit: the whole prompt is prefilled)."""
    if unique:
        return [3 + (i * 31 + j * 7) % 397 for j in range(n)]
    return [3 + (j * 7) % 400 for j in range(n - 1)] + [3 + i % 400]


def _gap(seconds: float, spin: bool) -> None:
    """Wait ``seconds`` between two requests: asleep, or (``spin``) busy on this thread, which keeps a CPU
    core clocked up (tells the CPU's idle states apart from the GPU's as the cause of a slower first step)."""
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _summary(ms: list[float], parts: list[dict[str, float]] | None = None) -> dict[str, Any]:
    ms = ms[3:]
    out: dict[str, Any] = {
        "requests": len(ms),
        "p50_ms": statistics.median(ms),
        "mean_ms": statistics.mean(ms),
        "min_ms": min(ms),
    }
    parts = [p for p in (parts or [])[3:] if p]
    if parts:
        out["breakdown_p50_ms"] = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    return out


def server_log_breakdown(path: str, n: int) -> dict[str, Any]:
    """Medians of the last ``n`` ``request_finished`` lines of a server's log (less the first 3): the
    server's ``ttft_s`` (ms) and each ``ttft_breakdown_ms`` part."""
    rows = []
    with open(path) as f:
        for line in f:
            if '"request_finished"' in line:
                rows.append(json.loads(line[line.index("{") :]))
    rows = rows[-n:][3:]
    out: dict[str, Any] = {"server_ttft_p50_ms": statistics.median(1e3 * r["ttft_s"] for r in rows)}
    parts = [r["ttft_breakdown_ms"] for r in rows if r.get("ttft_breakdown_ms")]
    if parts:
        out["server_breakdown_p50_ms"] = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    return out


def server(
    port: int, n: int, max_tokens: int, plen: int, unique: bool, gap_s: float, spin: bool
) -> dict[str, Any]:
    """TTFTs (ms) of ``n`` sequential streamed requests to 127.0.0.1:``port``."""
    import httpx

    out = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for i in range(n):
            ids = _prompt(i, plen, unique)
            body = {"model": model, "prompt": [ids], "max_tokens": max_tokens, "stream": True,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            t0, first = time.perf_counter(), None
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("data:"):
                        first = time.perf_counter() - t0
            out.append(1e3 * first)
            _gap(gap_s, spin)
    return _summary(out)


def offline(
    model: str, n: int, plen: int, device: str, unique: bool, gap_s: float, spin: bool
) -> dict[str, Any]:
    """``LLM.generate`` (``max_tokens=1``) of the same prompts, one at a time (ms each) on ``device`` (CPU:
    the server's flags above; CUDA: the defaults), with each request's engine parts."""
    from layerzero.engine import LLM, SamplingParams

    kw: dict[str, Any] = {"max_num_seqs": 16, "max_num_batched_tokens": 1024} if device == "cpu" else {}
    llm = LLM(model, device=device, warmup=True, **kw)
    out, parts = [], []
    for i in range(n):
        t0 = time.perf_counter()
        res = llm.generate(
            [_prompt(i, plen, unique)], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False
        )
        out.append(1e3 * (time.perf_counter() - t0))
        m = res[0].metrics
        parts.append(None if m is None else m.ttft_breakdown())
        _gap(gap_s, spin)
    llm.shutdown()
    return _summary(out, parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--requests", type=int, default=63)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--offline", default=None, metavar="MODEL", help="time LLM.generate on MODEL instead")
    ap.add_argument("--device", default="cpu", help="--offline's device (cpu, cuda)")
    ap.add_argument(
        "--prompts", choices=("shared", "unique"), default="shared", help="prefix-cache hits or none"
    )
    ap.add_argument("--gap-ms", type=float, default=50.0, help="idle time between two requests (ms)")
    ap.add_argument("--gap-mode", choices=("sleep", "spin"), default="sleep", help="how the gap is spent")
    ap.add_argument("--server-log", default=None, metavar="FILE", help="the server's log: add its breakdown")
    a = ap.parse_args(argv)
    if a.offline:
        res = offline(
            a.offline,
            a.requests,
            a.prompt_len,
            a.device,
            a.prompts == "unique",
            a.gap_ms / 1e3,
            a.gap_mode == "spin",
        )
    else:
        res = server(
            a.port,
            a.requests,
            a.max_tokens,
            a.prompt_len,
            a.prompts == "unique",
            a.gap_ms / 1e3,
            a.gap_mode == "spin",
        )
        if a.server_log:
            time.sleep(0.5)  # the last request's line is written after its stream ends
            res.update(server_log_breakdown(a.server_log, a.requests))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
