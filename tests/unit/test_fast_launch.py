"""``backends/triton/_launch.FastLaunch`` without a GPU: a fake ``@triton.jit`` function (binder, compiled
kernel, launcher) stands in for Triton so the bookkeeping of the fast and pinned paths is checked on CPU:
which launches compile, which reuse an entry, and what the compiled kernel's launcher receives. The real
kernels are checked on the GPU (``tests/gpu/test_gpu_fast_launch.py``: bit-identical to Triton's own path)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from layerzero.backends.triton import _launch
from layerzero.core.knobs import knobs

pytestmark = pytest.mark.unit


class FakeKernel:
    """A compiled kernel: ``run`` is its launcher (grid, stream, function, metadata, hooks, then every
    argument)."""

    def __init__(self, spec: tuple) -> None:
        self.spec, self.function, self.packed_metadata, self.launches = spec, object(), object(), []

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
        assert (function, packed, meta, enter, exit_) == (
            self.function,
            self.packed_metadata,
            None,
            None,
            None,
        )
        self.launches.append(((g0, g1, g2), stream, args))


class FakeJIT:
    """``kernel(x_ptr, y_ptr, n, scale, BLOCK: constexpr = 16)``: the binder specializes tensors on dtype and
    16-byte alignment and ints on ``n == 1`` / ``n % 16 == 0``, as Triton's does; ``run`` compiles per
    specialization and launches."""

    def __init__(self) -> None:
        self.device_caches: dict[int, tuple] = {}
        self.compiled: dict[tuple, FakeKernel] = {}
        self.binds = 0

    def _bind(self, x, y, n, scale, BLOCK=16, **options):
        self.binds += 1
        spec = [(t.dtype, t.data_ptr() % 16 == 0) for t in (x, y)] + [
            (n == 1, n % 16 == 0),
            ("fp32", None),
            ("constexpr", BLOCK),
        ]
        return {"x": x, "y": y, "n": n, "scale": scale, "BLOCK": BLOCK}, spec, options

    def run(self, *args, grid, warmup, **kwargs):
        self.device_caches.setdefault(0, (None, None, None, None, self._bind))
        bound, spec, _ = self._bind(*args, **kwargs)
        kernel = self.compiled.setdefault(tuple(spec), FakeKernel(tuple(spec)))
        kernel.run(
            *(tuple(grid) + (1, 1))[:3],
            0,
            kernel.function,
            kernel.packed_metadata,
            None,
            None,
            None,
            *bound.values(),
        )
        return kernel


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    monkeypatch.setattr(
        _launch, "_RUNTIME_KNOBS", [SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)]
    )


def test_pinned_skips_the_binder_after_the_first_call_and_keys_on_dtype_and_alignment(fake_cuda):
    fn = FakeJIT()
    fl = _launch.FastLaunch(fn)
    buf = torch.zeros(64)
    x, y = buf[:16], buf[16:32]  # 16-byte aligned (64-byte offsets)
    x_odd = buf[1:17]  # the same shape and strides, 4 bytes off: another specialization
    fl.pinned("plan-1", (2,), x, y, 32, 0.5, BLOCK=8)
    assert (fl.misses, fl.hits, len(fn.compiled)) == (1, 0, 1)
    binds = fn.binds
    fl.pinned("plan-1", (3, 2), x, y, 32, 0.25, BLOCK=8)
    assert (fl.misses, fl.hits, fn.binds) == (1, 1, binds)  # no binder call on a pinned hit
    kernel = next(iter(fn.compiled.values()))
    assert kernel.launches[-1] == (
        (3, 2, 1),
        7,
        (x, y, 32, 0.25, 8),
    )  # the args, then the bound constexpr tail
    fl.pinned(
        "plan-1", (2,), x_odd, y, 32, 0.5, BLOCK=8
    )  # alignment changed: compiled separately, not reused
    fl.pinned("plan-1", (2,), x.double(), y.double(), 32, 0.5, BLOCK=8)  # dtype changed: likewise
    assert (fl.misses, len(fn.compiled), len(fl.pins)) == (3, 3, 3)
    fl.pinned("plan-1", (2,), x_odd, y, 32, 0.5, BLOCK=8)
    assert fl.hits == 2
    odd_kernel = [k for k in fn.compiled.values() if k.spec[0] == (torch.float32, False)]
    assert odd_kernel and odd_kernel[0].launches[-1][2][0] is x_odd  # the hit went to the misaligned kernel


def test_a_new_pin_binds_again_and_hooks_or_errors_take_tritons_path(fake_cuda, monkeypatch):
    fn = FakeJIT()
    fl = _launch.FastLaunch(fn)
    x = torch.zeros(16)
    fl.pinned("a", (1,), x, x, 32, 1.0)
    fl.pinned("b", (1,), x, x, 1, 1.0)  # another pin, another int specialization (n == 1)
    assert fl.misses == 2 and len(fn.compiled) == 2
    plain: list = []
    monkeypatch.setattr(
        FakeJIT, "__getitem__", lambda self, grid: lambda *a, **k: plain.append((grid, a, k)), raising=False
    )
    monkeypatch.setattr(
        _launch,
        "_RUNTIME_KNOBS",
        [SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[1]), launch_exit_hook=None)],
    )
    fl.pinned("a", (1,), x, x, 32, 1.0)  # a profiler's hook is installed: Triton's own path, which calls it
    assert len(plain) == 1 and fl.hits == 0
    monkeypatch.setattr(_launch, "_RUNTIME_KNOBS", [])
    monkeypatch.setattr(
        _launch, "_knobs_runtime", lambda: (_ for _ in ()).throw(RuntimeError("internals moved"))
    )
    fl.pinned("a", (1,), x, x, 32, 1.0)
    assert fl.broken and len(plain) == 2  # disabled for good, the call still launched


def test_pins_are_bounded(fake_cuda, monkeypatch):
    monkeypatch.setattr(_launch, "PINS_MAX", 4)
    fl = _launch.FastLaunch(FakeJIT())
    x = torch.zeros(16)
    for i in range(6):
        fl.pinned(i, (1,), x, x, 32, 1.0)
    assert 1 <= len(fl.pins) <= 4


@pytest.mark.parametrize(
    "capture, as_captured, major, enabled, want",
    [
        (False, False, 9, True, {}),  # eager: no PDL (the host launch dominates there; graphs gain)
        (True, False, 9, True, {"PDL": True, "launch_pdl": True}),  # a capture on Hopper
        (
            False,
            True,
            9,
            True,
            {"PDL": True, "launch_pdl": True},
        ),  # lz.capture_selection(): the warm-up compiles it
        (True, False, 8, True, {}),  # Ampere has no griddepcontrol
        (True, False, 9, False, {}),  # LAYERZERO_TRITON_PDL=0
    ],
)
def test_pdl_only_for_captures_on_hopper(capture, as_captured, major, enabled, want, monkeypatch):
    from layerzero.core.capture import AS_CAPTURED

    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: capture, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx: (major, 0))
    monkeypatch.setattr(_launch, "_SM90", {})
    cuda_tensor = SimpleNamespace(
        is_cuda=True, get_device=lambda: 0
    )  # what pdl_kwargs reads of a CUDA tensor
    token = AS_CAPTURED.set(as_captured)
    try:
        with knobs(_launch.KNOBS, pdl=enabled) as kn:
            assert _launch.pdl_kwargs(cuda_tensor, 1) == want
            assert _launch.pdl_kwargs(cuda_tensor, kn.pdl_max_rows) == want
            assert _launch.pdl_kwargs(cuda_tensor, kn.pdl_max_rows + 1) == {}  # large batches: never
            with knobs(_launch.KNOBS, pdl_max_rows=kn.pdl_max_rows + 1):  # the knob moves the bound
                assert _launch.pdl_kwargs(cuda_tensor, kn.pdl_max_rows + 1) == want
    finally:
        AS_CAPTURED.reset(token)
    assert _launch.pdl_kwargs(torch.zeros(1), 1) == {}  # CPU tensors (the interpreter): never
