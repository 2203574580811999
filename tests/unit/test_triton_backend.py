"""The ``triton`` backend on a CPU machine: registration, availability reasons, routing, laziness.

1. Availability: with triton importable the backend is available with its version; with ``triton`` faked
   absent (``sys.modules["triton"] = None``) it is registered, unavailable with BACKEND_NOT_INSTALLED and its
   kernels raise BackendNotAvailableError; a broken import gives BACKEND_IMPORT_FAILED with the error text.
   ``import layerzero`` (and registration) never imports triton's kernel modules; the probe imports triton.
2. Routing on hand-built CUDA contexts through ``core.selection.select``: triton (60) beats torch_native (50)
   and the reference (0) on SM >= 8.0 and loses to nothing else registered here; each constraint rejects
   with the right reason (old SM, float64, hidden size, weight dtype, strides, grad, graph capture for
   sampling, head dim); CPU contexts never pick it.
"""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from layerzero.backends import triton as tb
from layerzero.backends.triton import norms, rope, sampling
from layerzero.core.capabilities import describe_backend
from layerzero.core.context import SelectionContext
from layerzero.core.device import DeviceSpec
from layerzero.core.errors import BackendNotAvailableError, NoKernelFoundError
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import SelectionInputs, select
from layerzero.core.specs import Layout
from layerzero.testing.devices import fake_cuda_device

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
OPS = ("rms_norm", "rope", "sample_topk", "sample_topp")


# ----------------------------------------------------------------------------- helpers


def make_registry(monkeypatch=None, *, absent=False):
    """A registry with every op, the reference and torch_native kernels, and the triton backend (with triton
    faked absent when ``absent``)."""
    RUNTIME.ensure_ready()
    reg = KernelRegistry()
    for op in RUNTIME.registry.ops:
        reg.add_op(RUNTIME.registry.ops.get(op))
    for op in RUNTIME.registry.ops:
        for spec in RUNTIME.registry.for_op(op):
            if spec.backend in ("reference", "torch_native"):
                if spec.backend not in reg.backends:
                    reg.add_backend(RUNTIME.registry.backend(spec.backend))
                reg.add_kernel(spec)
    if absent:
        monkeypatch.setitem(sys.modules, "triton", None)
    tb.register(reg)
    return reg


cuda_device = fake_cuda_device


