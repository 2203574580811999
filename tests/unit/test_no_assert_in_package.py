"""Validation never relies on ``assert`` (the brief: ``python -O`` strips it): the package holds no ``assert``
statement and reads no ``__debug__``, the only two things ``-O`` changes in our code, so every check runs the
same with and without it. Parsed with ``ast`` (a string or a comment saying "assert" does not count). The
``-O`` pass of ``tools/run_tests.sh`` then runs the validation tests only, as a second line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import layerzero

pytestmark = pytest.mark.unit


def _offenders(source: str, name: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Assert):
            out.append(f"{name}:{node.lineno} assert")
        elif isinstance(node, ast.Name) and node.id == "__debug__":
            out.append(f"{name}:{node.lineno} __debug__")
    return out


def test_the_checker_finds_both():
    src = "x = 1\nassert x, 'message'\nif __debug__:\n    pass\ns = 'assert in a string'\n"
    assert _offenders(src, "m.py") == ["m.py:2 assert", "m.py:3 __debug__"]


def test_no_assert_and_no_debug_in_the_package():
    root = Path(layerzero.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 200  # the whole package, engine included
    found = [o for p in files for o in _offenders(p.read_text(encoding="utf-8"), str(p.relative_to(root)))]
    assert found == [], f"validate with a typed error, not assert (python -O strips it): {found}"
