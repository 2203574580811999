"""Time to first token of sequential streamed ``/v1/completions`` requests against a running server (one at a
time, 50 ms apart, so each meets an idle engine: the server's own latency, as issue 37's 1 req/s target
reads it). Prompts are token ids (``--prompt-len``, only the last id differs between requests, so the prefix
cache serves the rest as it would offline); TTFT is the time to the first SSE ``data:`` line (ms). The first 3
requests are dropped (warm-up).

    python benchmarks/serving/ttft_sequential.py --port 8000 --requests 63 --max-tokens 1 --prompt-len 160

The same prompts offline: ``--offline MODEL`` (``LLM.generate`` with ``max_tokens=1``, CPU, warm-up on)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def _prompt(i: int, n: int) -> list[int]:
    return [3 + (j * 7) % 400 for j in range(n - 1)] + [3 + i % 400]


def _summary(ms: list[float]) -> dict[str, Any]:
    ms = ms[3:]
    return {
        "requests": len(ms),
        "p50_ms": statistics.median(ms),
        "mean_ms": statistics.mean(ms),
        "min_ms": min(ms),
    }


def server(port: int, n: int, max_tokens: int, plen: int) -> dict[str, Any]:
    """TTFTs (ms) of ``n`` sequential streamed requests to 127.0.0.1:``port``."""
    import httpx

    out = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for i in range(n):
            body = {"model": model, "prompt": [_prompt(i, plen)], "max_tokens": max_tokens, "stream": True,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            t0, first = time.perf_counter(), None
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("data:"):
                        first = time.perf_counter() - t0
            out.append(1e3 * first)
            time.sleep(0.05)
    return _summary(out)


def offline(model: str, n: int, plen: int) -> dict[str, Any]:
    """``LLM.generate`` (``max_tokens=1``) of the same prompts, one at a time (ms each), CPU."""
    from layerzero.engine import LLM, SamplingParams

    llm = LLM(model, device="cpu", warmup=True, max_num_seqs=16, max_num_batched_tokens=1024)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        llm.generate([_prompt(i, plen)], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        out.append(1e3 * (time.perf_counter() - t0))
    llm.shutdown()
    return _summary(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--requests", type=int, default=63)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--offline", default=None, metavar="MODEL", help="time LLM.generate on MODEL instead")
    a = ap.parse_args(argv)
    if a.offline:
        res = offline(a.offline, a.requests, a.prompt_len)
    else:
        res = server(a.port, a.requests, a.max_tokens, a.prompt_len)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
