"""Safe YAML loading for policy (and capability) files: size, depth, tag, duplicate-key and alias-bomb guards.

YAML is read with ``yaml.safe_load`` semantics only, after a guarded pre-scan: documents over
:data:`MAX_POLICY_BYTES`, nesting deeper than :data:`MAX_DEPTH`, explicit tags (``!!python/object``...),
duplicate keys (``<<`` merge keys included: list several merged mappings in one ``<<: [*a, *b]``) and alias
bombs (more than :data:`MAX_NODES` nodes once aliases are expanded) are rejected
with :class:`~layerzero.core.errors.PolicyValidationError`.

This is its own module because reading untrusted YAML safely is a concern apart from what a policy means:
:mod:`.policy` builds a :class:`~layerzero.core.policy.Policy` from the data :func:`safe_load_yaml` returns,
and :mod:`.capabilities` reads its files with the same guards. The names are re-exported by :mod:`.policy`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml

from .errors import PolicyValidationError, expected_got
from .policy_conditions import short, type_name

MAX_POLICY_BYTES = 1 << 20  #: largest accepted policy document, in bytes of UTF-8 text (1 MiB)
MAX_DEPTH = 32  #: deepest accepted nesting of YAML collections
MAX_NODES = 100_000  #: most nodes a document may expand to once aliases are followed
_LOADER: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _names_file(text: str) -> bool:
    return len(text) < 4096 and "\n" not in text and os.path.isfile(text)


def _read_source(text_or_path: Any) -> tuple[str, str, bool]:
    """Return ``(text, source, from_file)``; enforce the size limit before decoding."""
    from_file = isinstance(text_or_path, os.PathLike) or (
        isinstance(text_or_path, str) and _names_file(text_or_path)
    )
    if from_file:
        path = os.fsdecode(os.fspath(text_or_path))
        try:
            size = os.stat(path).st_size
            if size > MAX_POLICY_BYTES:
                raise PolicyValidationError(
                    expected_got(f"policy file {path}", f"at most {MAX_POLICY_BYTES} bytes", f"{size} bytes")
                )
            with open(path, "rb") as fh:
                raw = fh.read(MAX_POLICY_BYTES + 1)
        except OSError as exc:
            raise PolicyValidationError(
                expected_got(
                    f"policy file {path}",
                    "a readable YAML file",
                    f"{type(exc).__name__}: {exc.strerror or exc}",
                )
            ) from None
        source = path
    elif isinstance(text_or_path, bytes | bytearray | memoryview):
        raw, source = bytes(text_or_path), "<bytes>"
    elif isinstance(text_or_path, str):
        raw, source = text_or_path.encode("utf-8", "surrogatepass"), "<yaml>"
    else:
        raise PolicyValidationError(
            expected_got("policy source", "YAML text (str/bytes) or a file path", type_name(text_or_path))
        )
    if len(raw) > MAX_POLICY_BYTES:
        raise PolicyValidationError(
            expected_got(
                f"{source}",
                f"at most {MAX_POLICY_BYTES} bytes of YAML",
                f"{len(raw)} bytes",
                "Split or shrink the policy.",
            )
        )
    try:
        return raw.decode("utf-8-sig"), source, from_file
    except UnicodeDecodeError as exc:
        raise PolicyValidationError(
            expected_got(source, "UTF-8 text", f"invalid byte at offset {exc.start}")
        ) from None


def _yaml_error(source: str, exc: Exception) -> PolicyValidationError:
    return PolicyValidationError(
        f"{source}: not valid YAML ({short(str(exc), 300)}). Fix the syntax; see docs/policies.md."
    )


def _prescan(text: str, source: str) -> None:
    """Walk the YAML event stream (no objects built): reject tags, duplicate keys and deep nesting."""
    loader = _LOADER(text)
    stack: list[list[Any]] = []  # per open collection: [is_mapping, at_key_position, keys_seen]
    try:
        while loader.check_event():
            event = loader.get_event()
            if isinstance(event, yaml.CollectionEndEvent):
                stack.pop()
                continue
            if not isinstance(event, yaml.NodeEvent):
                continue
            tag = getattr(event, "tag", None)
            if tag is not None:
                raise PolicyValidationError(
                    expected_got(
                        f"{source}: line {event.start_mark.line + 1}",
                        "plain YAML values without tags",
                        f"tag {short(tag)}",
                        "Remove the tag; policies are data only.",
                    )
                )
            if stack and stack[-1][0]:
                frame = stack[-1]
                if frame[1] and isinstance(event, yaml.ScalarEvent):
                    if event.value in frame[2]:
                        fix = (
                            "List the merged mappings in one key: '<<: [*a, *b]'."
                            if event.value == "<<"
                            else "Merge the two entries into one."
                        )
                        raise PolicyValidationError(
                            expected_got(
                                f"{source}: line {event.start_mark.line + 1}",
                                "unique mapping keys",
                                f"duplicate key {short(event.value)}",
                                fix,
                            )
                        )
                    frame[2].add(event.value)
                frame[1] = not frame[1]
            if isinstance(event, yaml.CollectionStartEvent):
                stack.append([isinstance(event, yaml.MappingStartEvent), True, set()])
                if len(stack) > MAX_DEPTH:
                    raise PolicyValidationError(
                        expected_got(source, f"nesting depth <= {MAX_DEPTH}", "deeper nesting")
                    )
    except yaml.YAMLError as exc:
        raise _yaml_error(source, exc) from None
    finally:
        loader.dispose()


def check_budget(data: Any, source: str) -> None:
    """Reject data that expands to more than :data:`MAX_NODES` nodes or :data:`MAX_DEPTH` levels (alias
    bombs, recursive aliases, recursive dicts). Iterative, so its cost is bounded by the budget.
    Raises ``PolicyValidationError``."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    count = 0
    while stack:
        obj, depth = stack.pop()
        count += 1
        if count > MAX_NODES or depth > MAX_DEPTH:
            raise PolicyValidationError(
                expected_got(
                    source,
                    f"at most {MAX_NODES} nodes and depth {MAX_DEPTH} (aliases expanded)",
                    "more (a YAML alias bomb or a recursive structure?)",
                    "Write the policy without deep aliases.",
                )
            )
        if isinstance(obj, Mapping):
            for key, value in obj.items():
                stack.append((key, depth + 1))
                stack.append((value, depth + 1))
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend((item, depth + 1) for item in obj)


