"""``lz.linear_cross_entropy``: every CPU kernel against the float64 oracle ``F.cross_entropy(hidden.double()
@ weight.double().T (+ bias), target, ...)``: odd shapes, ignore_index rows, reductions, label smoothing,
softcap; the chunked torch_native kernel over many chunks, forward and gradient; typed input errors; the liger
kernel registered and rejected on this machine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import layerzero as lz
from layerzero.backends.reference.linear_ce import linear_cross_entropy as reference_lce
from layerzero.backends.torch_native.linear_ce import linear_cross_entropy as chunked_lce
from layerzero.core.errors import InvalidInputError

pytestmark = pytest.mark.correctness

TOL = {torch.float32: (2e-5, 2e-5), torch.float64: (1e-10, 1e-10), torch.bfloat16: (3e-2, 3e-2)}


def oracle(
    hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None
):
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(
        z,
        target.reshape(-1) if z.dim() == 2 else target,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )


def case(n=13, h=37, v=101, dtype=torch.float32, ignore=(2, 7), bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    for i in ignore:
        if i < n:
            target[i] = -100
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    return hidden, weight, target, b


KERNELS = {
    "reference": lambda *a, **k: reference_lce(*a),
    "chunked": lambda *a, **k: chunked_lce(*a, chunk_rows=k.get("chunk", 4)),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "smoothing,softcap,bias", [(0.0, None, False), (0.1, None, True), (0.0, 5.0, False), (0.2, 3.0, True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernels_match_the_oracle(kernel, reduction, smoothing, softcap, bias, dtype):
    hidden, weight, target, b = case(dtype=dtype, bias=bias)
    got = KERNELS[kernel](hidden, weight, target, b, -100, reduction, smoothing, softcap)
    want = oracle(hidden, weight, target, b, -100, reduction, smoothing, softcap)
    atol, rtol = TOL[dtype]
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", [(1, 1, 1), (5, 123, 123), (17, 3, 2), (64, 16, 1000)])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_odd_shapes_and_chunk_sizes(shape, chunk):
    n, h, v = shape
    hidden, weight, target, _ = case(n, h, v, ignore=(0,) if n > 2 else ())
    for reduction in ("mean", "sum", "none"):
        got = chunked_lce(hidden, weight, target, None, -100, reduction, 0.1, None, chunk_rows=chunk)
        torch.testing.assert_close(
            got.double(),
            oracle(hidden, weight, target, reduction=reduction, label_smoothing=0.1),
            atol=2e-5,
            rtol=2e-5,
        )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing,softcap,bias", [(0.0, None, True), (0.15, 4.0, True), (0.1, None, False)])
def test_chunked_gradient_matches_the_oracle(reduction, smoothing, softcap, bias):
    hidden, weight, target, b = case(n=11, h=9, v=23, dtype=torch.float64, bias=bias)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((b,) if bias else ())]
    leaves_o = [t.detach().clone().requires_grad_() for t in leaves]
    bb, bo = (leaves[2], leaves_o[2]) if bias else (None, None)
    got = chunked_lce(leaves[0], leaves[1], target, bb, -100, reduction, smoothing, softcap, chunk_rows=3)
    want = oracle(leaves_o[0], leaves_o[1], target, bo, -100, reduction, smoothing, softcap)
    w = (
        torch.rand(want.shape, dtype=torch.float64)
        if reduction == "none"
        else torch.tensor(1.7, dtype=torch.float64)
    )
    (got * w).sum().backward()
    (want * w).sum().backward()
    for a, o in zip(leaves, leaves_o, strict=True):
        torch.testing.assert_close(a.grad, o.grad, atol=1e-10, rtol=1e-10)


def test_chunked_gradcheck():
    hidden, weight, target, b = case(n=5, h=4, v=7, dtype=torch.float64, bias=True, ignore=(1,))
    args = [t.requires_grad_() for t in (hidden, weight, b)]
    assert torch.autograd.gradcheck(
        lambda h, w, bias: chunked_lce(h, w, target, bias, -100, "mean", 0.1, 2.0, chunk_rows=2), args
    )


def test_public_op_leading_dims_dispatch_and_grad():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    weight = torch.randn(33, 16, generator=g, requires_grad=True)
    target = torch.randint(0, 33, (2, 5), generator=g)
    target[1, 4] = -100
    rows = lz.linear_cross_entropy(hidden, weight, target, reduction="none")
    assert rows.shape == (2, 5) and rows[1, 4] == 0
    loss = lz.linear_cross_entropy(hidden, weight, target)
    torch.testing.assert_close(
        loss.double(),
        oracle(hidden.detach().reshape(-1, 16), weight.detach(), target.reshape(-1)),
        atol=2e-5,
        rtol=2e-5,
    )
    loss.backward()
    h2, w2 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    oracle(h2.reshape(-1, 16), w2, target.reshape(-1)).backward()
    torch.testing.assert_close(hidden.grad.double(), h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w2.grad, atol=1e-5, rtol=1e-5)
    assert (
        lz.which("linear_cross_entropy", hidden.detach().reshape(-1, 16), weight.detach(), target.reshape(-1))
        == "torch_native.linear_cross_entropy"
    )


def test_bfloat16_inputs_give_a_float32_loss():
    hidden, weight, target, _ = case(n=9, h=32, v=50, dtype=torch.bfloat16)
    for kernel in ("reference.linear_cross_entropy", "torch_native.linear_cross_entropy"):
        with lz.prefer(kernel):
            got = lz.linear_cross_entropy(hidden, weight, target)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), oracle(hidden, weight, target), atol=3e-2, rtol=3e-2)


def test_every_row_ignored_mean_is_nan_like_pytorch():
    hidden, weight, target, _ = case(n=3, ignore=(0, 1, 2))
    assert torch.isnan(lz.linear_cross_entropy(hidden, weight, target))
    assert lz.linear_cross_entropy(hidden, weight, target, reduction="sum") == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"reduction": "avg"}, r"reduction: expected 'mean', 'sum' or 'none', got 'avg'"),
        ({"label_smoothing": 1.5}, r"label_smoothing: expected a float in \[0, 1\]"),
        ({"softcap": 0.0}, r"softcap: expected None or a finite float > 0"),
        ({"ignore_index": 1.0}, r"ignore_index: expected an int"),
        ({"bias": torch.zeros(3)}, r"bias shape: expected \[V\] = \[101\]"),
    ],
)
def test_bad_options_raise_typed_errors(kwargs, match):
    hidden, weight, target, _ = case()
    with pytest.raises(InvalidInputError, match=match):
        lz.linear_cross_entropy(hidden, weight, target, **kwargs)


def test_bad_tensors_raise_typed_errors():
    hidden, weight, target, _ = case()
    with pytest.raises(InvalidInputError, match=r"weight shape: expected \[V, H\]"):
        lz.linear_cross_entropy(hidden, weight.T, target)
    with pytest.raises(InvalidInputError, match=r"target.dtype: expected torch.int64.*target.long\(\)"):
        lz.linear_cross_entropy(hidden, weight, target.int())
    with pytest.raises(InvalidInputError, match=r"target shape"):
        lz.linear_cross_entropy(hidden, weight, target[:-1])
    with pytest.raises(InvalidInputError, match=r"target values: expected class indices in \[0, 101\)"):
        lz.linear_cross_entropy(hidden, weight, torch.full_like(target, 101))
    with pytest.raises(InvalidInputError, match=r"hidden rank"):
        lz.linear_cross_entropy(hidden[0], weight, target[0])
    with pytest.raises(InvalidInputError, match=r"dtype"):
        lz.linear_cross_entropy(hidden, weight.double(), target)
    with pytest.raises(InvalidInputError):
        lz.linear_cross_entropy(hidden.long(), weight, target)


def test_liger_kernels_are_registered_and_rejected_here():
    rows = {k["kernel_id"]: k for k in lz.list_kernels()}
    for kid, op in (
        ("liger.linear_cross_entropy", "linear_cross_entropy"),
        ("liger.layer_norm", "layer_norm"),
    ):
        assert rows[kid]["op"] == op and rows[kid]["device_types"] == ["cuda"]
        if not rows[kid]["available"]:
            assert rows[kid]["reasons"]
    hidden, weight, target, _ = case()
    report = lz.explain("linear_cross_entropy", hidden, weight, target)
    text = str(report)
    liger_lines = [ln for ln in text.splitlines() if ln.startswith("liger.linear_cross_entropy")]
    assert liger_lines and "rejected" in liger_lines[0]
    assert "DEVICE_TYPE_UNSUPPORTED" in liger_lines[0] or "BACKEND_NOT_INSTALLED" in liger_lines[0]
    ln_text = str(lz.explain("layer_norm", torch.randn(3, 8), torch.ones(8)))
    line = [ln for ln in ln_text.splitlines() if ln.startswith("liger.layer_norm")]
    assert line and "rejected" in line[0]
