"""Helpers of the tests that start ``python -m layerzero serve`` as a process: its environment (this
checkout's ``src`` first on ``PYTHONPATH``) and the wait for ``/health``."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def serve_env() -> dict[str, str]:
    """The environment for a child ``python -m layerzero``: this process's, with the checkout's ``src``
    first."""
    return {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Poll ``url``/health until 200; fails (with the server's last stderr) when the process exits or
    ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            err = proc.stderr.read().decode()[-3000:] if proc.stderr is not None else ""
            raise AssertionError(f"server not healthy (exit code {proc.poll()}): {err}")
        time.sleep(0.1)


def complete_all(url: str, prompts: list[str], max_tokens: int = 6, model: str = "tiny") -> list[str]:
    """Greedy completions of ``prompts`` (``ignore_eos``), all at once, through the official ``openai``
    client: one client, so one connection, per prompt (a server of several processes may take each)."""
    import concurrent.futures

    import openai

    def complete(prompt: str) -> str:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        r = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, prompts))
