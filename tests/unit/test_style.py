"""The tree stays formatted and within 110 columns (issue 36): ``ruff format --check`` and ``ruff check``
(E501 on) over the code, as ``make lint`` runs them. ``tools/rewrap_long_lines.py`` re-flows a docstring,
comment or string that ``ruff format`` leaves too long."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["src", "tests", "benchmarks", "fuzz", "tools"]


def _ruff() -> str:
    beside = Path(sys.executable).parent / "ruff"
    exe = str(beside) if beside.exists() else shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (it is in the dev extra: pip install -e '.[dev]')")
    return exe


@pytest.mark.parametrize("args", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff_passes(args):
    r = subprocess.run([_ruff(), *args, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
