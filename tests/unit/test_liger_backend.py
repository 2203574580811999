"""The Liger backend on a CPU machine without liger_kernel.

1. Absent library: ``liger`` registered, unavailable with BACKEND_NOT_INSTALLED; a broken import (no triton)
   gives BACKEND_IMPORT_FAILED.
2. Routing with fakes: fake ``liger_kernel.ops.*`` modules in ``sys.modules`` and hand-built CUDA contexts fed
   to ``core.selection.select``: liger (70) beats torch_native (50) on CUDA SM >= 8.0; rejected with the right
   reasons for interleaved RoPE, a missing fused add + RMSNorm, old SMs, huge hidden sizes.
3. Calls: the plan runs the fakes (which mimic Liger, including its in-place rotation in [B, S, H, D] memory)
   and matches float64 oracles written here; the caller's tensors are never modified.
"""

from __future__ import annotations

import importlib
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from layerzero.backends import liger
from layerzero.core.capabilities import describe_backend
from layerzero.core.context import SelectionContext
from layerzero.core.device import DeviceSpec
from layerzero.core.errors import BackendNotAvailableError
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import SelectionInputs, select
from layerzero.core.specs import Layout
from layerzero.testing.devices import fake_cuda_device

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- fakes and helpers


def rms_oracle(x, w, eps):
    x64 = x.double()
    return x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w.double()


class FakeRMS:
    """Stand-in for LigerRMSNormFunction: records the arguments, computes in float64."""

    calls: list = []

    @classmethod
    def apply(cls, x, w, eps, offset, casting_mode, in_place):
        cls.calls.append((eps, offset, casting_mode, in_place))
        return rms_oracle(x, w, eps).to(x.dtype)


class FakeFusedRMS:
    calls: list = []

    @classmethod
    def apply(cls, x, r, w, eps, offset, casting_mode, in_place):
        cls.calls.append((eps, offset, casting_mode, in_place))
        h = x + r
        return rms_oracle(h, w, eps).to(x.dtype), h


