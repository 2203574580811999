"""Constraint mirroring on CUDA (run on an H200: ``pytest -m gpu tests/gpu -q``): for every point of the grid
(float16 / bfloat16 / float32 / float64 x head dims {8, 21, 64, 72, 203, 256, 512} x GQA x mask none/bool/float
x causal x dropout x stride(-1) == 1 or not x layout x Sq == Sk or not), ``lz.validate("torch_sdpa.<x>", ...)
== []`` must imply that torch itself runs sub-backend x (flash / efficient / cudnn / math) on the BHSD views
LayerZero passes it. This is how LayerZero's CUDA constraints are checked against the installed torch (2.11
on the H200). LayerZero may be stricter only in the ``CUDA_ALLOW`` cases, each with its reason. A failure
lists every disagreeing grid point with LayerZero's reasons and torch's error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from layerzero.ops._common import RUNTIME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from _shapes import SDPA_BACKENDS, Allow, mirror, sdpa_grid  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Where LayerZero is knowingly stricter than torch on CUDA (codes must all be in the entry's set).
CUDA_ALLOW: tuple[Allow, ...] = ()


@pytest.fixture(autouse=True)
def _healthy_backends():
    """An open circuit breaker would add BACKEND_UNHEALTHY reasons to every validate() of the grid."""
    RUNTIME.health.reset()
    yield
    RUNTIME.health.reset()


@pytest.mark.parametrize("kernel_id", sorted(SDPA_BACKENDS))
def test_validate_mirrors_torch_on_cuda(kernel_id):
    device = torch.device("cuda", torch.cuda.current_device())
    mismatches, used = mirror(kernel_id, sdpa_grid(DTYPES), str(device), CUDA_ALLOW)
    name, sm = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    assert not mismatches, (
        f"{len(mismatches)} grid points where LayerZero and torch {torch.__version__} disagree about {kernel_id} on "
        f"{name} (SM {sm[0]}.{sm[1]}):\n" + "\n".join(mismatches[:40])
        + (f"\n... {len(mismatches) - 40} more" if len(mismatches) > 40 else ""))
    stale = [a.why for a in CUDA_ALLOW if a.kernel_id == kernel_id and a not in used]
    assert not stale, f"allowlist entries no grid point needed (remove them): {stale}"
