"""Opt-in online autotune (``layerzero.tuning.autotune``) on CPU.

Oracles: the set of eligible kernels from ``lz.explain`` (a row per eligible kernel must be recorded); a
deliberately wrong kernel (2 x the right answer) and one that raises (neither may be recorded); the PerfDB
rows themselves for the pick that follows (the fastest recorded median wins); the unchunked reference kernel
for the chunked attention reference; generator states before the call.
"""

from __future__ import annotations

import logging

import pytest
import torch

import layerzero as lz
from layerzero.core import knobs
from layerzero.core.dispatch import device_fingerprint_parts
from layerzero.core.perfdb import fingerprint
from layerzero.core.report import CandidateStatus
from layerzero.core.runtime import RUNTIME
from layerzero.ops import OPS
from layerzero.tuning.autotune import KNOBS, autotune_context, reference_output

pytestmark = pytest.mark.unit


def _call(op, *args, **kwargs):
    key, canonical = OPS[op][0](*args, **kwargs)
    return OPS[op][1](key), canonical


def _rows(ctx):
    return RUNTIME.perfdb().for_bucket(
        ctx.op, ctx.bucket_key(), fingerprint(device_fingerprint_parts(ctx.device))
    )


def _eligible(op, *args, **kwargs):
    rep = lz.explain(op, *args, **kwargs)
    return {c.kernel_id for c in rep.candidates if c.status is not CandidateStatus.REJECTED}


@pytest.fixture
def custom():
    ids = []

    def register(kid, fn, **kw):
        lz.register_kernel("rms_norm", kid, fn, device_types={"cpu"}, dtypes={"float32"}, **kw)
        ids.append(kid)

    yield register
    for kid in ids:
        lz.unregister_kernel(kid)


def test_records_a_row_per_eligible_kernel_and_selection_uses_them():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 7, 64, generator=g), torch.randn(64, generator=g)
    x0 = x.clone()
    ctx, canonical = _call("rms_norm", x, w)
    autotune_context(RUNTIME, ctx, canonical)
    rows = _rows(ctx)
    assert set(rows) == _eligible("rms_norm", x, w) == {"torch_native.rms_norm", "reference.rms_norm"}
    assert all(r.samples >= 1 and r.median_us > 0 for r in rows.values())
    assert all(r.samples <= knobs.get(KNOBS).repeats for r in rows.values())
    assert torch.equal(x, x0)  # the caller's tensors are not changed
    # selection reads the rows: perf term = 1000 x fastest / this median for each kernel (no timing assertion:
    # the two medians can be close enough on a loaded CPU that priority, not speed, decides the pick)
    fastest = min(r.median_us for r in rows.values())
    plan, report = RUNTIME.select_context(ctx)
    for kid, row in rows.items():
        assert report.candidate(kid).score.perf == pytest.approx(1000.0 * fastest / row.median_us), kid
    best = max(rows, key=lambda k: report.candidate(k).score.total)
    assert plan.kernel_id == best


def test_wrong_and_raising_kernels_are_not_recorded(custom, caplog):
    def wrong(x, weight, eps, residual):
        return 2 * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def broken(x, weight, eps, residual):
        raise RuntimeError("boom")

    custom("test_autotune.wrong", wrong, priority=900)
    custom("test_autotune.broken", broken, priority=899)
    x, w = torch.randn(2, 32), torch.randn(32)
    assert {"test_autotune.wrong", "test_autotune.broken"} <= _eligible("rms_norm", x, w)
    ctx, canonical = _call("rms_norm", x, w)
    with caplog.at_level(logging.WARNING, logger="layerzero.autotune"):
        autotune_context(RUNTIME, ctx, canonical)  # never raises
    assert set(_rows(ctx)) == {"torch_native.rms_norm", "reference.rms_norm"}
    assert "test_autotune.wrong differs from the reference" in caplog.text
    assert "test_autotune.broken raised during the check (RuntimeError: boom)" in caplog.text
    # priorities would pick the wrong kernel (900); the fastest measured one now scores 1000 + its priority
    assert RUNTIME.select_context(ctx)[0].kernel_id in {"torch_native.rms_norm", "reference.rms_norm"}


def test_a_measured_bucket_is_not_measured_again(custom):
    calls = []

    def counting(x, weight, eps, residual):
        calls.append(1)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    custom("test_autotune.count", counting)
    x, w = torch.randn(2, 16), torch.randn(16)
    ctx, canonical = _call("rms_norm", x, w)
    autotune_context(RUNTIME, ctx, canonical)
    first = len(calls)
    kn = knobs.get(KNOBS)
    assert first >= 1 + kn.warmup + kn.iters and "test_autotune.count" in _rows(ctx)
    autotune_context(RUNTIME, ctx, canonical)
    assert len(calls) == first


