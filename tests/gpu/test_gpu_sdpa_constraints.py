"""Constraint mirroring on CUDA (run on an H200: ``pytest -m gpu tests/gpu -q``): for every point of the grid
of ``tests/unit/test_sdpa_constraints.py`` in float16 / bfloat16 / float32 / float64, ``lz.validate(
"torch_sdpa.<x>", ...) == []`` must imply that torch itself runs sub-backend x (flash / efficient / cudnn /
math) on the BHSD views LayerZero passes it. This checks LayerZero's CUDA constraints against the installed
torch (2.11 on the H200). LayerZero may be stricter only in the ``CUDA_ALLOW`` cases, each with its reason.
Disagreements that are known bugs are listed in ``KNOWN_BUGS`` with a strict-xfail test each; any other
disagreement fails, listing the grid point, LayerZero's reasons and torch's error."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from layerzero.core.runtime import RUNTIME

_spec = importlib.util.spec_from_file_location(
    "_sdpa_grid_helpers", Path(__file__).resolve().parents[1] / "unit" / "test_sdpa_constraints.py"
)
grid_helpers = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = grid_helpers
_spec.loader.exec_module(grid_helpers)  # shares the grid, judge and mirror; its tests are not collected here
Allow, SDPA_BACKENDS, mirror, sdpa_grid = (
    grid_helpers.Allow,
    grid_helpers.SDPA_BACKENDS,
    grid_helpers.mirror,
    grid_helpers.sdpa_grid,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

MASK_CAUSAL = frozenset({"MASK_WITH_CAUSAL"})
# Where LayerZero is knowingly stricter than torch on CUDA: the reasons' codes must all be in the entry's set.
CUDA_ALLOW = tuple(
    Allow(kid, "cuda", MASK_CAUSAL, lambda c: c.mask != "none" and c.causal, grid_helpers.MASK_AND_CAUSAL_WHY)
    for kid in ("torch_sdpa.efficient", "torch_sdpa.cudnn")
) + (
    Allow(
        "torch_sdpa.cudnn",
        "cuda",
        MASK_CAUSAL | {"DROPOUT_UNSUPPORTED"},
        lambda c: c.dropout,
        "dropout support in cuDNN SDPA depends on the cuDNN 9.x minor version (torch gates it per version); "
        "LayerZero does not track that version",
    ),
    Allow(
        "torch_sdpa.cudnn",
        "cuda",
        MASK_CAUSAL | {"DROPOUT_UNSUPPORTED", "MASK_UNSUPPORTED"},
        lambda c: c.mask == "bool",
        "cuDNN SDPA returns garbage instead of 0 for a query row a bool mask fully masks (seen with torch "
        "2.11 + cuDNN 9.19 on an H200), so LayerZero refuses bool masks there; float -inf masks are fine",
    ),
)

# (kernel id, predicate on the mismatch message, why): disagreements that are known bugs, seen on an H200 with
# torch 2.11.0+cu130 and cuDNN 9.19.0; each is checked by test_known_cuda_constraint_bugs (xfail while it
# reproduces). Emptied once the cuDNN rules were fixed in src (Sk == 1 refused; GQA, head_dim 256 on SM
# 9.0/10.0 and BHSD memory allowed), as measured on the H200.
KNOWN_BUGS: tuple = ()
# cuDNN builds a new plan for every successful call (~0.1 s): of the points LayerZero rejects, torch checks 1
# in 4.
STRICTER_EVERY = {"torch_sdpa.cudnn": 4}


@pytest.fixture(autouse=True)
def _healthy_backends_and_gpu():
    """Close every circuit breaker; fail fast (and say why) once an earlier test broke the CUDA context."""
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"the CUDA context was broken by an earlier test (see the first failure): {exc}")
    RUNTIME.health.reset()
    yield
    RUNTIME.health.reset()


@functools.cache
def _mirror(kernel_id: str) -> tuple[tuple[str, ...], tuple[str, ...], frozenset]:
    """(unexpected mismatches, known-bug mismatches, allowlist entries used) for ``kernel_id`` on this GPU
    (the grid runs once per kernel and session)."""
    device = f"cuda:{torch.cuda.current_device()}"
    mismatches, used = mirror(
        kernel_id, sdpa_grid(DTYPES), device, CUDA_ALLOW, STRICTER_EVERY.get(kernel_id, 1)
    )
    known = [m for m in mismatches if any(k == kernel_id and pred(m) for k, pred, _ in KNOWN_BUGS)]
    return tuple(m for m in mismatches if m not in known), tuple(known), frozenset(used)


def _header(kernel_id: str, n: int) -> str:
    sm = torch.cuda.get_device_capability()
    return (
        f"{n} grid points where LayerZero and torch {torch.__version__} (cuDNN "
        f"{torch.backends.cudnn.version()}) disagree about {kernel_id} on {torch.cuda.get_device_name()} (SM "
        f"{sm[0]}.{sm[1]}):\n"
    )


@pytest.mark.parametrize("kernel_id", sorted(SDPA_BACKENDS))
def test_validate_mirrors_torch_on_cuda(kernel_id):
    """validate() == [] implies torch runs the sub-backend on this GPU; stricter verdicts need CUDA_ALLOW or
    KNOWN_BUGS."""
    unexpected, _, used = _mirror(kernel_id)
    assert not unexpected, (
        _header(kernel_id, len(unexpected))
        + "\n".join(unexpected[:40])
        + (f"\n... {len(unexpected) - 40} more" if len(unexpected) > 40 else "")
    )
    stale = [a.why for a in CUDA_ALLOW if a.kernel_id == kernel_id and a not in used]
    assert not stale, f"allowlist entries no grid point needed (remove them): {stale}"


@pytest.mark.parametrize("index", range(len(KNOWN_BUGS)), ids=lambda i: f"{KNOWN_BUGS[i][0]}-{i}")
def test_known_cuda_constraint_bugs(index):
    """xfail while the bug reproduces; once it is fixed this fails, asking to drop the KNOWN_BUGS entry."""
    kernel_id, pred, why = KNOWN_BUGS[index]
    hits = [m for m in _mirror(kernel_id)[1] if pred(m)]
    if hits:
        pytest.xfail(f"BUG: {why}: {len(hits)} grid points, e.g. {hits[0]}")
    pytest.fail(f"KNOWN_BUGS entry no longer reproduces ({kernel_id}: {why}): remove it")
