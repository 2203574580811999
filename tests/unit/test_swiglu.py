"""``lz.swiglu``: input validation, the cache key and context, and routing among its kernels.

1. Bad inputs raise ``InvalidInputError`` naming what failed, expected vs got.
2. The key holds dtype, device, intermediate size, layout and flags; the fast and slow paths agree.
3. Routing on hand-built CUDA contexts with a fake ``liger_kernel.ops.swiglu`` (no GPU, no liger here):
   torch_native (50) > triton (45) > liger (40) unmeasured; measured Liger wins; rejections with their codes
   (old SM, float64, I > 65536, autograd, graph capture, a Liger without LigerSiLUMulFunction, stride(-1) !=
   1).
4. The Liger wrapper passes multipliers 1.0 and its output reaches the caller; the missing callables raise
   typed errors.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import layerzero as lz
from layerzero.backends import liger
from layerzero.backends import triton as triton_backend
from layerzero.core.context import SelectionContext
from layerzero.core.device import DeviceSpec
from layerzero.core.errors import BackendNotAvailableError, InvalidInputError
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import SelectionInputs, select
from layerzero.core.specs import BackendSpec
from layerzero.ops import OPS
from layerzero.testing.devices import fake_cuda_device

pytestmark = pytest.mark.unit


def oracle(gate, up):
    g = gate.double()
    return g / (1 + torch.exp(-g)) * up.double()


# ----------------------------------------------------------------------------- 1. bad inputs


@pytest.mark.parametrize(
    ("gate", "up", "match"),
    [
        ([1.0, 2.0], torch.ones(2), r"lz\.swiglu: gate.*expected a torch\.Tensor.*got list"),
        (torch.ones(2), "x", r"lz\.swiglu: up.*expected a torch\.Tensor.*got str"),
        (
            torch.ones(2, dtype=torch.int64),
            torch.ones(2, dtype=torch.int64),
            r"gate\.dtype.*float32/float64.*int64",
        ),
        (torch.ones(2), torch.ones(2, dtype=torch.int32), r"up\.dtype.*float32/float64.*int32"),
        (torch.tensor(1.0), torch.tensor(1.0), r"gate rank.*>= 1 dims.*0-dim"),
        (torch.ones(2, 3), torch.ones(3, 2), r"up shape.*\[2, 3\].*\[3, 2\].*chunk\(2, -1\)"),
        (torch.ones(2, 3), torch.ones(3), r"up shape.*\[2, 3\].*got \[3\]"),
        (
            torch.ones(2, 3),
            torch.ones(2, 3, dtype=torch.float16),
            r"up\.dtype.*torch\.float32.*torch\.float16",
        ),
        (torch.ones(2, 3), torch.ones(2, 3, device="meta"), r"up\.device.*cpu.*meta"),
        (torch.ones(4, 0), torch.ones(4, 0), r"intermediate size.*>= 1, got 0"),
    ],
)
def test_bad_input_raises_typed_error(gate, up, match):
    with pytest.raises(InvalidInputError, match=match):
        lz.swiglu(gate, up)


def test_bad_input_error_is_a_value_error():
    with pytest.raises(ValueError, match="lz.swiglu"):
        lz.swiglu(torch.ones(2, 3), torch.ones(2, 4))


# ----------------------------------------------------------------------------- 2. key and context


def test_key_and_context_fields():
    prepare, build = OPS["swiglu"]
    g = torch.randn(3, 5, 11)
    key, args = prepare(g, g.clone())
    assert args[0] is g and len(args) == 2
    ctx = build(key)
    assert (ctx.op, ctx.dtype, ctx.hidden_size, ctx.contiguous, ctx.stride_last_1, ctx.requires_grad) == (
        "swiglu",
        torch.float32,
        11,
        True,
        True,
        False,
    )
    gate_up = torch.randn(4, 22)
    ctx = build(prepare(gate_up[:, :11], gate_up[:, 11:])[0])
    assert (ctx.contiguous, ctx.stride_last_1) == (False, True)
    strided = torch.randn(4, 22)[:, ::2]
    assert build(prepare(strided, strided)[0]).stride_last_1 is False
    assert prepare(g, g)[0] != prepare(g.half(), g.half())[0]
    assert prepare(g, g)[0] != prepare(torch.randn(3, 5, 12), torch.randn(3, 5, 12))[0]


def test_requires_grad_is_in_the_key():
    prepare, build = OPS["swiglu"]
    g = torch.randn(2, 4, requires_grad=True)
    assert build(prepare(g, torch.randn(2, 4))[0]).requires_grad
    with torch.no_grad():
        assert not build(prepare(g, torch.randn(2, 4))[0]).requires_grad


def test_cpu_default_is_torch_native_and_matches_oracle_and_autograd():
    g = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    u = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    assert lz.which("swiglu", g, u) == "torch_native.swiglu"
    out = lz.swiglu(g, u)
    torch.testing.assert_close(out, oracle(g, u), rtol=1e-12, atol=1e-12)
    out.sum().backward()
    sig = torch.sigmoid(g.detach())
    torch.testing.assert_close(u.grad, g.detach() * sig)  # d/du = silu(g)
    torch.testing.assert_close(g.grad, (sig * (1 + g.detach() * (1 - sig))) * u.detach())  # silu'(g) * u


def test_registered_kernels():
    ids = {k["kernel_id"] for k in lz.list_kernels("swiglu")}
    assert ids == {"reference.swiglu", "torch_native.swiglu", "liger.swiglu", "triton.swiglu"}


# ----------------------------------------------------------------------------- 3. routing with fakes


class FakeSiLUMul:
    """Stand-in for LigerSiLUMulFunction: records the multipliers, computes in float64 like Liger's math."""

    calls: list = []

    @classmethod
    def apply(cls, a, b, gate_multiplier=1.0, down_multiplier=1.0):
        cls.calls.append((gate_multiplier, down_multiplier))
        return oracle(a, b).to(a.dtype)