def safe_load_yaml(text_or_path: str | bytes | os.PathLike[str]) -> tuple[Any, str]:
    """Load one YAML document safely; return ``(data, source)`` (source = the path, or ``"<yaml>"``).

    ``text_or_path``: ``bytes`` are always YAML text; an ``os.PathLike`` is a path; a ``str`` naming an
    existing file (one line, < 4096 chars) is read as a path, any other ``str`` is YAML text. Only plain
    YAML data is produced (``yaml.safe_load`` semantics, libyaml when available). Raises
    ``PolicyValidationError`` for unreadable or oversized input (> :data:`MAX_POLICY_BYTES`), invalid
    UTF-8 or YAML, explicit tags, duplicate keys, nesting deeper than :data:`MAX_DEPTH` or more than
    :data:`MAX_NODES` nodes once aliases are expanded.
    """
    text, source, from_file = _read_source(text_or_path)
    _prescan(text, source)
    try:
        data = yaml.load(text, Loader=_LOADER)  # noqa: S506 - _LOADER is a SafeLoader; tags were rejected
    except yaml.YAMLError as exc:
        raise _yaml_error(source, exc) from None
    check_budget(data, source)
    if (
        isinstance(data, str)
        and not from_file
        and "\n" not in text.strip()
        and (text.strip().endswith((".yaml", ".yml")) or os.sep in text)
    ):
        raise PolicyValidationError(
            expected_got(
                "policy file",
                "an existing file",
                short(text.strip()),
                "Check the path (it was read as YAML text).",
            )
        )
    return data, source
