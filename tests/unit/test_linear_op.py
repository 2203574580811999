"""``lz.linear``: every kernel reachable on CPU (reference, torch_native) equals a float64 product within the
dtype's tolerance, for odd shapes, any leading dims, with and without bias, strided x; gradients match the
float64 ones; typed errors for bad inputs; registered like every op; the key keeps small row counts exact."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.custom import CANONICAL_ARGS
from layerzero.ops import OPS
from layerzero.ops.linear import EXACT_ROWS, rows_key

pytestmark = pytest.mark.unit

KERNELS = ("reference.linear", "torch_native.linear")
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def oracle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float64 ``x @ w.T + b`` (no kernel under test involved)."""
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def assert_close_rel(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = want.abs().max().clamp_min(1e-6)
    err = ((out.double() - want).abs().max() / scale).item()
    assert err <= TOL[dtype], f"max error {err:.2e} relative to max |y| > {TOL[dtype]:.0e} ({dtype})"


@pytest.mark.parametrize("kernel_id", KERNELS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=["f32", "f64", "bf16", "f16"]
)
@pytest.mark.parametrize("seed", range(4))
def test_locked_kernel_matches_float64(kernel_id, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    lead = [(1,), (7,), (3, 5), (2, 1, 3)][seed]
    n, k = [(37, 129), (1, 1), (64, 17), (5, 300)][seed]
    x = torch.randn(*lead, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if seed % 2 == 0 else None
    lz.lock("linear", kernel_id)
    try:
        out = lz.linear(x, w, b)
        assert lz.which("linear", x, w, b) == kernel_id
    finally:
        lz.unlock("linear")
    assert out.shape == (*lead, n) and out.dtype == dtype
    assert_close_rel(out, oracle(x, w, b), dtype)


def test_hand_worked_case_and_strided_inputs():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = torch.tensor([0.5, -0.5, 0.0])
    for kernel_id in KERNELS:
        lz.lock("linear", kernel_id)
        try:
            assert lz.linear(x, w, b).tolist() == [[1.5, 1.5, 3.0], [3.5, 3.5, 7.0]]
            xs = torch.randn(6, 10)[:, ::2]  # non-contiguous rows and columns
            ws = torch.randn(4, 10)[:, ::2]
            assert_close_rel(lz.linear(xs.t().contiguous().t(), ws), oracle(xs, ws, None), torch.float32)
            assert_close_rel(lz.linear(xs, ws), oracle(xs, ws, None), torch.float32)
        finally:
            lz.unlock("linear")


def test_empty_rows_and_default_selection():
    w = torch.randn(3, 4)
    assert lz.linear(torch.zeros(0, 4), w).shape == (0, 3)
    assert lz.linear(torch.zeros(2, 0, 4), w).shape == (2, 0, 3)
    assert lz.which("linear", torch.zeros(2, 4), w) == "torch_native.linear"  # CPU: F.linear


@pytest.mark.parametrize("kernel_id", KERNELS)
def test_gradients_match_float64(kernel_id):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, generator=g, requires_grad=True)
    w = torch.randn(3, 7, generator=g, requires_grad=True)
    b = torch.randn(3, generator=g, requires_grad=True)
    gy = torch.randn(5, 3, generator=g)
    lz.lock("linear", kernel_id)
    try:
        lz.linear(x, w, b).backward(gy)
    finally:
        lz.unlock("linear")
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    (xd @ wd.t() + bd).backward(gy.double())
    for got, want in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        assert_close_rel(got, want, torch.float32)


def test_key_rows_exact_then_bucketed():
    assert [rows_key(m) for m in (0, 1, 3, 8, EXACT_ROWS)] == [0, 1, 3, 8, EXACT_ROWS]
    assert rows_key(EXACT_ROWS + 1) == 32 and rows_key(1000) == 1024
    rep = lz.explain("linear", torch.zeros(3, 4), torch.zeros(5, 4))
    f = rep.context.fields()
    assert (f["batch"], f["hidden_size"], f["intermediate_size"], f["has_bias"]) == (3, 4, 5, False)


@pytest.mark.parametrize(
    ("x", "w", "b", "match"),
    [
        ([1.0], torch.randn(2, 1), None, "x: expected a torch.Tensor"),
        (torch.ones(2, 3, dtype=torch.int64), torch.randn(2, 3), None, "x.dtype"),
        (torch.tensor(1.0), torch.randn(2, 1), None, "x rank: expected >= 1 dims"),
        (torch.randn(2, 3), torch.randn(3), None, "weight rank: expected 2 dims"),
        (torch.randn(2, 3), torch.randn(4, 5), None, r"x.shape\[-1\] \(in_features K\): expected 5"),
        (
            torch.randn(2, 3),
            torch.randn(4, 3, dtype=torch.float64),
            None,
            "weight.dtype: expected torch.float32",
        ),
        (torch.randn(2, 3), torch.randn(4, 3, device="meta"), None, "weight.device"),
        (torch.randn(2, 0), torch.randn(4, 0), None, "N >= 1 and K >= 1"),
        (torch.randn(2, 3), torch.randn(4, 3), torch.randn(5), r"bias shape: expected \[N\] = \[4\]"),
        (torch.randn(2, 3), torch.randn(4, 3), torch.randn(4, 1), "bias rank"),
        (torch.randn(2, 3), torch.randn(4, 3), torch.randn(4).half(), "bias.dtype"),
        (torch.randn(2, 3), torch.randn(4, 3), "b", "bias: expected a torch.Tensor"),
    ],
)
def test_bad_inputs_raise_typed_errors(x, w, b, match):
    with pytest.raises(lz.InvalidInputError, match=match) as info:
        lz.linear(x, w, b)
    assert isinstance(info.value, ValueError)


def test_registered_everywhere():
    assert CANONICAL_ARGS["linear"] == ("x", "weight", "bias")
    assert "linear" in OPS and "linear" in lz.__all__
    ids = {
        k["kernel_id"] if isinstance(k, dict) else getattr(k, "kernel_id", k)
        for k in lz.list_kernels("linear")
    }
    assert {*KERNELS, "triton.gemv"} <= ids
