"""``lz.plan_block``: joint kernel choice over a block of op calls (norm -> attention -> norm), hand-worked
totals.

Custom kernels (priorities far above the built-ins, which use 0..96) make the layouts matter:

- ``blk.norm``: rms_norm, ``layouts={"BSHD"}``, priority 300 (consumes and produces BSHD);
- ``blk.attn_bhsd``: attention, ``layouts={"BHSD"}``, priority 301;
- ``blk.attn_bshd``: attention, ``layouts={"BSHD"}``, priority 300.

Attention is called with BHSD tensors, so standalone ``blk.attn_bhsd`` scores 301 and ``blk.attn_bshd`` 300 -
1 (the adapter's transform cost) = 299: the greedy pick is ``blk.attn_bhsd``. In the block, attention is fed
by the BSHD norm (its caller-layout transform no longer counts, transitions do, 1.0 each):

- greedy: norm 300 + (attn_bhsd 301 - 1 transition) + (norm 300 - 1 transition) = 899, 2 transforms;
- joint:  norm 300 + attn_bshd 300 + norm 300 = 900, 0 transforms.
"""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME

B, H, S, D = 1, 2, 5, 4
IDS = ("blk.norm", "blk.attn_bhsd", "blk.attn_bshd")


def _rms(x, weight, eps, residual=None):
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(x.dtype)


def _sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0):
    s = (q.double() @ k.double().transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, -1) @ v.double()).to(q.dtype)


@pytest.fixture
def kernels():
    lz.register_kernel("rms_norm", "blk.norm", _rms, priority=300, device_types={"cpu"}, layouts={"BSHD"})
    lz.register_kernel(
        "attention", "blk.attn_bhsd", _sdpa, priority=301, device_types={"cpu"}, layouts={"BHSD"}
    )

    def attn_bshd(q, k, v, attn_mask, is_causal, scale, dropout_p):
        t = lambda x: x.transpose(1, 2)  # noqa: E731 - BSHD in, BSHD out
        return t(_sdpa(t(q), t(k), t(v), attn_mask, is_causal, scale))

    lz.register_kernel(
        "attention", "blk.attn_bshd", attn_bshd, priority=300, device_types={"cpu"}, layouts={"BSHD"}
    )
    yield
    for kid in IDS:
        if kid in RUNTIME.registry.kernels:
            lz.unregister_kernel(kid)


def _block():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, H * D, generator=g, dtype=torch.float64)
    w = torch.rand(H * D, generator=g, dtype=torch.float64) + 0.5
    q, k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(3))
    return [
        ("rms_norm", (x, w), {}),
        ("attention", (q, k, v), {"is_causal": True}),
        lz.BlockOp("rms_norm", (x, w)),
    ]


def test_joint_differs_from_greedy_hand_worked(kernels):
    plan = lz.plan_block(_block())
    assert [s.standalone for s in plan.steps] == ["blk.norm", "blk.attn_bhsd", "blk.norm"]
    assert plan.kernels == ("blk.norm", "blk.attn_bshd", "blk.norm")
    assert plan.greedy_total == pytest.approx(899.0)
    assert plan.total == pytest.approx(900.0)
    assert (plan.greedy_transforms, plan.transforms, plan.transforms_saved) == (2, 0, 2)
    att = plan.steps[1]
    assert (att.producer, att.layout_in, att.layout_out, att.transition_cost, att.score) == (
        0,
        "BSHD",
        "BSHD",
        0,
        300,
    )
    assert [s.layout_out for s in plan.steps] == ["BSHD", "BSHD", "BSHD"]
    d = plan.to_dict()
    assert d["transforms_saved"] == 2 and d["steps"][1]["chosen"] == "blk.attn_bshd"
    assert d["steps"][1]["report"]["chosen"] == "blk.attn_bhsd"


def test_explanation_names_choice_and_transitions(kernels):
    text = str(lz.plan_block(_block()))
    assert "score 900.0 (standalone picks: 899.0)" in text
    assert "transforms 0 (standalone picks: 2, saved 2)" in text
    assert "joint choice differs" in text
    assert "saves the 1.0 transition the standalone pick pays" in text
    assert "transition cost" in text.splitlines()[2]


