"""``core`` names nothing above it and the package above wires it (issue 36; DESIGN.md "Layers").

``core`` may not import a module above it, not even by a module-name string (``importlib.import_module(
"layerzero.ops")`` hides the dependency from import-linter): the first test reads every string constant of
``core`` with ``ast``. The runtime's loader and the tuning hooks are installed by ``layerzero/_wiring.py``
(``Runtime.install_hooks``); a runtime used before any loader is installed raises a typed error instead of
selecting from an empty registry. The "no cycles in core" rule is an import-linter contract
(``.importlinter``, checked by ``test_layering.py``).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import layerzero  # noqa: F401 - the package root installs the runtime's hooks
from layerzero.core import config as _config
from layerzero.core.dispatch import Runtime
from layerzero.core.errors import ConfigurationError
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.unit

CORE = Path(__file__).resolve().parents[2] / "src" / "layerzero" / "core"
ABOVE = re.compile(r"layerzero\.(?!core\b)[\w.]*(:\w+)?")
"""A module name above core, as a whole string (``"layerzero.ops"``, ``"layerzero.tuning.canary:check"``) or
the start of an f-string (``f"layerzero.{name}"``): what ``importlib`` would be given. Prose that mentions a
module in a message (an example in an error text) is no import and is not matched."""


def _docstrings(tree: ast.AST) -> set[int]:
    """Ids of the string constants that are statements of their own (module, class, function and attribute
    docstrings): documentation, not names the code uses."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)  # a statement list (a lambda's or an IfExp's body is one node)
        for stmt in body if isinstance(body, list) else ():
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                out.add(id(stmt.value))
    return out


def _logger_names(tree: ast.AST) -> set[int]:
    """Ids of the string arguments of ``logging.getLogger(...)``: logger names (children of the ``layerzero``
    logger, such as ``layerzero.dispatch``), not module names."""
    out = set()
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and func.attr == "getLogger":
            out.update(id(a) for a in node.args if isinstance(a, ast.Constant))
    return out


def test_core_names_no_module_above_it_in_strings():
    found = []
    for path in sorted(CORE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _docstrings(tree) | _logger_names(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in skip
                and ABOVE.fullmatch(node.value)
            ):
                found.append(f"{path.relative_to(CORE.parent)}:{node.lineno}: {node.value!r}")
    assert len(list(CORE.glob("*.py"))) > 20  # the walk found core
    assert not found, (
        "core names a module above it in a string (install it from above instead, like "
        "layerzero/_wiring.py does):\n" + "\n".join(found)
    )


def test_the_check_sees_a_module_name_string():
    tree = ast.parse(
        '"""doc: layerzero.ops is fine here"""\nimport logging\n'
        'log = logging.getLogger("layerzero.x")\nMOD = "layerzero.ops"\n'
        'MSG = "e.g. layerzero.ops"\n'
    )
    skip = _docstrings(tree) | _logger_names(tree)
    hits = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and id(n) not in skip
        and ABOVE.fullmatch(n.value)
    ]
    assert hits == ["layerzero.ops"]
    assert ABOVE.fullmatch("layerzero.") and ABOVE.fullmatch("layerzero.tuning.canary:check")
    assert not ABOVE.fullmatch("layerzero.core.dispatch") and not ABOVE.fullmatch("see layerzero.ops.rope")


def test_package_installs_the_runtime_hooks():
    from layerzero.ops import register_builtin

    assert RUNTIME._loader is register_builtin
    assert callable(RUNTIME.autotuner) and callable(RUNTIME.canary)


def test_runtime_without_loader_raises_a_typed_error():
    rt = Runtime()
    with pytest.raises(ConfigurationError, match=r"no backend loader.*install_hooks.*import layerzero"):
        rt.ensure_ready()
    assert not rt._ready
    assert len(rt.registry.ops) == 0


def test_install_hooks_installs_a_loader_later(monkeypatch):
    monkeypatch.setattr(_config, "add_listener", lambda fn: None)  # this throwaway runtime stays unsubscribed
    seen = []
    rt = Runtime()
    rt.install_hooks(loader=seen.append)
    rt.ensure_ready()
    assert seen == [rt.registry] and rt._ready
    assert rt.autotuner is None and rt.canary is None  # what was not given stays as it was


def test_tuning_hooks_import_tuning_lazily():
    code = (
        "import sys, layerzero; "
        "bad = [m for m in ('layerzero.tuning.autotune', 'layerzero.tuning.canary') "
        "if m in sys.modules]; "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
