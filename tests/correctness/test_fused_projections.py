"""``lz.rms_norm_linear`` (RMSNorm, optionally after the residual add, then a projection) and
``lz.swiglu_linear`` (SwiGLU, then a projection) against float64 oracles written out here: every CPU kernel
(reference, torch_native, and the default through ``lz``), the Triton kernel through the interpreter
(``TRITON_INTERPRET=1``; compiled on a GPU by tests/gpu/test_gpu_triton_gemv.py), seeded odd shapes, leading
dims, with and without bias and residual. Plus the Triton kernel's routing on hand-built contexts."""

from __future__ import annotations

import pytest
import torch
from _triton_interp import needs_interpreter

import layerzero as lz
from layerzero.backends.triton import gemv as tg
from layerzero.core.context import SelectionContext
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import SelectionInputs, select
from layerzero.testing.devices import fake_cuda_device
from layerzero.testing.registries import routing_registry

pytestmark = pytest.mark.correctness

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def oracle(x, nw, w, b, r, eps):
    """float64 ``linear(rms_norm(x [+ r]))`` and the residual stream ``x + r`` rounded to x's dtype (as a
    model stores it; the norm reads that rounded sum)."""
    h = (x.double() + r.double()).to(x.dtype) if r is not None else x
    hd = h.double()
    n = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * nw.double()
    y = n @ w.double().t() + (0 if b is None else b.double())
    return y, h


def case(dtype, lead, k, n, bias, residual, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, k, generator=g) * 3).to(dtype)
    nw = (torch.rand(k, generator=g) + 0.5).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    r = torch.randn(*lead, k, generator=g).to(dtype) if residual else None
    return x, nw, w, b, r


def check(out, x, nw, w, b, r, eps, tol=None):
    y_want, h_want = oracle(x, nw, w, b, r, eps)
    y = out[0] if r is not None else out
    assert y.shape == (*x.shape[:-1], w.shape[0]) and y.dtype == x.dtype
    err = ((y.double() - y_want).abs().max() / y_want.abs().max()).item()
    assert err <= (tol or TOL[x.dtype]), err
    if (
        r is not None
    ):  # the residual sum is rounded once, like the model's stream (to nearest; within one ulp with tol)
        h_err = (out[1].double() - h_want.double()).abs()
        assert (
            torch.equal(out[1], h_want)
            if tol is None
            else bool((h_err <= h_want.double().abs() * 2**-7).all())
        )


SHAPES = [
    ((1,), 64, 96, False, True),
    ((3,), 33, 7, True, True),
    ((2, 5), 130, 19, True, False),
    ((4,), 1, 3, False, False),
]


