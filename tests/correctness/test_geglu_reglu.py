"""``lz.geglu`` / ``lz.reglu`` kernels on CPU against float64 oracles written from the definitions: ``gelu(g)
= g * Phi(g) = g / 2 * (1 + erf(g / sqrt 2))`` (exact), ``g / 2 * (1 + tanh(sqrt(2/pi) (g + 0.044715
g^3)))`` (tanh form), ``relu(g) = max(g, 0)``, each times ``up``. Every CPU kernel, locked, on the seeded
swiglu cases of ``_shapes`` (odd intermediate sizes, 0-3 leading dims, fused gate_up halves / transposed /
strided inputs, scales 0.1..30) within ``_shapes.TOL`` per dtype; Hugging Face's activations
(``ACT2FN["gelu"]``, ``["gelu_pytorch_tanh"]``, ``["relu"]``) times up are bit-identical to torch_native (the
same torch calls) and, in float32/float64, to the reference (in half precision within one rounding: torch's
half kernels evaluate the activation their own way); a hand-worked row; the typed errors."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import DTYPES, MIN_CASES, TOL, dname, mismatch, swiglu_call  # noqa: E402

import layerzero as lz  # noqa: E402
from layerzero.core.errors import InvalidInputError  # noqa: E402

pytestmark = pytest.mark.correctness
F64 = torch.float64
_ids = lambda x: dname(x) if isinstance(x, torch.dtype) else x  # noqa: E731


def oracle(op: str, gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    g, u = gate.to(F64), up.to(F64)
    if op == "reglu":
        return g.clamp_min(0.0) * u
    if approximate == "tanh":
        return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3))) * u
    return 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0))) * u


def call(op: str, kernel_id: str | None, gate, up, approximate="none"):
    kw = {"approximate": approximate} if op == "geglu" else {}
    if kernel_id is not None:
        lz.lock(op, kernel_id)
    try:
        return getattr(lz, op)(gate, up, **kw)
    finally:
        if kernel_id is not None:
            lz.unlock(op)


VARIANTS = [("geglu", "none"), ("geglu", "tanh"), ("reglu", "none")]


@pytest.mark.parametrize(("op", "approximate"), VARIANTS)
@pytest.mark.parametrize("backend", ["reference", "torch_native"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_cpu_kernels_match_the_float64_oracle(op, approximate, backend, dtype):
    bad = []
    for seed in range(MIN_CASES):
        c = swiglu_call(seed, dtype)
        gate, up = c.args
        before = (gate.clone(), up.clone())
        out = call(op, f"{backend}.{op}", gate, up, approximate)
        # one rounding of the activation and one of the product in half precision: scale by |act| * |up| too
        why = mismatch(out, oracle(op, gate, up, approximate), dtype, str(c.case), floor=1.0)
        if why:
            bad.append(why)
        assert torch.equal(gate, before[0]) and torch.equal(up, before[1])  # inputs never written
    assert not bad, f"{len(bad)} of {MIN_CASES} cases off (tol {TOL[dtype]}): {bad[:3]}"


@pytest.mark.parametrize(
    ("op", "approximate", "hf_name"),
    [("geglu", "none", "gelu"), ("geglu", "tanh", "gelu_pytorch_tanh"), ("reglu", "none", "relu")],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_hf_activations_are_bit_identical(op, approximate, hf_name, dtype):
    act = pytest.importorskip("transformers.activations").ACT2FN[hf_name]
    for seed in range(30):
        gate, up = swiglu_call(seed, dtype).args
        hf = act(gate) * up
        assert torch.equal(call(op, f"torch_native.{op}", gate, up, approximate), hf), seed
        assert torch.equal(call(op, None, gate, up, approximate), hf), seed  # default selection on CPU
        ref = call(op, f"reference.{op}", gate, up, approximate)
        if dtype in (torch.float32, F64):  # the same torch function on the same dtype: the same bits
            assert torch.equal(ref, hf), seed
        else:  # the activation in float32 rounded once vs torch's half-precision kernel: within one rounding
            assert mismatch(ref, hf.to(F64), dtype, str(seed), floor=1.0) is None


def test_hand_worked_row():
    gate, up = torch.tensor([-2.0, 0.0, 1.0, 3.0], dtype=F64), torch.tensor([1.0, 5.0, 2.0, -1.0], dtype=F64)
    # gelu(1) = 0.5 * (1 + erf(1/sqrt2)) = 0.8413447460685429; gelu(-2) = -2 * Phi(-2) = -0.04550026389635842
    want = torch.tensor(
        [-0.04550026389635842, 0.0, 2 * 0.8413447460685429, -3 * 0.9986501019683699], dtype=F64
    )
    torch.testing.assert_close(lz.geglu(gate, up), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lz.reglu(gate, up), torch.tensor([0.0, 0.0, 2.0, -3.0], dtype=F64))


def test_bad_inputs_are_typed_errors_naming_the_op():
    g = torch.randn(2, 8)
    with pytest.raises(InvalidInputError, match="geglu.*approximate"):
        lz.geglu(g, g, approximate="erf")
    with pytest.raises(InvalidInputError, match="reglu.*up shape"):
        lz.reglu(g, torch.randn(2, 9))
    with pytest.raises(InvalidInputError, match="geglu"):
        lz.geglu(g.int(), g.int())
    assert lz.which("geglu", g, g) == "torch_native.geglu" and lz.which("reglu", g, g) == "torch_native.reglu"