def rms_ctx(sm=(9, 0), dtype=torch.bfloat16, h=4096, param_dtype=None, **kw):
    return SelectionContext(
        op="rms_norm",
        device=cuda_device(sm),
        dtype=dtype,
        hidden_size=h,
        param_dtype=param_dtype or dtype,
        stride_last_1=kw.pop("stride_last_1", True),
        **kw,
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


def sample_ctx(op, sm=(9, 0), dtype=torch.bfloat16, **kw):
    return SelectionContext(
        op=op, device=cuda_device(sm), dtype=dtype, vocab_size=151936, has_generator=True, **kw
    )


def _measured_triton_norm_faster(kernel_id):
    """A PerfDB stand-in where lz.tune measured triton.rms_norm faster (+15 score points, 40 µs): its priority
    (45) is below torch_native's (50), so on CUDA it wins only when measured faster (large prefill rows on the
    H200); the other Triton kernels win on priority alone."""
    return (15.0, 40.0) if kernel_id == "triton.rms_norm" else (0.0, None)


def run_select(reg, ctx, perf=_measured_triton_norm_faster):
    inputs = SelectionInputs(Policy.empty(), lambda _b: None, perf, log_fallbacks=False)
    return select(reg, ctx, inputs)


def codes(report, kernel_id):
    return {r.code for r in report.candidate(kernel_id).reasons}


# ----------------------------------------------------------------------------- 1. availability


def test_available_here_with_version():
    pytest.importorskip(
        "triton", reason="triton is not installed: only the absent-library path can be tested"
    )
    spec = tb.probe()
    assert spec.available and spec.reasons == () and spec.import_name == "triton"
    assert spec.version == importlib.import_module("triton").__version__


def test_absent_triton_is_not_installed_and_kernels_raise(monkeypatch):
    reg = make_registry(monkeypatch, absent=True)
    spec = reg.backend("triton")
    assert not spec.available
    assert [r.code for r in spec.reasons] == [R.BACKEND_NOT_INSTALLED]
    assert "pip install triton" in spec.reasons[0].message
    ids = {k.kernel_id for k in reg.kernels.values() if k.backend == "triton"}
    assert set(tb.KERNEL_IDS) <= ids
    with pytest.raises(
        BackendNotAvailableError, match=r"triton\.rms_norm cannot run: module 'triton' not found"
    ):
        reg.kernel("triton.rms_norm").fn(torch.ones(2), torch.ones(2), 1e-6, None)
    with pytest.raises(BackendNotAvailableError, match="triton.sample_topp cannot run"):
        reg.kernel("triton.sample_topp").fn(torch.ones(1, 2), 0.5, 1.0, None)
    # unavailable backend: selection on a CUDA context falls back with the backend reason
    plan, report = run_select(reg, rms_ctx())
    assert plan.kernel_id == "torch_native.rms_norm"
    assert R.BACKEND_NOT_INSTALLED in codes(report, "triton.rms_norm")


@pytest.mark.parametrize(
    "exc",
    [
        ModuleNotFoundError("No module named 'triton._C'", name="triton._C"),
        RuntimeError("libcuda.so: cannot open shared object file"),
    ],
)
def test_broken_import_is_import_failed(monkeypatch, exc):
    real = importlib.import_module

    def fake_import(name, package=None):
        if name == "triton":
            raise exc
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    spec = tb.probe()
    assert not spec.available
    assert [r.code for r in spec.reasons] == [R.BACKEND_IMPORT_FAILED]
    assert str(exc) in spec.reasons[0].message


def test_import_layerzero_and_registration_do_not_import_triton_kernels():
    code = (
        "import sys, torch, layerzero as lz\n"
        "assert 'triton' not in sys.modules, 'import layerzero imported triton'\n"
        "lz.rms_norm(torch.ones(2, 4), torch.ones(4))\n"  # first call: registers every backend
        "print(sorted(m for m in sys.modules if m.startswith('layerzero.backends.triton._')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    # helpers only (_launch, _paged_common, the host halves of paged, sampling and cascade: _paged_geometry,
    # _paged_launch, _sampling_*, _cascade_knobs; none imports triton at import), never a module of
    # @triton.jit kernels
    assert out.stdout.strip() == (
        "['layerzero.backends.triton._cascade_knobs', 'layerzero.backends.triton._common', "
        "'layerzero.backends.triton._launch', "
        "'layerzero.backends.triton._paged_common', 'layerzero.backends.triton._paged_geometry', "
        "'layerzero.backends.triton._paged_launch', 'layerzero.backends.triton._sampling_greedy', "
        "'layerzero.backends.triton._sampling_knobs', 'layerzero.backends.triton._sampling_race']"
    )


def test_every_kernel_is_cuda_only_sm80_and_half_precision():
    for spec in tb.kernel_specs(True, ""):
        if spec.kernel_id not in tb.KERNEL_IDS:
            continue  # paged kernels: their own tests
        assert spec.device_types == {"cuda"} and spec.sm_min == (8, 0), spec.kernel_id
        half = {torch.float16, torch.bfloat16}
        # triton.gemv / triton.quantized_linear: fp32 projections stay on cuBLAS (tl.dot would round fp32
        # inputs to TF32)
        tl_dot = spec.kernel_id in (
            "triton.gemv",
            "triton.quantized_linear",
            "triton.rms_norm_linear",
            "triton.swiglu_linear",
        )
        assert spec.dtypes == (half if tl_dot else half | {torch.float32}), spec.kernel_id
        assert not spec.supports_backward, spec.kernel_id
    by_id = {s.kernel_id: s for s in tb.kernel_specs(True, "")}
    assert by_id["triton.rms_norm"].fn is norms.rms_norm and by_id["triton.rope"].fn is rope.rope
    assert (
        by_id["triton.sample_topk"].fn is sampling.sample_topk
        and by_id["triton.sample"].fn is sampling.sample
    )
    # above the reference (0) since its GPU test passed and it was measured: see sampling.PRIORITY_SAMPLE
    assert by_id["triton.sample"].op == "sample" and by_id["triton.sample"].priority > 0
    assert by_id["triton.swiglu"].fn is tb.swiglu.swiglu
    assert by_id["triton.fused_moe"].fn is tb.moe.fused_moe
    assert by_id["triton.reshape_and_cache"].fn is tb.cache.reshape_and_cache
    assert by_id["triton.gemv"].fn is tb.gemv.gemv and by_id["triton.gemv"].op == "linear"
    ql = by_id["triton.quantized_linear"]
    assert ql.fn is tb.quantized_linear.quantized_linear and ql.op == "quantized_linear"
    assert (
        by_id["triton.qk_norm_rope"].fn is rope.qk_norm_rope
        and by_id["triton.qk_norm_rope"].op == "qk_norm_rope"
    )
    assert by_id["triton.rms_norm_linear"].fn is tb.gemv.rms_norm_linear
    assert (
        by_id["triton.swiglu_linear"].fn is tb.gemv.swiglu_linear
        and by_id["triton.swiglu_linear"].op == "swiglu_linear"
    )
    assert [by_id[k].graph_safe for k in tb.KERNEL_IDS] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
        True,
        True,
        True,
        True,
        True,
        True,
        True,
        True,
        True,
        True,
        True,  # apply_token_bitmask
    ]
    assert (
        by_id["triton.sample_greedy"].fn is sampling.sample_greedy
        and by_id["triton.sample_greedy"].op == "sample_greedy"
    )
    att = by_id["triton.attention"]
    assert att.fn is tb.attention.attention and att.op == "attention" and att.supports_alibi
    assert by_id["triton.qk_norm_rope_cache"].fn is rope.qk_norm_rope_cache
    rp = by_id["triton.rope_paged_decode"]
    assert rp.fn is tb.rope_paged.rope_paged_decode and rp.op == "rope_paged_attention"


def test_register_includes_paged_specs():
    from layerzero.backends.triton import paged

    reg = make_registry()
    expected = {s.kernel_id for s in paged.kernel_specs(True, "")}
    assert expected <= {k.kernel_id for k in reg.kernels.values() if k.backend == "triton"}


def test_capability_descriptor_matches_code():
    RUNTIME.ensure_ready()
    on_disk = yaml.safe_load((ROOT / "capabilities" / "triton.yaml").read_text())
    assert on_disk == describe_backend(RUNTIME.registry, "triton")


# ----------------------------------------------------------------------------- 2. routing

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sm", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 1)])
def test_triton_wins_rms_norm_on_cuda(dtype, sm):
    reg = make_registry()
    plan, report = run_select(reg, rms_ctx(sm=sm, dtype=dtype, param_dtype=torch.float32))
    assert plan.kernel_id == "triton.rms_norm"
    assert report.candidate("triton.rms_norm").score.total == 60  # priority 45 + 15 measured
    assert report.candidate("torch_native.rms_norm").score.total == 50
    unmeasured = run_select(
        reg, rms_ctx(sm=sm, dtype=dtype, param_dtype=torch.float32), perf=lambda _k: (0.0, None)
    )
    assert unmeasured[0].kernel_id == "torch_native.rms_norm"
    assert run_select(reg, rms_ctx(sm=sm, dtype=dtype, fused_residual=True))[0].kernel_id == "triton.rms_norm"


@needs_triton
@pytest.mark.parametrize(
    ("ctx", "code"),
    [
        (rms_ctx(sm=(7, 5)), R.SM_TOO_OLD),
        (rms_ctx(dtype=torch.float64), R.DTYPE_UNSUPPORTED),
        (rms_ctx(h=65537), R.HIDDEN_SIZE_UNSUPPORTED),
        (rms_ctx(dtype=torch.float16, param_dtype=torch.float64), R.DTYPE_UNSUPPORTED),
        (rms_ctx(stride_last_1=False), R.STRIDE_LAST_DIM_NOT_1),
        (rms_ctx(requires_grad=True), R.BACKWARD_UNSUPPORTED),
    ],
)
def test_rms_norm_rejections(ctx, code):
    plan, report = run_select(make_registry(), ctx)
    assert plan.kernel_id != "triton.rms_norm"
    assert codes(report, "triton.rms_norm") == {code}


@needs_triton
def test_rms_norm_largest_hidden_and_graph_capture_accepted():
    reg = make_registry()
    assert run_select(reg, rms_ctx(h=65536))[0].kernel_id == "triton.rms_norm"
    assert run_select(reg, rms_ctx(graph_capture=True))[0].kernel_id == "triton.rms_norm"


@needs_triton
@pytest.mark.parametrize("layout", [Layout.BHSD, Layout.BSHD])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("d", "r"), [(128, 128), (128, 64), (80, 32), (256, 256)])
def test_triton_wins_rope_all_forms_without_transform(layout, interleaved, d, r):
    plan, _ = run_select(make_registry(), rope_ctx(layout=layout, interleaved=interleaved, d=d, r=r))
    assert plan.kernel_id == "triton.rope" and plan.transforms == ()


