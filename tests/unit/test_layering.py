"""The layering DESIGN.md states, enforced with import-linter (a kept library): core imports nothing above it, the
engine imports only the public API, nothing but the CLI imports the engine, a backend imports no other backend
(contracts in ``.importlinter``). A new import that breaks a layer fails here with import-linter's report."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    beside = Path(sys.executable).parent / "lint-imports"  # the venv running the tests, on PATH or not
    exe = str(beside) if beside.exists() else shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (it is in the dev extra: pip install -e '.[dev]')")
    r = subprocess.run([exe, "--no-cache", str(ROOT / ".importlinter")], cwd=ROOT / "src", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout
