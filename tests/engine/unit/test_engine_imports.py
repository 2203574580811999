"""The engine is a wing of its own: it imports only the public ``layerzero`` API, and ``import layerzero``
does not import it (DESIGN.md, "The engine")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ENGINE = Path(__file__).resolve().parents[3] / "src" / "layerzero" / "engine"


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_engine_imports_only_the_public_api():
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 10
    # the engine itself; the public test helpers (demo); the public telemetry module (docs/telemetry.md: the
    # core process's dispatch counters)
    public = ("layerzero.engine", "layerzero.testing", "layerzero.telemetry")
    private = {
        f"{f.relative_to(ENGINE)}: {m}"
        for f in files
        for m in _imports(f)
        if m.startswith("layerzero.") and not m.startswith(public)
    }
    assert private == set()


def test_import_layerzero_does_not_import_the_engine():
    code = "import sys, layerzero; print(any(m.startswith('layerzero.engine') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_files_stay_small():
    sizes = {f.name: len(f.read_text().splitlines()) for f in ENGINE.rglob("*.py")}
    assert max(sizes.values()) <= 500, sizes
