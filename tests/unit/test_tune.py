"""lz.tune / ``layerzero tune``: every eligible kernel is checked against the reference, timed and recorded in
the PerfDB; selection then follows the measurements. Oracles: hand-worked statistics and a brute-force
nearest-rank / MAD implementation, ``lz.validate`` for eligibility, the PerfDB read back directly, and the
scoring rule recomputed from the stored medians.

The PerfDB is a per-test file (tests/conftest.py sets ``LAYERZERO_PERFDB``).
"""

from __future__ import annotations

import json
import logging
import math
import sys

import numpy as np
import pytest
import torch

import layerzero as lz
from layerzero.cli import main as cli_main
from layerzero.core.dispatch import device_fingerprint_parts
from layerzero.core.perfdb import fingerprint
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import BackendSpec, KernelSpec
from layerzero.tuning import TuneStatus, compare, harness, make_inputs, sample_stats

pytestmark = pytest.mark.unit

FAST = {"warmup": 1, "iters": 1, "repeats": 3, "progress": False}
SHAPES = [
    {"batch": 1, "heads": 4, "kv_heads": 2, "seq": 16, "head_dim": 8, "causal": True},
    {"batch": 2, "heads": 2, "seq": 32, "head_dim": 16},
]


# ----------------------------------------------------------------------------------------- statistics
def _nearest_rank(sorted_x: list[float], q: float) -> float:
    return sorted_x[max(1, math.ceil(q * len(sorted_x))) - 1]