def install(monkeypatch, *, swiglu=True):
    FakeSiLUMul.calls = []
    names = (
        "liger_kernel",
        "liger_kernel.ops",
        "liger_kernel.ops.rms_norm",
        "liger_kernel.ops.rope",
        "liger_kernel.ops.fused_add_rms_norm",
        "liger_kernel.ops.swiglu",
    )
    mods = {name: types.ModuleType(name) for name in names}
    mods["liger_kernel"].__version__ = "0.8.5"
    mods["liger_kernel.ops.rms_norm"].LigerRMSNormFunction = object()
    mods["liger_kernel.ops.rope"].LigerRopeFunction = object()
    if swiglu:
        mods["liger_kernel.ops.swiglu"].LigerSiLUMulFunction = FakeSiLUMul
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def make_registry(triton_available=True):
    RUNTIME.ensure_ready()
    reg = KernelRegistry()
    for op in (
        "rms_norm",
        "rope",
        "swiglu",
        "layer_norm",
        "linear_cross_entropy",
    ):  # every op liger registers
        reg.add_op(RUNTIME.registry.ops.get(op))
        for spec in RUNTIME.registry.for_op(op):
            if spec.backend in ("reference", "torch_native"):
                if spec.backend not in reg.backends:
                    reg.add_backend(RUNTIME.registry.backend(spec.backend))
                reg.add_kernel(spec)
    liger.register(reg)
    reg.add_backend(BackendSpec("triton", "triton", "3.6", triton_available))
    from layerzero.backends.triton import swiglu as tsw

    reg.add_kernel(tsw.kernel_spec(triton_available, "test"))
    return reg


@pytest.fixture
def reg(monkeypatch):
    install(monkeypatch)
    return make_registry()


cuda_device = fake_cuda_device


def ctx(sm=(9, 0), dtype=torch.bfloat16, inter=14336, **kw):
    return SelectionContext(op="swiglu", device=cuda_device(sm), dtype=dtype, hidden_size=inter, **kw)


def run_select(reg, context, faster=None):
    def perf(kernel_id):
        """A PerfDB stand-in: ``faster`` measured +30 score points (10 µs), every other kernel unmeasured."""
        return (30.0, 10.0) if kernel_id == faster else (0.0, None)

    return select(reg, context, SelectionInputs(Policy.empty(), lambda _b: None, perf, log_fallbacks=False))


def codes(report, kernel_id):
    return {r.code for r in report.candidate(kernel_id).reasons}


def test_probe_finds_the_fake_swiglu(monkeypatch):
    install(monkeypatch)
    assert liger.probe().functions["swiglu"] is FakeSiLUMul
    install(monkeypatch, swiglu=False)
    p = liger.probe()
    assert p.backend.available and p.functions["swiglu"] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_priorities_and_measured_winners(reg, dtype):
    plan, report = run_select(reg, ctx(dtype=dtype))
    assert plan.kernel_id == "torch_native.swiglu"
    scores = {
        k: report.candidate(k).score.total for k in ("torch_native.swiglu", "triton.swiglu", "liger.swiglu")
    }
    assert scores == {"torch_native.swiglu": 50, "triton.swiglu": 45, "liger.swiglu": 40}
    assert run_select(reg, ctx(dtype=dtype), faster="liger.swiglu")[0].kernel_id == "liger.swiglu"
    assert run_select(reg, ctx(dtype=dtype), faster="triton.swiglu")[0].kernel_id == "triton.swiglu"


