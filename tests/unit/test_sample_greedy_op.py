"""``lz.sample_greedy``: dispatch on CPU (the reference serves, with the contract's NaN / tie / ``-inf``
answers worked out by hand), typed errors for bad inputs, the cache key, and selection on hand-built CUDA
contexts (``fake_cuda_device``): ``triton.sample_greedy`` is the default on SM >= 8.0 eagerly and under graph
capture, and each constraint hands the call to the reference with its reason. The kernels' correctness against
an oracle: tests/correctness/test_sample_greedy.py."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

import layerzero as lz
from layerzero.backends import triton as tb
from layerzero.core.context import SelectionContext
from layerzero.core.custom import CANONICAL_ARGS
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import SelectionInputs, select
from layerzero.ops import OPS
from layerzero.testing.devices import fake_cuda_device

pytestmark = pytest.mark.unit
NAN, INF = math.nan, math.inf


# ------------------------------------------------------------------------------------ lz.sample_greedy on CPU
def test_cpu_calls_take_the_reference_and_follow_the_contract():
    logits = torch.tensor(
        [
            [0.0, 5.0, 5.0, 1.0],  # tie: the lower index
            [1.0, NAN, 9.0, NAN],  # NaN: the first NaN, whatever the maximum
            [-INF, -INF, -INF, -INF],  # all -inf: 0
            [-INF, 2.0, INF, INF],
        ]
    )  # +inf: the first
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = logits.to(dtype)
        assert lz.which("sample_greedy", x) == "reference.sample_greedy"
        with lz.trace() as t:
            out = lz.sample_greedy(x)
        assert t.counts[("sample_greedy", "reference.sample_greedy")] == 1
        assert out.dtype == torch.int64 and out.tolist() == [1, 1, 0, 2]
    assert lz.is_graph_safe("sample_greedy", logits)


def test_zero_rows_strided_rows_and_one_column():
    assert lz.sample_greedy(torch.zeros(0, 7)).shape == (0,)
    assert lz.sample_greedy(torch.zeros(0, 7)).dtype == torch.int64
    t = torch.tensor([[3.0, 1.0], [2.0, 8.0], [3.0, 0.0]]).t()  # [2, 3], strides (1, 2)
    assert lz.sample_greedy(t).tolist() == [0, 1]
    assert lz.sample_greedy(torch.full((4, 1), -INF)).tolist() == [0, 0, 0, 0]


def test_a_locked_reference_serves_and_kernel_specs_say_graph_safe():
    lz.lock("sample_greedy", "reference.sample_greedy")
    try:
        assert lz.sample_greedy(torch.tensor([[1.0, 2.0]])).tolist() == [1]
    finally:
        lz.unlock("sample_greedy")
    RUNTIME.ensure_ready()
    specs = {s.kernel_id: s for s in RUNTIME.registry.for_op("sample_greedy")}
    assert {"reference.sample_greedy", "triton.sample_greedy"} <= set(specs)
    assert specs["reference.sample_greedy"].graph_safe and specs["triton.sample_greedy"].graph_safe
    assert specs["triton.sample_greedy"].priority > specs["reference.sample_greedy"].priority == 0
    assert CANONICAL_ARGS["sample_greedy"] == ("logits",)


# ------------------------------------------------------------------------------------------- bad inputs
BAD = [
    ([[1.0, 2.0]], r"lz\.sample_greedy: logits: expected a torch\.Tensor, got list"),
    (torch.zeros(5), r"logits rank: expected 2 dims \[S, V\].*got 1 dims \(shape \(5,\)\).*logits\[None\]"),
    (torch.zeros(2, 3, 4), r"logits rank: .*got 3 dims.*reshape\(-1, logits\.shape\[-1\]\)"),
    (
        torch.zeros(2, 3, dtype=torch.int64),
        r"logits\.dtype: expected one of float32/float64/float16/bfloat16, "
        r"got torch\.int64\. Cast logits with logits\.float\(\)",
    ),
    (torch.zeros(2, 3, dtype=torch.bool), r"logits\.dtype: .*got torch\.bool"),
    (torch.zeros(3, 0), r"logits shape: expected \[S, V\] with V >= 1 .*got \[3, 0\]"),
]


@pytest.mark.parametrize(("logits", "match"), BAD, ids=["list", "1d", "3d", "int64", "bool", "empty-vocab"])
def test_bad_inputs_raise_typed_errors(logits, match):
    with pytest.raises(lz.InvalidInputError, match=match) as info:
        lz.sample_greedy(logits)
    assert isinstance(info.value, ValueError)


def test_the_key_holds_dtype_device_vocabulary_not_rows():
    prepare, context = OPS["sample_greedy"]
    k1, args = prepare(torch.zeros(3, 11))
    k2, _ = prepare(torch.zeros(5, 11))
    assert args[0].shape == (3, 11) and k1 == k2  # the row count is not in the key
    assert prepare(torch.zeros(3, 12))[0] != k1 and prepare(torch.zeros(3, 11, dtype=torch.bfloat16))[0] != k1
    ctx = context(k1)
    assert ctx.op == "sample_greedy" and ctx.vocab_size == 11 and not ctx.graph_capture


# ------------------------------------------------------------------------------------------ selection on CUDA
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def _registry(monkeypatch=None, *, absent=False) -> KernelRegistry:
    """Every op (the triton backend registers kernels of several), ``reference.sample_greedy`` and the triton
    backend (faked absent when ``absent``)."""
    RUNTIME.ensure_ready()
    reg = KernelRegistry()
    for op in RUNTIME.registry.ops:
        reg.add_op(RUNTIME.registry.ops.get(op))
    reg.add_backend(RUNTIME.registry.backend("reference"))
    reg.add_kernel(RUNTIME.registry.kernel("reference.sample_greedy"))
    if absent:
        monkeypatch.setitem(sys.modules, "triton", None)
    tb.register(reg)
    return reg


def _select(reg, sm=(9, 0), dtype=torch.bfloat16, **kw):
    ctx = SelectionContext(
        op="sample_greedy", device=fake_cuda_device(sm), dtype=dtype, vocab_size=151936, **kw
    )
    return select(
        reg,
        ctx,
        SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False),
    )


def _codes(report, kernel_id):
    return {r.code for r in report.candidate(kernel_id).reasons}


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sm", [(8, 0), (9, 0), (10, 0), (12, 1)])
@pytest.mark.parametrize("capture", [False, True])
def test_triton_is_the_cuda_default_eager_and_captured(sm, dtype, capture):
    plan, report = _select(_registry(), sm=sm, dtype=dtype, graph_capture=capture)
    assert plan.kernel_id == "triton.sample_greedy" and plan.transforms == ()
    assert report.candidate("reference.sample_greedy").status != "rejected"  # graph-safe too: the fallback


@needs_triton
@pytest.mark.parametrize(
    ("kw", "code"), [({"sm": (7, 5)}, R.SM_TOO_OLD), ({"dtype": torch.float64}, R.DTYPE_UNSUPPORTED)]
)
def test_constraints_hand_the_call_to_the_reference(kw, code):
    plan, report = _select(_registry(), **kw)
    assert plan.kernel_id == "reference.sample_greedy"
    assert _codes(report, "triton.sample_greedy") == {code}


def test_without_triton_the_reference_serves_cuda(monkeypatch):
    plan, report = _select(_registry(monkeypatch, absent=True), graph_capture=True)
    assert plan.kernel_id == "reference.sample_greedy"
    assert _codes(report, "triton.sample_greedy") == {R.BACKEND_NOT_INSTALLED}
