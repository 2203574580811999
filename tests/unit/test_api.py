"""The public API (``lz.*``): locks (code, YAML, env), preferences, strict mode, ``lz.disabled``, per-thread
scoping, select / which / validate / list_kernels / trace and the export list.

Hand-worked expectations on CPU: plain float32 attention runs ``torch_sdpa.flash``; ``torch_sdpa.cudnn``
cannot run on CPU (DEVICE_TYPE_UNSUPPORTED, DTYPE_UNSUPPORTED, LAYOUT_UNSUPPORTED).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import layerzero as lz
from layerzero.core.reasons import ReasonCode as R

pytestmark = pytest.mark.unit


def _qkv(s: int = 4):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, s, 8, generator=g) for _ in range(3))


def _all_ops_args():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 8, generator=g), torch.ones(8), torch.zeros(8)
    q = torch.randn(1, 2, 4, 8, generator=g)
    return {
        "attention": ((q, q, q), {}),
        "rms_norm": ((x, w), {}),
        "layer_norm": ((x, w, b), {}),
        "rope": ((q, q, torch.ones(4, 8), torch.zeros(4, 8)), {}),
        "sample_topk": ((x, 2), {}),
        "sample_topp": ((x, 0.5), {}),
        "sample": ((x,), {"temperature": torch.ones(2), "top_k": torch.tensor([2, 0])}),
        "apply_penalties": (
            (x, torch.tensor([[1, 8], [8, 8]]), torch.tensor([[3], [4]])),
            {"repetition_penalty": torch.ones(2)},
        ),
        "fused_moe": (
            (
                x,
                torch.randn(3, 6, 8, generator=g),
                torch.randn(3, 8, 3, generator=g),
                torch.ones(2, 2),
                torch.tensor([[0, 2], [1, 2]]),
            ),
            {},
        ),
    }


# ------------------------------------------------------------------------------------------ locks
def test_lock_forces_kernel_and_unlock_restores():
    q, k, v = _qkv()
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    lz.lock("attention", "torch_sdpa.math")
    assert lz.get_locks() == {"attention": "torch_sdpa.math"}
    assert lz.which("attention", q, k, v) == "torch_sdpa.math"
    plan = lz.select("attention", q, k, v)
    assert plan.locked and plan.fallbacks == ()
    rep = lz.explain("attention", q, k, v)
    assert rep.locked == "torch_sdpa.math"
    assert [r.code for r in rep.candidate("torch_sdpa.flash").reasons] == [R.POLICY_LOCKED_OTHER]
    with lz.trace() as t:
        lz.attention(q, k, v)
    assert t.kernels_for("attention") == ["torch_sdpa.math"]
    lz.unlock("attention")
    assert lz.get_locks() == {}
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    lz.unlock("attention")  # no lock: a no-op


def test_lock_to_kernel_that_cannot_run_raises_with_reasons():
    q, k, v = _qkv()
    lz.lock("attention", "torch_sdpa.cudnn")
    with pytest.raises(lz.NoKernelFoundError, match="DEVICE_TYPE_UNSUPPORTED") as info:
        lz.attention(q, k, v)
    assert isinstance(info.value, RuntimeError)
    assert "torch_sdpa.cudnn" in str(info.value) and "lz.unlock('attention')" in str(info.value)
    assert info.value.report is not None and info.value.report.chosen is None
    with pytest.raises(lz.NoKernelFoundError, match="DEVICE_TYPE_UNSUPPORTED"):
        lz.which("attention", q, k, v)
    rep = lz.explain("attention", q, k, v)  # explain never raises for a lock
    assert rep.chosen is None and rep.locked == "torch_sdpa.cudnn"
    lz.unlock("attention")
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"


@pytest.mark.parametrize(
    ("op", "kernel", "error", "match"),
    [
        ("attention", "nope.kernel", lz.UnknownKernelError, r"unknown kernel 'nope\.kernel'"),
        (
            "attention",
            "torch_native.rms_norm",
            lz.UnknownKernelError,
            r"implements op 'rms_norm', not 'attention'",
        ),
        ("attentoin", "torch_sdpa.math", lz.UnknownOperationError, r"unknown op 'attentoin'"),
    ],
)
def test_lock_rejects_unknown_ids(op, kernel, error, match):
    with pytest.raises(error, match=match):
        lz.lock(op, kernel)
    assert lz.get_locks() == {}


def test_unlock_unknown_op_raises():
    with pytest.raises(lz.UnknownOperationError, match="Known ops"):
        lz.unlock("nope")


def test_policy_yaml_lock_via_load_config(tmp_path):
    q, k, v = _qkv()
    path = tmp_path / "lock.yaml"
    path.write_text("version: 1\nlocks:\n  - op: attention\n    kernel: torch_sdpa.math\n", encoding="utf-8")
    lz.load_config(path)
    assert lz.which("attention", q, k, v) == "torch_sdpa.math"
    assert lz.explain("attention", q, k, v).locked == "torch_sdpa.math"
    assert lz.get_locks() == {}  # file locks live in the policy, not in lz.lock's table


def test_env_lock_applies_after_reload(monkeypatch):
    q, k, v = _qkv()
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    monkeypatch.setenv("LAYERZERO_LOCK", "attention=torch_sdpa.math")
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"  # env is read once, until reload
    lz.reload()
    assert lz.which("attention", q, k, v) == "torch_sdpa.math"
    monkeypatch.delenv("LAYERZERO_LOCK")
    lz.reload()
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"


def test_env_lock_that_cannot_run_raises(monkeypatch):
    monkeypatch.setenv("LAYERZERO_LOCK", "attention=torch_sdpa.efficient")
    lz.reload()
    with pytest.raises(lz.NoKernelFoundError, match="DEVICE_TYPE_UNSUPPORTED"):
        lz.attention(*_qkv())


# ------------------------------------------------------------------------------------------ prefer
def test_prefer_boosts_a_kernel_inside_the_block_only():
    q, k, v = _qkv()
    with lz.prefer("torch_sdpa.math"):
        assert lz.which("attention", q, k, v) == "torch_sdpa.math"
        rep = lz.explain("attention", q, k, v)
        assert rep.candidate("torch_sdpa.math").score.boost == 1000.0
        assert not rep.fell_back
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"


def test_prefer_backend_id_and_custom_weight():
    q, k, v = _qkv()
    with lz.prefer("reference"):
        assert lz.which("attention", q, k, v) == "reference.attention"
    with lz.prefer("reference", by=50.0):  # 0 + 50 < 80: not enough to beat flash
        assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    with lz.prefer("reference", by=100.0):
        assert lz.which("attention", q, k, v) == "reference.attention"


def test_prefer_kernel_that_cannot_run_falls_back_with_warning(caplog):
    q, k, v = _qkv()
    with lz.prefer("torch_sdpa.cudnn"):
        rep = lz.explain("attention", q, k, v)
        assert rep.chosen == "torch_sdpa.flash"
        assert rep.fell_back
        assert any("torch_sdpa.cudnn" in n and "DEVICE_TYPE_UNSUPPORTED" in n for n in rep.notes)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="layerzero"):
            out = lz.attention(q, k, v)
    assert out.shape == q.shape
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("preferred torch_sdpa.cudnn cannot run" in m for m in msgs)


def test_prefer_kernel_that_cannot_run_raises_in_strict_mode():
    q, k, v = _qkv()
    lz.configure(strict=True)
    with lz.prefer("torch_sdpa.cudnn"):
        with pytest.raises(lz.NoKernelFoundError, match="strict mode") as info:
            lz.attention(q, k, v)
        assert "torch_sdpa.cudnn" in str(info.value)
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"  # no preference: nothing to fall back from


def test_strict_mode_raises_when_reference_stands_in():
    q, k, v = _qkv()
    mask = torch.ones(4, 4, dtype=torch.bool)
    lz.configure(strict=True)
    with pytest.raises(lz.NoKernelFoundError, match="MASK_WITH_CAUSAL"):
        lz.attention(q, k, v, attn_mask=mask, is_causal=True)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (("nope.zzz",), r"'nope\.zzz' matches no kernel or backend id"),
        (("torch_sdpa.math", "torch_sdpa.nothing*"), r"torch_sdpa\.nothing\*"),
    ],
)
def test_prefer_unknown_id_raises(ids, match):
    with pytest.raises(lz.UnknownKernelError, match=match):
        with lz.prefer(*ids):
            pass


def test_prefer_needs_an_id():
    with pytest.raises(lz.ConfigurationError, match="at least one"):
        with lz.prefer():
            pass


def test_prefer_glob():
    with lz.prefer("torch_sdpa.ma*"):
        assert lz.which("attention", *_qkv()) == "torch_sdpa.math"


# ------------------------------------------------------------------------------------------ disabled
def test_disabled_runs_reference_kernels_for_every_op():
    cases = _all_ops_args()
    with lz.disabled():
        with lz.trace() as t:
            for op, (args, kwargs) in cases.items():
                getattr(lz, op)(*args, **kwargs)
                assert lz.which(op, *args, **kwargs) == f"reference.{op}"
    assert dict(t.counts) == {(op, f"reference.{op}"): 1 for op in cases}
    assert lz.which("attention", *cases["attention"][0]) == "torch_sdpa.flash"


def test_disabled_beats_a_prefer_inside_it():
    with lz.prefer("torch_sdpa.math"), lz.disabled():
        assert lz.which("attention", *_qkv()) == "reference.attention"


def test_scope_is_per_thread():
    q, k, v = _qkv()
    seen: dict[str, str] = {}

    def worker():
        seen["thread"] = lz.which("attention", q, k, v)

    with lz.prefer("torch_sdpa.math"):
        th = threading.Thread(target=worker)
        th.start()
        th.join()
        seen["main"] = lz.which("attention", q, k, v)
    assert seen == {"thread": "torch_sdpa.flash", "main": "torch_sdpa.math"}


def test_disabled_scope_is_per_thread():
    q, k, v = _qkv()
    seen = []
    with lz.disabled():
        th = threading.Thread(target=lambda: seen.append(lz.which("attention", q, k, v)))
        th.start()
        th.join()
    assert seen == ["torch_sdpa.flash"]


# ------------------------------------------------------------------------------------------ inspection
def test_validate_lists_reasons_and_empty_when_it_can_run():
    q, k, v = _qkv()
    assert lz.validate("torch_sdpa.flash", "attention", q, k, v) == []
    reasons = lz.validate("torch_sdpa.cudnn", "attention", q, k, v)
    assert {r.code for r in reasons} == {R.DEVICE_TYPE_UNSUPPORTED, R.DTYPE_UNSUPPORTED}
    assert [r.code for r in lz.validate("torch_sdpa.flash", "attention", q, k, v, dropout_p=0.5)] == [
        R.DROPOUT_UNSUPPORTED
    ]


def test_validate_includes_policy_reasons(tmp_path):
    path = tmp_path / "deny.yaml"
    path.write_text(
        "version: 1\ndeny:\n  - op: attention\n    kernels: [torch_sdpa.flash]\n", encoding="utf-8"
    )
    lz.load_config(path)
    assert [r.code for r in lz.validate("torch_sdpa.flash", "attention", *_qkv())] == [R.POLICY_DENIED]


def test_validate_unknown_or_foreign_kernel_raises():
    with pytest.raises(lz.UnknownKernelError, match="unknown kernel"):
        lz.validate("torch_sdpa.nope", "attention", *_qkv())
    with pytest.raises(lz.UnknownKernelError, match="implements op 'attention', not 'rms_norm'"):
        lz.validate("torch_sdpa.math", "rms_norm", torch.ones(2, 8), torch.ones(8))


def test_list_kernels_shape():
    all_kernels = lz.list_kernels()
    ids = {d["kernel_id"] for d in all_kernels}
    assert {
        "reference.attention",
        "torch_sdpa.flash",
        "torch_native.rms_norm",
        "reference.sample_topp",
    } <= ids
    for op in _all_ops_args():
        assert f"reference.{op}" in {d["kernel_id"] for d in lz.list_kernels(op)}
        assert all(d["op"] == op for d in lz.list_kernels(op))
    flash = next(d for d in all_kernels if d["kernel_id"] == "torch_sdpa.flash")
    assert flash["priority"] == 80 and flash["available"] is True and flash["backend"] == "torch_sdpa"
    assert flash["dtypes"] == ["bfloat16", "float16", "float32", "float64"]


def test_select_returns_a_callable_plan():
    q, k, v = _qkv()
    plan = lz.select("attention", q, k, v)
    assert isinstance(plan, lz.ExecutionPlan) and plan.kernel_id == "torch_sdpa.flash"
    assert plan.backend == "torch_sdpa"
    assert [p.kernel_id for p in plan.fallbacks] == [
        "torch_sdpa.math",
        "reference.attention",
        "flex_attention.attention",
    ]
    out = plan(q, k, v, None, False, None, 0.0)
    torch.testing.assert_close(out, lz.attention(q, k, v))


def test_explain_unknown_op_raises():
    with pytest.raises(lz.UnknownOperationError, match=r"unknown op 'atention'.*Known ops"):
        lz.explain("atention", *_qkv())


def test_trace_is_per_block_and_counts_calls():
    q, k, v = _qkv()
    with lz.trace() as outer:
        lz.attention(q, k, v)
        with lz.trace() as inner:
            lz.attention(q, k, v)
            lz.attention(q, k, v, dropout_p=0.1)
    assert dict(inner.counts) == {("attention", "torch_sdpa.flash"): 1, ("attention", "torch_sdpa.math"): 1}
    assert dict(outer.counts) == {("attention", "torch_sdpa.flash"): 1}
    assert inner.fallbacks == [] and outer.fallbacks == []


def test_public_exports():
    for name in lz.__all__:
        assert hasattr(lz, name), name
    for name in (
        "attention",
        "rms_norm",
        "layer_norm",
        "rope",
        "sample_topk",
        "sample_topp",
        "sample",
        "apply_penalties",
        "swiglu",
        "fused_moe",
        "lock",
        "unlock",
        "prefer",
        "disabled",
        "explain",
        "which",
        "validate",
        "select",
        "configure",
        "load_config",
    ):
        assert name in lz.__all__
    for err in (lz.InvalidInputError, lz.NoKernelFoundError, lz.ConfigurationError, lz.KernelExecutionError):
        assert issubclass(err, lz.LayerZeroError)
        assert issubclass(err, (ValueError, RuntimeError))