def test_transition_costs_in_explanation_when_unavoidable(kernels):
    """A preference makes the BHSD attention win jointly too: both of its edges pay a transition."""
    with lz.prefer("blk.attn_bhsd"):  # boost 1000: the BHSD kernel wins jointly too
        plan = lz.plan_block(_block())
    assert plan.kernels == ("blk.norm", "blk.attn_bhsd", "blk.norm")
    assert plan.total == plan.greedy_total == pytest.approx(300 + (1301 - 1) + (300 - 1))
    assert [s.transition_cost for s in plan.steps] == [0.0, 1.0, 1.0]
    text = str(plan)
    assert "joint choice equals the standalone picks" in text
    assert (
        "transition 1.0 from op 0's output layout" in text
        and "transition 1.0 from op 1's output layout" in text
    )


def test_joint_equals_greedy_with_builtins_only():
    plan = lz.plan_block(_block())
    assert plan.kernels == tuple(s.standalone for s in plan.steps)
    assert plan.total == plan.greedy_total and plan.transforms_saved == 0
    assert plan.steps[0].standalone == lz.which("rms_norm", *_block()[0][1])


def test_apply_runs_chosen_kernels_and_matches_float64_reference(kernels):
    calls = _block()
    plan = lz.plan_block(calls)
    (x, w), (q, k, v) = calls[0][1], calls[1][1]
    with plan.apply(), lz.trace() as t:
        y = lz.rms_norm(x, w)
        o = lz.attention(q, k, v, is_causal=True)
        z = lz.rms_norm(x, w)
    assert t.counts[("attention", "blk.attn_bshd")] == 1 and t.counts[("rms_norm", "blk.norm")] == 2
    assert ("attention", "blk.attn_bhsd") not in t.counts
    torch.testing.assert_close(o, _sdpa(q, k, v, is_causal=True), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, _rms(x, w, 1e-6), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, y)
    with lz.trace() as t:  # outside the block: standalone choice again
        lz.attention(q, k, v, is_causal=True)
    assert t.kernels_for("attention") == ["blk.attn_bhsd"]


def test_independent_ops_are_standalone(kernels):
    plan = lz.plan_block(_block(), feeds={})
    assert plan.kernels == ("blk.norm", "blk.attn_bhsd", "blk.norm")
    assert plan.total == pytest.approx(300 + 301 + 300)
    assert all(s.producer is None for s in plan.steps)


def test_bad_inputs_raise_typed_errors(kernels):
    calls = _block()
    with pytest.raises(lz.InvalidInputError, match="at least one op call"):
        lz.plan_block([])
    with pytest.raises(lz.InvalidInputError, match=r"ops\)\[1\]: expected \(op, args, kwargs\)"):
        lz.plan_block([calls[0], "attention"])
    with pytest.raises(lz.UnknownOperationError, match="Did you mean 'rms_norm'"):
        lz.plan_block([("rms_nrom", calls[0][1], {})])
    with pytest.raises(lz.InvalidInputError, match=r"producer index in 0\.\.2, got 7"):
        lz.plan_block(calls, feeds={1: 7})
    with pytest.raises(lz.InvalidInputError, match="a producer before op 1"):
        lz.plan_block(calls, feeds={1: 2})
    with pytest.raises(lz.InvalidInputError, match="op 0 also feeds op 1"):
        lz.plan_block(calls, feeds={1: 0, 2: 0})
    with pytest.raises(lz.InvalidInputError):  # the op's own argument checks
        lz.plan_block([("attention", (calls[1][1][0],), {})])


def test_op_without_eligible_kernel_raises_no_kernel_found(kernels):
    calls = _block()
    q = calls[1][1][0]
    lz.register_kernel("attention", "blk.nocausal", _sdpa, device_types={"cpu"}, supports_causal=False)
    try:
        lz.lock("attention", "blk.nocausal")
        with pytest.raises(
            lz.NoKernelFoundError, match=r"op 1 \('attention'\) has no eligible kernel"
        ) as exc:
            lz.plan_block([calls[0], ("attention", (q, q, q), {"is_causal": True})])
        assert exc.value.report is not None and exc.value.report.chosen is None
    finally:
        lz.unlock("attention")
        lz.unregister_kernel("blk.nocausal")
