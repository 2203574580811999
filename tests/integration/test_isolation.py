"""Process isolation (``layerzero.isolation``): an rms_norm kernel running in a worker process.

The worker-side kernels live in ``_isolated_kernels.py`` next to this file and are imported only inside the
worker. One worker per module (started once: importing torch takes ~1 s) serves most tests; the tests that
kill or time out a worker use their own. Oracle: float64 RMSNorm written here.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.core.errors import (
    ConfigurationError,
    InvalidInputError,
    IsolatedWorkerError,
    IsolatedWorkerTimeoutError,
    KernelExecutionError,
)
from layerzero.core.runtime import RUNTIME
from layerzero.isolation import IsolatedBackend, isolated_kernel
from layerzero.isolation import protocol as P

pytestmark = pytest.mark.integration

HERE = str(Path(__file__).parent)
MOD = "_isolated_kernels"
KID = "isotest.rms"


def oracle(x, w, eps=1e-6):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.fixture(scope="module")
def backend():
    with IsolatedBackend(path=[HERE], timeout_s=20, name="isotest") as b:
        yield b


@pytest.fixture
def registered(backend):
    spec = lz.register_isolated_kernel(
        "rms_norm", KID, f"{MOD}:rms_norm", backend=backend, priority=99, dtypes={"float32", "float64"}
    )
    yield spec
    lz.unlock("rms_norm")
    lz.unregister_kernel(KID)


@pytest.mark.parametrize("shape", [(3, 5, 64), (1, 1), (7, 123)])
def test_locked_isolated_rms_norm_matches_float64_oracle(registered, shape):
    lz.lock("rms_norm", KID)
    g = torch.Generator().manual_seed(sum(shape))
    x, w = torch.randn(*shape, generator=g), torch.randn(shape[-1], generator=g)
    with lz.trace() as t:
        y = lz.rms_norm(x, w, 1e-6)
    assert t.counts[("rms_norm", KID)] == 1
    assert y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), oracle(x, w), atol=1e-5, rtol=1e-5)
    assert lz.which("rms_norm", x, w, 1e-6) == KID
    assert KID in str(lz.explain("rms_norm", x, w, 1e-6))


def test_non_contiguous_inputs_and_fused_residual(registered):
    lz.lock("rms_norm", KID)
    x = torch.randn(64, 9, dtype=torch.float64).t()[:, ::2]  # [9, 32], strides (1, 128)
    w = torch.randn(64, dtype=torch.float64)[::2]
    r = torch.randn(32, 9, dtype=torch.float64).t()
    assert not x.is_contiguous() and not w.is_contiguous()
    torch.testing.assert_close(lz.rms_norm(x, w, 1e-5), oracle(x, w, 1e-5))
    y, h = lz.rms_norm(x, w, 1e-5, residual=r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, oracle(x + r, w, 1e-5))


def test_scalars_tuples_and_empty_tensors_round_trip(backend):
    x = torch.arange(6, dtype=torch.int64).view(2, 3)
    args, kw = backend.call(
        f"{MOD}:echo", 1, -2.5, float("inf"), None, True, "s", (1, (2, [3.0])), x[:, 1], e=torch.empty(0, 4)
    )
    assert args[:6] == (1, -2.5, float("inf"), None, True, "s") and args[6] == (1, (2, [3.0]))
    assert torch.equal(args[7], x[:, 1]) and kw[0][0] == "e" and kw[0][1].shape == (0, 4)


def test_large_tensor_grows_the_arenas(backend):
    x = torch.randn(1 << 20)  # 4 MiB > the 64 KiB first arena
    assert torch.equal(backend.call(f"{MOD}:identity", x), x)


def test_exception_in_worker_is_typed_with_remote_traceback(backend):
    with pytest.raises(IsolatedWorkerError, match="ValueError: boom from the worker") as info:
        backend.call(f"{MOD}:boom", torch.ones(2))
    assert info.value.remote_type == "ValueError" and "_isolated_kernels.py" in info.value.remote_traceback
    assert info.value.exit_code is None
    assert torch.equal(backend.call(f"{MOD}:identity", torch.ones(2)), torch.ones(2))  # still serving


def test_unknown_target_is_a_remote_error(backend):
    with pytest.raises(IsolatedWorkerError, match="ModuleNotFoundError"):
        backend.call("no_such_module_xyz:f")


@pytest.mark.parametrize("bad", [object(), {"a": 1}, torch.float32, torch.ones(2, requires_grad=True), b"x"])
def test_schema_refuses_non_schema_args_before_sending(backend, bad, monkeypatch):
    sent = []
    monkeypatch.setattr(P, "send", lambda *a: sent.append(a))
    with pytest.raises(InvalidInputError, match="isolated call"):
        backend.call(f"{MOD}:echo", 1, bad)
    assert sent == []


def test_no_pickle_during_calls(backend, monkeypatch):
    import multiprocessing.reduction as mpr

    def refuse(*a, **k):
        raise AssertionError("pickle used")

    for mod, name in ((pickle, "dumps"), (pickle, "loads"), (pickle, "dump"), (pickle, "load")):
        monkeypatch.setattr(mod, name, refuse)
    monkeypatch.setattr(mpr.ForkingPickler, "dumps", classmethod(refuse))
    x = torch.randn(4, 16)
    y = backend.call(f"{MOD}:rms_norm", x, torch.ones(16), 1e-6, None)
    torch.testing.assert_close(y.double(), oracle(x, torch.ones(16)), atol=1e-5, rtol=1e-5)
    with pytest.raises(IsolatedWorkerError):
        backend.call(f"{MOD}:boom")


def test_killed_worker_raises_exit_code_then_restarts():
    own = IsolatedBackend(path=[HERE], timeout_s=20, name="killme")
    try:
        lz.register_isolated_kernel(
            "rms_norm", "isokill.rms", f"{MOD}:rms_norm", backend=own, priority=120, dtypes={"float32"}
        )
        lz.lock("rms_norm", "isokill.rms")
        x, w = torch.randn(2, 8), torch.randn(8)
        lz.rms_norm(x, w)
        pid = own.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(KernelExecutionError) as info:
            lz.rms_norm(x, w)
        cause = info.value.__cause__
        assert isinstance(cause, IsolatedWorkerError) and cause.exit_code == -signal.SIGKILL
        assert "SIGKILL" in str(cause)
        torch.testing.assert_close(lz.rms_norm(x, w).double(), oracle(x, w), atol=1e-5, rtol=1e-5)
        assert own.pid != pid and own.starts == 2
        # unlocked: a dead worker is a kernel failure -> fallback to another kernel and health is charged
        lz.unlock("rms_norm")
        os.kill(own.pid, signal.SIGKILL)
        torch.testing.assert_close(lz.rms_norm(x, w).double(), oracle(x, w), atol=1e-5, rtol=1e-5)
        assert RUNTIME.health.snapshot()["isokill"]["failures"] == 1
    finally:
        lz.unlock("rms_norm")
        lz.unregister_kernel("isokill.rms")
        own.close()


def test_restart_false_keeps_raising():
    with IsolatedBackend(path=[HERE], restart=False) as b:
        with pytest.raises(IsolatedWorkerError, match="exit code 3") as info:
            b.call(f"{MOD}:crash")
        assert info.value.exit_code == 3
        with pytest.raises(IsolatedWorkerError, match="restart=False"):
            b.call(f"{MOD}:pid")


def test_timeout_kills_the_worker_and_is_typed():
    with IsolatedBackend(path=[HERE], timeout_s=0.5, env={**os.environ, "LZ_TEST_SLEEP": "30"}) as b:
        b.start()
        pid = b.pid
        with pytest.raises(IsolatedWorkerTimeoutError, match="timeout_s=0.5") as info:
            b.call(f"{MOD}:sleepy", torch.ones(2), torch.ones(2))
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, IsolatedWorkerError)
        assert b.pid is None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_bad_interpreter_fails_to_start_with_a_typed_error(tmp_path):
    with pytest.raises(IsolatedWorkerError, match="cannot start"):
        IsolatedBackend(python=str(tmp_path / "no-python")).call(f"{MOD}:pid")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'torch is not installed here' >&2\nexit 7\n")
    fake.chmod(0o755)
    with pytest.raises(IsolatedWorkerError, match="did not start") as info:
        IsolatedBackend(python=str(fake)).call(f"{MOD}:pid")
    assert info.value.exit_code == 7 and "torch is not installed" in info.value.stderr_tail


def test_registration_errors():
    with pytest.raises(ConfigurationError, match="device_types"):
        lz.register_isolated_kernel("rms_norm", "isobad.rms", f"{MOD}:rms_norm", device_types={"mps"})
    with pytest.raises(ConfigurationError):
        lz.register_isolated_kernel("rms_norm", "torch_native.x", f"{MOD}:rms_norm")
    with pytest.raises(InvalidInputError, match="timeout_s"):
        IsolatedBackend(timeout_s=0)
    fn = isolated_kernel(f"{MOD}:identity", path=[HERE])
    try:
        assert torch.equal(fn(torch.ones(3)), torch.ones(3))
    finally:
        fn.backend.close()


def test_main_process_never_imports_the_worker_module(registered):
    lz.lock("rms_norm", KID)
    lz.rms_norm(torch.randn(2, 4), torch.ones(4))
    assert MOD not in sys.modules


def _cuda_descriptor(**over):
    ipc = {
        "handle": "aGFuZGxl",
        "bytes": 512,
        "storage_offset": 0,
        "ref": "cmVm",
        "ref_offset": 0,
        "event": None,
        "event_sync": False,
    }
    d = {"ipc": ipc, "offset": 4, "shape": [2, 3], "strides": [3, 1], "dtype": "float32", "device": "cuda:0"}
    for k, v in over.items():
        if k.startswith("ipc_"):
            ipc[k[4:]] = v
        else:
            d[k] = v
    return d


@pytest.mark.parametrize(
    "over",
    [
        {"device": "cuda"},
        {"device": "cuda:x"},
        {"device": "cpu"},
        {"ipc": "handle"},
        {"ipc_bytes": -1},
        {"ipc_bytes": True},
        {"ipc_handle": None},
        {"ipc_event": 3},
        {"ipc_event_sync": 1},
        {"ipc_extra": 1},
        {"offset": -1},
        {"shm": "seg"},
        {"strides": [1]},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_cuda_descriptors_are_checked_before_any_mapping(over):
    """A CUDA descriptor carries PyTorch's IPC reduction fields as JSON; a malformed one is refused by the
    schema (SchemaError, which the worker replies as an error and the client turns into IsolatedWorkerError)
    before ``cudaIpcOpenMemHandle`` is reached."""
    assert P.check_descriptor(_cuda_descriptor()) and P.check_descriptor(_cuda_descriptor(ipc=None))
    with pytest.raises(P.SchemaError, match="malformed tensor descriptor"):
        P.check_descriptor(_cuda_descriptor(**over))
    with pytest.raises(P.SchemaError, match="CUDA IPC handle"):
        P.ipc_tensor(_cuda_descriptor(ipc_handle="not base64!"))


def test_cuda_device_types_register():
    spec = lz.register_isolated_kernel(
        "rms_norm", "isocuda.rms", f"{MOD}:rms_norm", device_types={"cpu", "cuda"}
    )
    try:
        assert set(spec.device_types) == {"cpu", "cuda"}
    finally:
        spec.fn.backend.close()
        lz.unregister_kernel("isocuda.rms")


@pytest.mark.gpu
def test_cuda_rms_norm_through_the_worker_matches_float64_oracle(backend, monkeypatch):
    """CUDA tensors cross by CUDA IPC: a locked isolated rms_norm on CUDA inputs (strided, odd sizes) equals
    the float64 oracle, its result lives on the caller's device and survives the worker, and no pickle
    runs."""
    lz.register_isolated_kernel(
        "rms_norm",
        "isocuda.rms",
        f"{MOD}:rms_norm",
        backend=backend,
        priority=99,
        device_types={"cuda"},
        dtypes={"float32", "bfloat16"},
    )
    gen = torch.Generator().manual_seed(5)
    try:
        lz.lock("rms_norm", "isocuda.rms")
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            x = torch.randn(7, 2 * 123, generator=gen).to("cuda", dtype)[:, ::2]  # strided, odd width
            w = (torch.rand(123, generator=gen) + 0.5).to("cuda", dtype)
            monkeypatch.setattr(pickle, "dumps", lambda *a, **k: pytest.fail("pickle.dumps during a call"))
            monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads during a call"))
            y = lz.rms_norm(x, w)
            monkeypatch.undo()
            assert y.device == x.device and y.dtype == dtype
            torch.testing.assert_close(y.double(), oracle(x, w).to(dtype).double(), rtol=tol, atol=tol)
    finally:
        lz.unlock("rms_norm")
        lz.unregister_kernel("isocuda.rms")
    with IsolatedBackend(path=[HERE], timeout_s=20, name="isocuda") as own:
        out = own.call(
            f"{MOD}:rms_norm", torch.ones(3, 8, device="cuda"), torch.full((8,), 2.0, device="cuda")
        )
    torch.cuda.synchronize()
    assert torch.allclose(out, torch.full((3, 8), 2.0, device="cuda"))  # the clone outlives the closed worker


@pytest.mark.gpu
def test_cuda_inputs_are_shared_so_in_place_writes_reach_the_caller(backend):
    x = torch.arange(6, dtype=torch.float32, device="cuda").view(2, 3)
    device, total = backend.call(f"{MOD}:add_one_inplace", x)
    assert device.startswith("cuda") and total == 21.0
    assert torch.equal(x, torch.arange(1, 7, dtype=torch.float32, device="cuda").view(2, 3))
    empty = backend.call(f"{MOD}:identity", torch.empty(0, 4, device="cuda"))
    assert empty.shape == (0, 4) and empty.is_cuda


@pytest.mark.gpu
def test_cuda_results_on_the_callers_memory_come_back_as_copies(backend):
    """A kernel that returns its input, or a view of it, hands back the caller's own allocation, which CUDA
    IPC cannot export again (PyTorch raises "Attempted to send CUDA tensor received from another process");
    the worker copies such a result first. Values, shape and strides as the kernel returned them; the caller's
    tensor is not aliased (each result is a copy)."""
    x = torch.randn(4, 6, device="cuda")
    same = backend.call(f"{MOD}:identity", x)
    torch.cuda.synchronize()
    assert torch.equal(same, x) and same.data_ptr() != x.data_ptr()
    part = backend.call(f"{MOD}:identity", x[1:, ::2])
    torch.cuda.synchronize()
    assert torch.equal(part, x[1:, ::2]) and part.shape == (3, 3)
    same.add_(1)
    assert not torch.equal(same, x)
