"""``layerzero serve --api-server-count 2`` (the CLI, 127.0.0.1, CPU): two API-server processes on one port in
front of a shared engine core. Concurrent greedy completions through the official ``openai`` client equal
``LLM.generate``'s text (the oracle); ``/metrics`` sums the front-end counters over both processes on every
scrape; SIGTERM drains and exits 0 with no process left; a killed engine core takes the whole server down
(exit 1) with no process left. The routing of one core's outputs to several clients is checked in
``tests/engine/unit/test_core_clients.py``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from layerzero.engine import LLM, SamplingParams  # noqa: E402

from ..serve_process import complete_all, serve_env, wait_healthy  # noqa: E402

PROMPTS = ["hello world", "the cat sat on", "a b c d e", "one two", "x y", "seven", "to be or", "z"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(p)
    return alive


def _assert_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids)


def _start(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "layerzero", "serve", "--model", model, "--port", str(port)]
    cmd += ["--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "--served-model-name", "tiny"]
    cmd += ["--api-server-count", "2", "--drain-timeout", "20", *extra]
    proc = subprocess.Popen(cmd, env=serve_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 180)
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def test_two_api_servers_answer_the_openai_client_and_sum_their_metrics(checkpoints):
    model = str(checkpoints["qwen3"])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(model, device="cpu", dtype=torch.float32, max_model_len=128) as one:
        want = [o.outputs[0].text for o in one.generate(PROMPTS, params, use_tqdm=False)]
    proc, url = _start(model, [])
    try:
        kids = _children(proc.pid)
        assert len(kids) >= 3  # two API servers and the core (and multiprocessing's resource tracker)

        got = complete_all(url, PROMPTS)
        assert got == want
        for _ in range(4):  # new connections: the scrapes land on both processes; each sums both
            text = httpx.get(url + "/metrics", timeout=10, headers={"Connection": "close"}).text
            assert _metric(text, "layerzero:request_success_total") == len(PROMPTS)
            assert _metric(text, "layerzero:generation_tokens_total") == 6 * len(PROMPTS)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err.decode()[-3000:]
        served = [int(p) for p in re.findall(r'"event": "request_finished".*?"pid": (\d+)', err.decode())]
        assert len(served) == len(PROMPTS) and set(served) <= set(kids)  # by the API-server processes
        _assert_gone(kids)
    finally:
        _stop(proc)


def test_a_killed_engine_core_takes_the_server_down(checkpoints):
    proc, url = _start(str(checkpoints["qwen3"]), [])
    try:
        kids = _children(proc.pid)
        pgid = os.getpgid(proc.pid)
        cores = [
            p
            for p in kids
            if os.getpgid(p) == pgid  # the API servers run in their own process groups
            and b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert len(cores) == 1, kids
        os.kill(cores[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 1
        assert "an engine core exited on its own" in err.decode()
        _assert_gone(kids)
    finally:
        _stop(proc)


def test_a_busy_port_is_a_typed_error_before_anything_starts():
    import socket

    import layerzero as lz
    from layerzero.engine.entrypoints.openai.api_servers import _listen

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(lz.ConfigurationError, match=rf"got 127.0.0.1:{port} .*Pick another --port"):
            _listen("127.0.0.1", port)
