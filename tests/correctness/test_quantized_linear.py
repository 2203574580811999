"""``lz.quantized_linear`` (weight-only int8 / fp8 / int4 linear) against a float64 oracle written out here
(codes decoded by hand: int8 and fp8 values times the per-channel or per-tensor scale, int4 nibbles low-first
minus the group's zero point times its scale), for every kernel that runs on this machine: the reference,
torch_native's dequantize-then-GEMM and, under the Triton interpreter, the fused ``triton.quantized_linear``.
Seeded odd shapes (N and K not multiples of the tiles, M from 1 to 70, leading dims), with and without bias;
the bad inputs; the Triton kernel's routing."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from _triton_interp import needs_interpreter

import layerzero as lz
from layerzero.backends.reference.linear import quantized_linear as reference_ql
from layerzero.backends.torch_native.quantize import quantized_linear as native_ql
from layerzero.backends.triton import quantized_linear as tq
from layerzero.core.knobs import knobs
from layerzero.testing.quant_oracle import oracle_weight

pytestmark = pytest.mark.correctness
ql = importlib.import_module(
    "layerzero.ops.quantized_linear"
)  # the module (lz.ops.quantized_linear is the op)

interpreted = needs_interpreter("tests/gpu/test_gpu_quantized_linear.py")
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1e-2}
FORMATS = [
    ("int8", dict(axis=0)),
    ("int8", {}),
    ("fp8_e4m3", dict(axis=0)),
    ("fp8_e5m2", {}),
    ("int4", dict(group_size=16)),
    ("int4", dict(group_size=32)),
]
IDS = ["int8-channel", "int8-tensor", "e4m3-channel", "e5m2-tensor", "int4-g16", "int4-g32"]


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def _case(fmt, kw, dtype, m, n, k, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    qt = lz.quantize(w, fmt, **kw)
    want = x.double() @ oracle_weight(qt).t() + (0 if b is None else b.double())
    return x, qt, b, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize(("fmt", "kw"), FORMATS, ids=IDS)
@pytest.mark.parametrize("kernel", [reference_ql, native_ql], ids=["reference", "torch_native"])
def test_cpu_kernels_match_the_float64_oracle(kernel, fmt, kw, dtype):
    for m, n, k, bias in ((1, 37, 96, True), (5, 3, 64, False), (19, 33, 160, True)):
        x, qt, b, want = _case(fmt, kw, dtype, m, n, k, seed=m + n + k, bias=bias)
        out = kernel(x, qt, b)
        assert out.shape == (m, n) and out.dtype == dtype
        # torch_native takes lz.dequantize's weight: codes times scales in float32 (so float32 precision for
        # float64 x), rounded to x's dtype: one rounding more than the oracle
        tol = (
            TOL[dtype]
            if kernel is reference_ql
            else 1e-6
            if dtype == torch.float64
            else 2 * TOL[dtype] + 1e-6
        )
        assert _rel_err(out, want) <= tol, (m, n, k)


def test_the_op_picks_a_kernel_keeps_leading_dims_and_matches():
    x, qt, b, want = _case("int4", dict(group_size=16), torch.float32, 6, 7, 48, seed=3)
    out = lz.quantized_linear(x.view(2, 3, 48), qt, b)
    assert out.shape == (2, 3, 7)
    assert _rel_err(out.view(6, 7), want) <= 1e-5
    assert lz.which("quantized_linear", x, qt, b) == "torch_native.quantized_linear"


def test_a_scoped_preference_is_not_served_a_cached_unscoped_choice():
    """The key carries the policy scope: a call inside ``lz.prefer`` after the same call outside runs the
    preferred kernel (a key without the scope served the cached default), and autograd flows through x."""
    x, qt, b, want = _case("int8", dict(axis=0), torch.float32, 3, 7, 32, seed=2)
    with lz.trace() as t:
        lz.quantized_linear(x, qt, b)
        with lz.prefer("reference.quantized_linear"):
            lz.quantized_linear(x, qt, b)
    assert t.kernels_for("quantized_linear") == [
        "torch_native.quantized_linear",
        "reference.quantized_linear",
    ]
    xg = x.clone().requires_grad_(True)
    lz.quantized_linear(xg, qt, b).sum().backward()
    torch.testing.assert_close(xg.grad.double(), oracle_weight(qt).sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda x, qt, b: (x, "not a qt", b), "QuantizedTensor"),
        (lambda x, qt, b: (x[:, :-1], qt, b), "in_features"),
        (lambda x, qt, b: (x.double(), qt, b), "qt.dtype"),
        (lambda x, qt, b: (x, qt, b[:-1]), "bias shape"),
        (lambda x, qt, b: (x.int(), qt, b), "x.dtype"),
        (lambda x, qt, b: (x, lz.quantize(torch.randn(2, 3, 32), "int8", axis=0), None), "qt.shape"),
        (lambda x, qt, b: (x, lz.quantize(torch.randn(7, 32), "mxfp4"), b), "qt.format"),
        (lambda x, qt, b: (x, lz.quantize(torch.randn(7, 32), "int8", group_size=16), b), "granularity"),
        (lambda x, qt, b: (x, lz.quantize(torch.randn(7, 32), "int8", axis=1), b), "granularity"),
    ],
    ids=["not-qt", "k-mismatch", "dtype", "bias", "int-x", "3d-weight", "mxfp4", "int8-group", "int8-axis1"],
)
def test_bad_inputs_raise_typed_errors_before_any_work(bad, match):
    x, qt, b, _ = _case("int8", dict(axis=0), torch.float32, 3, 7, 32, seed=1)
    with pytest.raises(lz.InvalidInputError, match=match) as info:
        lz.quantized_linear(*bad(x, qt, b))
    assert isinstance(info.value, ValueError)


# ------------------------------------------------------------------------------ the memoized weight checks
# A weight's metadata (format, shape, dtype, axis, group_size) passes the full checks once and is memoized by
# value (ops/quantized_linear.py: _WEIGHTS); its tensors, x and bias are checked on every call. Each bad input
# below is built from a weight whose metadata is memoized, by hand (NamedTuple._replace) or by altering a
# tensor in place, and must raise what the full checks raise.
_INT8 = ("int8", dict(axis=0))
_INT4 = ("int4", dict(group_size=16))
_META = torch.device("meta")


def _memoized(fmt_kw=_INT8):
    """x, qt, b with qt's metadata memoized (asserted, so these tests never pass vacuously on the full
    checks)."""
    x, qt, b, _ = _case(*fmt_kw, torch.float32, 3, 7, 32, seed=11)
    lz.quantized_linear(x, qt, b)
    assert ql._meta_key(qt) in ql._WEIGHTS and ql._fast_weight(x, qt, b) is not None
    return x, qt, b


@pytest.mark.parametrize(
    "fmt_kw, bad, match",
    [
        (_INT8, lambda x, qt, b: (x, qt._replace(format="int8"), b), r"qt\.format: expected a QuantFormat"),
        (_INT8, lambda x, qt, b: (x, qt._replace(format=lz.QuantFormat.FP8_E4M3), b), r"qt\.data\.dtype"),
        (_INT8, lambda x, qt, b: (x, qt._replace(axis=False), b), r"axis: expected an int"),
        (_INT8, lambda x, qt, b: (x, qt._replace(axis=1), b), r"qt\.scale shape: expected \[1, 32\]"),
        (_INT8, lambda x, qt, b: (x, qt._replace(axis=None), b), r"qt\.scale shape: expected \[\]"),
        (
            _INT8,
            lambda x, qt, b: (x, qt._replace(shape=(np.int64(7), 32)), b),
            r"qt\.shape: expected a torch\.Size",
        ),
        (_INT8, lambda x, qt, b: (x, qt._replace(shape=(7, 32)), b), None),
        (_INT8, lambda x, qt, b: (x, qt._replace(shape=[7, 32]), b), r"qt\.shape: expected a torch\.Size"),
        (
            _INT8,
            lambda x, qt, b: (x, qt._replace(dtype=torch.float16), b),
            r"qt\.dtype \(the weight's float dtype\)",
        ),
        (
            _INT8,
            lambda x, qt, b: (x, qt._replace(dtype=torch.int8), b),
            r"qt\.dtype: expected one of float32",
        ),
        (_INT8, lambda x, qt, b: (x, qt._replace(dtype="float32"), b), r"qt\.dtype: expected one of float32"),
        (
            _INT8,
            lambda x, qt, b: (x, qt._replace(dtype=[1]), b),
            r"qt\.dtype: expected one of float32",
        ),  # unhashable
        (_INT8, lambda x, qt, b: (x, qt._replace(data=qt.data.float()), b), r"qt\.data\.dtype"),
        (_INT8, lambda x, qt, b: (x, qt._replace(data=qt.data[:, :-1]), b), r"qt\.data shape"),
        (_INT8, lambda x, qt, b: (x, qt._replace(data=qt.data.to(_META)), b), r"qt\.scale\.device"),
        (
            _INT8,
            lambda x, qt, b: (x, qt._replace(data=list(qt.data)), b),
            r"qt\.data: expected a torch\.Tensor",
        ),
        (_INT8, lambda x, qt, b: (x, qt._replace(scale=torch.ones(())), b), r"qt\.scale shape"),
        (_INT8, lambda x, qt, b: (x, qt._replace(scale=qt.scale.double()), b), r"qt\.scale\.dtype"),
        (_INT8, lambda x, qt, b: (x, qt._replace(scale=qt.scale.to(_META)), b), r"qt\.scale\.device"),
        (
            _INT8,
            lambda x, qt, b: (x, qt._replace(zero_point=torch.zeros(7, 1, dtype=torch.uint8)), b),
            r"qt\.zero_point for int8: expected None",
        ),
        (
            _INT8,
            lambda x, qt, b: (x, qt._replace(global_scale=torch.ones(())), b),
            r"qt\.global_scale for int8",
        ),
        (_INT8, lambda x, qt, b: (x, tuple(qt), b), r"qt: expected a QuantizedTensor"),
        (
            _INT4,
            lambda x, qt, b: (x, qt._replace(zero_point=None), b),
            r"qt\.zero_point: expected a torch\.uint8",
        ),
        (
            _INT4,
            lambda x, qt, b: (x, qt._replace(zero_point=qt.zero_point.float()), b),
            r"qt\.zero_point\.dtype",
        ),
        (
            _INT4,
            lambda x, qt, b: (x, qt._replace(zero_point=qt.zero_point[:, :1]), b),
            r"qt\.zero_point shape",
        ),
        (
            _INT4,
            lambda x, qt, b: (x, qt._replace(zero_point=qt.zero_point.to(_META)), b),
            r"qt\.zero_point\.device",
        ),
        (_INT4, lambda x, qt, b: (x, qt._replace(group_size=32), b), r"qt\.scale shape: expected \[7, 1\]"),
        (
            _INT4,
            lambda x, qt, b: (x, qt._replace(group_size=16.0), b),
            r"group_size for int4: expected an int",
        ),
        (_INT8, lambda x, qt, b: (x[:, :-1], qt, b), r"x\.shape\[-1\] \(in_features K\)"),
        (_INT8, lambda x, qt, b: (x[0, 0], qt, b), r"x rank"),
        (_INT8, lambda x, qt, b: (x.double(), qt, b), r"qt\.dtype"),
        (_INT8, lambda x, qt, b: (x.int(), qt, b), r"x\.dtype"),
        (_INT8, lambda x, qt, b: (x.int(), qt._replace(dtype=torch.int32), b.int()), r"x\.dtype"),
        (_INT8, lambda x, qt, b: (x.to(_META), qt, b), r"devices: expected x on cpu"),
        (_INT8, lambda x, qt, b: (x.tolist(), qt, b), r"x: expected a torch\.Tensor"),
        (_INT8, lambda x, qt, b: (x, qt, b[:-1]), r"bias shape"),
        (_INT8, lambda x, qt, b: (x, qt, b.view(7, 1)), r"bias rank"),
        (_INT8, lambda x, qt, b: (x, qt, b.double()), r"bias\.dtype"),
        (_INT8, lambda x, qt, b: (x, qt, b.to(_META)), r"bias\.device"),
        (_INT8, lambda x, qt, b: (x, qt, b.tolist()), r"bias: expected a torch\.Tensor"),
    ],
    ids=[
        "str-format",
        "other-format",
        "axis-false",
        "axis-1",
        "axis-none",
        "numpy-dim",
        "tuple-shape",
        "list-shape",
        "dtype-f16",
        "dtype-int",
        "dtype-str",
        "dtype-unhashable",
        "data-dtype",
        "data-shape",
        "data-device",
        "data-list",
        "scale-shape",
        "scale-dtype",
        "scale-device",
        "int8-zero-point",
        "global-scale",
        "plain-tuple",
        "int4-no-zero",
        "zero-dtype",
        "zero-shape",
        "zero-device",
        "int4-group",
        "int4-float-group",
        "x-k",
        "x-0d",
        "x-dtype",
        "x-int",
        "x-and-dtype-int",
        "x-device",
        "x-list",
        "bias-shape",
        "bias-rank",
        "bias-dtype",
        "bias-device",
        "bias-list",
    ],
)
def test_a_memoized_weight_still_checks_every_call(fmt_kw, bad, match):
    x, qt, b = _memoized(fmt_kw)
    args = bad(x, qt, b)
    if match is None:  # equal metadata of another accepted type: valid, the same result
        torch.testing.assert_close(lz.quantized_linear(*args), lz.quantized_linear(x, qt, b))
        return
    with pytest.raises(
        lz.InvalidInputError, match=r"^lz\.quantized_linear: " + match
    ):  # under this op's name
        lz.quantized_linear(*args)


@pytest.mark.parametrize("fmt_kw", [_INT8, _INT4], ids=["int8", "int4"])
def test_a_tensor_resized_in_place_after_its_weight_was_memoized_is_refused(fmt_kw):
    """Shapes change in place only through ``resize_`` / ``set_``: the memo holds metadata, never tensors, so
    the next call sees the new shape."""
    x, qt, b = _memoized(fmt_kw)
    qt.scale.resize_(6, qt.scale.shape[1])
    with pytest.raises(lz.InvalidInputError, match=r"qt\.scale shape"):
        lz.quantized_linear(x, qt, b)
    x, qt, b = _memoized(fmt_kw)
    qt.data.set_(torch.zeros(7, 8, dtype=qt.data.dtype))
    with pytest.raises(lz.InvalidInputError, match=r"qt\.data shape"):
        lz.quantized_linear(x, qt, b)


def test_the_full_checks_run_once_per_weight_metadata(monkeypatch):
    """A weight rebuilt per call (the engine's layers do: QuantizedLinear.qtensor) takes the memoized path:
    the full checks (prepare_dequantize) run for the first call only, and a new metadata runs them again."""
    calls = []
    real = ql.prepare_dequantize
    monkeypatch.setattr(ql, "prepare_dequantize", lambda qt: calls.append(qt) or real(qt))
    monkeypatch.setattr(ql, "_WEIGHTS", {})
    x, qt, b, want = _case("int4", dict(group_size=16), torch.float32, 3, 7, 32, seed=4)
    for _ in range(3):
        out = lz.quantized_linear(x, lz.QuantizedTensor(*qt), b)
        assert _rel_err(out, want) <= 1e-5
    assert len(calls) == 1
    lz.quantized_linear(x, qt, None)
    lz.quantized_linear(x[:, :16], lz.quantize(torch.randn(5, 16), "int8"), None)
    assert len(calls) == 2 and len(ql._WEIGHTS) == 2


def test_the_memo_is_bounded_and_a_subclass_is_never_memoized(monkeypatch):
    monkeypatch.setattr(ql, "_WEIGHTS", {})
    monkeypatch.setattr(ql, "_MAX_WEIGHTS", 2)
    for n in (3, 4, 5):
        lz.quantized_linear(torch.randn(2, 16), lz.quantize(torch.randn(n, 16), "int8", axis=0))
        assert len(ql._WEIGHTS) <= 2

    class Sub(lz.QuantizedTensor):
        pass

    monkeypatch.setattr(ql, "_WEIGHTS", {})
    x, qt, b, want = _case("int8", dict(axis=0), torch.float32, 3, 7, 32, seed=5)
    assert _rel_err(lz.quantized_linear(x, Sub(*qt), b), want) <= 1e-5 and not ql._WEIGHTS


# ------------------------------------------------------------------------------ the fused Triton kernel
TRITON_CASES = [  # (M, N, K, bias): every path of tq.config (int4 at up to 8 rows: the int4 decode kernel,
    (1, 37, 96, True),  # tested further in test_quantized_linear_int4.py); row kernel, BM 1, BN 4
    (2, 5, 3072, False),  # row kernel, BN 2 (long K)
    (3, 70, 160, True),  # row kernel, rows padded to 4
    (8, 33, 96, False),  # row kernel, BM 8
    (12, 70, 96, True),  # tl.dot, 16-row tiles (padded)
    (70, 5, 160, False),  # tl.dot, 64-row tiles
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(("fmt", "kw"), FORMATS, ids=IDS)
def test_triton_kernel_matches_the_float64_oracle(fmt, kw, dtype):
    """Every kernel path (TRITON_CASES), N not a multiple of the column tile, K not a multiple of the K tile
    (a masked last tile; for int4 a multiple of the group), with and without bias."""
    for m, n, k, bias in TRITON_CASES:
        x, qt, b, want = _case(fmt, kw, dtype, m, n, k, seed=7 * m + n + k, bias=bias)
        out = tq.quantized_linear(x, qt, b)
        assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
        assert _rel_err(out, want) <= TOL[dtype], (m, n, k)
        assert _rel_err(out, reference_ql(x, qt, b).double()) <= TOL[dtype]


@interpreted
def test_triton_kernel_takes_strided_rows_leading_dims_and_empty_batches():
    x, qt, b, want = _case("int4", dict(group_size=32), torch.float16, 6, 9, 64, seed=5)
    wide = torch.zeros(6, 70, dtype=torch.float16)
    wide[:, 3:67] = x
    out = tq.quantized_linear(wide[:, 3:67], qt, b)
    assert _rel_err(out, want) <= TOL[torch.float16]
    assert tq.quantized_linear(x.view(2, 3, 64), qt, None).shape == (2, 3, 9)
    assert tq.quantized_linear(x[:0], qt, b).shape == (0, 9)


def test_config_picks_the_path_and_never_straddles_an_int4_group():
    assert (
        tq.config(1, 4096, 1024, 16)["kernel"] == "int4" and tq.config(8, 4096, 1024, 128)["kernel"] == "int4"
    )
    with knobs(tq.KNOBS, int4_decode=False):  # int4 decode rows back on the row kernel (A/B knob)
        assert tq.config(1, 4096, 1024, 16)["BK"] == 16 and tq.config(1, 4096, 1024, 128)["BK"] == 128
    assert tq.config(12, 4096, 1024, 128)["BK"] == 64 and tq.config(12, 4096, 1024, 32)["BK"] == 32
    assert tq.config(8, 10, 64, None)["kernel"] == "rows" and tq.config(8, 10, 64, None)["BM"] == 8
    assert tq.config(1, 1024, 3072, None)["BN"] == 2 and tq.config(3, 1024, 3072, None)["BN"] == 4
    assert tq.config(9, 10, 64, None)["kernel"] == "dot" and tq.config(16, 10, 64, None)["BM"] == 16
    assert tq.config(17, 10, 64, None)["BM"] == 64


# ------------------------------------------------------------------------------------------------ routing
def _select(ctx):
    from layerzero.core.policy import Policy
    from layerzero.core.selection import SelectionInputs, select
    from layerzero.testing.registries import routing_registry

    reg = routing_registry("quantized_linear", [tq.kernel_spec(True, "")])
    return select(
        reg,
        ctx,
        SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False),
    )


def _ctx(device, fmt="int4", gran="group:128", dtype=torch.bfloat16, grad=False):
    from layerzero.core.context import SelectionContext

    return SelectionContext(
        op="quantized_linear",
        device=device,
        dtype=dtype,
        batch=1,
        hidden_size=1024,
        intermediate_size=4096,
        quant_format=fmt,
        quant_granularity=gran,
        requires_grad=grad,
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fmt", "gran", "sm", "capture", "want"),
    [
        ("int8", "channel", (9, 0), False, tq.KERNEL_ID),
        ("int8", "tensor", (10, 0), True, tq.KERNEL_ID),
        ("fp8_e4m3", "channel", (9, 0), False, tq.KERNEL_ID),
        (
            "int4",
            "group:128",
            (9, 0),
            False,
            tq.KERNEL_ID,
        ),  # the int4 decode kernel at 1 row (measured faster)
        ("int4", "group:128", (8, 0), False, "torch_native.quantized_linear"),  # not measured before Hopper
        ("fp8_e5m2", "channel", (9, 0), False, "torch_native.quantized_linear"),  # not measured
        ("int8", "channel", (8, 0), False, "torch_native.quantized_linear"),  # not measured before Hopper
        ("fp8_e4m3", "channel", (8, 9), True, "torch_native.quantized_linear"),
    ],
)
def test_the_default_per_weight_format_follows_the_measurements(fmt, gran, sm, capture, want):
    """``priority_for``: the fused kernel outranks dequantize + cuBLAS for int8 and fp8 e4m3 weights, and int4
    at decode rows, on Hopper and newer (measured faster on an H200), eagerly and under capture; fp8 e5m2 and
    older GPUs keep the default (int4 with more rows: ``test_quantized_linear_int4.py``)."""
    import dataclasses

    from layerzero.testing.devices import fake_cuda_device

    plan, report = _select(dataclasses.replace(_ctx(fake_cuda_device(sm), fmt, gran), graph_capture=capture))
    assert plan.kernel_id == want
    score = report.candidate(tq.KERNEL_ID).score.priority
    assert score == (tq.MEASURED_PRIORITY if want == tq.KERNEL_ID else tq.PRIORITY)


@pytest.mark.unit
def test_triton_kernel_is_eligible_on_cuda_and_refuses_what_it_cannot_run():
    from layerzero.core.device import DeviceSpec
    from layerzero.core.reasons import ReasonCode as R
    from layerzero.core.report import CandidateStatus
    from layerzero.testing.devices import fake_cuda_device

    h100, a100 = fake_cuda_device((9, 0)), fake_cuda_device((8, 0))
    plan, report = _select(_ctx(a100))
    assert plan.kernel_id == "torch_native.quantized_linear"  # int4 before Hopper: opt in (not measured)
    assert report.candidate(tq.KERNEL_ID).status is CandidateStatus.ELIGIBLE
    for ctx, code in (
        (_ctx(h100, gran="group:8"), R.SHAPE_MISMATCH),
        (_ctx(a100, "fp8_e4m3", "channel"), R.SM_TOO_OLD),
        (_ctx(DeviceSpec.detect("cpu")), R.DEVICE_TYPE_UNSUPPORTED),
        (_ctx(h100, dtype=torch.float32), R.DTYPE_UNSUPPORTED),
        (_ctx(h100, grad=True), R.BACKWARD_UNSUPPORTED),
    ):
        _, report = _select(ctx)
        assert code in {r.code for r in report.candidate(tq.KERNEL_ID).reasons}
    _, report = _select(_ctx(h100, "fp8_e5m2", "channel"))
    assert report.candidate(tq.KERNEL_ID).status is CandidateStatus.ELIGIBLE
