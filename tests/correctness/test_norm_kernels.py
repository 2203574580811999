"""Every rms_norm / layer_norm / rope / qk_norm_rope kernel available on this CPU, locked with ``lz.lock``,
against float64 oracles (formulas for the norms, complex multiplication for RoPE) on >= 200 seeded cases per
dtype: odd hidden sizes 1..5120, 0-3 leading dims, fused residual, bias, float32 weights, sliced / transposed
inputs; RoPE both styles, partial rotary, gathered / table / position_ids (int64 and int32), BHSD and BSHD,
GQA; q/k norm + RoPE on the same cases with inputs scaled 0.05-20x."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import (  # noqa: E402
    DTYPES,
    MIN_CASES,
    dname,
    kernel_dtype_params,
    layer_norm_oracle,
    mismatch,
    randn,
    rms_oracle,
    run_kernel,
)

pytestmark = pytest.mark.correctness

OPS = ("rms_norm", "layer_norm", "rope", "qk_norm_rope")
PARAMS = kernel_dtype_params(OPS, "cpu")
_ids = lambda x: dname(x) if isinstance(x, torch.dtype) else x  # noqa: E731


def test_every_cpu_kernel_is_covered():
    """The parametrization found the reference and torch_native norm/rope kernels."""
    ids = {kid for _, kid, _ in PARAMS}
    expected = {
        "reference.rms_norm",
        "torch_native.rms_norm",
        "reference.layer_norm",
        "torch_native.layer_norm",
        "reference.rope",
        "reference.qk_norm_rope",
        "torch_native.qk_norm_rope",
    }
    assert expected <= ids, f"missing CPU kernels: {sorted(expected - ids)}"


@pytest.mark.parametrize(("op", "kernel_id", "dtype"), PARAMS, ids=_ids)
def test_kernel_matches_float64_oracle(op, kernel_id, dtype, record_property):
    """Locked kernel vs the float64 formula/complex oracle on 200 seeded cases; every call traced to it."""
    run = run_kernel(op, kernel_id, dtype)
    record_property("cases_run", run.ran)
    print(run.report())
    assert not run.failures, run.report()
    assert run.traced == run.ran, f"lz.trace saw {run.traced} calls served by {kernel_id}, expected {run.ran}"
    assert run.ran >= MIN_CASES, f"only {run.ran} eligible cases (need {MIN_CASES})\n{run.report()}"


NORM_PARAMS = [p for p in PARAMS if p[0] in ("rms_norm", "layer_norm")]


@pytest.mark.parametrize(
    ("op", "kernel_id", "dtype"), [p for p in NORM_PARAMS if p[2] == torch.float16], ids=_ids
)
def test_float16_values_whose_square_overflows_float16(op, kernel_id, dtype):
    """|x| ~ 1000: x^2 ~ 1e6 > float16 max 65504. Kernels must square in float32, not float16 (which would
    give inf and an all-zero output)."""
    gen = torch.Generator().manual_seed(3)
    x = randn((4, 64), gen, "cpu", dtype, 1000.0)
    w = torch.ones(64, dtype=dtype)
    lz.lock(op, kernel_id)
    if op == "rms_norm":
        out, ref = lz.rms_norm(x, w, 1e-6), rms_oracle(x, w, 1e-6)
    else:
        out, ref = lz.layer_norm(x, w, None, 1e-5), layer_norm_oracle(x, w, None, 1e-5)
    assert mismatch(out, ref, dtype) is None, mismatch(out, ref, dtype)


@pytest.mark.parametrize(("op", "kernel_id", "dtype"), NORM_PARAMS, ids=_ids)
def test_nan_in_one_row_stays_in_that_row(op, kernel_id, dtype):
    """A NaN in row 2 of x makes exactly output row 2 NaN (neither hidden nor spread)."""
    gen = torch.Generator().manual_seed(4)
    x = randn((5, 33), gen, "cpu", dtype)
    x[2, 7] = float("nan")
    w = torch.ones(33, dtype=dtype)
    lz.lock(op, kernel_id)
    out = lz.rms_norm(x, w) if op == "rms_norm" else lz.layer_norm(x, w)
    nan = torch.isnan(out)
    assert nan[2].all(), f"{kernel_id}: NaN of row 2 hidden: {out[2, :4].tolist()}"
    nan[2] = False
    assert not nan.any(), f"{kernel_id}: NaN leaked to {nan.nonzero().tolist()[:5]}"


@pytest.mark.parametrize(("op", "kernel_id", "dtype"), [p for p in PARAMS if p[0] == "rms_norm"], ids=_ids)
def test_rms_norm_residual_is_the_sum_in_the_input_dtype(op, kernel_id, dtype):
    """Hand-worked: x = [1, 2], residual = [2, 2] -> h = [3, 4], rms = sqrt(12.5), y = h / rms (eps = 0+)."""
    x = torch.tensor([[1.0, 2.0]], dtype=dtype)
    r = torch.tensor([[2.0, 2.0]], dtype=dtype)
    lz.lock(op, kernel_id)
    y, h = lz.rms_norm(x, torch.ones(2, dtype=dtype), 1e-12, residual=r)
    assert h.dtype == dtype and torch.equal(h, torch.tensor([[3.0, 4.0]], dtype=dtype))
    expected = torch.tensor([[3.0, 4.0]], dtype=torch.float64) / 12.5**0.5
    assert mismatch(y, expected, dtype) is None, mismatch(y, expected, dtype)


# F.layer_norm (torch 2.13 CPU) takes a weight/bias dtype other than x's only for half x with float32
# parameters; the torch_native.layer_norm check must reject the rest (a BUG this test found, fixed in
# ff2c6b0).
MIXED_PARAMS = sorted({(op, kid) for op, kid, _ in NORM_PARAMS})


@pytest.mark.parametrize(("op", "kernel_id"), MIXED_PARAMS)
def test_norm_weight_dtype_other_than_input(op, kernel_id):
    """Whenever validate() says the kernel can run x of one dtype with weight (and bias) of another, it must
    run and match the oracle."""
    failures = []
    gen = torch.Generator().manual_seed(9)
    lz.lock(op, kernel_id)
    for xd, wd in ((a, b) for a in DTYPES for b in DTYPES if a != b):
        x = randn((3, 24), gen, "cpu", xd)
        w, b = randn((24,), gen, "cpu", wd), randn((24,), gen, "cpu", wd)
        args = (x, w, b) if op == "layer_norm" else (x, w)
        if lz.validate(kernel_id, op, *args):
            continue
        try:
            out = getattr(lz, op)(*args)
        except lz.KernelExecutionError as exc:
            failures.append(f"x {dname(xd)}, weight {dname(wd)}: validate() says it can run, it raised {exc}")
            continue
        ref = layer_norm_oracle(x, w, b, 1e-5) if op == "layer_norm" else rms_oracle(x, w, 1e-6)
        msg = mismatch(out, ref, xd)
        if msg:
            failures.append(f"x {dname(xd)}, weight {dname(wd)}: {msg}")
    assert not failures, "\n".join(failures)
