"""Which grammar backend enforces a constraint, and why (LayerZero style: a selection with its reason).

Rules, in order:

1. ``backend="guidance"``: llguidance (asked for).
2. xgrammar when it can build the constraint's grammar (the default: fast bitmasks, compiled grammars cached),
   except a JSON schema with a length-bounded free string (``minLength`` / ``maxLength`` without ``pattern``,
   ``format``, ``enum`` or ``const``): xgrammar 0.2.9 lets raw control characters (U+0000-U+001F, invalid in
   JSON strings) into those, so llguidance takes them when it can (:func:`xgrammar_gap`).
3. ``backend="xgrammar"`` and xgrammar cannot: refused (``InvalidInputError``: xgrammar's message).
4. llguidance when it can (e.g. Lark grammars, JSON-schema features xgrammar lacks); the fallback is logged
   with xgrammar's error as the reason.
5. Neither can: ``InvalidInputError`` naming both errors.

Building a grammar here needs no tokenizer (xgrammar's ``Grammar.from_*``, llguidance's ``validate_grammar``),
so the front end checks a request before anything is queued; the engine core compiles against the vocabulary
(:mod:`.backends`)."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

from ..errors import bad_input
from ..sampling_params import SamplingParams
from ..structured_params import StructuredOutputsParams

__all__ = ["Selection", "check_request", "guidance_grammar", "select_backend", "xgrammar_grammar"]

log = logging.getLogger("layerzero.engine")


@dataclass(frozen=True)
class Selection:
    """The backend that enforces a constraint (``"xgrammar"`` or ``"guidance"``) and why it was chosen."""

    backend: str
    reason: str


def xgrammar_grammar(so: StructuredOutputsParams):  # -> xgrammar.Grammar
    """``so`` as an xgrammar ``Grammar`` (no tokenizer). JSON schemas and ``json_object`` (the schema
    ``{"type": "object"}``) without free whitespace when ``so.disable_any_whitespace``; ``choice`` as the EBNF
    alternation of its strings; ``grammar`` as xgrammar's EBNF (root rule ``root``).

    Raises:
        RuntimeError / ValueError: xgrammar cannot build it (its own message).
    """
    import xgrammar as xgr

    kind = so.kind
    if kind in ("json", "json_object"):
        schema = so.json if kind == "json" else '{"type": "object"}'
        return xgr.Grammar.from_json_schema(schema, any_whitespace=not so.disable_any_whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(so.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(so.choice))
    return xgr.Grammar.from_ebnf(so.grammar)


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """The EBNF grammar whose language is exactly ``choices`` (JSON string escapes: xgrammar's literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def guidance_grammar(so: StructuredOutputsParams) -> str:
    """``so`` as an llguidance grammar definition (text for ``LLMatcher``); JSON whitespace as in
    :func:`xgrammar_grammar`, objects closed as xgrammar's strict mode closes them (:func:`_closed`);
    ``grammar`` may be GBNF or Lark.

    Raises:
        ValueError: llguidance cannot convert it (a malformed schema or grammar).
    """
    import llguidance as ll

    kind = so.kind
    if kind in ("json", "json_object"):
        schema = _closed(so.schema) if kind == "json" else {"type": "object"}
        opts = {"whitespace_flexible": not so.disable_any_whitespace}
        return ll.LLMatcher.grammar_from_json_schema(schema, defaults=opts)
    if kind == "regex":
        return ll.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return ll.grammar_from("choice", list(so.choice))
    return ll.grammar_from("grammar", so.grammar)


def xgrammar_gap(so: StructuredOutputsParams) -> str | None:
    """Why xgrammar would enforce ``so`` wrongly although it compiles it (None: it would not): a JSON schema
    with a length-bounded free string (its character class there admits raw control characters)."""
    if so.kind != "json":
        return None

    def walk(node: object) -> bool:
        if isinstance(node, dict):
            if (
                ("minLength" in node or "maxLength" in node)
                and not any(k in node for k in ("pattern", "format", "enum", "const"))
                and node.get("type", "string") == "string"
            ):
                return True
            return any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False

    if walk(so.schema):
        return "xgrammar lets control characters into length-bounded JSON strings"
    return None


def _closed(node: Any) -> Any:
    """A copy of a JSON schema whose objects with ``properties`` and no ``additionalProperties`` get
    ``additionalProperties: false`` (what xgrammar's strict mode does; vLLM's guidance backend option
    ``disable-additional-properties``): both backends then generate the same objects."""
    if isinstance(node, dict):
        out = {k: _closed(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_closed(v) for v in node]
    return node


def _xgrammar_error(so: StructuredOutputsParams) -> str | None:
    try:
        xgrammar_grammar(so)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own types, by version
        return _short(exc)
    return None


def _guidance_error(so: StructuredOutputsParams) -> str | None:
    import llguidance as ll

    try:
        err = ll.LLMatcher.validate_grammar(guidance_grammar(so))
    except Exception as exc:  # a schema / grammar llguidance cannot even convert
        return _short(exc)
    return " ".join(err.split())[:300] or None


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # xgrammar prefixes "[time] file:line: "; keep the message
    msg = text[0] if text else type(exc).__name__
    if "] " in msg and msg.startswith("["):
        msg = msg.split(": ", 1)[-1]
    return msg[:300]


@functools.lru_cache(maxsize=1024)
def select_backend(so: StructuredOutputsParams) -> Selection:
    """The backend for ``so`` and the reason (rules in the module docstring); cached per constraint.

    Raises:
        InvalidInputError: the asked backend cannot build it, or neither can (each backend's message, before
            anything is queued).
    """
    what = f"structured_outputs.{so.kind}"
    fix = "Fix the constraint (see docs/decoding.md, 'Structured outputs', for what each backend supports)."
    if so.backend == "guidance":
        err = _guidance_error(so)
        if err is not None:
            raise bad_input(what, "a constraint llguidance can compile", f"llguidance: {err}", fix)
        return Selection("guidance", "backend='guidance' asked for")
    xerr = _xgrammar_error(so)
    gap = xgrammar_gap(so) if xerr is None and so.backend is None else None
    if gap is not None and _guidance_error(so) is None:
        sel = Selection("guidance", f"{gap}; llguidance does not")
        log.info("structured outputs: llguidance for a %s constraint: %s", so.kind, sel.reason)
        return sel
    if xerr is None:
        why = "backend='xgrammar' asked for" if so.backend == "xgrammar" else "default backend; compiles it"
        return Selection("xgrammar", why)
    if so.backend == "xgrammar":
        raise bad_input(what, "a constraint xgrammar can compile", f"xgrammar: {xerr}", fix)
    gerr = _guidance_error(so)
    if gerr is not None:
        raise bad_input(
            what,
            "a constraint xgrammar or llguidance can compile",
            f"xgrammar: {xerr}; llguidance: {gerr}",
            fix,
        )
    sel = Selection("guidance", f"xgrammar cannot compile this {so.kind} ({xerr}); llguidance can")
    log.info("structured outputs: llguidance for a %s constraint: %s", so.kind, sel.reason)
    return sel


def check_request(params: SamplingParams) -> Selection | None:
    """The request-level checks of ``params.structured_outputs`` that need no tokenizer (the front end and the
    engine core both run them): its backend selection (None: no constraint).

    Raises:
        InvalidInputError: see :func:`select_backend`; ``min_tokens`` with a constraint (the grammar may allow
            only EOS while ``min_tokens`` bans it: refused rather than sampled from an all -inf row).
    """
    so = params.structured_outputs
    if so is None:
        return None
    if params.min_tokens:
        raise bad_input(
            "SamplingParams.min_tokens",
            "0 with structured_outputs",
            params.min_tokens,
            "The grammar decides where the output ends; drop min_tokens.",
        )
    return select_backend(so)
