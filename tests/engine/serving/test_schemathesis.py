"""schemathesis against the live server's own OpenAPI document (``GET /openapi.json``): bodies generated from
the request schemas, valid (``positive``) and invalid (``negative``), sent over 127.0.0.1 with the API key.

Checks on every response: no 5xx (``not_a_server_error``), the status is one the document declares
(``status_code_conformance``: so never FastAPI's 422), the content type too, the body matches the declared
schema (``response_schema_conformance``: 2xx bodies against the strict response models of
``entrypoints/openai/responses.py``, 4xx against OpenAI's error object), every 4xx is OpenAI's error object
(:func:`openai_error_shape`, also without the schema), an SSE stream is framed as OpenAI's (``data:`` events,
JSON or an error object, then ``[DONE]``); invalid bodies are refused (``negative_data_rejection``).

Bounded: :data:`MAX_EXAMPLES` per operation and mode, derandomized (the same examples every run), no
deadline, no example database; about 15 s on 2 cores with the tiny checkpoint.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from .conftest import API_KEY, LiveServer, server_args

pytestmark = pytest.mark.integration

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

MAX_EXAMPLES = 30
AUTH = {"Authorization": f"Bearer {API_KEY}"}
OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("GET", "/v1/layerzero/kernels"),
]


def openai_error_shape(ctx, response, case):
    """Every 4xx / 5xx body is ``{"error": {"message", "type", "param", "code"}}``, without a traceback."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"], err
    want = "invalid_request_error" if response.status_code < 500 else "server_error"
    assert err["type"] == want, err
    return None


def sse_framing(ctx, response, case):
    """A ``text/event-stream`` 200: ``data: {json}`` events (chunks, or an error object), then ``[DONE]``."""
    if (
        response.status_code != 200
        or "text/event-stream" not in response.headers.get("content-type", [""])[0]
    ):
        return None
    events = [e for e in response.content.decode().split("\n\n") if e]
    assert events and events[-1] == "data: [DONE]", events[-3:]
    for e in events[:-1]:
        assert e.startswith("data: "), e
        obj = json.loads(e[6:])
        if "error" in obj:
            assert set(obj["error"]) == {"message", "type", "param", "code"}, obj
        else:
            assert obj["object"] in {"text_completion", "chat.completion.chunk"}, obj
            assert obj["id"] and isinstance(obj["choices"], list), obj
    return None


@pytest.fixture(scope="module")
def server(engine, model_dir):
    """This module's server: the shared one's options, but at most 16 tokens a request (schemathesis' valid
    examples ask for up to n=128 choices)."""
    from layerzero.engine.entrypoints.openai.api_server import build_app

    args = server_args(
        model_dir, api_key=API_KEY, served_model_name=["tiny"], max_tokens_limit=16, max_request_bytes=65536
    )
    live = LiveServer(build_app(engine, args))
    yield live
    live.close()


@pytest.fixture(scope="module")
def api_schema(server):
    from schemathesis.config import SchemathesisConfig

    doc = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=30).json()
    return schemathesis.openapi.from_dict(doc, config=SchemathesisConfig())


def test_the_document_declares_no_422_and_errors_as_openai_objects(api_schema):
    doc = api_schema.raw_schema
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            answers = op["responses"]
            assert "422" not in answers, (method, path)
            assert "200" in answers, (method, path)
            for status, answer in answers.items():
                if int(status) >= 400:
                    ref = answer["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorResponse"), (method, path, status)
            assert ("401" in answers) == (path != "/health"), (method, path)


# negative examples only where there is a body to make invalid (the GET routes take no parameters)
RUNS = [(m, p, "positive") for m, p in OPERATIONS] + [
    (m, p, "negative") for m, p in OPERATIONS if m == "POST"
]


@pytest.mark.parametrize(("method", "path", "mode"), RUNS, ids=[f"{m} {p} {g}" for m, p, g in RUNS])
def test_schemathesis(api_schema, server, engine, method, path, mode):
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    op = api_schema[path][method]
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        openai_error_shape,
        sse_framing,
    ]
    if mode == "negative":
        checks.append(negative_data_rejection)
    gen = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    seen: list[int] = []

    @given(case=op.as_strategy(gen))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as generated
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        r = case.call(base_url=server.url, headers=AUTH, timeout=60)
        seen.append(r.status_code)
        case.validate_response(r, checks=checks, headers=AUTH)

    run()
    assert seen
    if mode == "positive" and method == "POST":
        assert any(s == 200 for s in seen), f"no valid example was accepted: {sorted(set(seen))}"
    deadline = time.monotonic() + 10
    while engine.num_running or engine.num_waiting:
        assert time.monotonic() < deadline, "requests still run after every client got its answer"
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # n was unbounded: 10**30 passed SamplingParams, the handler stalled the event loop building choices
        ("/v1/completions", b'{"prompt": "x", "n": 1000000000000000000000000000000}', "n"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 129}', "n"),
        # a lone surrogate is valid JSON but no text: the tokenizer raised a TypeError (500)
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    ],
)
def test_what_fuzzing_found_is_a_400(server, path, body, param):
    """Bodies found by fuzzing beyond schemathesis' examples (kept as regressions)."""
    r = httpx.post(
        server.url + path, content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=30
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