@needs_triton
@pytest.mark.parametrize("capture", [False, True])
def test_triton_wins_qk_norm_rope_over_the_reference(capture):
    """On CUDA the fused kernel serves lz.qk_norm_rope (eagerly and under capture) over the two-op
    torch_native form and the reference; too large a head dim or too old a GPU leaves it to torch_native."""
    reg = make_registry()
    ctx = dataclasses.replace(rope_ctx(graph_capture=capture), op="qk_norm_rope")
    plan, report = run_select(reg, ctx)
    assert plan.kernel_id == "triton.qk_norm_rope" and plan.transforms == ()
    assert {c.kernel_id for c in report.candidates} == {
        "triton.qk_norm_rope",
        "torch_native.qk_norm_rope",
        "reference.qk_norm_rope",
    }
    plan, report = run_select(reg, dataclasses.replace(rope_ctx(d=2048), op="qk_norm_rope"))
    assert plan.kernel_id == "torch_native.qk_norm_rope"
    assert codes(report, "triton.qk_norm_rope") == {R.HEAD_DIM_TOO_LARGE}
    plan, report = run_select(reg, dataclasses.replace(rope_ctx(sm=(7, 0)), op="qk_norm_rope"))
    assert codes(report, "triton.qk_norm_rope") == {R.SM_TOO_OLD}


