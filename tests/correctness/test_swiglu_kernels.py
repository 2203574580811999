"""``lz.swiglu`` kernels on CPU against oracles.

- Every CPU kernel (reference, torch_native), locked, on >= 200 seeded ``_shapes.swiglu_call`` cases per dtype
  (odd intermediate sizes 1..4096, 0-3 leading dims, contiguous / fused gate_up halves / transposed / stride
  2, value scales 0.1..30) vs the float64 oracle ``g / (1 + exp(-g)) * u`` within ``_shapes.TOL``.
- Hugging Face equality: ``ACT2FN["silu"](gate) * up`` (transformers' LlamaMLP activation) is bit-identical to
  the reference and to torch_native in every dtype on CPU (they round where HF rounds).
- ``triton.swiglu`` through the Triton interpreter (``TRITON_INTERPRET=1`` on machines without CUDA, set by
  tests/conftest.py and below as a fallback): seeded small cases vs the float64 oracle, the HF rounding order
  (a few ulps of the input dtype from HF: float32 ``exp`` implementations differ, and the interpreter
  truncates float32 -> bfloat16 where the GPU rounds to nearest; float16 is > 99% bit-identical), several
  column blocks, strided rows; inputs never written.
- NaN/inf propagate like the oracle.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first @triton.jit of the session (kernels load lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import DTYPES, MIN_CASES, dname, mismatch, run_kernel, swiglu_call, swiglu_oracle  # noqa: E402

import layerzero as lz  # noqa: E402

pytestmark = pytest.mark.correctness
HAS_TRITON = importlib.util.find_spec("triton") is not None
HALF = (torch.float16, torch.bfloat16)
_ids = lambda x: dname(x) if isinstance(x, torch.dtype) else x  # noqa: E731


def locked(kernel_id: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``lz.swiglu(gate, up)`` with the op locked to ``kernel_id``."""
    lz.lock("swiglu", kernel_id)
    try:
        return lz.swiglu(gate, up)
    finally:
        lz.unlock("swiglu")


@pytest.mark.parametrize("kernel_id", ["reference.swiglu", "torch_native.swiglu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_cpu_kernel_matches_float64_oracle(kernel_id, dtype):
    run = run_kernel("swiglu", kernel_id, dtype)
    assert not run.failures, run.report()
    assert run.ran >= MIN_CASES and run.traced == run.ran, run.report()
    assert not run.rejected, run.report()  # CPU kernels take every layout


def test_seeded_cases_cover_every_layout():
    layouts = {swiglu_call(seed, torch.float32).case.layout for seed in range(MIN_CASES)}
    assert layouts == {"contiguous", "fused", "transposed", "strided"}


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_hf_llama_mlp_activation_is_bit_identical(dtype):
    act = pytest.importorskip("transformers.activations").ACT2FN["silu"]
    from layerzero.backends.reference.swiglu import swiglu as reference

    for seed in range(40):
        call = swiglu_call(seed, dtype)
        gate, up = call.args
        hf = act(gate) * up
        assert torch.equal(reference(gate, up), hf), call.case
        assert torch.equal(locked("torch_native.swiglu", gate, up), hf), call.case
        assert torch.equal(lz.swiglu(gate, up), hf), call.case  # default selection on CPU


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_nan_and_inf_propagate(dtype):
    gate = torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0, 2.0], dtype=dtype)
    up = torch.tensor([1.0, 2.0, 3.0, float("nan"), float("inf")], dtype=dtype)
    ref = swiglu_oracle(gate, up)  # [nan, inf, nan (-inf * 0), nan, inf]
    for kid in ("reference.swiglu", "torch_native.swiglu"):
        out = locked(kid, gate, up)
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), (kid, out)
        finite = ~torch.isnan(ref)
        assert torch.equal(out[finite].double(), ref[finite]), (kid, out)


