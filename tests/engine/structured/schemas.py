"""JSON schemas for the structured-output tests: nested objects, arrays with minItems / maxItems, enums,
consts, patterns, integers and numbers with bounds, booleans, nulls, required and optional properties,
anyOf, $defs / $ref. Every string is bounded (an enum, a pattern with bounded repeats, or maxLength) and every
number bounded, so a random-weight model (which only the grammar keeps valid) ends well within max_tokens."""

from __future__ import annotations

WORD = {"type": "string", "pattern": "^[a-z]{1,6}$"}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
COLOR = {"enum": ["red", "green", "blue"]}


def obj(props: dict, required: list[str] | None = None) -> dict:
    """A closed object of ``props`` (all required unless ``required`` says otherwise)."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[dict] = [
    # scalars at the top level
    {"type": "boolean"},
    {"type": "null"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    {"enum": ["alpha", "beta", "gamma", 1, None, True]},
    {"const": "fixed"},
    {"type": "string", "pattern": "^[A-Z][a-z]{2,4}$"},
    {"type": "string", "pattern": "^\\d{3}-\\d{4}$"},
    {"type": "string", "pattern": "^(yes|no|maybe)$"},
    {"type": "string", "enum": ["north", "south", "east", "west"]},
    # flat objects
    obj({"name": WORD, "age": SMALL}),
    obj({"ok": {"type": "boolean"}, "code": {"type": "integer", "minimum": 200, "maximum": 599}}),
    obj({"color": COLOR, "count": SMALL}),
    obj({"a": WORD, "b": WORD, "c": WORD}),
    obj({"id": {"type": "string", "pattern": "^[0-9a-f]{4}$"}, "flag": {"type": "null"}}),
    obj({"level": {"type": "integer", "minimum": 1, "maximum": 3}, "label": {"const": "x"}}),
    # optional properties
    obj({"name": WORD, "nick": WORD}, required=["name"]),
    obj({"x": SMALL, "y": SMALL, "z": SMALL}, required=["x"]),
    obj({"p": COLOR, "q": {"type": "boolean"}}, required=[]),
    # arrays
    {"type": "array", "items": SMALL, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": COLOR, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": WORD, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    {"type": "array", "items": obj({"k": WORD, "v": SMALL}), "minItems": 1, "maxItems": 2},
    obj({"tags": {"type": "array", "items": WORD, "minItems": 1, "maxItems": 3}, "n": SMALL}),
    obj(
        {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": SMALL, "maxItems": 2},
                "maxItems": 2,
            }
        }
    ),
    # nested objects
    obj({"user": obj({"name": WORD, "age": SMALL}), "active": {"type": "boolean"}}),
    obj({"a": obj({"b": obj({"c": SMALL})})}),
    obj({"point": obj({"x": SMALL, "y": SMALL}), "color": COLOR}),
    obj(
        {
            "meta": obj({"v": {"const": 1}, "kind": {"enum": ["doc", "img"]}}),
            "items": {"type": "array", "items": SMALL, "maxItems": 2},
        }
    ),
    obj(
        {"owner": obj({"id": SMALL, "email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}})}
    ),
    # numbers with bounds (integer-valued bounds on integers; numbers as enums / small ranges)
    obj(
        {
            "pct": {"type": "integer", "minimum": 0, "maximum": 100},
            "neg": {"type": "integer", "minimum": -9, "maximum": -1},
        }
    ),
    obj({"score": {"enum": [0.5, 1.5, 2.25]}}),
    {"type": "integer", "minimum": 0, "maximum": 0},
    # anyOf / nullable / $ref
    {"anyOf": [SMALL, {"type": "null"}]},
    obj({"v": {"anyOf": [WORD, {"type": "boolean"}]}}),
    {"anyOf": [obj({"kind": {"const": "a"}, "x": SMALL}), obj({"kind": {"const": "b"}, "y": WORD})]},
    {
        "$defs": {"pt": obj({"x": SMALL, "y": SMALL})},
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
        "required": ["from", "to"],
        "additionalProperties": False,
    },
    # length-bounded free strings (llguidance takes these: see the selector)
    obj({"title": {"type": "string", "minLength": 1, "maxLength": 6}}),
    {"type": "string", "maxLength": 5},
    obj({"words": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}}),
    # a realistic one
    obj(
        {
            "name": WORD,
            "age": {"type": "integer", "minimum": 18, "maximum": 65},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": obj(
                {"city": WORD, "zip": {"type": "string", "pattern": "^\\d{5}$"}}, required=["zip"]
            ),
            "langs": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "minItems": 1, "maxItems": 3},
            "verified": {"type": "boolean"},
        },
        required=["name", "age", "role", "address"],
    ),
]
