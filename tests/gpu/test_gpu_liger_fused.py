"""Liger ``layer_norm`` and fused linear cross-entropy through LayerZero on a CUDA GPU, against float64
oracles (``F.layer_norm`` / ``F.cross_entropy(hidden.double() @ weight.double().T, ...)``): forward and
gradients, ignore_index rows, label smoothing, softcap. Skipped without CUDA or liger-kernel."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import layerzero as lz

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("liger_kernel", reason="needs liger-kernel (pip install liger-kernel)")

DEV = "cuda"
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (5e-2, 5e-2), torch.float16: (2e-2, 2e-2)}


def oracle(hidden, weight, target, bias=None, reduction="mean", label_smoothing=0.0, softcap=None):
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, target, reduction=reduction, label_smoothing=label_smoothing)


@contextlib.contextmanager
def _locked(op, kernel_id):
    """``lz.lock(op, kernel_id)`` for the block (a lock is process-wide; ``lz.unlock`` lifts it)."""
    lz.lock(op, kernel_id)
    try:
        yield
    finally:
        lz.unlock(op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "smoothing,softcap,bias", [(0.0, None, False), (0.1, None, True), (0.0, 30.0, False)]
)
def test_liger_linear_cross_entropy_forward_and_grad(dtype, reduction, smoothing, softcap, bias):
    g = torch.Generator(device=DEV).manual_seed(0)
    n, h, v = 67, 96, 1031
    hidden = torch.randn(n, h, device=DEV, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=DEV, generator=g) / h**0.5).to(dtype).requires_grad_()
    b = torch.randn(v, device=DEV, generator=g).to(dtype).requires_grad_() if bias else None
    target = torch.randint(0, v, (n,), device=DEV, generator=g)
    target[::7] = -100
    if softcap is not None:
        reasons = lz.validate(
            "liger.linear_cross_entropy",
            "linear_cross_entropy",
            hidden,
            weight,
            target,
            bias=b,
            softcap=softcap,
        )
        if (
            reasons
        ):  # the installed liger_kernel's forward takes no softcap: refused with the reason, never ignored
            assert [r.code for r in reasons] == [lz.ReasonCode.SOFTCAP_UNSUPPORTED]
            pytest.skip(f"liger.linear_cross_entropy refuses softcap here: {reasons[0]}")
    with _locked("linear_cross_entropy", "liger.linear_cross_entropy"):
        loss = lz.linear_cross_entropy(
            hidden, weight, target, bias=b, reduction=reduction, label_smoothing=smoothing, softcap=softcap
        )
    leaves = [t for t in (hidden, weight, b) if t is not None]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    want = oracle(
        ref_leaves[0], ref_leaves[1], target, ref_leaves[2] if bias else None, reduction, smoothing, softcap
    )
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(loss.double(), want, atol=atol * (n if reduction == "sum" else 1), rtol=rtol)
    loss.backward()
    want.backward()
    for got, ref in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_liger_layer_norm(dtype, bias):
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(5, 123, 123, device=DEV, generator=g).to(dtype)
    w = torch.randn(123, device=DEV, generator=g).to(dtype)
    b = torch.randn(123, device=DEV, generator=g).to(dtype) if bias else None
    with _locked("layer_norm", "liger.layer_norm"):
        y = lz.layer_norm(x, w, b, 1e-5)
    want = F.layer_norm(x.double(), (123,), w.double(), None if b is None else b.double(), 1e-5)
    atol, rtol = TOL[dtype]
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), want, atol=atol * 4, rtol=rtol)
