"""``lz.warmup(manifest, *, timeout_s, background)``: critical cases first, the rest in a background thread, a
kernel whose first call exceeds the timeout skipped (with its reason) in favour of its fallback; the old
``lz.warmup(op, cases)`` form unchanged."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import layerzero as lz
from layerzero.planning.warmup import WARMED


@pytest.fixture(autouse=True)
def _clean():
    WARMED.clear()
    yield
    WARMED.clear()


def _norm_case(hidden: int, critical: bool = False):
    return ("rms_norm", (torch.randn(2, 4, hidden), torch.randn(hidden)), {}, critical)


def test_critical_cases_first():
    cases = [_norm_case(16), _norm_case(32, True), _norm_case(48), _norm_case(64, True)]
    handle = lz.warmup(cases)
    assert handle.done() and not handle.errors
    assert handle.order == [1, 3, 0, 2]
    assert [r.index for r in handle.results] == [1, 3, 0, 2]
    assert [r.critical for r in handle.results] == [True, True, False, False]
    assert all(r.kernel_id == "torch_native.rms_norm" and r.skipped is None for r in handle.results)
    assert len(WARMED) == 4


def test_background_thread_completes():
    gate = threading.Event()
    seen: list[str] = []

    def gated(x, weight, eps, residual):
        seen.append(threading.current_thread().name)
        gate.wait(5)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)

    lz.register_kernel(
        "rms_norm",
        "gated.rms",
        gated,
        priority=99,
        device_types={"cpu"},
        check=lambda ctx: [] if ctx.hidden_size == 40 else ["only hidden 40"],
    )
    try:
        manifest = lz.Manifest().add("rms_norm", torch.randn(2, 4, 24), torch.randn(24), critical=True)
        manifest.add("rms_norm", torch.randn(2, 4, 40), torch.randn(40))
        handle = lz.warmup(manifest, background=True)
        assert [r.index for r in handle.results] == [0]  # the critical case is done on return
        assert not handle.done()  # the background case is blocked in its kernel
        gate.set()
        assert handle.wait(5) and handle.done()
        assert [r.index for r in handle.results] == [0, 1] and not handle.errors
        assert handle.results[1].kernel_id == "gated.rms"
        assert seen and seen[0] == "lz-warmup-background"
    finally:
        gate.set()
        lz.unregister_kernel("gated.rms")


def test_slow_kernel_skipped_after_timeout(caplog):
    release = threading.Event()

    def slow(x, weight, eps, residual):
        release.wait(2.0)  # a JIT compile that takes too long
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)

    lz.register_kernel("rms_norm", "slow.rms", slow, priority=99, device_types={"cpu"})
    x, w = torch.randn(2, 4, 56), torch.randn(56)
    try:
        with caplog.at_level(logging.WARNING, logger="layerzero"):
            t0 = time.perf_counter()
            handle = lz.warmup(lz.Manifest().add("rms_norm", x, w, critical=True), timeout_s=0.2)
            assert time.perf_counter() - t0 < 1.5
        (res,) = handle.results
        assert res.skipped == "slow.rms" and res.kernel_id == "torch_native.rms_norm"
        assert "slow.rms" in res.reason and "timeout_s=0.2" in res.reason
        assert any("slow.rms" in r.getMessage() and "timeout_s=0.2" in r.getMessage() for r in caplog.records)
        with lz.trace() as tr:
            out = lz.rms_norm(x, w)
        assert tr.kernels_for("rms_norm") == ["torch_native.rms_norm"]
        torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (56,), w, 1e-6))
    finally:
        release.set()
        lz.unregister_kernel("slow.rms")


def test_old_form_and_argument_errors():
    x, w = torch.randn(2, 4, 16), torch.randn(16)
    assert lz.warmup("rms_norm", [((x, w), {})]) == ["torch_native.rms_norm"]
    with pytest.raises(lz.InvalidInputError, match="timeout_s"):
        lz.warmup("rms_norm", [((x, w), {})], timeout_s=1.0)
    with pytest.raises(lz.InvalidInputError, match="timeout_s"):
        lz.warmup(lz.Manifest().add("rms_norm", x, w), timeout_s=-1)
    handle = lz.warmup([("rms_norm", (x, torch.randn(3)), {})])  # a bad case is collected, not raised
    assert handle.done() and len(handle.errors) == 1 and isinstance(handle.errors[0][1], lz.InvalidInputError)
