"""Files stay small (issue 36; ../shared/STYLE.md): every module of the package has at most 500 lines, so each
can be read whole. A file that grows past it is split by concern, not trimmed of its docstrings."""

from __future__ import annotations

from pathlib import Path

import pytest

import layerzero

pytestmark = pytest.mark.unit

MAX_LINES = 500


def test_every_module_of_the_package_has_at_most_500_lines():
    root = Path(layerzero.__file__).parent
    sizes = {
        str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines()) for p in root.rglob("*.py")
    }
    assert len(sizes) > 200  # the whole package, engine included
    too_long = {name: n for name, n in sorted(sizes.items()) if n > MAX_LINES}
    assert too_long == {}, f"modules over {MAX_LINES} lines (split them by concern): {too_long}"
