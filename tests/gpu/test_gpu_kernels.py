"""Every CUDA kernel (``lz.list_kernels`` entries that run on cuda), locked with ``lz.lock``, against the
float64 oracles of ``tests/correctness/_shapes.py`` on >= 200 seeded cases per dtype, plus fully-masked-row
and NaN behaviour and sampling on the GPU. Run on an H200 with ``pytest -m gpu tests/gpu -q``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.ops._common import RUNTIME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from _shapes import (  # noqa: E402
    MIN_CASES,
    attention_oracle,
    dname,
    kernel_dtype_params,
    mismatch,
    randn,
    run_kernel,
    run_sampling_kernel,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
PARAMS = kernel_dtype_params(["attention", "rms_norm", "layer_norm", "rope"], DEV)
SAMPLING = kernel_dtype_params(["sample_topk", "sample_topp"], DEV)
ATTN = [(kid, dt) for op, kid, dt in PARAMS if op == "attention"]
_ids = lambda x: dname(x) if isinstance(x, torch.dtype) else x  # noqa: E731


@pytest.fixture(autouse=True)
def _healthy_backends():
    """A kernel failing in one test must not leave its backend's circuit breaker open for the next."""
    RUNTIME.health.reset()
    yield
    RUNTIME.health.reset()


def test_sdpa_kernels_are_listed_for_cuda():
    ids = {kid for kid, _ in ATTN}
    assert {"torch_sdpa.flash", "torch_sdpa.efficient", "torch_sdpa.cudnn", "torch_sdpa.math"} <= ids, ids


@pytest.mark.parametrize(("op", "kernel_id", "dtype"), PARAMS, ids=_ids)
def test_cuda_kernel_matches_float64_oracle(op, kernel_id, dtype, record_property):
    run = run_kernel(op, kernel_id, dtype, DEV)
    record_property("cases_run", run.ran)
    print(run.report())
    assert not run.failures, f"on {torch.cuda.get_device_name()} / torch {torch.__version__}:\n{run.report()}"
    assert run.traced == run.ran, f"lz.trace saw {run.traced} calls served by {kernel_id}, expected {run.ran}"
    assert run.ran >= MIN_CASES, f"only {run.ran} eligible cases (need {MIN_CASES})\n{run.report()}"


def _masked_inputs(dtype, kind, layout):
    """q/k/v [2, 4, 5, 64] (cuDNN wants BSHD memory) and a [2, 1, 5, 8] mask whose query row 2 sees no key."""
    gen = torch.Generator().manual_seed(5)
    shape_q, shape_kv = ((2, 5, 4, 64), (2, 8, 4, 64)) if layout == "BSHD" else ((2, 4, 5, 64), (2, 4, 8, 64))
    q, k, v = randn(shape_q, gen, DEV, dtype), randn(shape_kv, gen, DEV, dtype), randn(shape_kv, gen, DEV, dtype)
    keep = torch.rand(2, 1, 5, 8, generator=gen) < 0.7
    keep[..., 0] = True
    keep[:, :, 2] = False
    keep = keep.to(DEV)
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=dtype, device=DEV).masked_fill(~keep, float("-inf"))
    return q, k, v, mask


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize(("kernel_id", "dtype"), ATTN, ids=_ids)
def test_cuda_fully_masked_row_gives_zero(kernel_id, dtype, kind):
    """lz.attention documents that a row whose keys are all masked returns 0, whatever the kernel."""
    for layout in ("BSHD", "BHSD"):
        q, k, v, mask = _masked_inputs(dtype, kind, layout)
        if not lz.validate(kernel_id, "attention", q, k, v, attn_mask=mask, layout=layout):
            break
    else:
        pytest.skip(f"{kernel_id} takes no {kind} mask in {dname(dtype)}")
    lz.lock("attention", kernel_id)
    out = lz.attention(q, k, v, attn_mask=mask, layout=layout)
    row = out[:, 2] if layout == "BSHD" else out[:, :, 2]
    assert torch.equal(row, torch.zeros_like(row)), (
        f"{kernel_id} {dname(dtype)} {kind} mask: fully masked row gave {row.flatten()[:4].tolist()}, expected 0")
    ref = attention_oracle(q, k, v, mask, layout=layout)
    assert mismatch(out, ref, dtype) is None, mismatch(out, ref, dtype)


@pytest.mark.parametrize(("kernel_id", "dtype"), ATTN, ids=_ids)
def test_cuda_nan_in_one_query_row_stays_in_that_row(kernel_id, dtype):
    gen = torch.Generator().manual_seed(11)
    q, k, v = (randn((1, s, 2, 64), gen, DEV, dtype) for s in (8, 8, 8))  # BSHD memory, Sq == Sk
    q[0, 3, 1, 5] = float("nan")
    if lz.validate(kernel_id, "attention", q, k, v, is_causal=True, layout="BSHD"):
        pytest.skip(f"{kernel_id} cannot run causal {dname(dtype)}")
    lz.lock("attention", kernel_id)
    out = lz.attention(q, k, v, is_causal=True, layout="BSHD")
    nan = torch.isnan(out)
    assert nan[0, 3, 1].all(), f"{kernel_id}: the NaN of q row 3 vanished: {out[0, 3, 1, :4].tolist()}"
    nan[0, 3, 1] = False
    assert not nan.any(), f"{kernel_id}: NaN leaked to {nan.nonzero().tolist()[:5]}"


@pytest.mark.parametrize(("op", "kernel_id", "dtype"), SAMPLING, ids=_ids)
def test_cuda_sampling_kernel_draws_inside_oracle_sets(op, kernel_id, dtype):
    ran, failures = run_sampling_kernel(op, kernel_id, dtype, DEV)
    assert not failures, f"{kernel_id} {dname(dtype)}: {ran} cases\n" + "\n".join(failures[:12])
    assert ran >= MIN_CASES
