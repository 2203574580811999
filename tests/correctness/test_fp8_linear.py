"""``lz.fp8_linear`` (W8A8 fp8: x quantized to e4m3 per row, e4m3 weight, float32 accumulation) against a
float64 oracle written here from the documented rule (per-row scale ``max(amax / 448, 2^-126)`` in float32,
codes by clamping and casting, the codes' products summed in float64 times both scales, bias, one rounding),
every kernel (``torch_native.fp8_linear``: ``torch._scaled_mm`` on CPU; ``reference.fp8_linear``), seeded odd
shapes and ragged leading dims; a case worked out by hand; the typed errors; the CUDA routing rules on
hand-built contexts."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero import InvalidInputError
from layerzero.backends.reference.linear import fp8_linear as reference_fp8_linear
from layerzero.backends.torch_native import fp8_linear as tn
from layerzero.core.context import SelectionContext
from layerzero.core.reasons import ReasonCode
from layerzero.testing.devices import fake_cuda_device

pytestmark = pytest.mark.correctness

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
KERNELS = {"torch_native": tn.fp8_linear, "reference": reference_fp8_linear}


def oracle(
    x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """float64 ``[M, N]`` from the documented rule."""
    xf = x.reshape(-1, x.shape[-1]).float()
    s = torch.clamp(xf.abs().max(dim=1, keepdim=True).values / 448.0, min=2.0**-126)
    codes = torch.clamp(xf / s, -448.0, 448.0).to(torch.float8_e4m3fn).double()
    y = codes @ w_codes.double().t() * s.double() * w_scale.double().reshape(1, -1)
    return y + bias.double() if bias is not None else y


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().reshape(want.shape) - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize(
    ("lead", "n", "k", "axis", "bias"),
    [
        ((3, 5), 24, 40, 0, True),
        ((1,), 7, 33, 0, False),
        ((4,), 48, 64, None, True),
        ((2, 1, 3), 16, 17, 0, True),
    ],
)
def test_matches_the_float64_oracle(kernel, dtype, lead, n, k, axis, bias):
    if kernel == "torch_native" and dtype == torch.float64:
        pytest.skip("torch._scaled_mm writes no float64 (the kernel declares float16 / bfloat16 / float32)")
    g = torch.Generator().manual_seed(n * 31 + k)
    x = (torch.randn(*lead, k, generator=g, dtype=torch.float64) * 3).to(dtype)
    x[..., 0] = 0  # a zero column; and below, one row all zero
    x.reshape(-1, k)[0] = 0
    w = torch.randn(n, k, generator=g, dtype=torch.float64).to(dtype)
    qt = lz.quantize(w, "fp8_e4m3", axis=axis)
    b = torch.randn(n, generator=g, dtype=torch.float64).to(dtype) if bias else None
    y = KERNELS[kernel](x, qt, b)
    assert y.shape == (*lead, n) and y.dtype == dtype
    want = oracle(x, qt.data, qt.scale, b)
    assert _rel(y, want) <= TOL[dtype]
    assert torch.equal(
        y.reshape(-1, n)[0], (b if b is not None else torch.zeros(n, dtype=dtype))
    )  # the zero row


def test_dispatch_runs_torch_native_on_cpu_and_falls_back_for_float64():
    x, w = torch.randn(3, 32), torch.randn(16, 32)
    qt = lz.quantize(w, "fp8_e4m3", axis=0)
    assert lz.which("fp8_linear", x, qt) == "torch_native.fp8_linear"
    torch.testing.assert_close(lz.fp8_linear(x, qt), tn.fp8_linear(x, qt, None), rtol=0, atol=0)
    x64, qt64 = x.double(), lz.quantize(w.double(), "fp8_e4m3", axis=0)
    assert lz.which("fp8_linear", x64, qt64) == "reference.fp8_linear"
    assert _rel(lz.fp8_linear(x64, qt64), oracle(x64, qt64.data, qt64.scale, None)) <= 1e-12


def test_hand_worked_values():
    """w rows [1, -2] and [0.5, 4]: codes 224, -448 and 56, 448 with scales 2/448, 4/448; x [3, 0.75]: codes
    448, 112 with scale 3/448: y = [3 * 1 - 0.75 * 2, 3 * 0.5 + 0.75 * 4] = [1.5, 4.5] (every value exact in
    e4m3)."""
    qt = lz.quantize(torch.tensor([[1.0, -2.0], [0.5, 4.0]]), "fp8_e4m3", axis=0)
    assert qt.data.float().tolist() == [[224.0, -448.0], [56.0, 448.0]]
    y = lz.fp8_linear(torch.tensor([[3.0, 0.75]]), qt, torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(y, torch.tensor([[2.5, 3.5]]), rtol=1e-6, atol=0)


def test_the_activation_is_rounded_unlike_weight_only():
    """The same fp8 weight through the weight-only op differs by the activation's e4m3 rounding: more than
    float32 noise, within e4m3's half ulp (2^-4 relative) of each product."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 256, generator=g), torch.randn(32, 256, generator=g)
    qt = lz.quantize(w, "fp8_e4m3", axis=0)
    w8a8, wonly = lz.fp8_linear(x, qt), lz.quantized_linear(x, qt)
    rel = ((w8a8 - wonly).abs().max() / wonly.abs().max()).item()
    assert 1e-4 < rel < 2**-4


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda x, w: (x, lz.quantize(w, "int8", axis=0)),
            r"lz\.fp8_linear: qt\.format: expected fp8_e4m3.*got int8",
        ),
        (
            lambda x, w: (x, lz.quantize(w, "fp8_e5m2", axis=0)),
            r"qt\.format: expected fp8_e4m3.*got fp8_e5m2",
        ),
        (lambda x, w: (x, lz.quantize(w, "int4", group_size=16)), r"qt\.format: expected fp8_e4m3.*got int4"),
        (
            lambda x, w: (x[:, :16], lz.quantize(w, "fp8_e4m3", axis=0)),
            r"lz\.fp8_linear: x\.shape\[-1\] \(in_features K\): expected 32",
        ),
        (lambda x, w: (x.half(), lz.quantize(w, "fp8_e4m3", axis=0)), r"lz\.fp8_linear: qt\.dtype"),
        (lambda x, w: (x, lz.quantize(w, "fp8_e4m3", axis=1)), r"lz\.fp8_linear: fp8_e4m3 scale granularity"),
        (
            lambda x, w: (x.requires_grad_(), lz.quantize(w, "fp8_e4m3", axis=0)),
            r"lz\.fp8_linear: x / bias requires_grad",
        ),
    ],
)
def test_bad_inputs_raise_typed_errors(make, match):
    x, qt = make(torch.randn(4, 32), torch.randn(8, 32))
    with pytest.raises(InvalidInputError, match=match):
        lz.fp8_linear(x, qt)
    with torch.no_grad():
        if x.requires_grad:
            assert lz.fp8_linear(x, qt).shape == (4, 8)  # the same call without autograd is fine


