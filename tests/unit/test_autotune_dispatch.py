"""Opt-in online autotune wired into dispatch (``lz.configure(autotune=True)``): the first eager call of a new
key measures its eligible kernels into the PerfDB, then selects with those measurements; later calls measure
nothing.

The oracle is a kernel made slow on purpose (it sleeps 3 ms, then returns the right answer): measured, it must
lose to the fast kernel that priorities alone would rank below it.
"""

from __future__ import annotations

import time

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.unit


@pytest.fixture
def slow_kernel(tmp_path):
    calls = {"slow": 0}

    def slow_rms(x, weight, eps, residual):
        calls["slow"] += 1
        time.sleep(0.003)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)

    lz.configure(perfdb_path=str(tmp_path / "perf.sqlite"), use_perfdb=True)
    lz.register_kernel(
        "rms_norm", "slowlib.rms_norm", slow_rms, priority=100, device_types={"cpu"}, dtypes={torch.float32}
    )
    yield calls
    lz.unregister_kernel("slowlib.rms_norm")


def _call(h: int):
    x, w = torch.randn(3, h), torch.rand(h) + 0.5
    return x, w, lz.rms_norm(x, w)


def test_priority_alone_picks_the_slow_kernel(slow_kernel):
    x, w, _ = _call(40)
    assert lz.which("rms_norm", x, w) == "slowlib.rms_norm"


def test_first_call_measures_and_the_faster_kernel_wins(slow_kernel):
    lz.configure(autotune=True)
    x, w, out = _call(48)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (48,), w, 1e-6))
    report = lz.explain("rms_norm", x, w)
    assert report.chosen != "slowlib.rms_norm", str(report)
    slow = report.candidate("slowlib.rms_norm")
    assert slow.measured_us is not None and slow.measured_us >= 2_500, slow
    measured = [c for c in report.candidates if c.measured_us is not None]
    assert len(measured) >= 2
    before = slow_kernel["slow"]
    for _ in range(3):
        lz.rms_norm(x, w)
    assert slow_kernel["slow"] == before, "a cached key must not be measured again"


def test_autotune_off_measures_nothing(slow_kernel):
    x, w, _ = _call(56)
    assert slow_kernel["slow"] == 1  # served once, never timed
    assert all(c.measured_us is None for c in lz.explain("rms_norm", x, w).candidates)


def test_a_failing_autotuner_never_fails_the_call(slow_kernel, monkeypatch, caplog):
    def broken(runtime, ctx, args):
        raise RuntimeError("boom")

    monkeypatch.setattr(RUNTIME, "autotuner", broken)
    lz.configure(autotune=True)
    x, w, out = _call(64)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (64,), w, 1e-6))
    assert "autotune failed" in caplog.text