def test_nothing_during_capture_or_without_a_perfdb():
    x, w = torch.randn(2, 16), torch.randn(16)
    ctx, canonical = _call("rms_norm", x, w)
    import dataclasses

    autotune_context(RUNTIME, dataclasses.replace(ctx, graph_capture=True), canonical)
    assert _rows(ctx) == {}
    lz.configure(use_perfdb=False)
    autotune_context(RUNTIME, ctx, canonical)  # no PerfDB: a no-op, no error
    lz.configure(use_perfdb=True)
    assert _rows(ctx) == {}


def test_generator_state_is_restored_and_sampling_kernels_checked_by_support():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 100, generator=g)
    gen = torch.Generator().manual_seed(123)
    state = gen.get_state()
    cpu_state = torch.random.get_rng_state()
    ctx, canonical = _call("sample_topk", logits, 5, temperature=0.7, generator=gen)
    autotune_context(RUNTIME, ctx, canonical)
    assert torch.equal(gen.get_state(), state) and torch.equal(torch.random.get_rng_state(), cpu_state)
    assert set(_rows(ctx)) == _eligible("sample_topk", logits, 5, temperature=0.7, generator=gen)


def test_chunked_attention_reference_equals_the_whole_one():
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(3, 8, 20, 16, generator=g),
        torch.randn(3, 2, 24, 16, generator=g),
        torch.randn(3, 2, 24, 16, generator=g),
    )
    for layout, args in (
        ("BHSD", (q, k, v)),
        ("BSHD", tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))),
    ):
        ctx, canonical = _call("attention", *args, is_causal=False, layout=layout)
        whole = reference_output(RUNTIME, ctx, canonical)
        per_head = 4 * 20 * 24 * 4  # one KV head's score bytes (group 4)
        chunked = reference_output(RUNTIME, ctx, canonical, max_bytes=per_head)  # 3 batches x 2 KV heads
        assert torch.equal(chunked, whole)
        torch.testing.assert_close(
            chunked if layout == "BHSD" else chunked.transpose(1, 2),
            torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            atol=1e-5,
            rtol=1e-5,
        )


def test_rounds_time_the_kernels_in_turn_and_keep_each_ones_better_round(custom, monkeypatch):
    """``measure_context(rounds=2)`` times every checked kernel once, then every one again (round-robin, not
    one kernel twice in a row), and keeps each kernel's round with the smaller median: a kernel that read slow
    in round 1 only (a first-use effect, a disturbed moment) is recorded at its round-2 time."""
    from layerzero.tuning import autotune as at

    custom(
        "test_autotune.a",
        lambda x, weight, eps, residual: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight,
    )
    custom(
        "test_autotune.b",
        lambda x, weight, eps, residual: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight,
    )
    order: list[str] = []
    fake = {
        ("test_autotune.a", 0): [50.0] * 3,
        ("test_autotune.a", 1): [10.0] * 3,
        ("test_autotune.b", 0): [20.0] * 3,
        ("test_autotune.b", 1): [30.0] * 3,
    }
    names = {}

    def fake_time(fn, args, device, **timing):
        kid = names[fn]
        rnd = sum(1 for k in order if k == kid)
        order.append(kid)
        return fake.get((kid, rnd), [40.0] * 3)

    real_bind = at.bind

    def spy_bind(registry, spec, ctx):
        bound = real_bind(registry, spec, ctx)
        names[bound[0]] = spec.kernel_id
        return bound

    monkeypatch.setattr(at, "time_kernel", fake_time)
    monkeypatch.setattr(at, "bind", spy_bind)
    x, w = torch.randn(3, 16), torch.randn(16)
    ctx, canonical = _call("rms_norm", x, w)
    results = at.measure_context(
        RUNTIME,
        ctx,
        canonical,
        warmup=1,
        iters=1,
        repeats=3,
        max_time_s=1.0,
        kernels=["test_autotune.a", "test_autotune.b"],
        rounds=2,
    )
    assert order == ["test_autotune.a", "test_autotune.b", "test_autotune.a", "test_autotune.b"]
    medians = {row.kernel_id: row.median_us for row, _ in results}
    assert medians == {"test_autotune.a": 10.0, "test_autotune.b": 20.0}
    assert knobs.get(KNOBS).rounds >= 2
