"""Adding an op is one module in ``layerzero/ops/`` plus its kernels (issue 36; ``layerzero.core.opdef``).

The test copies the package, writes one new op module into the copy's ``ops/`` (nothing else of the package is
edited), registers a kernel for it through the public ``lz.register_kernel`` and checks, in a fresh
interpreter, that every list of ops knows the op: ``lz.<op>``, ``lz.__all__``, ``lz.ops.OPS`` /
``OPERATION_SPECS`` / ``OPDEFS``, the registry, the canonical kernel arguments that ``register_kernel`` checks
a kernel against, and ``lz.select`` / ``lz.explain``; and that a call gives the hand-computed result.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import layerzero

NEW_OP = '''
"""``lz.scale_add``: ``out = x * alpha + 1`` (a test op)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec

from ._common import check_tensor, device_spec, fail, flags, scope_token

OP = "scale_add"


class ScaleAddKey(NamedTuple):
    op: str
    device: torch.device
    dtype: torch.dtype
    alpha: float
    requires_grad: bool
    deterministic: bool
    capture: bool
    stride_last_1: bool
    scope: tuple[Any, ...]


def prepare(x: torch.Tensor, alpha: float) -> tuple[ScaleAddKey, tuple[Any, ...]]:
    check_tensor(OP, "x", x)
    if not isinstance(alpha, float):
        raise fail(OP, "alpha", "a float", type(alpha).__name__)
    return ScaleAddKey(OP, x.device, x.dtype, alpha, *flags(x), scope_token()), (x, alpha)


def context(key: ScaleAddKey) -> SelectionContext:
    return SelectionContext(op=OP, device=device_spec(key.device), dtype=key.dtype)


def scale_add(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """``x * alpha + 1``."""
    key, args = prepare(x, alpha)
    return RUNTIME.run(key, context, args)


SPEC = OperationSpec(OP, "x * alpha + 1", ("x",), "mine.scale_add")
OPDEFS = define(OpDef(SPEC, scale_add, prepare, context, kernel_args=("x", "alpha")))
'''

CHECK = """
import sys

import torch
import layerzero as lz
from layerzero.core.custom import CANONICAL_ARGS
from layerzero.core.runtime import RUNTIME

lz.register_kernel("scale_add", "mine.scale_add", lambda x, alpha: x * alpha + 1)
x = torch.tensor([1.0, -2.0, 0.5])
out = lz.scale_add(x, 3.0)
checks = {
    "result": out.tolist() == [4.0, -5.0, 2.5],
    "lz attribute": lz.scale_add is sys.modules["layerzero.ops.scale_add"].scale_add,
    "lz.__all__": "scale_add" in lz.__all__,
    "ops.__all__": "scale_add" in lz.ops.__all__,
    "OPS": lz.ops.OPS["scale_add"][0] is sys.modules["layerzero.ops.scale_add"].prepare,
    "OPERATION_SPECS": any(s.op_id == "scale_add" for s in lz.ops.OPERATION_SPECS),
    "OPDEFS": any(d.name == "scale_add" for d in lz.ops.OPDEFS),
    "registry": "scale_add" in RUNTIME.registry.ops,
    "canonical args": CANONICAL_ARGS["scale_add"] == ("x", "alpha"),
    "select": lz.select("scale_add", x, 3.0).kernel_id == "mine.scale_add",
    "explain": "mine.scale_add" in str(lz.explain("scale_add", x, 3.0)),
}
try:
    lz.register_kernel("scale_add", "mine.bad", lambda x: x)
    checks["signature checked"] = False
except lz.ConfigurationError as exc:
    checks["signature checked"] = "alpha" in str(exc)
bad = sorted(k for k, ok in checks.items() if not ok)
print("FAILED:", bad if bad else "none")
"""


def test_one_new_module_in_ops_is_a_whole_op(tmp_path: Path) -> None:
    """A new ``ops/scale_add.py`` (and a kernel registered for it) is all it takes: every derived list, the
    registry, the signature check of kernels and selection know the op in a fresh interpreter."""
    src = Path(layerzero.__file__).parent
    pkg = tmp_path / "layerzero"
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "ops" / "scale_add.py").write_text(textwrap.dedent(NEW_OP))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILED: none" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_every_custom_op_name_an_opdef_names_exists() -> None:
    """Each OpDef's ``custom_ops`` are wrappers of ``layerzero.custom_ops`` (what ``traced`` returns), and
    every wrapper there belongs to exactly one OpDef: the custom ops are derived from the ops, none is
    orphaned."""
    from layerzero.custom_ops import _ops

    named = [n for d in layerzero.ops.OPDEFS for n in d.custom_ops]
    assert len(named) == len(set(named))
    assert sorted(named) == sorted(_ops.__all__)
    assert all(callable(getattr(_ops, n)) for n in named)
