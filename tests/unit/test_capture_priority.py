"""``KernelSpec.capture_priority``: while a CUDA graph is captured (``ctx.graph_capture``) selection scores a
kernel with it instead of ``priority``. Our Triton RMSNorm and SwiGLU lose eagerly (their launch costs more
than torch's) and win inside graphs (measured, ``benchmarks/results/in_graph_h200.md``): torch_native eagerly,
triton under capture, on a fake-installed triton; the report's score says which priority counted; capabilities
files carry the field."""

from __future__ import annotations

import pytest
import torch

from layerzero.backends.triton import norms as tn
from layerzero.backends.triton import swiglu as ts
from layerzero.core.capabilities import _PARSERS
from layerzero.core.context import SelectionContext
from layerzero.core.policy import Policy
from layerzero.core.selection import SelectionInputs, select
from layerzero.core.specs import KernelSpec
from layerzero.testing.devices import fake_cuda_device
from layerzero.testing.registries import routing_registry

pytestmark = pytest.mark.unit


def _registry(op: str, triton_spec: KernelSpec):
    return routing_registry(op, [triton_spec])


def _select(reg, ctx):
    return select(
        reg,
        ctx,
        SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False),
    )


@pytest.mark.parametrize(
    ("op", "spec", "fields"),
    [
        ("rms_norm", tn.kernel_spec(True, ""), {"hidden_size": 1024, "fused_residual": True}),
        ("swiglu", ts.kernel_spec(True, ""), {"hidden_size": 3072}),
    ],
)
def test_triton_wins_only_under_capture(op, spec, fields):
    reg = _registry(op, spec)
    h100 = fake_cuda_device((9, 0))
    eager = SelectionContext(op=op, device=h100, dtype=torch.bfloat16, **fields)
    captured = SelectionContext(op=op, device=h100, dtype=torch.bfloat16, graph_capture=True, **fields)
    plan, report = _select(reg, eager)
    assert plan.kernel_id == f"torch_native.{op}"
    assert report.candidate(spec.kernel_id).score.priority == spec.priority
    plan, report = _select(reg, captured)
    assert plan.kernel_id == spec.kernel_id
    assert report.candidate(spec.kernel_id).score.priority == spec.capture_priority
    assert report.candidate(f"torch_native.{op}").score.priority == 50  # no capture_priority: priority


def test_capture_priority_listed_and_parsed():
    spec = tn.kernel_spec(True, "")
    assert spec.constraints()["capture_priority"] == tn.CAPTURE_PRIORITY
    assert KernelSpec("x.y", "rms_norm", len).constraints()["capture_priority"] is None
    assert (
        _PARSERS["capture_priority"]("where", None) is None and _PARSERS["capture_priority"]("where", 7) == 7
    )