def _oracle_stats(x: list[float]) -> tuple[float, float, float, int]:
    s = sorted(x)
    n = len(s)
    med = (s[(n - 1) // 2] + s[n // 2]) / 2
    dev = sorted(abs(v - med) for v in x)
    mad = (dev[(n - 1) // 2] + dev[n // 2]) / 2
    kept = sorted(v for v in x if mad == 0 or v <= med + 5 * mad)
    m = len(kept)
    return (
        (kept[(m - 1) // 2] + kept[m // 2]) / 2,
        _nearest_rank(kept, 0.95),
        _nearest_rank(kept, 0.99),
        n - m,
    )


def test_sample_stats_hand_worked():
    # median 12, |x - 12| = 2,1,0,1,988 -> MAD 1, limit 17: 1000 dropped; kept 10..13 -> median 11.5, p95 =
    # 4th
    st = sample_stats([10.0, 11.0, 12.0, 13.0, 1000.0])
    assert (st.median_us, st.p95_us, st.p99_us, st.outliers, st.kept) == (
        11.5,
        13.0,
        13.0,
        1,
        (10, 11, 12, 13),
    )


def test_sample_stats_zero_mad_keeps_the_tail():
    st = sample_stats([5.0, 5.0, 5.0, 5.0, 9.0])
    assert (st.median_us, st.p95_us, st.outliers) == (5.0, 9.0, 0)


@pytest.mark.parametrize("seed", range(6))
def test_sample_stats_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    x = list(rng.lognormal(3.0, 0.2, size=int(rng.integers(5, 200))))
    x[: int(rng.integers(0, 4))] = [float(v) for v in rng.uniform(500, 5000, size=3)][: len(x)]
    st = sample_stats(x)
    med, p95, p99, out = _oracle_stats(x)
    assert (st.median_us, st.p95_us, st.p99_us, st.outliers) == pytest.approx((med, p95, p99, out))
    assert len(st.kept) + st.outliers == len(x)


@pytest.mark.parametrize(
    ("samples", "mads", "match"),
    [
        ([], 5.0, "non-empty"),
        ([1.0, float("nan")], 5.0, "finite"),
        ([-1.0], 5.0, "finite timings >= 0"),
        ([1.0], 0.0, "finite number > 0"),
        ("abc", 5.0, "sequence of numbers"),
    ],
)
def test_sample_stats_rejects_bad_samples(samples, mads, match):
    with pytest.raises(lz.InvalidInputError, match=match):
        sample_stats(samples, mads=mads)


# ----------------------------------------------------------------------------------------- output check
def test_compare_tolerances_and_mismatches():
    ref = torch.tensor([1.0, -2.0, 0.0])
    assert compare(ref.clone(), ref)[0]
    ok, err, _ = compare(ref + torch.tensor([0.0, 2.7e-4, 5e-5]), ref)  # 2.7e-4 / (1 + 2) = 0.9e-4 <= 1e-4
    assert ok and err == pytest.approx(0.9e-4, rel=1e-3)
    ok, err, why = compare(ref + torch.tensor([0.0, 0.0, 2e-4]), ref)
    assert not ok and err == pytest.approx(2e-4, rel=1e-3) and "float32 tolerance" in why
    assert compare(ref.bfloat16() + 0.01, ref.bfloat16())[0]  # bf16: 2e-2
    assert not compare(ref[:2], ref)[0]
    assert not compare(ref.double(), ref)[0]
    assert not compare(torch.tensor([1, 2]), torch.tensor([1, 3]))[0]
    assert compare((torch.tensor([1, 2]), ref), (torch.tensor([1, 2]), ref))[0]
    assert not compare(torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]))[0]
    assert compare(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))[0]


# ----------------------------------------------------------------------------------------- make_inputs
def test_make_inputs_shapes_by_hand():
    (q, k, v), kw = make_inputs(
        "attention",
        batch=2,
        heads=6,
        kv_heads=3,
        seq=5,
        kv_seq=7,
        head_dim=4,
        layout="BSHD",
        dtype="bfloat16",
        mask="bool",
    )
    assert (q.shape, k.shape, v.shape, q.dtype) == ((2, 5, 6, 4), (2, 7, 3, 4), (2, 7, 3, 4), torch.bfloat16)
    assert kw["attn_mask"].shape == (2, 1, 5, 7) and kw["layout"] == "BSHD"
    (x, w, eps), kw = make_inputs("rms_norm", batch=3, seq=2, hidden=16, residual=True)
    assert (x.shape, w.shape, eps, kw["residual"].shape) == ((3, 2, 16), (16,), 1e-6, (3, 2, 16))
    a1, _ = make_inputs("layer_norm", hidden=8, seed=3)
    a2, _ = make_inputs("layer_norm", hidden=8, seed=3)
    assert torch.equal(a1[0], a2[0]) and a1[2].shape == (8,)
    (logits,), kw = make_inputs("sample_greedy", batch=3, vocab=17, dtype="bfloat16")
    assert (logits.shape, logits.dtype, kw) == ((3, 17), torch.bfloat16, {})


@pytest.mark.parametrize(
    ("op", "shape", "error", "match"),
    [
        ("attention", {"seqq": 4}, lz.InvalidInputError, "Did you mean 'seq'"),
        ("attention", {"seq": 0}, lz.InvalidInputError, "an int > 0"),
        ("attention", {"dtype": "int8"}, lz.InvalidInputError, "dtype"),
        ("attention", {"mask": "causal"}, lz.InvalidInputError, "'none', 'bool' or 'float'"),
        ("paged", {}, lz.UnknownOperationError, "unknown op"),
    ],
)
def test_make_inputs_rejects_bad_shapes(op, shape, error, match):
    with pytest.raises(error, match=match):
        make_inputs(op, **shape)


# ----------------------------------------------------------------------------------------- lz.tune
def _db_rows(args, kwargs):
    """The PerfDB rows of the bucket ``lz.attention(*args, **kwargs)`` selects on (read back
    independently)."""
    ctx = lz.explain("attention", *args, **kwargs).context
    db = RUNTIME.perfdb()
    return db.for_bucket("attention", ctx.bucket_key(), fingerprint(device_fingerprint_parts(ctx.device)))


def test_tune_records_every_eligible_kernel_and_selection_follows():
    report = lz.tune("attention", SHAPES, **FAST)
    assert isinstance(report, lz.TuneReport) and len(report.cases) == 2
    weight = lz.get_config().perf_weight
    for i, shape in enumerate(SHAPES):
        args, kwargs = make_inputs("attention", **shape)
        eligible = {
            k["kernel_id"]
            for k in lz.list_kernels("attention")
            if lz.validate(k["kernel_id"], "attention", *args, **kwargs) == []
        }
        assert {"reference.attention", "torch_sdpa.math"} <= eligible
        rows = _db_rows(args, kwargs)
        assert set(rows) == eligible
        for kid in eligible:
            row = report.row(i, kid)
            assert row.status is TuneStatus.OK and row.recorded and row.samples + row.outliers == 3
            assert rows[kid].median_us == pytest.approx(row.median_us) and rows[kid].samples == row.samples
        for row in report.for_case(i):
            assert (row.status is TuneStatus.OK) == (row.kernel_id in eligible)
        fastest = min(r.median_us for r in rows.values())
        assert report.best()[i].median_us == fastest
        # the scoring rule recomputed from the stored medians decides the selection
        expl = lz.explain("attention", *args, **kwargs)
        expect = max(
            eligible,
            key=lambda kid: (
                lz.list_kernels("attention")[
                    [k["kernel_id"] for k in lz.list_kernels("attention")].index(kid)
                ]["priority"]
                + weight * fastest / rows[kid].median_us
            ),
        )
        assert expl.chosen == expect == lz.which("attention", *args, **kwargs)
        assert all(expl.candidate(k).score.perf > 0 for k in eligible)
    d = report.to_dict()
    assert json.loads(report.to_json()) == d and d["cases"][0]["best"] == report.best()[0].kernel_id
    text = str(report)
    assert "torch_sdpa.math" in text and "median µs" in text and "ineligible" in text


def test_tune_invalidates_the_selection_cache():
    args, kwargs = make_inputs("attention", **SHAPES[1])
    first = lz.which("attention", *args, **kwargs)
    assert first == "torch_sdpa.flash"  # priority 80, nothing measured yet
    ctx = lz.explain("attention", *args, **kwargs).context
    fp = fingerprint(device_fingerprint_parts(ctx.device))
    RUNTIME.perfdb().record("torch_sdpa.math", "attention", ctx.bucket_key(), fp, [0.001])  # no notification
    assert lz.which("attention", *args, **kwargs) == first  # the cached plan is still served
    lz.tune("attention", [(args, kwargs)], kernels=["torch_sdpa.flash"], **FAST)
    assert lz.which("attention", *args, **kwargs) == "torch_sdpa.math"
    expl = lz.explain("attention", *args, **kwargs)
    flash_median = _db_rows(args, kwargs)["torch_sdpa.flash"].median_us
    weight = lz.get_config().perf_weight
    assert expl.candidate("torch_sdpa.math").score.perf == pytest.approx(weight)
    assert expl.candidate("torch_sdpa.flash").score.perf == pytest.approx(weight * 0.001 / flash_median)


WRONG = "lzwrong"


@pytest.fixture
def wrong_kernels():
    """``lzwrong.offset`` (attention + 0.5) and ``lzwrong.raises``; removed afterwards."""
    RUNTIME.ensure_ready()

    def offset(q, k, v, attn_mask, is_causal, scale, dropout_p):
        return (
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
            + 0.5
        )

    def raises(*args):
        raise RuntimeError("simulated crash")

    RUNTIME.registry.add_backend(
        BackendSpec(WRONG, None, "0.0", True, description="test backend"), replace=True
    )
    for name, fn in (("offset", offset), ("raises", raises)):
        RUNTIME.registry.add_kernel(
            KernelSpec(f"{WRONG}.{name}", "attention", fn, priority=1, device_types=frozenset({"cpu"}))
        )
    yield
    for name in ("offset", "raises"):
        if f"{WRONG}.{name}" in RUNTIME.registry.kernels:
            RUNTIME.registry.remove_kernel(f"{WRONG}.{name}")
    if WRONG in RUNTIME.registry.backends:
        RUNTIME.registry.backends.remove(WRONG)
    RUNTIME.health.reset()


def test_wrong_kernel_fails_the_check_and_is_not_recorded(wrong_kernels, caplog):
    args, kwargs = make_inputs("attention", **SHAPES[0])
    with caplog.at_level(logging.WARNING, logger="layerzero.tuning"):
        report = lz.tune("attention", [(args, kwargs)], **FAST)
    bad = report.row(0, f"{WRONG}.offset")
    assert bad.status is TuneStatus.FAILED_CHECK and not bad.recorded and bad.median_us is None
    assert bad.max_error > 0.1 and "tolerance" in bad.detail
    crash = report.row(0, f"{WRONG}.raises")
    assert crash.status is TuneStatus.ERROR and "simulated crash" in crash.detail
    rows = _db_rows(args, kwargs)
    assert f"{WRONG}.offset" not in rows and f"{WRONG}.raises" not in rows and "torch_sdpa.math" in rows
    assert report.row(0, "torch_sdpa.math").status is TuneStatus.OK
    assert "lzwrong.offset differs from the reference" in caplog.text


def test_sampling_kernels_are_checked_on_the_same_random_stream():
    report = lz.tune("sample_topk", [{"batch": 4, "vocab": 500, "top_k": 100}], **FAST)
    assert report.row(0, "reference.sample_topk").status is TuneStatus.OK


def test_norm_cases_and_kernel_filter():
    report = lz.tune(
        "rms_norm",
        [{"hidden": 64, "dtype": "bfloat16"}, {"hidden": 32, "residual": True}],
        kernels="torch_native",
        **FAST,
    )
    assert [(r.case, r.kernel_id, r.status) for r in report.rows] == [
        (0, "torch_native.rms_norm", TuneStatus.OK),
        (1, "torch_native.rms_norm", TuneStatus.OK),
    ]


def test_time_budget_stops_sampling():
    report = lz.tune(
        "layer_norm",
        [{"hidden": 16}],
        kernels=["reference.*"],
        warmup=0,
        iters=1,
        repeats=50,
        max_time_s=1e-9,
        progress=False,
    )
    row = report.rows[0]
    assert row.samples == 1 and "time budget" in row.detail


def test_disabled_perfdb_reports_but_does_not_store(caplog):
    lz.configure(use_perfdb=False)
    with caplog.at_level(logging.WARNING, logger="layerzero.tuning"):
        report = lz.tune("layer_norm", [{"hidden": 16}], **FAST)
    assert report.perfdb_path is None and report.rows and not any(r.recorded for r in report.rows)
    assert "not stored" in caplog.text


def test_progress_bar_and_plain_line(capsys, monkeypatch):
    lz.tune("layer_norm", [{"hidden": 16}], kernels=["reference.*"], warmup=0, iters=1, repeats=1)
    assert "lz.tune layer_norm" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # tqdm missing -> a plain line on stderr
    lz.tune("layer_norm", [{"hidden": 16}], kernels=["reference.*"], warmup=0, iters=1, repeats=1)
    assert "lz.tune layer_norm: 1/1 case 0 reference.layer_norm" in capsys.readouterr().err


def test_refuses_while_a_cuda_graph_is_captured(monkeypatch):
    monkeypatch.setattr(harness, "_capturing_now", lambda: True)
    with pytest.raises(lz.CudaGraphUnsafeError, match="CUDA graph is being captured"):
        lz.tune("attention", SHAPES, **FAST)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: lz.tune("attn", SHAPES), lz.UnknownOperationError, "unknown op 'attn'"),
        (
            lambda: lz.tune("attention", SHAPES, kernels=["nope.*"]),
            lz.UnknownKernelError,
            "matches no kernel",
        ),
        (lambda: lz.tune("attention", SHAPES[0]), lz.InvalidInputError, "Wrap a single case in a list"),
        (lambda: lz.tune("attention", []), lz.InvalidInputError, "at least one case"),
        (lambda: lz.tune("attention", [42]), lz.InvalidInputError, "case 0"),
        (lambda: lz.tune("attention", SHAPES, repeats=0), lz.InvalidInputError, "repeats"),
        (lambda: lz.tune("attention", SHAPES, max_time_s=float("nan")), lz.InvalidInputError, "max_time_s"),
        (lambda: lz.tune("attention", [{"heads": 3, "kv_heads": 2}]), lz.InvalidInputError, "divisible"),
    ],
)
def test_bad_arguments_raise_typed_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------------------------- CLI
def test_cli_tune_prints_a_table(capsys):
    rc = cli_main(
        [
            "tune",
            "attention",
            "--batch",
            "1",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--seq",
            "16",
            "--head-dim",
            "8",
            "--dtype",
            "float32",
            "--causal",
            "--device",
            "cpu",
            "--warmup",
            "0",
            "--repeats",
            "2",
            "--iters",
            "1",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "torch_sdpa.math" in out and "median µs" in out and "case 1" in out


def test_cli_tune_json(capsys):
    rc = cli_main(
        ["tune", "rms_norm", "--hidden", "32", "--seq", "4", "--repeats", "2", "--warmup", "0", "--json"]
    )
    data = json.loads(capsys.readouterr().out)
    cpu_rows = [r for r in data["rows"] if r["kernel_id"].split(".")[0] in ("reference", "torch_native")]
    assert (
        rc == 0
        and data["op"] == "rms_norm"
        and len(cpu_rows) == 2
        and {r["status"] for r in cpu_rows} == {"ok"}
    )


def test_cli_tune_bad_kernel_exits_2(capsys):
    assert cli_main(["tune", "rms_norm", "--hidden", "8", "--kernels", "nope"]) == 2
    assert "matches no kernel" in capsys.readouterr().err
