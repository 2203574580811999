"""The layering DESIGN.md states, enforced with import-linter (a kept library): core imports nothing above it,
the engine imports only the public API, nothing but the CLI imports the engine, a backend imports no other
backend (contracts in ``.importlinter``). A new import that breaks a layer fails here with import-linter's
report."""

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
    r = subprocess.run(
        [exe, "--no-cache", str(ROOT / ".importlinter")],
        cwd=ROOT / "src",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the strongly connected components of ``graph`` with more than one module
    (each an import cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return cycles


def test_no_import_cycles_anywhere_in_the_package():
    """DESIGN.md: "No import cycles". Every import counts, a function-level (lazy) one too: a cycle that works
    only because one side imports late is still two modules that cannot be understood or changed apart."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the dev extra)")
    sys.path.insert(0, str(ROOT / "src"))
    try:
        g = grimp.build_graph("layerzero", cache_dir=None)
    finally:
        sys.path.remove(str(ROOT / "src"))
    graph = {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}
    assert _strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the checker itself
    assert _strongly_connected(graph) == []