@pytest.mark.parametrize(
    "kernel",
    ["reference.rms_norm_linear", "torch_native.rms_norm_linear", "composite.rms_norm_linear", None],
    ids=["reference", "torch_native", "composite", "default"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cpu_kernels_match_float64(kernel, dtype, shape):
    lead, k, n, bias, residual = shape
    x, nw, w, b, r = case(dtype, lead, k, n, bias, residual, seed=k * 31 + n)
    eps = 1e-5
    if kernel is not None:
        lz.lock("rms_norm_linear", kernel)
    try:
        out = lz.rms_norm_linear(x, nw, w, b, eps=eps, residual=r)
    finally:
        if kernel is not None:
            lz.unlock("rms_norm_linear")
    check(out, x, nw, w, b, r, eps)


def test_equals_the_two_op_form():
    """The default CPU kernel (composite: each part dispatched) is the engine's former two calls bit for bit
    (its CPU parity tests rest on that)."""
    x, nw, w, b, r = case(torch.float32, (5,), 48, 20, True, True, seed=3)
    assert lz.which("rms_norm_linear", x, nw, w, b, residual=r) == "composite.rms_norm_linear"
    y, h = lz.rms_norm_linear(x, nw, w, b, eps=1e-6, residual=r)
    hn, h2 = lz.rms_norm(x, nw, 1e-6, residual=r)
    assert torch.equal(y, lz.linear(hn, w, b)) and torch.equal(h, h2)


interpreted = needs_interpreter("tests/gpu/test_gpu_triton_gemv.py")
TRITON_CASES = [
    (1, 37, 129, True, True),
    (2, 5, 3001, False, True),
    (3, 70, 33, True, False),
    (4, 30, 1030, False, True),
    (1, 1, 7, False, False),
    (1, 3, 64, False, True),
]  # the last: one program stores the residual


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(("m", "n", "k", "bias", "residual"), TRITON_CASES, ids=str)
def test_triton_kernel_matches_float64(dtype, m, n, k, bias, residual):
    x, nw, w, b, r = case(dtype, (m,), k, n, bias, residual, seed=m + n + k)
    # Triton's interpreter rounds float32 -> bfloat16 toward zero (1 + 2^-8 + 2^-10 -> 1.0; CUDA and torch
    # round to nearest, 1.0078125), and the kernel rounds three times (n, n * weight, y): twice bf16's
    # tolerance there
    check(
        tg.rms_norm_linear(x, nw, w, b, r, 1e-6),
        x,
        nw,
        w,
        b,
        r,
        1e-6,
        2e-2 if dtype == torch.bfloat16 else None,
    )


# ------------------------------------------------------------------------------------------------ routing
def _select(rows, n, k, dtype=torch.bfloat16, cc=(9, 0)):
    reg = routing_registry("rms_norm_linear", [tg.norm_kernel_spec(True, "")])
    ctx = SelectionContext(
        op="rms_norm_linear",
        device=fake_cuda_device(cc),
        dtype=dtype,
        batch=rows,
        hidden_size=k,
        intermediate_size=n,
        fused_residual=True,
    )
    return select(
        reg,
        ctx,
        SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False),
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("rows", "n", "k"), [(1, 4096, 1024), (1, 6144, 1024), (2, 4096, 1024), (4, 1024, 2048)]
)
def test_triton_is_the_default_for_decode_rows(rows, n, k):
    plan, _ = _select(rows, n, k)
    assert plan.kernel_id == tg.NORM_KERNEL_ID


@pytest.mark.unit
@pytest.mark.parametrize(
    ("rows", "n", "k", "dtype", "code"),
    [
        (2, 6144, 1024, torch.bfloat16, R.SHAPE_MISMATCH),  # two rows of a wide N: the dot kernel's territory
        (5, 1024, 1024, torch.bfloat16, R.SHAPE_MISMATCH),
        (1, 1024, 8192, torch.bfloat16, R.SHAPE_MISMATCH),  # K beyond the register slab
        (1, 1024, 1024, torch.float32, R.DTYPE_UNSUPPORTED),
    ],
)
def test_triton_refuses_outside_its_measured_range(rows, n, k, dtype, code):
    plan, report = _select(rows, n, k, dtype)
    assert plan.kernel_id == "torch_native.rms_norm_linear"
    assert code in {x.code for x in report.candidate(tg.NORM_KERNEL_ID).reasons}


# ---------------------------------------------------------------------------------------------- swiglu_linear
def swiglu_oracle(gate, up, w, b):
    """float64 ``linear(silu(gate) * up)``."""
    g = gate.double()
    return (g * torch.sigmoid(g) * up.double()) @ w.double().t() + (0 if b is None else b.double())


def swiglu_case(dtype, lead, i, n, bias, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(*lead, 2 * i, generator=g) * 2).to(dtype)  # packed, as the engine's projection is
    w = (torch.randn(n, i, generator=g) / i**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    gate, up = gate_up.chunk(2, dim=-1)
    return gate, up, w, b


def swiglu_check(y, gate, up, w, b, tol=None):
    want = swiglu_oracle(gate, up, w, b)
    assert y.shape == (*gate.shape[:-1], w.shape[0]) and y.dtype == gate.dtype
    err = ((y.double() - want).abs().max() / want.abs().max()).item()
    assert err <= (tol or TOL[gate.dtype]), err


@pytest.mark.parametrize(
    "kernel",
    ["reference.swiglu_linear", "torch_native.swiglu_linear", "composite.swiglu_linear", None],
    ids=["reference", "torch_native", "composite", "default"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize(
    "shape", [((1,), 64, 96, False), ((3,), 33, 7, True), ((2, 5), 130, 19, False)], ids=str
)
def test_swiglu_linear_cpu_kernels_match_float64(kernel, dtype, shape):
    lead, i, n, bias = shape
    gate, up, w, b = swiglu_case(dtype, lead, i, n, bias, seed=i + n)
    if kernel is not None:
        lz.lock("swiglu_linear", kernel)
    try:
        y = lz.swiglu_linear(gate, up, w, b)
    finally:
        if kernel is not None:
            lz.unlock("swiglu_linear")
    swiglu_check(y, gate, up, w, b)


def test_swiglu_linear_equals_the_two_op_form():
    gate, up, w, b = swiglu_case(torch.float32, (4,), 40, 9, True, seed=5)
    assert torch.equal(lz.swiglu_linear(gate, up, w, b), lz.linear(lz.swiglu(gate, up), w, b))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(
    ("m", "n", "i", "bias"),
    [(1, 37, 129, True), (2, 5, 3001, False), (4, 30, 1030, True), (1, 3, 64, False)],
    ids=str,
)
def test_swiglu_linear_triton_kernel_matches_float64(dtype, m, n, i, bias):
    gate, up, w, b = swiglu_case(dtype, (m,), i, n, bias, seed=m * n + i)
    swiglu_check(tg.swiglu_linear(gate, up, w, b), gate, up, w, b, 2e-2 if dtype == torch.bfloat16 else None)


@pytest.mark.unit
def test_swiglu_linear_routing_follows_the_prefetch_rule():
    reg = routing_registry("swiglu_linear", [tg.swiglu_kernel_spec(True, "")])
    for rows, n, i, want in (
        (1, 1024, 3072, tg.SWIGLU_KERNEL_ID),
        (4, 1024, 3072, tg.SWIGLU_KERNEL_ID),
        (8, 1024, 3072, "torch_native.swiglu_linear"),
        (1, 1024, 8192, "torch_native.swiglu_linear"),
    ):
        ctx = SelectionContext(
            op="swiglu_linear",
            device=fake_cuda_device((9, 0)),
            dtype=torch.bfloat16,
            batch=rows,
            hidden_size=i,
            intermediate_size=n,
        )
        plan, _ = select(
            reg,
            ctx,
            SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False),
        )
        assert plan.kernel_id == want, (rows, n, i)


# ------------------------------------------------------------------------------------------------ exact keys
@pytest.mark.unit
def test_warm_calls_still_check_every_input():
    """The exact keys (``Runtime.run_hot``) hold every fact the checks read: after warm calls, a bad eps, a
    residual of another dtype or shape, a weight of another width and a strided x are still checked (and
    computed right)."""
    x, nw, w, b, r = case(torch.float32, (3,), 16, 5, True, True, seed=9)
    for _ in range(2):
        lz.rms_norm_linear(x, nw, w, b, eps=1e-6, residual=r)
        lz.swiglu_linear(x, r, w, b)
    for bad in (
        lambda: lz.rms_norm_linear(x, nw, w, b, eps=float("nan"), residual=r),
        lambda: lz.rms_norm_linear(x, nw, w, b, eps=1e-6, residual=r.double()),
        lambda: lz.rms_norm_linear(x, nw, w, b, eps=1e-6, residual=r[:2]),
        lambda: lz.rms_norm_linear(x, nw[:8], w, b, eps=1e-6, residual=r),
        lambda: lz.swiglu_linear(x, r[:, :8], w, b),
        lambda: lz.swiglu_linear(x, r, w[:, :8], b),
    ):
        # the fused op's own check (the composite kernel's inner calls would also refuse some: not enough)
        with pytest.raises(lz.InvalidInputError, match=r"lz\.(rms_norm|swiglu)_linear: "):
            bad()
    keys = {k for k in RUNTIME.cache.hot if isinstance(k, tuple) and k and k[0] == "rms_norm_linear"}
    xs = torch.randn(16, 3).t()  # x transposed: another stride, the same shape
    check(lz.rms_norm_linear(xs, nw, w, b, eps=1e-6, residual=r), xs, nw, w, b, r, 1e-6)
    lz.rms_norm_linear(xs, nw, w, b, eps=1e-6, residual=r)
    assert len(
        {k for k in RUNTIME.cache.hot if isinstance(k, tuple) and k and k[0] == "rms_norm_linear"}
    ) > len(keys)
    swiglu_check(lz.swiglu_linear(xs, r, w, b), xs, r, w, b)