@needs_triton
def test_rope_rejections():
    reg = make_registry()
    plan, report = run_select(reg, rope_ctx(d=2048))
    assert plan.kernel_id == "torch_native.rope" and codes(report, "triton.rope") == {R.HEAD_DIM_TOO_LARGE}
    plan, report = run_select(reg, rope_ctx(sm=(7, 0)))
    assert plan.kernel_id == "torch_native.rope" and codes(report, "triton.rope") == {R.SM_TOO_OLD}
    assert run_select(reg, rope_ctx(graph_capture=True))[0].kernel_id == "triton.rope"


@needs_triton
@pytest.mark.parametrize("op", ["sample_topk", "sample_topp"])
def test_sampling_routing(op):
    reg = make_registry()
    plan, report = run_select(reg, sample_ctx(op))
    assert plan.kernel_id == f"triton.{op}"
    assert report.candidate(f"triton.{op}").score.total == 60
    with pytest.raises(NoKernelFoundError, match="CUDA_GRAPH_UNSAFE") as info:  # the reference is not either
        run_select(reg, sample_ctx(op, graph_capture=True))
    assert codes(info.value.report, f"triton.{op}") == {R.CUDA_GRAPH_UNSAFE}
    plan, report = run_select(reg, sample_ctx(op, dtype=torch.float64))
    assert codes(report, f"triton.{op}") == {R.DTYPE_UNSUPPORTED}


@needs_triton
@pytest.mark.parametrize("op", OPS)
def test_cpu_contexts_never_pick_triton(op):
    dev = DeviceSpec.detect("cpu")
    ctx = {
        "rms_norm": SelectionContext(
            op=op,
            device=dev,
            dtype=torch.float32,
            hidden_size=8,
            param_dtype=torch.float32,
            stride_last_1=True,
        ),
        "rope": SelectionContext(
            op=op,
            device=dev,
            dtype=torch.float32,
            num_heads_q=2,
            num_heads_kv=2,
            head_dim=8,
            rotary_dim=8,
            layout=Layout.BHSD,
        ),
    }.get(op, SelectionContext(op=op, device=dev, dtype=torch.float32, vocab_size=11))
    plan, report = run_select(make_registry(), ctx)
    assert not plan.kernel_id.startswith("triton.")
    assert codes(report, f"triton.{op}") == {R.DEVICE_TYPE_UNSUPPORTED}


def test_lazy_module_imports_once(monkeypatch):
    from layerzero.backends.triton._common import LazyModule, next_pow2

    calls = []
    real = importlib.import_module

    def counting(name, package=None):
        calls.append(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", counting)
    lazy = LazyModule("_common")
    assert lazy.get() is lazy.get() is sys.modules["layerzero.backends.triton._common"]
    assert calls == ["layerzero.backends.triton._common"]
    assert [next_pow2(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
