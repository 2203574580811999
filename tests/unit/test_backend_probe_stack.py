"""Backend probes run on a clean stack: a library that keeps an exception from its import (xFormers keeps its
C++ extension's load error) must not keep alive the frames, and so the tensors, of whoever triggered the first
selection (on an H200 it pinned a deleted engine's model, KV cache and graphs: ~14 GB)."""

from __future__ import annotations

import contextvars
import gc
import sys
import types
import weakref

import pytest

import layerzero.backends as backends
from layerzero.backends._clean_stack import on_clean_stack
from layerzero.core.registry import KernelRegistry

_LEAKY = "layerzero_test_leaky_lib"
_FAKE_BACKEND = "layerzero_test_leaky_backend"


class _Sentinel:
    """Stands for a model's tensors held in a caller's frame."""


@pytest.fixture
def leaky_backend(monkeypatch, tmp_path):
    """A 'backend' whose register() imports a library that, like xFormers, keeps an exception from its
    import."""
    (tmp_path / f"{_LEAKY}.py").write_text(
        "def _load():\n    raise OSError('libcudart.so.12: cannot open shared object file')\n"
        "try:\n    _load()\nexcept OSError as exc:\n    LOAD_ERROR = exc\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, _LEAKY, raising=False)
    fake = types.ModuleType(f"layerzero.backends.{_FAKE_BACKEND}")

    def register(registry: KernelRegistry) -> None:
        __import__(_LEAKY)

    fake.register = register
    monkeypatch.setitem(sys.modules, f"layerzero.backends.{_FAKE_BACKEND}", fake)
    monkeypatch.setattr(backends, "BUILTIN_BACKENDS", (_FAKE_BACKEND,))
    yield
    sys.modules.pop(_LEAKY, None)


def _first_selection_inside_a_forward(register) -> weakref.ref:
    held = _Sentinel()  # a local of the frame that triggers the probes, as a model's forward is
    register(KernelRegistry())
    return weakref.ref(held)


def test_a_kept_import_error_does_not_pin_the_callers_frames(leaky_backend):
    ref = _first_selection_inside_a_forward(backends.register_builtin)
    gc.collect()
    assert sys.modules[_LEAKY].LOAD_ERROR.__traceback__ is not None  # the library did keep it
    assert ref() is None, "the probe's kept exception pinned the caller's frame (and its locals)"


def test_the_same_import_on_the_callers_stack_would_pin_them(leaky_backend):
    """The oracle of the test above: without the clean stack the sentinel stays alive."""
    ref = _first_selection_inside_a_forward(
        lambda registry: sys.modules[f"layerzero.backends.{_FAKE_BACKEND}"].register(registry)
    )
    gc.collect()
    assert ref() is not None


def test_on_clean_stack_returns_raises_and_keeps_context_variables():
    var = contextvars.ContextVar("layerzero_test_var", default="unset")
    token = var.set("caller's value")
    try:
        assert on_clean_stack(lambda a, b: (a + b, var.get()), 2, 3) == (5, "caller's value")

        def fail() -> None:
            raise KeyError("from the probe")

        with pytest.raises(KeyError, match="from the probe"):
            on_clean_stack(fail)
    finally:
        var.reset(token)
