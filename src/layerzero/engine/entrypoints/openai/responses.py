"""The response shapes of the OpenAI-compatible server, for its OpenAPI document (``/openapi.json``).

The handlers build plain dicts (serving_*.py); these pydantic models only *describe* them (FastAPI's
``responses=``, never ``response_model``: nothing is re-validated or re-serialized on the hot path). They are
strict on purpose (every field required, no extra fields), so a client generated from the schema, or
schemathesis' ``response_schema_conformance`` check (tests/engine/serving/test_schemathesis.py), catches a
response that drifts from OpenAI's shape.

:func:`document` declares, per route, the error statuses it can answer (OpenAI's error object) and the
``text/event-stream`` alternative of a streamed 200, and drops FastAPI's ``422`` (this server never answers
it: errors.py maps validation errors to 400).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["ERRORS", "OPEN_ROUTES", "document", "responses"]

OPEN_ROUTES = frozenset({"/health"})
"""Routes that never need the API key."""

FinishReason = Literal["stop", "length", "abort", "error"]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Shape):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Shape):
    """OpenAI's error object."""

    error: ErrorDetail


class Usage(_Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Shape):
    """OpenAI's legacy logprobs (``-inf`` written -9999.0; the first echoed prompt token's is null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


class CompletionResponse(_Shape):
    """``POST /v1/completions`` (not streamed; a stream is ``text/event-stream`` of such objects' chunks)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Shape):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Shape):
    content: list[TokenLogprob]


class AssistantMessage(_Shape):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Shape):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


class ChatCompletionResponse(_Shape):
    """``POST /v1/chat/completions`` (not streamed)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(_Shape):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Shape):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Shape):
    prompt: str


class VersionResponse(_Shape):
    version: str


_WHY = {
    400: "An invalid or unsupported field (`param` names it), malformed JSON, a prompt over the context",
    401: "A missing or wrong API key (`code` `invalid_api_key`)",
    404: "An unknown model (`code` `model_not_found`)",
    408: "The body did not arrive within --request-body-timeout (`code` `request_timeout`)",
    413: "A body over --max-request-bytes (`code` `request_too_large`)",
    500: "The request failed inside the engine",
    503: "The queue is full, the server drains or the engine is dead (`Retry-After` when retrying helps)",
}
ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse, "description": d} for s, d in _WHY.items()
}
"""Every error status with OpenAI's error object."""

_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def responses(ok: type[BaseModel] | None, *errors: int, stream: bool = False) -> dict[int | str, Any]:
    """FastAPI ``responses=`` for a route: ``ok`` as the 200 body (``stream``: or an SSE stream), and the
    error statuses (401 is declared app-wide)."""
    out: dict[int | str, Any] = {s: ERRORS[s] for s in errors}
    if ok is not None:
        out[200] = {"model": ok, "description": "Success"}
        if stream:
            out[200]["content"] = dict(_SSE)
    return out


def document(app: Any) -> None:
    """Make ``app.openapi()`` drop FastAPI's ``422`` responses and their component schemas, and describe
    every error status as OpenAI's JSON error object (401 not on :data:`OPEN_ROUTES`)."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base()
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, item in schema.get("paths", {}).items():
            for op in item.values():
                if not isinstance(op, dict):
                    continue
                answers = op.get("responses", {})
                answers.pop("422", None)
                if path in OPEN_ROUTES:
                    answers.pop("401", None)
                for status, answer in answers.items():
                    if int(status) >= 400:  # JSON whatever the route's own media type (text/plain: /metrics)
                        answer["content"] = error
        comps = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            comps.pop(name, None)
        return schema

    app.openapi = openapi
