"""Every module of the package imports on its own, in a fresh interpreter (import cycles that work only by
import order fail here: ``import layerzero.library_paged`` alone raised a circular ImportError), and every
lazily exported attribute of ``layerzero`` is what its docs say (``lz.isolation`` was
``layerzero.distributed``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

# One fresh interpreter imports torch, numpy and yaml (the required dependencies, slow to import), then forks
# one child per module: each child starts with no layerzero module loaded and imports exactly one.
_SCRIPT = textwrap.dedent("""
    import importlib, os, pkgutil, sys
    import numpy, torch, yaml  # noqa: F401
    import layerzero as _probe
    root = os.path.dirname(_probe.__file__)
    for name in [n for n in sys.modules if n == "layerzero" or n.startswith("layerzero.")]:
        del sys.modules[name]
    names = ["layerzero"] + sorted(m.name for m in pkgutil.walk_packages([root], "layerzero.")
                                   if not m.name.endswith("__main__"))
    failed = 0
    for name in names:
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(name)
            except BaseException as exc:
                print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
                os._exit(1)
            os._exit(0)
        failed += os.waitpid(pid, 0)[1] != 0
    print(f"{len(names)} modules, {failed} failed")
    sys.exit(1 if failed else 0)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (one child process per module)")
def test_every_module_imports_on_its_own():
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    count = int(r.stdout.split()[-4])
    assert count > 200, r.stdout  # the walk found the package's modules


def test_lazy_attributes_are_the_documented_modules():
    code = (
        "import layerzero as lz, sys; assert 'layerzero.isolation' not in sys.modules; "
        "assert lz.isolation.__name__ == 'layerzero.isolation', lz.isolation; "
        "assert lz.distributed.__name__ == 'layerzero.distributed', lz.distributed; "
        "assert hasattr(lz.isolation, 'register'); "
        "missing = [n for n in lz.__all__ if not hasattr(lz, n)]; assert not missing, missing"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
