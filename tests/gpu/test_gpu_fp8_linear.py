"""``lz.fp8_linear`` (W8A8 fp8) on a real GPU (``pytest -m gpu``): ``torch_native.fp8_linear``
(``torch._scaled_mm`` with row-wise scales) is chosen on Hopper for bfloat16 with K and N multiples of 16 and
matches the float64 oracle of ``tests/correctness/test_fp8_linear.py`` on Qwen3-0.6B's projection shapes at 1
to 70 rows; float16 and odd shapes fall back to the reference, which matches too; a captured CUDA graph
replays it bit for bit."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.backends.torch_native.fp8_linear import KERNEL_ID

pytestmark = pytest.mark.gpu
DEV = "cuda"
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _oracle(x, qt, bias):
    xf = x.reshape(-1, x.shape[-1]).float()
    s = torch.clamp(xf.abs().max(dim=1, keepdim=True).values / 448.0, min=2.0**-126)
    codes = torch.clamp(xf / s, -448.0, 448.0).to(torch.float8_e4m3fn).double()
    y = codes @ qt.data.double().t() * s.double() * qt.scale.double().reshape(1, -1)
    return y + bias.double() if bias is not None else y


def _rel(got, want):
    return ((got.double().reshape(want.shape) - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 12, 70])
@pytest.mark.parametrize("axis", [0, None], ids=["channel", "tensor"])
def test_scaled_mm_on_hopper_matches_the_oracle(shape, rows, axis):
    if not _hopper():
        pytest.skip("torch_native.fp8_linear runs on CUDA SM >= 9.0 (row-wise scaled fp8 GEMM)")
    n, k = shape
    g = torch.Generator(device=DEV).manual_seed(n + k + rows)
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=g) * 0.05
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16, generator=g)
    qt = lz.quantize(w, "fp8_e4m3", axis=axis)
    assert lz.which("fp8_linear", x, qt, b) == KERNEL_ID
    y = lz.fp8_linear(x, qt, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert _rel(y, _oracle(x, qt, b)) <= 1e-2


@pytest.mark.parametrize(("dtype", "shape"), [(torch.float16, (1024, 2048)), (torch.bfloat16, (40, 72))])
def test_other_calls_fall_back_to_the_reference(dtype, shape):
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    n, k = shape
    x = torch.randn(5, k, device=DEV, dtype=dtype)
    qt = lz.quantize(torch.randn(n, k, device=DEV, dtype=dtype), "fp8_e4m3", axis=0)
    assert lz.which("fp8_linear", x, qt) == "reference.fp8_linear"
    assert (
        _rel(lz.fp8_linear(x, qt), _oracle(x, qt, None)) <= {torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    )


def test_graph_replay_equals_eager():
    if not _hopper():
        pytest.skip("torch_native.fp8_linear runs on CUDA SM >= 9.0")
    x = torch.randn(4, 1024, device=DEV, dtype=torch.bfloat16)
    qt = lz.quantize(torch.randn(3072, 1024, device=DEV, dtype=torch.bfloat16), "fp8_e4m3", axis=0)
    check = lz.validate_graph_capture(
        lambda t: lz.fp8_linear(t, qt), x, rtol=0, atol=0
    )  # replays equal eager bits
    assert check.ok and check.replays == 2 and f"fp8_linear:{KERNEL_ID}" in check.kernels, str(check)
