"""Correctness canaries (``lz.configure(canaries=True)``): a wrong kernel's first call is checked against the
reference, its backend quarantined at this version and architecture (persisted in the PerfDB's file), the call
served by the re-selected kernel, and every later selection rejects the backend with ``BACKEND_QUARANTINED``;
a version change or ``layerzero quarantine --clear`` lifts it. Hand-made cases on CPU: a kernel that doubles
its output."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.cli import main
from layerzero.core.quarantine import QuarantineStore, arch_of
from layerzero.core.reasons import ReasonCode
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.unit

KID = "wronglib.rms_norm"


@pytest.fixture
def wrong_kernel(tmp_path):
    """A top-priority rms_norm kernel that returns twice the right answer; canaries on, a private PerfDB."""
    calls = {"n": 0}

    def wrong(x, weight, eps, residual):
        calls["n"] += 1
        return 2 * torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)

    before = lz.get_config()
    lz.configure(perfdb_path=str(tmp_path / "perf.sqlite"), use_perfdb=True, canaries=True)
    lz.register_kernel("rms_norm", KID, wrong, priority=1000, device_types={"cpu"}, dtypes={torch.float32})
    RUNTIME.cache.invalidate()
    yield calls
    lz.unregister_kernel(KID)
    store = RUNTIME.quarantine()
    if store is not None:
        store.clear()
    lz.configure(perfdb_path=before.perfdb_path, use_perfdb=before.use_perfdb, canaries=before.canaries)
    RUNTIME.cache.invalidate()


def _oracle(x, w, eps=1e-6):
    x64 = x.double()
    return (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


def test_a_wrong_kernel_is_caught_quarantined_and_never_returned(wrong_kernel, tmp_path):
    x, w = torch.randn(4, 32), torch.rand(32) + 0.5
    out = lz.rms_norm(x, w)  # the wrong kernel ran once, its output was checked and thrown away
    torch.testing.assert_close(out, _oracle(x, w), rtol=1e-5, atol=1e-5)
    assert wrong_kernel["n"] == 1
    (entry,) = RUNTIME.quarantine().entries()
    assert (entry.backend, entry.version, entry.kernel) == ("wronglib", "none", KID)
    assert entry.arch == arch_of(lz.explain("rms_norm", x, w).context.device)
    assert "tolerance" in entry.reason
    # later calls and other shapes: the backend is rejected with the reason, the wrong kernel never runs again
    for h in (32, 48):
        x2, w2 = torch.randn(3, h), torch.ones(h)
        torch.testing.assert_close(lz.rms_norm(x2, w2), _oracle(x2, w2), rtol=1e-5, atol=1e-5)
        reasons = lz.explain("rms_norm", x2, w2).candidate(KID).reasons
        assert [r.code for r in reasons] == [ReasonCode.BACKEND_QUARANTINED]
    assert wrong_kernel["n"] == 1
    # persisted: a new store on the same file (a later process) sees it
    assert len(QuarantineStore(str(tmp_path / "perf.sqlite")).entries()) == 1


def test_a_capture_time_choice_respects_the_quarantine(tmp_path):
    """Regression (seen on the H200): the capture-time choice, prepared on a CUDA key's first eager call,
    skipped the quarantine store (no file I/O under capture), so a quarantined graph-safe kernel was picked
    and warm-run again. The store's entries are in memory once it is open; a capture context reads them
    then."""
    import dataclasses

    kid = "wronggraph.rms_norm"
    calls = {"n": 0}

    def wrong(x, weight, eps, residual):
        calls["n"] += 1
        return 2 * torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)

    lz.configure(perfdb_path=str(tmp_path / "perf.sqlite"), use_perfdb=True, canaries=True)
    lz.register_kernel(
        "rms_norm", kid, wrong, priority=1000, device_types={"cpu"}, dtypes={torch.float32}, graph_safe=True
    )
    try:
        RUNTIME.cache.invalidate()
        x, w = torch.randn(4, 32), torch.ones(32)
        torch.testing.assert_close(lz.rms_norm(x, w), _oracle(x, w), rtol=1e-5, atol=1e-5)
        assert calls["n"] == 1 and len(RUNTIME.quarantine()) == 1
        capture_ctx = dataclasses.replace(lz.explain("rms_norm", x, w).context, graph_capture=True)
        plan, report = RUNTIME.select_context(capture_ctx)
        assert plan.kernel_id != kid
        assert [r.code for r in report.candidate(kid).reasons] == [ReasonCode.BACKEND_QUARANTINED]
    finally:
        RUNTIME.quarantine().clear()
        lz.unregister_kernel(kid)
        lz.configure(canaries=False)
        RUNTIME.cache.invalidate()


def test_a_correct_kernel_passes_its_canary(tmp_path):
    lz.configure(perfdb_path=str(tmp_path / "perf.sqlite"), use_perfdb=True, canaries=True)
    try:
        lz.register_kernel(
            "rms_norm",
            "rightlib.rms_norm",
            lambda x, w, e, r: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, e),
            priority=1000,
            device_types={"cpu"},
            dtypes={torch.float32},
        )
        RUNTIME.cache.invalidate()
        x, w = torch.randn(2, 16), torch.ones(16)
        lz.rms_norm(x, w)
        assert lz.which("rms_norm", x, w) == "rightlib.rms_norm" and RUNTIME.quarantine().entries() == []
    finally:
        lz.unregister_kernel("rightlib.rms_norm")
        lz.configure(canaries=False)
        RUNTIME.cache.invalidate()


def test_canaries_off_trusts_the_kernel(wrong_kernel):
    lz.configure(canaries=False)
    x, w = torch.randn(2, 16), torch.ones(16)
    torch.testing.assert_close(lz.rms_norm(x, w), 2 * _oracle(x, w), rtol=1e-5, atol=1e-5)
    assert RUNTIME.quarantine().entries() == []


def test_a_new_version_or_clear_lifts_it(wrong_kernel, tmp_path, capsys):
    x, w = torch.randn(2, 16), torch.ones(16)
    lz.rms_norm(x, w)
    store = RUNTIME.quarantine()
    (entry,) = store.entries()
    assert store.lookup("wronglib", "none", entry.arch) is not None
    assert store.lookup("wronglib", "2.0", entry.arch) is None  # another version: not quarantined
    assert store.lookup("wronglib", "none", "cuda:other|9.0") is None  # another architecture: not either
    assert main(["quarantine"]) == 0 and KID in capsys.readouterr().out
    assert main(["quarantine", "--clear", "wronglib"]) == 0 and "lifted 1" in capsys.readouterr().out
    assert store.entries() == []
    lz.configure(canaries=False)
    RUNTIME.cache.invalidate()
    assert lz.which("rms_norm", x, w) == KID  # lifted: the kernel is eligible again


def test_doctor_lists_the_quarantine(wrong_kernel):
    from layerzero.diagnostics import collect

    lz.rms_norm(torch.randn(2, 16), torch.ones(16))
    state = collect().to_dict()["state"]["quarantine (canaries)"]
    assert isinstance(state, list) and KID in state[0]


def test_lz_doctor_survives_its_module_import():
    """Regression: the report module was ``layerzero/doctor.py``; importing it (lz.doctor() does, lazily) set
    the package attribute ``layerzero.doctor`` to the module, so a second ``lz.doctor()`` raised "module
    object is not callable". It is ``layerzero/diagnostics.py`` now."""
    import layerzero.diagnostics  # noqa: F401

    lz.doctor(print_report=False)
    assert callable(lz.doctor) and lz.doctor(print_report=False).to_dict()["backends"]
