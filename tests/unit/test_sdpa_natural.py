"""The forced SDPA kernels skip the process-wide switches exactly when torch's own first choice is theirs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layerzero.backends.torch_sdpa import kernels

pytestmark = pytest.mark.unit


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))


class _Recorder:
    def __init__(self):
        self.calls = []

    def setters(self):
        def make(i):
            def set_(on):
                self.calls.append((i, on))
                kernels._SETTERS_REAL[i](on)

            return set_

        return tuple(make(i) for i in range(4))


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(kernels, "_SETTERS_REAL", kernels._SETTERS, raising=False)
    monkeypatch.setattr(kernels, "_SETTERS", rec.setters())
    return rec


def test_first_in_torch_order_and_enabled_calls_plain_sdpa(recorder, monkeypatch):
    monkeypatch.setattr(kernels, "_ORDER", lambda: [0, 1, 2, 3, 4])  # math first
    q, k, v = _qkv()
    out = kernels._forced(2)(q, k, v, None, True, None, 0.0)
    assert recorder.calls == []  # no switch touched
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-12, atol=0
    )


def test_not_first_forces_and_restores(recorder, monkeypatch):
    monkeypatch.setattr(kernels, "_ORDER", lambda: [1, 2, 0, 3, 4])  # flash first: math must be forced
    before = tuple(g() for g in kernels._GETTERS)
    q, k, v = _qkv(1)
    kernels._forced(2)(q, k, v, None, False, None, 0.0)
    forced = [c for c in recorder.calls[:4]]
    assert forced == [(0, False), (1, False), (2, True), (3, False)]
    assert tuple(g() for g in kernels._GETTERS) == before


def test_first_but_disabled_is_forced(recorder, monkeypatch):
    monkeypatch.setattr(kernels, "_ORDER", lambda: [0, 1, 2, 3, 4])
    prev = torch._C._get_math_sdp_enabled()
    torch._C._set_sdp_use_math(False)
    try:
        q, k, v = _qkv(2)
        kernels._forced(2)(q, k, v, None, False, None, 0.0)
    finally:
        torch._C._set_sdp_use_math(prev)
    assert (2, True) in recorder.calls  # math had to be switched on for the call
