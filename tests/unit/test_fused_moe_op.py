"""``lz.fused_moe``: the cache key and context, the registered kernels and routing on hand-built CUDA
contexts.

1. The key holds dtype, device, T bucketed, H, I, E, K exact and the flags; the fast and slow paths agree; the
   ids dtype stays out of it. (Bad inputs: tests/unit/test_bad_input_catalogue.py, section 6.)
2. Routing (no GPU): ``triton.fused_moe`` wins on an SM 8.0+ CUDA context over the reference; rejected with
   its codes on an old SM, float64, autograd, huge H/I; graph-safe (chosen under capture, the reference is
   not).
3. Autograd flows through the reference on CPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import layerzero as lz
from layerzero.backends.triton import moe as triton_moe
from layerzero.core.context import SelectionContext
from layerzero.core.device import DeviceSpec
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import SelectionInputs, select
from layerzero.core.specs import BackendSpec
from layerzero.ops import OPS
from layerzero.testing.devices import fake_cuda_device

pytestmark = pytest.mark.unit


def args(tokens=5, hidden=12, inter=7, experts=4, top_k=2, dtype=torch.float32, ids_dtype=torch.int64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g).to(dtype)
    w2 = torch.randn(experts, hidden, inter, generator=g).to(dtype)
    weights, ids = torch.topk(torch.rand(tokens, experts, generator=g), top_k)
    return x, w13, w2, weights, ids.to(ids_dtype)


# ----------------------------------------------------------------------------- 1. key and context


def test_key_and_context_fields():
    prepare, build = OPS["fused_moe"]
    a = args()
    key, canonical = prepare(*a)
    assert all(c is t for c, t in zip(canonical, a, strict=True))
    ctx = build(key)
    assert (
        ctx.op,
        ctx.dtype,
        ctx.batch,
        ctx.hidden_size,
        ctx.intermediate_size,
        ctx.num_experts,
        ctx.top_k,
    ) == ("fused_moe", torch.float32, 8, 12, 7, 4, 2)
    assert ctx.contiguous and not ctx.requires_grad and not ctx.graph_capture
    assert key == prepare(*args(tokens=7))[0]  # T bucketed: 5 and 7 share the bucket 8
    assert key == prepare(*args(ids_dtype=torch.int32))[0]  # every kernel takes both id dtypes
    for other in (
        args(tokens=9),
        args(hidden=13),
        args(inter=8),
        args(experts=5),
        args(top_k=3),
        args(dtype=torch.bfloat16),
    ):
        assert prepare(*other)[0] != key
    x, w13, w2, weights, ids = a
    assert (
        build(prepare(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)[0]).contiguous
        is False
    )
    assert build(prepare(*args(tokens=0))[0]).batch == 0


def test_fast_and_slow_paths_build_the_same_key(monkeypatch):
    mod = importlib.import_module("layerzero.ops.fused_moe")  # the module: lz.ops.fused_moe is the function

    a = args()
    fast = mod.prepare(*a)[0]
    monkeypatch.setattr(mod, "_fast_ok", lambda *_: False)
    assert mod.prepare(*a)[0] == fast


def test_requires_grad_is_in_the_key():
    prepare, build = OPS["fused_moe"]
    x, w13, w2, weights, ids = args()
    w13.requires_grad_(True)
    assert build(prepare(x, w13, w2, weights, ids)[0]).requires_grad
    with torch.no_grad():
        assert not build(prepare(x, w13, w2, weights, ids)[0]).requires_grad


def test_registered_kernels():
    assert {k["kernel_id"] for k in lz.list_kernels("fused_moe")} == {
        "reference.fused_moe",
        "triton.fused_moe",
    }


# --------------------------------------------------------------------------- 2. routing on fake CUDA contexts


def make_registry():
    RUNTIME.ensure_ready()
    reg = KernelRegistry()
    reg.add_op(RUNTIME.registry.ops.get("fused_moe"))
    reg.add_backend(RUNTIME.registry.backend("reference"))
    reg.add_kernel(RUNTIME.registry.kernels.get("reference.fused_moe"))
    reg.add_backend(BackendSpec("triton", "triton", "3.6", True))
    reg.add_kernel(triton_moe.kernel_spec(True, "test"))
    return reg


def ctx(sm=(9, 0), dtype=torch.bfloat16, **kw):
    fields = dict(batch=16, hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8) | kw
    return SelectionContext(op="fused_moe", device=fake_cuda_device(sm), dtype=dtype, **fields)


def run_select(reg, context):
    return select(
        reg,
        context,
        SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False),
    )


def codes(report, kernel_id):
    return {r.code for r in report.candidate(kernel_id).reasons}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_triton_wins_on_cuda(dtype):
    plan, report = run_select(make_registry(), ctx(dtype=dtype))
    assert plan.kernel_id == "triton.fused_moe"
    assert report.candidate("triton.fused_moe").score.total == triton_moe.PRIORITY


@pytest.mark.parametrize(
    ("kw", "code"),
    [
        ({"sm": (7, 5)}, R.SM_TOO_OLD),
        ({"dtype": torch.float64}, R.DTYPE_UNSUPPORTED),
        ({"requires_grad": True}, R.BACKWARD_UNSUPPORTED),
        ({"hidden_size": triton_moe.MAX_COLS + 1}, R.HIDDEN_SIZE_UNSUPPORTED),
        ({"intermediate_size": triton_moe.MAX_COLS + 1}, R.HIDDEN_SIZE_UNSUPPORTED),
    ],
)
def test_triton_rejections(kw, code):
    plan, report = run_select(make_registry(), ctx(**kw))
    assert plan.kernel_id == "reference.fused_moe"
    assert code in codes(report, "triton.fused_moe")


def test_graph_capture_takes_triton_and_cpu_never_does():
    reg = make_registry()
    assert run_select(reg, ctx(graph_capture=True))[0].kernel_id == "triton.fused_moe"
    cpu = SelectionContext(
        op="fused_moe",
        device=DeviceSpec.detect("cpu"),
        dtype=torch.float32,
        batch=4,
        hidden_size=8,
        intermediate_size=4,
        num_experts=2,
        top_k=1,
    )
    plan, report = run_select(reg, cpu)
    assert plan.kernel_id == "reference.fused_moe"
    assert codes(report, "triton.fused_moe") == {R.DEVICE_TYPE_UNSUPPORTED}


def test_policy_when_fields_know_the_moe_fields():
    from layerzero.core.policy_fields import FIELD_KINDS, FieldKind

    for name in ("intermediate_size", "num_experts", "top_k"):
        assert FIELD_KINDS[name] is FieldKind.INT
    assert ctx().fields()["num_experts"] == 128


# ----------------------------------------------------------------------------- 3. autograd


def test_autograd_through_the_reference():
    x, w13, w2, weights, ids = args(dtype=torch.float64)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    out = lz.fused_moe(x, w13, w2, weights.float(), ids)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and bool(x.grad.abs().sum() > 0)
    assert weights.grad is not None and weights.grad.shape == weights.shape
