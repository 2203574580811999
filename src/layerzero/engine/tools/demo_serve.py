"""The server's part of ``make demo``: build the small checkpoint (as :mod:`.demo` does), start
``layerzero serve`` on it as a child process on 127.0.0.1 (a free port), wait for ``/health``, then talk to it
with the official ``openai`` client (one completion, one streamed chat completion) and ``httpx``
(``GET /v1/layerzero/kernels``), print what came back, SIGTERM the server and check that it drained and
exited 0. Every wait is bounded; the server process is always killed at the end.

Run: ``python -m layerzero.engine.tools.demo_serve [--dir DIR] [--timeout S]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODEL_NAME = "demo"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(model: Path, port: int) -> list[str]:
    """``layerzero serve`` on ``model`` (CPU, float32, a short context) at ``127.0.0.1:port``."""
    return [
        sys.executable,
        "-m",
        "layerzero",
        "serve",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "64",
        "--drain-timeout",
        "10",
    ]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    """Wait until ``GET url/health`` answers 200.

    Raises:
        RuntimeError: the server exited first, or did not answer within ``timeout`` seconds.
    """
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"layerzero serve exited with code {proc.returncode} before /health answered")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"layerzero serve: /health did not answer 200 within {timeout:.0f} s")
        time.sleep(0.2)


def _usage(u: Any) -> str:
    return f"{u.prompt_tokens} prompt + {u.completion_tokens} completion = {u.total_tokens} tokens"


def talk(url: str, timeout: float) -> dict[str, Any]:
    """One completion, one streamed chat completion (``openai``) and the kernel report (``httpx``)."""
    import httpx
    import openai

    out: dict[str, Any] = {}
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout) as client:
        r = client.completions.create(
            model=MODEL_NAME, prompt="The quick brown fox", max_tokens=16, temperature=0
        )
        out["completion"] = (r.choices[0].text, r.choices[0].finish_reason, _usage(r.usage))
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Say hello to the engine."}],
            max_tokens=16,
            temperature=0.8,
            seed=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, finish, usage = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = _usage(chunk.usage)
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                finish = c.finish_reason or finish
        out["chat"] = (parts, finish, usage)
    k = httpx.get(url + "/v1/layerzero/kernels", timeout=timeout)
    k.raise_for_status()
    out["kernels"] = k.json()
    return out


def _kernel_lines(report: dict[str, Any], limit: int = 8) -> list[str]:
    """``op  bucket -> kernels`` lines of the kernel report (op -> bucket -> rows of ``kernel``, ``why``):
    the first bucket of each op, its distinct kernels."""
    lines = []
    for op, buckets in report.items():
        if not isinstance(buckets, dict) or not buckets:
            continue
        bucket, rows = next(iter(buckets.items()))
        rows = rows if isinstance(rows, list) else [rows]
        kernels = sorted({str(r.get("kernel")) if isinstance(r, dict) else str(r) for r in rows})
        lines.append(f"    {op:<20} {bucket:<10} -> {', '.join(kernels)}")
        if len(lines) >= limit:
            break
    return lines


def stop(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM ``proc`` (the server drains) and wait up to ``timeout`` s; its exit code (killed: -9)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        return -9


def run(model: Path, timeout: float) -> int:
    """Serve ``model``, talk to it, stop it; 0 when everything answered and the server exited 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(serve_command(model, port), stdout=log, stderr=subprocess.STDOUT, env=env)
        code = None
        try:
            t0 = time.monotonic()
            wait_healthy(proc, url, timeout)
            print(f"  layerzero serve on {url}: healthy after {time.monotonic() - t0:.1f} s")
            got = talk(url, timeout)
            text, finish, usage = got["completion"]
            print("  (random weights: the text is noise; the point is the protocol)")
            print(f"  completions (openai client, greedy): {text!r} [{finish}, usage {usage}]")
            parts, finish, usage = got["chat"]
            print(f"  chat, streamed in {len(parts)} deltas: {''.join(parts)!r} [{finish}, usage {usage}]")
            rows = _kernel_lines(got["kernels"])
            print(f"  /v1/layerzero/kernels ({len(got['kernels'])} ops; the first shape bucket of each):")
            print("\n".join(rows))
            code = stop(proc, timeout)
            print(f"  SIGTERM: drained, exit code {code}")
        except Exception as exc:
            print(f"  server demo failed: {type(exc).__name__}: {exc}")
            log.seek(0)
            print("  server log (tail):\n" + "".join(log.readlines()[-40:]))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    ok = code == 0
    print("server demo: OK" if ok else "server demo: FAILED")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Build the checkpoint (or use ``--model``), then :func:`run`."""
    from layerzero.testing.checkpoints import build_checkpoint

    ap = argparse.ArgumentParser(
        prog="python -m layerzero.engine.tools.demo_serve", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint to serve (default: build one)")
    ap.add_argument("--dir", type=Path, default=None, help="where to build it (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any one wait may take")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_checkpoint("qwen3", args.dir or Path(tmp) / "qwen3")
        print(f"server demo: layerzero serve --model {path}")
        return run(path, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
