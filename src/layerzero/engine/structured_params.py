"""``StructuredOutputsParams``: the constraint a request's output must follow (vLLM's
``SamplingParams(structured_outputs=StructuredOutputsParams(...))``): a JSON schema, any JSON object, a regex,
one of a list of choices, or an EBNF grammar. Plain validated data; the grammar engine that enforces it is
:mod:`layerzero.engine.structured` (docs/decoding.md)."""

from __future__ import annotations

import json as _json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from .errors import bad_input

__all__ = ["KINDS", "StructuredOutputsParams"]

KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The constraint kinds, one of which a :class:`StructuredOutputsParams` sets."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names):

    - ``json``: a JSON schema (a dict, or its JSON text): the output is one JSON value valid under it.
    - ``regex``: the output full-matches this regular expression.
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: an EBNF grammar (GBNF / xgrammar's dialect, root rule ``root``).
    - ``json_object=True``: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).

    ``disable_any_whitespace`` (default True, unlike vLLM's False): JSON is generated without free whitespace
    between tokens, so a model cannot fill ``max_tokens`` with blanks (vLLM's engine option of that name).
    ``backend``: None (LayerZero picks per constraint kind, with reasons), ``"xgrammar"`` or
    ``"guidance"`` (llguidance).

    Stored as plain data (``json`` as the canonical JSON text, ``choice`` as a tuple); ``to_dict()`` /
    ``StructuredOutputsParams(**d)`` round-trip through msgpack.

    Raises:
        InvalidInputError: no constraint or more than one, a schema that is not a JSON object (or not valid
            JSON text), an empty regex / grammar, an empty or non-string choice, an unknown backend.
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    backend: str | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise bad_input(
                "StructuredOutputsParams",
                f"exactly one of {', '.join(KINDS)}",
                given or "none",
                "Set one constraint per request.",
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as exc:
                    raise bad_input(
                        "StructuredOutputsParams.json",
                        "a JSON schema (dict or JSON text)",
                        f"invalid JSON: {exc}",
                    ) from None
            if not isinstance(schema, Mapping):
                raise bad_input("StructuredOutputsParams.json", "a JSON schema object", type(schema).__name__)
            put(self, "json", _json.dumps(schema, sort_keys=True, separators=(",", ":")))
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise bad_input(f"StructuredOutputsParams.{name}", "a non-empty string", repr(v))
        if self.choice is not None:
            ch = self.choice
            if (
                isinstance(ch, str)
                or not isinstance(ch, Sequence)
                or not ch
                or not all(isinstance(c, str) and c for c in ch)
            ):
                raise bad_input(
                    "StructuredOutputsParams.choice", "a non-empty list of non-empty strings", repr(ch)
                )
            put(self, "choice", tuple(ch))
        if self.json_object not in (None, True, False):
            raise bad_input("StructuredOutputsParams.json_object", "True or None", repr(self.json_object))
        if not isinstance(self.disable_any_whitespace, bool):
            raise bad_input(
                "StructuredOutputsParams.disable_any_whitespace", "a bool", repr(self.disable_any_whitespace)
            )
        if self.backend not in (None, "xgrammar", "guidance"):
            raise bad_input(
                "StructuredOutputsParams.backend", "None, 'xgrammar' or 'guidance'", repr(self.backend)
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: one of :data:`KINDS`."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema as a dict (``json`` parsed), or None."""
        return None if self.json is None else _json.loads(self.json)

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from the defaults, as plain data (``StructuredOutputsParams(**d)``
        rebuilds it)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out
