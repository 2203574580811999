"""``lz.capture_selection()`` on CPU: the switch is on inside the block only (nesting restores it, exceptions
too), CUDA-only by construction (CPU calls keep their eager keys and kernels), and a cache miss of a
capture-time key outside a real capture selects instead of raising ``CudaGraphUnsafeError``. The CUDA
behaviour (eager choices equal the captured graph's, bit for bit) is in
tests/gpu/test_gpu_capture_selection.py."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.capture import AS_CAPTURED, capture_key, capturing_now
from layerzero.core.runtime import RUNTIME
from layerzero.ops import OPS

pytestmark = pytest.mark.unit


def test_switch_scoped_and_nested():
    assert not AS_CAPTURED.get()
    with lz.capture_selection():
        assert AS_CAPTURED.get()
        with lz.capture_selection():
            assert AS_CAPTURED.get()
        assert AS_CAPTURED.get()
    assert not AS_CAPTURED.get()
    with pytest.raises(RuntimeError), lz.capture_selection():
        raise RuntimeError("boom")
    assert not AS_CAPTURED.get() and not capturing_now()


def test_disabled_inside_an_enabled_block():
    """``capture_selection(False)`` selects eagerly inside an enclosing ``capture_selection()`` (the engine's
    piecewise graphs run each attention call so between two captured pieces), and restores it after."""
    with lz.capture_selection():
        with lz.capture_selection(False):
            assert not AS_CAPTURED.get()
            with lz.capture_selection():
                assert AS_CAPTURED.get()
            assert not AS_CAPTURED.get()
        assert AS_CAPTURED.get()
    assert not AS_CAPTURED.get()


def test_cpu_calls_unaffected():
    x, w = torch.randn(3, 8), torch.rand(8) + 0.5
    key, _ = OPS["rms_norm"][0](x, w, 1e-6)
    with lz.capture_selection():
        key_in, _ = OPS["rms_norm"][0](x, w, 1e-6)
        out = lz.rms_norm(x, w, 1e-6)
    assert key_in == key and not key.capture
    assert torch.equal(out, lz.rms_norm(x, w, 1e-6))


def test_capture_key_selects_outside_a_real_capture():
    """A capture-time key (``capture=True``) that misses the cache is selected when no graph is really being
    captured, which is what capture_selection's eager calls produce on CUDA."""
    x, w = torch.randn(2, 8), torch.rand(8) + 0.5
    key, _ = OPS["rms_norm"][0](x, w, 1e-6)
    cap = capture_key(key)
    RUNTIME.cache.invalidate()
    plan = RUNTIME.resolve(cap, OPS["rms_norm"][1])
    assert plan.kernel_id in {"torch_native.rms_norm", "reference.rms_norm"}
