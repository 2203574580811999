"""Structured outputs through the OpenAI-compatible server, with the official ``openai`` client: chat
``response_format`` ``json_schema`` / ``json_object``, completions with ``response_format`` and vLLM's
``structured_outputs`` extra field; a schema no backend compiles is a 400 with OpenAI's error object (the
engine queued nothing). Lives with the server tests to share their engine (tests/engine/structured has the
rest)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "temp": {"type": "integer", "minimum": -20, "maximum": 45},
    },
    "required": ["city", "temp"],
}
MSG = [{"role": "user", "content": "Weather as JSON"}]


def test_chat_json_schema_and_json_object(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        n=2,
        seed=3,
        max_tokens=48,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
        },
    )
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    closers = {"95": 8.0, "63": 8.0, "4": 8.0}  # '}', ']', '"' of the test tokenizer: objects end early
    r = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        seed=4,
        max_tokens=64,
        logit_bias=closers,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_structured_outputs_extra_field(client):
    r = client.completions.create(
        model="tiny",
        prompt="Code:",
        n=3,
        seed=5,
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": "[A-F]{2}-[0-9]{2}"}},
    )
    assert all(re.fullmatch("[A-F]{2}-[0-9]{2}", c.text) for c in r.choices)
    r = client.completions.create(
        model="tiny",
        prompt="Pick:",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )
    assert r.choices[0].text in ("red", "green")
    r = client.completions.create(
        model="tiny",
        prompt="Data:",
        max_tokens=48,
        seed=6,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
        },
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            None,
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, None),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ],
)
def test_bad_constraints_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, **kw)
    err = e.value.body
    assert e.value.status_code == 400 and set(err) >= {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    else:
        assert "structured_outputs" in err["message"]
