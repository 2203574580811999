"""The server as a process: its flags, the bind check, and in a child process SIGTERM draining (running
requests finish, new ones 503, exit 0) and no web library imported by ``import layerzero.engine`` or the
server module."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

import layerzero as lz
from layerzero.engine.entrypoints.openai.api_server import add_server_args, check_bind

from ..serve_process import serve_env, wait_healthy
from .conftest import free_port

pytestmark = pytest.mark.integration


def test_flags_and_defaults():
    ns = add_server_args(argparse.ArgumentParser()).parse_args([])
    assert (ns.host, ns.port, ns.api_key, ns.served_model_name) == ("127.0.0.1", 8000, None, None)
    assert ns.max_request_bytes == 1 << 20 and ns.drain_timeout == 30.0 and not ns.allow_unauthenticated
    ns = add_server_args(argparse.ArgumentParser()).parse_args(
        ["--served-model-name", "a", "b", "--max-waiting-requests", "3", "--log-requests"]
    )
    assert ns.served_model_name == ["a", "b"] and ns.max_waiting_requests == 3 and ns.log_requests


def test_a_public_address_needs_a_key_or_an_explicit_opt_out():
    for host in ("127.0.0.1", "::1", "localhost"):
        check_bind(host, None, False)
    with pytest.raises(lz.ConfigurationError, match="--allow-unauthenticated"):
        check_bind("0.0.0.0", None, False)
    check_bind("0.0.0.0", "sk", False)
    check_bind("0.0.0.0", None, True)


def test_the_http_stack_in_the_start_up_log_follows_what_is_installed():
    from layerzero.engine.entrypoints.openai.api_server import _http_stack

    assert _http_stack(lambda name: None) == "uvicorn on asyncio, h11 parser"
    assert _http_stack(lambda name: object()) == "uvicorn on uvloop, httptools parser"
    only = _http_stack(lambda name: object() if name == "httptools" else None)
    assert only == "uvicorn on asyncio, httptools parser"


NO_WEB = textwrap.dedent(
    """
    import sys
    import layerzero.engine
    from layerzero.engine import AsyncLLM
    from layerzero.engine.entrypoints.openai import api_server
    web = [m for m in ("fastapi", "uvicorn", "starlette", "prometheus_client", "zmq") if m in sys.modules]
    assert not web, f"imported before the app was built: {web}"
    """
)


def test_engine_and_server_modules_import_no_web_library():
    r = subprocess.run([sys.executable, "-c", NO_WEB], env=serve_env(), capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-3000:]


def test_sigterm_drains_then_exits_zero(model_dir):
    """``layerzero serve`` (the CLI, its engine core a grandchild process) drains on SIGTERM: the running
    stream finishes, new requests and /health get 503, then the process exits 0."""
    port = free_port()
    cmd = [sys.executable, "-m", "layerzero", "serve", "--model", model_dir, "--port", str(port)]
    cmd += ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--drain-timeout", "20"]
    proc = subprocess.Popen(cmd, env=serve_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
            assert refused.status_code == 503 and refused.headers["Retry-After"]
            assert httpx.get(url + "/health", timeout=10).status_code == 503
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
