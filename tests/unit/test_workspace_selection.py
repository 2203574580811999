"""Memory-aware selection: a kernel whose declared workspace (``KernelSpec.workspace``, bytes) exceeds the
device's free memory minus ``workspace_headroom_bytes`` is rejected with ``WORKSPACE_TOO_LARGE``. On CPU with
a fake memory reading (``RUNTIME.free_memory``); the real reading is ``torch.cuda.mem_get_info`` on CUDA
devices only."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.device import device_free_bytes
from layerzero.core.errors import ConfigurationError, NoKernelFoundError
from layerzero.core.reasons import ReasonCategory, ReasonCode
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.unit

GIB = 1 << 30
KID = "bigws.rms_norm"


@pytest.fixture
def big_workspace_kernel():
    """A CPU rms_norm kernel of top priority that declares 1 GiB of workspace; a controllable memory
    reading."""
    reading = {"free": None, "reads": 0}

    def fake(device):
        reading["reads"] += 1
        return reading["free"]

    def rms(x, weight, eps, residual):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)

    before, headroom = RUNTIME.free_memory, lz.get_config().workspace_headroom_bytes
    lz.register_kernel(
        "rms_norm",
        KID,
        rms,
        priority=1000,
        device_types={"cpu"},
        dtypes={torch.float32},
        workspace=lambda ctx: GIB,
    )
    RUNTIME.free_memory = fake
    RUNTIME.cache.invalidate()
    yield reading
    RUNTIME.free_memory = before
    lz.configure(workspace_headroom_bytes=headroom)
    lz.unregister_kernel(KID)
    RUNTIME.cache.invalidate()


def _pick(free, headroom):
    lz.configure(workspace_headroom_bytes=headroom)
    RUNTIME.cache.invalidate()
    x, w = torch.randn(3, 64), torch.ones(64)
    report = lz.explain("rms_norm", x, w)
    return lz.which("rms_norm", x, w), report


@pytest.mark.parametrize(
    ("free", "headroom", "fits"),
    [
        (None, 0, True),  # no reading (CPU, or a failed read): no check
        (4 * GIB, 256 << 20, True),
        (GIB + (256 << 20), 256 << 20, True),  # exactly enough: need <= free - headroom
        (GIB + (256 << 20) - 1, 256 << 20, False),
        (GIB // 2, 0, False),
        (3 * GIB // 2, 3 * GIB // 4, False),  # the headroom alone rejects it
    ],
)
def test_workspace_against_free_memory_minus_headroom(big_workspace_kernel, free, headroom, fits):
    big_workspace_kernel["free"] = free
    picked, report = _pick(free, headroom)
    cand = report.candidate(KID)
    if fits:
        assert picked == KID and not cand.reasons
    else:
        assert picked != KID
        (r,) = [r for r in cand.reasons if r.code is ReasonCode.WORKSPACE_TOO_LARGE]
        assert "1024.0 MiB of workspace" in r.message and r.code.category is ReasonCategory.MEMORY


def test_memory_is_read_once_per_selection_and_only_for_declared_workspaces(big_workspace_kernel):
    big_workspace_kernel["free"] = 4 * GIB
    _pick(4 * GIB, 0)
    reads = big_workspace_kernel["reads"]
    assert 1 <= reads <= 2  # which() and explain() select once each; the other kernels declare no workspace
    lz.unregister_kernel(KID)
    lz.register_kernel(
        "rms_norm",
        KID,
        lambda x, w, e, r: x,
        priority=1000,
        device_types={"cpu"},
        dtypes={torch.float32},
        replace=True,
    )
    big_workspace_kernel["reads"] = 0
    _pick(4 * GIB, 0)
    assert big_workspace_kernel["reads"] == 0


def test_a_lock_on_a_kernel_that_does_not_fit_raises_with_the_reason(big_workspace_kernel):
    big_workspace_kernel["free"] = GIB // 4
    lz.configure(workspace_headroom_bytes=0)
    RUNTIME.cache.invalidate()
    lz.lock("rms_norm", KID)
    try:
        with pytest.raises(NoKernelFoundError, match="WORKSPACE_TOO_LARGE"):
            lz.rms_norm(torch.randn(2, 64), torch.ones(64))
    finally:
        lz.unlock("rms_norm")


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1GiB", None])
def test_headroom_must_be_a_byte_count(bad):
    with pytest.raises(ConfigurationError, match="workspace_headroom_bytes"):
        lz.configure(workspace_headroom_bytes=bad)


def test_the_real_reading_is_cuda_only():
    from layerzero.ops._common import device_spec

    assert device_free_bytes(device_spec(torch.device("cpu"))) is None
