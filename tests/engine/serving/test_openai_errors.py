"""Every error is OpenAI's error object with the right status (never a traceback, never 422), and a client
that leaves aborts its request: checked with the ``openai`` client and raw ``httpx`` against live servers."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import API_KEY, LiveServer, server_args, wait_idle

pytestmark = pytest.mark.integration

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server, path, body=None, headers=AUTH, **kw):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30, **kw)


def _err(r, status, param=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    assert "Traceback" not in e["message"]
    if param is not None:
        assert e["param"] == param, e
    return e


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/v1/completions", {"prompt": "x", "foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of", "best_of"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", "temperature"),
        ("/v1/completions", {"prompt": "x", "temperature": "1"}, "temperature", "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "top_p"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "logprobs"),
        ("/v1/completions", {"prompt": "x", "n": True}, "n", "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 65}, "max_tokens", "limit"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens"),
        ("/v1/completions", {"prompt": "x " * 100, "max_tokens": 64}, "max_tokens", "maximum context length"),
        ("/v1/completions", {"prompt": []}, "prompt", "prompt"),
        ("/v1/completions", {"prompt": [1, 99999]}, "prompt", "[0, 512)"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "logit_bias"),
        ("/v1/completions", {}, "prompt", "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": []},
            "tools",
            "tools",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format",
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages.[0].role",
            "role",
        ),
        ("/v1/chat/completions", {"messages": []}, "messages", "messages"),
    ],
)
def test_bad_requests_are_400_naming_the_field(server, path, body, param, needle):
    e = _err(_post(server, path, body), 400, param)
    assert e["type"] == "invalid_request_error" and needle.lower() in e["message"].lower()


def test_malformed_bodies_methods_and_routes(server):
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"{bad",
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=60,
    )
    assert "JSON" in _err(r, 400)["message"]
    _err(
        httpx.post(
            server.url + "/v1/completions",
            content=b"prompt=x",
            headers={**AUTH, "Content-Type": "text/plain"},
            timeout=60,
        ),
        400,
    )
    _err(httpx.get(server.url + "/v1/completions", headers=AUTH, timeout=60), 405)
    _err(httpx.get(server.url + "/v1/nothing", headers=AUTH, timeout=60), 404)


def test_auth_model_and_size(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x", max_tokens=1)
    bad.close()
    assert _err(_post(server, "/v1/models", headers={}), 401)["code"] == "invalid_api_key"
    _err(httpx.get(server.url + "/metrics", timeout=60), 401)
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as exc:
        good.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert exc.value.body["code"] == "model_not_found"
    good.close()
    assert _err(_post(server, "/v1/completions", {"prompt": "x" * 70000}), 413)["code"] == "request_too_large"

    def chunked():
        for _ in range(20):
            yield b"x" * 8192

    r = httpx.post(
        server.url + "/v1/completions",
        content=chunked(),
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=60,
    )
    _err(r, 413)


def test_queue_full_and_draining_answer_503(engine, model_dir):
    from layerzero.engine.entrypoints.openai.api_server import build_app

    app = build_app(engine, server_args(model_dir, max_waiting_requests=0))
    live = LiveServer(app)
    try:
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x"}, timeout=60)
        assert _err(r, 503)["code"] == "queue_full" and r.headers["Retry-After"]
        app.state.server.max_waiting_requests = None
        assert (
            httpx.post(
                live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60
            ).status_code
            == 200
        )
        app.state.server.draining = True
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x"}, timeout=60)
        assert _err(r, 503)["type"] == "server_error" and r.headers["Retry-After"]
        assert httpx.get(live.url + "/health", timeout=60).status_code == 503
    finally:
        live.close()


def test_a_client_that_leaves_aborts_its_request(engine, model_dir):
    from layerzero.engine.entrypoints.openai.api_server import build_app

    live = LiveServer(build_app(engine, server_args(model_dir)))
    body = {"prompt": "hello", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    try:
        assert wait_idle(engine)
        with httpx.stream(
            "POST", live.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            first = next(r.iter_lines())
            assert first.startswith("data: ")
        assert wait_idle(engine), "the stream's request still runs (or holds KV blocks) after its client left"
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json=body, timeout=0.3)
        assert wait_idle(engine), "the request still runs (or holds KV blocks) after its client left"
    finally:
        live.close()