def test_bias_shape_is_checked():
    with pytest.raises(InvalidInputError, match=r"lz\.fp8_linear: bias shape: expected \[N\] = \[8\]"):
        lz.fp8_linear(torch.randn(4, 32), lz.quantize(torch.randn(8, 32), "fp8_e4m3", axis=0), torch.randn(9))


def _ctx(dtype: torch.dtype, k: int, n: int) -> SelectionContext:
    return SelectionContext(
        op="fp8_linear",
        device=fake_cuda_device((9, 0)),
        dtype=dtype,
        batch=4,
        hidden_size=k,
        intermediate_size=n,
        quant_format="fp8_e4m3",
        quant_granularity="channel",
    )


def test_cuda_routing_rules():
    """CUDA: Hopper (SM 9.0) and newer, bfloat16 only, K and N multiples of 16 (torch._scaled_mm's row-wise
    fp8 GEMM); the CPU path has none of these limits."""
    spec = tn.kernel_spec()
    assert (
        spec.sm_min == (9, 0)
        and spec.device_types == frozenset({"cpu", "cuda"})
        and not spec.supports_backward
    )
    assert tn._check(_ctx(torch.bfloat16, 1024, 3072)) == []
    assert [r.code for r in tn._check(_ctx(torch.float16, 1024, 3072))] == [ReasonCode.DTYPE_UNSUPPORTED]
    assert [r.code for r in tn._check(_ctx(torch.bfloat16, 1000, 3072))] == [ReasonCode.SHAPE_MISMATCH]
    assert [r.code for r in tn._check(_ctx(torch.bfloat16, 1024, 24))] == [ReasonCode.SHAPE_MISMATCH]
