"""Memory-aware selection and correctness canaries on a real GPU (``pytest -m gpu``).

- ``WORKSPACE_TOO_LARGE`` from the live ``torch.cuda.mem_get_info`` reading: a kernel whose declared workspace
  fits the free memory is picked; after the test fills most of the free memory (a real allocation),
  re-selection rejects the same kernel with the reason and picks another one. Oracle: the free bytes read
  here, by hand arithmetic.
- canaries: a CUDA rms_norm kernel that returns twice the right answer is caught on its first call (checked
  against the reference), its backend quarantined for this GPU's architecture, and the call returns the right
  answer (float64 oracle).
"""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.quarantine import arch_of
from layerzero.core.reasons import ReasonCode
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.gpu
DEV = "cuda"
MIB = 1 << 20


def _rms(x, weight, eps, residual):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


@pytest.fixture
def restore():
    before = lz.get_config()
    yield
    lz.configure(
        workspace_headroom_bytes=before.workspace_headroom_bytes,
        canaries=before.canaries,
        perfdb_path=before.perfdb_path,
        use_perfdb=before.use_perfdb,
    )
    RUNTIME.cache.invalidate()
    torch.cuda.empty_cache()


def test_workspace_is_checked_against_the_live_free_memory(restore):
    kid = "gpuws.rms_norm"
    torch.cuda.empty_cache()
    free0, _ = torch.cuda.mem_get_info()
    headroom = 256 * MIB
    workspace = free0 // 2
    lz.configure(workspace_headroom_bytes=headroom)
    lz.register_kernel(
        "rms_norm",
        kid,
        _rms,
        priority=1000,
        device_types={"cuda"},
        dtypes={torch.bfloat16},
        workspace=lambda ctx: workspace,
    )
    try:
        x, w = (
            torch.randn(5, 4096, device=DEV, dtype=torch.bfloat16),
            torch.ones(4096, device=DEV, dtype=torch.bfloat16),
        )
        RUNTIME.cache.invalidate()
        assert lz.which("rms_norm", x, w) == kid  # free0/2 <= free0 - 256 MiB
        filler = torch.empty(free0 - workspace // 2, dtype=torch.uint8, device=DEV)  # leaves < free0/2 free
        free1, _ = torch.cuda.mem_get_info()
        assert free1 - headroom < workspace
        RUNTIME.cache.invalidate()
        report = lz.explain("rms_norm", x, w)
        assert report.chosen != kid
        (reason,) = [r for r in report.candidate(kid).reasons if r.code is ReasonCode.WORKSPACE_TOO_LARGE]
        assert f"{workspace / MIB:.1f} MiB of workspace" in reason.message
        out = lz.rms_norm(x, w)
        ref = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
        del filler
    finally:
        lz.unregister_kernel(kid)


def test_a_wrong_cuda_kernel_is_quarantined_by_its_canary(restore, tmp_path):
    kid = "gpuwrong.rms_norm"
    calls = {"n": 0}

    def wrong(x, weight, eps, residual):
        calls["n"] += 1
        return 2 * _rms(x, weight, eps, residual)

    lz.configure(perfdb_path=str(tmp_path / "perf.sqlite"), use_perfdb=True, canaries=True)
    lz.register_kernel("rms_norm", kid, wrong, priority=1000, device_types={"cuda"}, dtypes={torch.float32})
    try:
        RUNTIME.cache.invalidate()
        x, w = torch.randn(7, 1000, device=DEV), torch.rand(1000, device=DEV) + 0.5
        out = lz.rms_norm(x, w)
        ref = (x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()).float()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert calls["n"] == 1
        (entry,) = RUNTIME.quarantine().entries()
        assert entry.backend == "gpuwrong" and entry.kernel == kid
        assert entry.arch == arch_of(lz.explain("rms_norm", x, w).context.device) and entry.arch.startswith(
            "cuda:"
        )
        x2 = torch.randn(3, 512, device=DEV)
        report = lz.explain("rms_norm", x2, torch.ones(512, device=DEV))
        assert any(r.code is ReasonCode.BACKEND_QUARANTINED for r in report.candidate(kid).reasons)
        lz.rms_norm(x2, torch.ones(512, device=DEV))
        assert calls["n"] == 1
    finally:
        store = RUNTIME.quarantine()
        if store is not None:
            store.clear()
        lz.unregister_kernel(kid)
