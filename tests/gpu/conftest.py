"""Fixtures shared by the GPU tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from layerzero.core.runtime import RUNTIME


@pytest.fixture
def triton_usable() -> Iterator[None]:
    """Skip unless LayerZero's triton backend is available here (with its reasons); backend health is reset
    before and after, so one test's kernel failures do not steer the next."""
    RUNTIME.ensure_ready()
    backend = RUNTIME.registry.backend("triton")
    if not backend.available:
        pytest.skip(f"triton not usable here: {'; '.join(str(r) for r in backend.reasons)}")
    RUNTIME.health.reset()
    yield
    RUNTIME.health.reset()
