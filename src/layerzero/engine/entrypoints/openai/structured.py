"""The server's structured-output fields as a :class:`~layerzero.engine.StructuredOutputsParams`:

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (the
  output is valid under ``schema``; always enforced, ``strict`` or not, as in vLLM);
- vLLM's extra field ``structured_outputs``: ``{"json": ..., "regex": ..., "choice": [...], "grammar": ...,
  "json_object": true, "disable_any_whitespace": ..., "backend": ...}`` (one constraint).

Anything else (an unknown type, a missing schema, both fields at once) is a 400 naming the field; a
constraint no grammar backend compiles is a 400 too (the engine's ``InvalidInputError``, raised before
anything is queued). docs/decoding.md, "Structured outputs"."""

from __future__ import annotations

from typing import Any

from ...structured_params import StructuredOutputsParams
from .errors import OpenAIError

__all__ = ["structured_outputs_from"]


def _params(field: str, **kw: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except (TypeError, ValueError) as exc:  # InvalidInputError, or an unknown key
        raise OpenAIError(400, f"{field}: {exc}", param=field) from None


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise OpenAIError(400, "response_format must be an object with a 'type'.", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _params("response_format", json_object=True)
    if kind == "json_schema":
        js = fmt.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError(
                400,
                "response_format of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}.",
                param="response_format",
            )
        return _params("response_format", json=schema)
    raise OpenAIError(
        400,
        f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'.",
        param="response_format",
    )


def structured_outputs_from(req: Any) -> StructuredOutputsParams | None:
    """The constraint a request asks for through ``response_format`` or ``structured_outputs`` (None: none).

    Raises:
        OpenAIError: 400 for a malformed field, an unsupported ``response_format`` type, or both fields set.
    """
    fmt = getattr(req, "response_format", None)
    extra = getattr(req, "structured_outputs", None)
    from_fmt = None if fmt is None else _response_format(fmt)
    if extra is None:
        return from_fmt
    if from_fmt is not None:
        raise OpenAIError(
            400, "Set either response_format or structured_outputs, not both.", param="structured_outputs"
        )
    if not isinstance(extra, dict):
        raise OpenAIError(400, "structured_outputs must be an object.", param="structured_outputs")
    return _params("structured_outputs", **extra)