class FakeRope:
    """Stand-in for LigerRopeFunction: like Liger, transposes q/k to [B, S, H, D], calls .contiguous() (a
    no-op for BSHD storage) and rotates *in place* there, then returns BHSD views."""

    calls: list = []

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        raise NotImplementedError

    @classmethod
    def apply(cls, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        cls.calls.append(
            {"q": tuple(q.shape), "cos": tuple(cos.shape), "in_place": q.transpose(1, 2).is_contiguous()}
        )
        out = []
        for t in (q, k):
            p = t.transpose(1, 2).contiguous()  # [B, S, H, D], in place when already BSHD memory
            r = cos.shape[-1]
            c, s = cos.unsqueeze(2).to(p.dtype), sin.unsqueeze(2).to(p.dtype)  # [b, S, 1, R]
            x1, x2 = p[..., : r // 2].clone(), p[..., r // 2 : r].clone()
            p[..., : r // 2] = x1 * c[..., : r // 2] - x2 * s[..., : r // 2]
            p[..., r // 2 : r] = x2 * c[..., : r // 2] + x1 * s[..., : r // 2]
            out.append(p.transpose(1, 2))
        return tuple(out)


class OldFakeRope(FakeRope):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        raise NotImplementedError


def install(monkeypatch, *, fused=True, rope=FakeRope):
    FakeRMS.calls, FakeFusedRMS.calls, FakeRope.calls = [], [], []
    mods = {
        name: types.ModuleType(name)
        for name in (
            "liger_kernel",
            "liger_kernel.ops",
            "liger_kernel.ops.rms_norm",
            "liger_kernel.ops.fused_add_rms_norm",
            "liger_kernel.ops.rope",
        )
    }
    mods["liger_kernel"].__version__ = "0.8.5"
    mods["liger_kernel.ops.rms_norm"].LigerRMSNormFunction = FakeRMS
    if fused:
        mods["liger_kernel.ops.fused_add_rms_norm"].LigerFusedAddRMSNormFunction = FakeFusedRMS
    mods["liger_kernel.ops.rope"].LigerRopeFunction = rope
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def make_registry():
    RUNTIME.ensure_ready()
    reg = KernelRegistry()
    for op in ("rms_norm", "rope", "swiglu", "layer_norm", "linear_cross_entropy"):
        reg.add_op(RUNTIME.registry.ops.get(op))
        for spec in RUNTIME.registry.for_op(op):
            if spec.backend in ("reference", "torch_native"):
                if spec.backend not in reg.backends:
                    reg.add_backend(RUNTIME.registry.backend(spec.backend))
                reg.add_kernel(spec)
    liger.register(reg)
    return reg


@pytest.fixture
def reg(monkeypatch):
    install(monkeypatch)
    return make_registry()


cuda_device = fake_cuda_device


def rms_ctx(sm=(9, 0), dtype=torch.bfloat16, h=4096, **kw):
    return SelectionContext(
        op="rms_norm", device=cuda_device(sm), dtype=dtype, hidden_size=h, param_dtype=dtype, **kw
    )


def rope_ctx(sm=(9, 0), dtype=torch.float16, d=128, r=None, layout=Layout.BHSD, **kw):
    return SelectionContext(
        op="rope",
        device=cuda_device(sm),
        dtype=dtype,
        num_heads_q=8,
        num_heads_kv=2,
        head_dim=d,
        rotary_dim=d if r is None else r,
        layout=layout,
        **kw,
    )


def _measured_liger_faster(kernel_id):
    """A PerfDB stand-in where lz.tune measured Liger faster (+30 score points, 10 µs): Liger's priority (40)
    is below torch_native's (50), so only measurement makes it win, as on the H200 for large fused inputs."""
    return (30.0, 10.0) if kernel_id.startswith("liger.") else (0.0, None)


def run_select(reg, ctx, perf=_measured_liger_faster):
    inputs = SelectionInputs(Policy.empty(), lambda _b: None, perf, log_fallbacks=False)
    return select(reg, ctx, inputs)


def codes(report, kernel_id="liger.rms_norm"):
    return {r.code for r in report.candidate(kernel_id).reasons}


# ----------------------------------------------------------------------------- 1. absent / broken library


def test_registered_and_unavailable_without_the_library():
    RUNTIME.ensure_ready()
    spec = RUNTIME.registry.backend("liger")
    assert not spec.available and spec.import_name == "liger_kernel"
    assert [r.code for r in spec.reasons] == [R.BACKEND_NOT_INSTALLED]
    assert "pip install liger-kernel" in spec.reasons[0].message
    assert {k.kernel_id for k in RUNTIME.registry.kernels.values() if k.backend == "liger"} == set(
        liger.KERNEL_IDS
    )


@pytest.mark.parametrize(
    "exc",
    [ModuleNotFoundError("No module named 'triton'", name="triton"), RuntimeError("CUDA driver too old")],
)
def test_broken_import_is_import_failed(monkeypatch, exc):
    real = importlib.import_module

    def fake_import(name, package=None):
        if name.startswith("liger_kernel"):
            raise exc
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    spec = liger.probe().backend
    assert not spec.available
    assert [r.code for r in spec.reasons] == [R.BACKEND_IMPORT_FAILED]
    assert str(exc) in spec.reasons[0].message


def test_missing_kernel_callable_raises_typed_error():
    spec = liger.kernel_specs(None, "module 'liger_kernel' not found")[0]
    with pytest.raises(BackendNotAvailableError, match="liger_kernel"):
        spec.fn(torch.ones(2), torch.ones(2), 1e-6, None)


def test_capability_descriptor_matches_code():
    RUNTIME.ensure_ready()
    on_disk = yaml.safe_load((ROOT / "capabilities" / "liger.yaml").read_text())
    assert on_disk == describe_backend(RUNTIME.registry, "liger")


# ----------------------------------------------------------------------------- 2. routing


def test_probe_with_fakes(monkeypatch):
    install(monkeypatch)
    p = liger.probe()
    assert p.backend.available and p.backend.version == "0.8.5"
    # no liger_kernel.ops.swiglu among these fakes: liger.swiglu is rejected, not the backend
    # (tests/unit/test_swiglu.py)
    assert p.functions == {
        "rms_norm": FakeRMS,
        "fused_add_rms_norm": FakeFusedRMS,
        "rope": FakeRope,
        "swiglu": None,
        "layer_norm": None,
        "linear_cross_entropy": None,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_liger_wins_rms_norm_on_cuda_only_when_measured_faster(reg, dtype):
    plan, report = run_select(reg, rms_ctx(dtype=dtype))
    assert plan.kernel_id == "liger.rms_norm"
    assert report.candidate("liger.rms_norm").score.total == 70  # priority 40 + 30 measured
    assert report.candidate("torch_native.rms_norm").score.total == 50
    plan, report = run_select(reg, rms_ctx(dtype=dtype), perf=lambda _k: (0.0, None))
    assert plan.kernel_id == "torch_native.rms_norm"  # unmeasured: the priorities alone (50 > 40)
    assert report.candidate("liger.rms_norm").score.total == 40


@pytest.mark.parametrize(
    ("ctx_kw", "code", "winner"),
    [
        ({"sm": (7, 5)}, R.SM_TOO_OLD, "torch_native.rms_norm"),
        ({"h": 65537}, R.HIDDEN_SIZE_UNSUPPORTED, "torch_native.rms_norm"),
        ({"dtype": torch.float64}, R.DTYPE_UNSUPPORTED, "torch_native.rms_norm"),
    ],
)
def test_rms_norm_rejections(reg, ctx_kw, code, winner):
    plan, report = run_select(reg, rms_ctx(**ctx_kw))
    assert plan.kernel_id == winner
    assert code in codes(report)


def test_largest_hidden_size_accepted(reg):
    assert run_select(reg, rms_ctx(h=65536))[0].kernel_id == "liger.rms_norm"


def test_cpu_rms_norm_not_liger(reg):
    ctx = SelectionContext(op="rms_norm", device=DeviceSpec.detect("cpu"), dtype=torch.float32, hidden_size=8)
    plan, report = run_select(reg, ctx)
    assert plan.kernel_id == "torch_native.rms_norm"
    assert R.DEVICE_TYPE_UNSUPPORTED in codes(report)


def test_fused_residual_with_and_without_liger_fused(monkeypatch):
    install(monkeypatch, fused=True)
    assert run_select(make_registry(), rms_ctx(fused_residual=True))[0].kernel_id == "liger.rms_norm"
    install(monkeypatch, fused=False)
    plan, report = run_select(make_registry(), rms_ctx(fused_residual=True))
    assert plan.kernel_id == "torch_native.rms_norm"
    assert codes(report) == {R.BACKEND_VERSION_UNSUPPORTED}
    assert "LigerFusedAddRMSNormFunction" in report.candidate("liger.rms_norm").reasons[0].message


@pytest.mark.parametrize("layout", [Layout.BHSD, Layout.BSHD])
def test_liger_wins_rope_both_layouts_no_transform(reg, layout):
    plan, report = run_select(reg, rope_ctx(layout=layout))
    assert plan.kernel_id == "liger.rope" and plan.transforms == ()


def test_interleaved_rope_rejected(reg):
    plan, report = run_select(reg, rope_ctx(interleaved=True))
    assert plan.kernel_id == "torch_native.rope"
    assert codes(report, "liger.rope") == {R.LAYOUT_UNSUPPORTED}


def test_partial_rotary_needs_rotary_dim_parameter(monkeypatch):
    install(monkeypatch)
    assert run_select(make_registry(), rope_ctx(d=128, r=64))[0].kernel_id == "liger.rope"
    install(monkeypatch, rope=OldFakeRope)
    plan, report = run_select(make_registry(), rope_ctx(d=128, r=64))
    assert plan.kernel_id == "torch_native.rope"
    assert codes(report, "liger.rope") == {R.HEAD_DIM_MISMATCH}
    assert run_select(make_registry(), rope_ctx(d=128, r=128))[0].kernel_id == "liger.rope"


def test_graph_capture_excludes_liger(reg):
    plan, report = run_select(reg, rms_ctx(graph_capture=True))
    assert plan.kernel_id == "torch_native.rms_norm"
    assert R.CUDA_GRAPH_UNSAFE in codes(report)


# ----------------------------------------------------------------------------- 3. calls through the plan


def test_rms_norm_call_matches_oracle_and_passes_llama_mode(reg):
    plan, _ = run_select(reg, rms_ctx(dtype=torch.float32, h=16))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 16, generator=g), torch.randn(16, generator=g)
    torch.testing.assert_close(plan(x, w, 1e-5, None), rms_oracle(x, w, 1e-5).float())
    assert FakeRMS.calls == [(1e-5, 0.0, "llama", False)]
    r = torch.randn(3, 5, 16, generator=g)
    fused_plan, _ = run_select(reg, rms_ctx(dtype=torch.float32, h=16, fused_residual=True))
    y, h = fused_plan(x, w, 1e-6, r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, rms_oracle(x + r, w, 1e-6).float())
    assert FakeFusedRMS.calls == [(1e-6, 0.0, "llama", False)]


def rope_oracle(x, cos, sin, layout):
    """float64 half rotation, worked per pair (i, i + R/2) with explicit loops over the rotary half."""
    x = x.double() if layout == "BHSD" else x.double().transpose(1, 2)  # [B, H, S, D]
    cos, sin = cos.double().unsqueeze(1), sin.double().unsqueeze(1)  # [b, 1, S, R]
    out = x.clone()
    half = cos.shape[-1] // 2
    for i in range(half):
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * cos[..., i] - b * sin[..., i]
        out[..., i + half] = b * cos[..., i + half] + a * sin[..., i + half]
    return out if layout == "BHSD" else out.transpose(1, 2)


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("form", ["gathered", "table", "indexed"])
@pytest.mark.parametrize("rot", [8, 4])
def test_rope_call_matches_oracle_and_leaves_inputs(reg, layout, form, rot):
    lay = Layout(layout)
    plan, _ = run_select(reg, rope_ctx(dtype=torch.float32, d=8, r=rot, layout=lay))
    g = torch.Generator().manual_seed(1)
    b, s, hq, hkv, d = 2, 5, 4, 2, 8
    shape_q = (b, hq, s, d) if layout == "BHSD" else (b, s, hq, d)
    shape_k = (b, hkv, s, d) if layout == "BHSD" else (b, s, hkv, d)
    q, k = torch.randn(shape_q, generator=g), torch.randn(shape_k, generator=g)
    q0, k0 = q.clone(), k.clone()
    theta = torch.arange(11, dtype=torch.float64)[:, None] / (10000 ** (torch.arange(rot // 2) * 2 / rot))
    table_c, table_s = torch.cat([theta.cos()] * 2, -1).float(), torch.cat([theta.sin()] * 2, -1).float()
    pos = None
    if form == "gathered":
        cos, sin = table_c[3 : 3 + s].unsqueeze(0), table_s[3 : 3 + s].unsqueeze(0)
        gc, gs = cos, sin
    elif form == "table":
        cos, sin = table_c, table_s
        gc, gs = table_c[:s].unsqueeze(0), table_s[:s].unsqueeze(0)
    else:
        pos = torch.tensor([[0, 2, 4, 6, 8], [10, 9, 1, 3, 5]])
        cos, sin = table_c, table_s
        gc, gs = table_c[pos], table_s[pos]
    qo, ko = plan(q, k, cos, sin, pos, False, lay)
    torch.testing.assert_close(qo.double(), rope_oracle(q0, gc, gs, layout))
    torch.testing.assert_close(ko.double(), rope_oracle(k0, gc, gs, layout))
    assert qo.shape == q.shape and ko.shape == k.shape
    assert torch.equal(q, q0) and torch.equal(k, k0)  # the caller's tensors are untouched
    assert FakeRope.calls[-1]["in_place"]  # Liger got BSHD memory: it rotated our copy in place


def test_rope_oracle_hand_worked():
    # a 90-degree rotation of (1, 0) is (0, 1); of (0, 1) is (-1, 0)
    x = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # [1, 1, 2, 2]
    c, s = torch.zeros(1, 2, 2), torch.ones(1, 2, 2)
    assert torch.equal(rope_oracle(x, c, s, "BHSD").float(), torch.tensor([[[[0.0, 1.0], [-1.0, 0.0]]]]))
    assert math.isclose(
        rms_oracle(torch.tensor([3.0, 4.0]), torch.ones(2), 0.0)[0].item(), 3 / math.sqrt(12.5)
    )


def test_liger_linear_cross_entropy_refuses_reduction_none_with_grad():
    """Liger's fused linear cross-entropy scales its precomputed gradients by one scalar, so reduction="none"
    with gradients would be silently wrong: its check refuses exactly that context (hand-built CUDA
    contexts)."""
    import dataclasses

    import torch

    from layerzero.backends.liger.fused import linear_cross_entropy_check
    from layerzero.core.context import SelectionContext
    from layerzero.core.reasons import ReasonCode

    class FakeLCE:
        @staticmethod
        def forward(
            ctx,
            _input,
            weight,
            target,
            bias=None,
            ce_weight=None,
            ignore_index=-100,
            lse_square_scale=0.0,
            label_smoothing=0.0,
            reduction="mean",
            softcap=None,
        ):
            raise NotImplementedError

    check = linear_cross_entropy_check(FakeLCE)
    base = SelectionContext(
        op="linear_cross_entropy",
        device=cuda_device((9, 0)),
        dtype=torch.bfloat16,
        batch=64,
        hidden_size=128,
        vocab_size=1000,
        reduction="none",
        requires_grad=True,
    )
    assert [r.code for r in check(base)] == [ReasonCode.BACKWARD_UNSUPPORTED]
    assert check(dataclasses.replace(base, requires_grad=False)) == []
    assert check(dataclasses.replace(base, reduction="mean")) == []
    assert (
        check(dataclasses.replace(base, has_softcap=True, reduction="sum")) == []
    )  # this forward has softcap
