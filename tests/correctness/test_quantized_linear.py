"""``lz.quantized_linear`` (weight-only int8 / fp8 / int4 linear) against a float64 oracle written out here (codes
decoded by hand: int8 and fp8 values times the per-channel or per-tensor scale, int4 nibbles low-first minus the
group's zero point times its scale), for every kernel that runs on this machine: the reference, torch_native's
dequantize-then-GEMM and, under the Triton interpreter, the fused ``triton.quantized_linear``. Seeded odd shapes
(N and K not multiples of the tiles, M from 1 to 70, leading dims), with and without bias; the bad inputs; the
Triton kernel's routing."""

from __future__ import annotations

import pytest
import torch
from _triton_interp import needs_interpreter

import layerzero as lz
from layerzero.backends.reference.linear import quantized_linear as reference_ql
from layerzero.backends.torch_native.quantize import quantized_linear as native_ql
from layerzero.backends.triton import quantized_linear as tq
from layerzero.testing.quant_oracle import oracle_weight

pytestmark = pytest.mark.correctness

interpreted = needs_interpreter("tests/gpu/test_gpu_quantized_linear.py")
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1e-2}
FORMATS = [("int8", dict(axis=0)), ("int8", {}), ("fp8_e4m3", dict(axis=0)), ("fp8_e5m2", {}),
           ("int4", dict(group_size=16)), ("int4", dict(group_size=32))]
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
        # torch_native takes lz.dequantize's weight: codes times scales in float32 (so float32 precision for float64
        # x), rounded to x's dtype: one rounding more than the oracle
        tol = TOL[dtype] if kernel is reference_ql else 1e-6 if dtype == torch.float64 else 2 * TOL[dtype] + 1e-6
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
    assert t.kernels_for("quantized_linear") == ["torch_native.quantized_linear", "reference.quantized_linear"]
    xg = x.clone().requires_grad_(True)
    lz.quantized_linear(xg, qt, b).sum().backward()
    torch.testing.assert_close(xg.grad.double(), oracle_weight(qt).sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad, match", [
    (lambda x, qt, b: (x, "not a qt", b), "QuantizedTensor"),
    (lambda x, qt, b: (x[:, :-1], qt, b), "in_features"),
    (lambda x, qt, b: (x.double(), qt, b), "qt.dtype"),
    (lambda x, qt, b: (x, qt, b[:-1]), "bias shape"),
    (lambda x, qt, b: (x.int(), qt, b), "x.dtype"),
    (lambda x, qt, b: (x, lz.quantize(torch.randn(2, 3, 32), "int8", axis=0), None), "qt.shape"),
    (lambda x, qt, b: (x, lz.quantize(torch.randn(7, 32), "mxfp4"), b), "qt.format"),
    (lambda x, qt, b: (x, lz.quantize(torch.randn(7, 32), "int8", group_size=16), b), "granularity"),
    (lambda x, qt, b: (x, lz.quantize(torch.randn(7, 32), "int8", axis=1), b), "granularity"),
], ids=["not-qt", "k-mismatch", "dtype", "bias", "int-x", "3d-weight", "mxfp4", "int8-group", "int8-axis1"])
def test_bad_inputs_raise_typed_errors_before_any_work(bad, match):
    x, qt, b, _ = _case("int8", dict(axis=0), torch.float32, 3, 7, 32, seed=1)
    with pytest.raises(lz.InvalidInputError, match=match) as info:
        lz.quantized_linear(*bad(x, qt, b))
    assert isinstance(info.value, ValueError)


# ------------------------------------------------------------------------------ the fused Triton kernel
TRITON_CASES = [  # (M, N, K, bias): every path of tq.config
    (1, 37, 96, True),      # row kernel, BM 1, BN 4
    (2, 5, 3072, False),    # row kernel, BN 2 (long K)
    (3, 70, 160, True),     # row kernel, rows padded to 4
    (8, 33, 96, False),     # row kernel, BM 8
    (12, 70, 96, True),     # tl.dot, 16-row tiles (padded)
    (70, 5, 160, False),    # tl.dot, 64-row tiles
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(("fmt", "kw"), FORMATS, ids=IDS)
def test_triton_kernel_matches_the_float64_oracle(fmt, kw, dtype):
    """Every kernel path (TRITON_CASES), N not a multiple of the column tile, K not a multiple of the K tile (a
    masked last tile; for int4 a multiple of the group), with and without bias."""
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
    return select(reg, ctx, SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None),
                                            log_fallbacks=False))


def _ctx(device, fmt="int4", gran="group:128", dtype=torch.bfloat16, grad=False):
    from layerzero.core.context import SelectionContext

    return SelectionContext(op="quantized_linear", device=device, dtype=dtype, batch=1, hidden_size=1024,
                            intermediate_size=4096, quant_format=fmt, quant_granularity=gran, requires_grad=grad)


@pytest.mark.unit
def test_triton_kernel_is_eligible_on_cuda_but_opt_in_and_refuses_what_it_cannot_run():
    from layerzero.core.device import DeviceSpec
    from layerzero.core.reasons import ReasonCode as R
    from layerzero.core.report import CandidateStatus
    from layerzero.testing.devices import fake_cuda_device

    h100, a100 = fake_cuda_device((9, 0)), fake_cuda_device((8, 0))
    plan, report = _select(_ctx(h100))
    assert plan.kernel_id == "torch_native.quantized_linear"  # opt in until measured on a GPU
    assert report.candidate(tq.KERNEL_ID).status is CandidateStatus.ELIGIBLE
    for ctx, code in ((_ctx(h100, gran="group:8"), R.SHAPE_MISMATCH),
                      (_ctx(a100, "fp8_e4m3", "channel"), R.SM_TOO_OLD),
                      (_ctx(DeviceSpec.detect("cpu")), R.DEVICE_TYPE_UNSUPPORTED),
                      (_ctx(h100, dtype=torch.float32), R.DTYPE_UNSUPPORTED),
                      (_ctx(h100, grad=True), R.BACKWARD_UNSUPPORTED)):
        _, report = _select(ctx)
        assert code in {r.code for r in report.candidate(tq.KERNEL_ID).reasons}
    _, report = _select(_ctx(h100, "fp8_e4m3", "channel"))
    assert report.candidate(tq.KERNEL_ID).status is CandidateStatus.ELIGIBLE