@pytest.mark.parametrize(
    ("kw", "kernel_id", "code"),
    [
        ({"sm": (7, 5)}, "liger.swiglu", R.SM_TOO_OLD),
        ({"sm": (7, 5)}, "triton.swiglu", R.SM_TOO_OLD),
        ({"dtype": torch.float64}, "liger.swiglu", R.DTYPE_UNSUPPORTED),
        ({"dtype": torch.float64}, "triton.swiglu", R.DTYPE_UNSUPPORTED),
        ({"inter": 65537}, "liger.swiglu", R.HIDDEN_SIZE_UNSUPPORTED),
        ({"inter": 65535 * 1024 + 1}, "triton.swiglu", R.HIDDEN_SIZE_UNSUPPORTED),
        ({"requires_grad": True}, "liger.swiglu", R.BACKWARD_UNSUPPORTED),
        ({"requires_grad": True}, "triton.swiglu", R.BACKWARD_UNSUPPORTED),
        ({"graph_capture": True}, "liger.swiglu", R.CUDA_GRAPH_UNSAFE),
        ({"stride_last_1": False, "contiguous": False}, "triton.swiglu", R.STRIDE_LAST_DIM_NOT_1),
    ],
)
def test_rejections(reg, kw, kernel_id, code):
    plan, report = run_select(reg, ctx(**kw), faster=kernel_id)
    assert plan.kernel_id != kernel_id
    assert code in codes(report, kernel_id)


def test_accepted_edges(reg):
    assert run_select(reg, ctx(inter=65536), faster="liger.swiglu")[0].kernel_id == "liger.swiglu"
    assert run_select(reg, ctx(inter=65535 * 1024), faster="triton.swiglu")[0].kernel_id == "triton.swiglu"
    graph = run_select(reg, ctx(graph_capture=True), faster="triton.swiglu")[0]
    assert graph.kernel_id == "triton.swiglu"  # graph-safe, unlike Liger


def test_cpu_never_routes_to_cuda_kernels(reg):
    cpu = SelectionContext(op="swiglu", device=DeviceSpec.detect("cpu"), dtype=torch.float32, hidden_size=8)
    for faster in ("liger.swiglu", "triton.swiglu"):
        plan, report = run_select(reg, cpu, faster=faster)
        assert plan.kernel_id == "torch_native.swiglu"
        assert R.DEVICE_TYPE_UNSUPPORTED in codes(report, faster)


def test_liger_without_silu_mul_is_rejected_with_version_reason(monkeypatch):
    install(monkeypatch, swiglu=False)
    reg = make_registry()
    plan, report = run_select(reg, ctx(), faster="liger.swiglu")
    assert plan.kernel_id == "torch_native.swiglu"
    assert codes(report, "liger.swiglu") == {R.BACKEND_VERSION_UNSUPPORTED}
    with pytest.raises(BackendNotAvailableError, match="LigerSiLUMulFunction"):
        reg.kernel("liger.swiglu").fn(torch.ones(2), torch.ones(2))


def test_liger_plan_runs_the_fake_with_unit_multipliers(reg):
    plan, _ = run_select(reg, ctx(dtype=torch.float32, inter=9), faster="liger.swiglu")
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(2, 4, 9, generator=g), torch.randn(2, 4, 9, generator=g)
    torch.testing.assert_close(plan(gate, up), oracle(gate, up).float())
    assert FakeSiLUMul.calls == [(1.0, 1.0)]


def test_missing_callables_raise_typed_errors():
    spec = liger.kernel_specs(None, "module 'liger_kernel' not found")[2]
    assert spec.kernel_id == "liger.swiglu"
    with pytest.raises(BackendNotAvailableError, match="liger.swiglu cannot run: module 'liger_kernel'"):
        spec.fn(torch.ones(2), torch.ones(2))
    tspec = next(s for s in triton_backend.kernel_specs(False, "no triton here") if s.op == "swiglu")
    with pytest.raises(BackendNotAvailableError, match="triton.swiglu cannot run: no triton here"):
        tspec.fn(torch.ones(2), torch.ones(2))


def test_hand_worked_value():
    # silu(1) * 2 = 2 / (1 + e^-1) = 1.4621171572600098; silu(0) * 5 = 0; silu(-1) * 1 = -1 / (1 + e) =
    # -0.2689...
    out = lz.swiglu(
        torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64),
        torch.tensor([2.0, 5.0, 1.0], dtype=torch.float64),
    )
    assert out.tolist() == pytest.approx([1.4621171572600098, 0.0, -0.2689414213699951], abs=1e-15)
