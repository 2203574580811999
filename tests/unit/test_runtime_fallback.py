"""Runtime failures: a kernel that raises is recorded, the call is retried on the next eligible kernel (with
a WARNING and a trace entry), the backend's circuit breaker opens after ``health_failure_threshold``
failures and selection then rejects it with BACKEND_UNHEALTHY. A locked kernel, or strict mode, never
falls back: ``KernelExecutionError``.

A fake backend ``lzfail`` is registered per test with one attention kernel of priority 1000 (it beats
torch_sdpa.flash, 80) that raises; it is removed and its health reset in teardown.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import layerzero as lz
from layerzero.core.health import BreakerState
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import BackendSpec, KernelSpec

pytestmark = pytest.mark.unit

BACKEND = "lzfail"
KERNEL = f"{BACKEND}.attention"


class Boom(RuntimeError):
    """The failing kernel's error (a plain RuntimeError, like a CUDA launch failure)."""


@pytest.fixture
def failing_kernel():
    """Register ``lzfail.attention`` (raises Boom, counts its calls); remove it afterwards."""
    RUNTIME.ensure_ready()
    RUNTIME.health.reset()
    calls: list[int] = []

    def boom(*args):
        calls.append(1)
        raise Boom("simulated kernel crash")

    RUNTIME.registry.add_backend(
        BackendSpec(BACKEND, None, "0.0", True, description="test backend"), replace=True
    )
    RUNTIME.registry.add_kernel(
        KernelSpec(
            KERNEL,
            "attention",
            boom,
            priority=1000,
            device_types=frozenset({"cpu"}),
            description="always raises",
        )
    )
    yield calls
    lz.unlock("attention")
    if KERNEL in RUNTIME.registry.kernels:
        RUNTIME.registry.remove_kernel(KERNEL)
    if BACKEND in RUNTIME.registry.backends:
        RUNTIME.registry.backends.remove(BACKEND)
    RUNTIME.health.reset()


def _qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))


def _oracle(q, k, v):
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
    return p @ v


def test_failing_kernel_is_selected_first(failing_kernel):
    q, k, v = _qkv()
    assert lz.which("attention", q, k, v) == KERNEL
    assert failing_kernel == []  # selection never runs a kernel


def test_runtime_failure_falls_back_to_next_kernel(failing_kernel, caplog):
    q, k, v = _qkv()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="layerzero"), lz.trace() as t:
        out = lz.attention(q, k, v)
    torch.testing.assert_close(out, _oracle(q, k, v), atol=1e-10, rtol=1e-10)
    assert failing_kernel == [1]
    assert t.fallbacks == [("attention", KERNEL, "Boom: simulated kernel crash")]
    assert t.counts[("attention", "torch_sdpa.flash")] == 1
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(KERNEL in m and "retrying with torch_sdpa.flash" in m for m in msgs)
    assert RUNTIME.health.state(BACKEND) is BreakerState.CLOSED  # one failure < threshold 3


def test_circuit_breaker_opens_after_threshold(failing_kernel, caplog):
    q, k, v = _qkv()
    threshold = lz.get_config().health_failure_threshold
    assert threshold == 3
    for i in range(threshold):
        assert RUNTIME.health.state(BACKEND) is BreakerState.CLOSED, i
        torch.testing.assert_close(lz.attention(q, k, v), _oracle(q, k, v), atol=1e-10, rtol=1e-10)
    assert RUNTIME.health.state(BACKEND) is BreakerState.OPEN
    assert len(failing_kernel) == threshold
    rep = lz.explain("attention", q, k, v)
    assert [r.code for r in rep.candidate(KERNEL).reasons] == [R.BACKEND_UNHEALTHY]
    assert rep.chosen == "torch_sdpa.flash"
    with lz.trace() as t:
        lz.attention(q, k, v)
    assert len(failing_kernel) == threshold  # not called again while OPEN
    assert t.fallbacks == [] and t.kernels_for("attention") == ["torch_sdpa.flash"]
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"


def test_threshold_follows_config(failing_kernel):
    lz.configure(health_failure_threshold=1)
    q, k, v = _qkv()
    lz.attention(q, k, v)
    assert RUNTIME.health.state(BACKEND) is BreakerState.OPEN
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"


def test_reset_breaker_makes_backend_eligible_again(failing_kernel):
    lz.configure(health_failure_threshold=1)
    q, k, v = _qkv()
    lz.attention(q, k, v)
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    RUNTIME.health.reset(BACKEND)
    assert lz.which("attention", q, k, v) == KERNEL


def test_locked_kernel_failure_raises_without_fallback(failing_kernel):
    q, k, v = _qkv()
    lz.lock("attention", KERNEL)
    with lz.trace() as t, pytest.raises(lz.KernelExecutionError, match="it is locked") as info:
        lz.attention(q, k, v)
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, Boom)
    assert "simulated kernel crash" in str(info.value)
    assert t.fallbacks == []
    assert failing_kernel == [1]


def test_strict_mode_failure_raises_without_fallback(failing_kernel):
    q, k, v = _qkv()
    lz.configure(strict=True)
    with pytest.raises(lz.KernelExecutionError, match="strict mode is on"):
        lz.attention(q, k, v)
    assert failing_kernel == [1]


def test_removing_the_kernel_invalidates_cached_plans(failing_kernel):
    q, k, v = _qkv()
    assert lz.which("attention", q, k, v) == KERNEL
    RUNTIME.registry.remove_kernel(KERNEL)
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    with lz.trace() as t:
        lz.attention(q, k, v)
    assert t.fallbacks == [] and failing_kernel == []
