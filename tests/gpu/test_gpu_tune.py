"""lz.tune on CUDA: a bf16 attention shape is checked against the reference, timed with CUDA events and
recorded; selection then follows the PerfDB. Skipped without a CUDA GPU (``pytest -m gpu tests/gpu``).

Oracles: ``lz.validate`` for the eligible set, the PerfDB read back directly, the scoring rule recomputed
from the stored medians, and a host clock that must not be used on the CUDA path.
"""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.dispatch import device_fingerprint_parts
from layerzero.core.perfdb import fingerprint
from layerzero.core.runtime import RUNTIME
from layerzero.tuning import TuneStatus, harness, make_inputs

pytestmark = pytest.mark.gpu

SHAPE = {
    "batch": 2,
    "heads": 16,
    "kv_heads": 4,
    "seq": 512,
    "head_dim": 128,
    "causal": True,
    "dtype": "bfloat16",
    "device": "cuda",
}


def test_tune_bf16_attention_with_cuda_events(monkeypatch):
    def no_host_clock():
        raise AssertionError("the CUDA path must time with torch.cuda.Event, not perf_counter_ns")

    monkeypatch.setattr(harness.time, "perf_counter_ns", no_host_clock)
    report = lz.tune("attention", [SHAPE], warmup=3, iters=3, repeats=10, progress=False)
    args, kwargs = make_inputs("attention", **SHAPE)
    kernels = [k["kernel_id"] for k in lz.list_kernels("attention")]
    eligible = {kid for kid in kernels if lz.validate(kid, "attention", *args, **kwargs) == []}
    assert {"torch_sdpa.flash", "torch_sdpa.math", "reference.attention"} <= eligible
    ok = {r.kernel_id for r in report.rows if r.status is TuneStatus.OK}
    assert ok == eligible, [(r.kernel_id, r.status, r.detail) for r in report.rows]
    ctx = lz.explain("attention", *args, **kwargs).context
    rows = RUNTIME.perfdb().for_bucket(
        "attention", ctx.bucket_key(), fingerprint(device_fingerprint_parts(ctx.device))
    )
    assert set(rows) == eligible
    for kid in eligible:
        row = report.row(0, kid)
        assert 0.5 < row.median_us < 1e6 and row.p95_us >= row.median_us and row.recorded
        assert rows[kid].median_us == pytest.approx(row.median_us)
    # a fused kernel beats the float32 reference on this shape by a wide margin
    assert report.row(0, "torch_sdpa.flash").median_us < report.row(0, "reference.attention").median_us
    weight = lz.get_config().perf_weight
    prio = {k["kernel_id"]: k["priority"] for k in lz.list_kernels("attention")}
    fastest = min(r.median_us for r in rows.values())
    expect = max(eligible, key=lambda kid: prio[kid] + weight * fastest / rows[kid].median_us)
    expl = lz.explain("attention", *args, **kwargs)
    assert expl.chosen == expect == lz.which("attention", *args, **kwargs)
    assert all(expl.candidate(kid).score.perf > 0 for kid in eligible)


def test_tune_refuses_inside_cuda_graph_capture():
    x = torch.zeros(8, device="cuda")
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), pytest.raises(lz.CudaGraphUnsafeError, match="CUDA graph"):  # noqa: SIM117
        with torch.cuda.graph(g, stream=stream):
            x.add_(1)
            lz.tune("attention", [SHAPE], progress=False)
    torch.cuda.synchronize()
