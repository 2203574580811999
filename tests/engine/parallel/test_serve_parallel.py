"""``layerzero serve --tensor-parallel-size 2 --data-parallel-size 2`` (the CLI, on 127.0.0.1, CPU, Gloo): two
engine replicas of two ranks each answer the official ``openai`` client; concurrent greedy completions equal
one-rank ``LLM.generate``'s text, ``/health`` is 200, and SIGTERM drains and exits 0 with no process left."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from layerzero.engine import LLM, SamplingParams  # noqa: E402

from ..serve_process import complete_all, serve_env, wait_healthy  # noqa: E402

PROMPTS = ["hello world", "the cat sat on", "a b c d e", "one two"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_tp2_dp2_answers_the_openai_client(checkpoints):
    model = str(checkpoints["qwen3"])
    with LLM(model, device="cpu", dtype=torch.float32, max_model_len=128) as one:
        want = [
            o.outputs[0].text
            for o in one.generate(
                PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False
            )
        ]
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "layerzero",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--device",
        "cpu",
    ]
    cmd += ["--dtype", "float32", "--max-model-len", "128", "--served-model-name", "tiny"]
    cmd += ["--tensor-parallel-size", "2", "--data-parallel-size", "2", "--drain-timeout", "20"]
    proc = subprocess.Popen(cmd, env=serve_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 180)
        got = complete_all(url, PROMPTS)
        assert got == want
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