# ----------------------------------------------------------------------------- triton.swiglu, interpreted
triton_only = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
CPU_WORK = 40_000  # elements per seeded case at most (interpreter time)


def _triton():
    from layerzero.backends.triton import swiglu

    return swiglu.swiglu


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=_ids)
def test_triton_seeded_cases_match_float64(dtype):
    fn, ran, failures = _triton(), 0, []
    for seed in range(400):
        call = swiglu_call(seed, dtype)
        gate, up = call.args
        if gate.numel() > CPU_WORK or gate.stride(-1) != 1:
            continue
        before = (gate.clone(), up.clone())
        out = fn(gate, up)
        msg = mismatch(out, call.oracle(), dtype, "out")
        if msg:
            failures.append(f"[{call.case}] {msg}")
        if not (torch.equal(gate, before[0]) and torch.equal(up, before[1])):
            failures.append(f"[{call.case}] inputs were modified")
        ran += 1
        if ran >= 25:
            break
    assert ran >= 25 and not failures, failures[:5]


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=_ids)
def test_triton_rounds_like_hf(dtype):
    """Several column blocks (I = 2053 > 1024), a fused gate_up view: within a few ulps of HF's F.silu(g) *
    u."""
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(3, 2 * 2053, generator=g) * 4).to(dtype)
    gate, up = gate_up[:, :2053], gate_up[:, 2053:]
    out = _triton()(gate, up)
    hf = torch.nn.functional.silu(gate) * up
    assert out.shape == (3, 2053) and out.dtype == dtype and out.is_contiguous()
    ulp = torch.finfo(dtype).eps * hf.double().abs().clamp_min(torch.finfo(dtype).tiny)
    # float32: exp implementations differ by a few ulps; bfloat16: the interpreter truncates both roundings
    assert bool(((out.double() - hf.double()).abs() <= 4 * ulp).all())
    if dtype == torch.float16:  # rounded to nearest like the GPU: HF's rounding order gives HF's bits
        assert float((out == hf).double().mean()) > 0.99


@triton_only
def test_triton_column_block_from_the_knobs():
    """``SwigluKnobs.block`` 16: a 70-wide row in 5 column blocks (the last partial) matches float64."""
    from layerzero.backends.triton import swiglu
    from layerzero.core.knobs import knobs

    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(4, 70, generator=g), torch.randn(4, 70, generator=g)
    with knobs(swiglu.KNOBS, block=16):
        out = _triton()(gate, up)
    assert mismatch(out, swiglu_oracle(gate, up), torch.float32) is None


@triton_only
def test_triton_transposed_and_empty_inputs():
    g = torch.Generator().manual_seed(1)
    gate = torch.randn(5, 3, 7, generator=g).transpose(0, 1)  # rows cannot be merged: copied
    up = torch.randn(3, 5, 7, generator=g)
    out = _triton()(gate, up)
    assert mismatch(out, swiglu_oracle(gate, up), torch.float32) is None
    empty = torch.empty(0, 4)
    assert _triton()(empty, empty).shape == (0, 4)


def test_hand_worked_row():
    # silu(2) * 3 = 6 / (1 + e^-2) = 6 / 1.1353352832 = 5.2847824...; silu(-2) * 3 = -6 / (1 + e^2) =
    # -0.7152175...
    gate, up = (
        torch.tensor([[2.0, -2.0]], dtype=torch.float64),
        torch.tensor([[3.0, 3.0]], dtype=torch.float64),
    )
    expected = [5.284782467867294, -0.7152175321327053]
    assert swiglu_oracle(gate, up)[0].tolist() == pytest.approx(expected, abs=1e-14)
    for kid in ("reference.swiglu", "torch_native.swiglu"):
        assert locked(kid, gate, up)[0].tolist() == pytest.approx(expected, abs=1e-14)
    if HAS_TRITON:
        assert _triton()(gate.float(), up.float())[0].tolist() == pytest.approx(expected, abs=1e-6)
