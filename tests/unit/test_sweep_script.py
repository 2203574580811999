"""benchmarks/sweep.py (the H200 proof sweep) on CPU with tiny shapes: the shape plan, the float64 reference
slice, the CSV / markdown / env.json outputs, and the target math on a hand-worked table.

Oracles: a hand-worked two-shape table (ratios, geomean, bandwidths computed by hand below), the reference
kernel ``reference.paged_attention`` and a deliberately corrupted output for the reference slice, and
``lz.explain`` for the set of kernels that must appear in the CSV.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _sweep_report as report  # noqa: E402
import _sweep_shapes as shapes  # noqa: E402
import sweep  # noqa: E402
from _sweep_measure import COLUMNS, COPY, LZ_CALL, LZ_GRAPH, SDPA_DEFAULT, Timing  # noqa: E402

pytestmark = pytest.mark.unit

FAST = Timing(warmup=1, iters=1, repeats=2, rounds=1, max_time_s=0.02)


# ------------------------------------------------------------------------------------------ shape plan
def test_full_plan_covers_the_issue_and_stays_bounded():
    plan = shapes.full_shapes()
    assert len(plan) >= 60
    assert {s.phase for s in plan} == set(shapes.PHASES)
    assert {(s.hq, s.hkv) for s in plan} == set(shapes.HEADS)
    assert {s.head_dim for s in plan} == {64, 128, 256}
    assert {s.dtype for s in plan} == {"bfloat16", "float16"}
    prefill = [s for s in plan if s.phase == "prefill"]
    assert all(s.batch * s.kv_len**2 <= 16384**2 and s.q_len == s.kv_len for s in prefill)
    assert {s.kv_len for s in prefill if s.batch == 1} >= {128, 16384}
    assert max(s.batch for s in prefill if s.kv_len > 1024) < 16
    assert all(s.kv_bytes_max() <= shapes.KV_BYTES_MAX for s in plan)
    assert all(s.page == 16 for s in plan if s.paged) and all(s.page == 0 for s in plan if not s.paged)
    decode = [s for s in plan if s.phase in ("decode", "paged_decode")]
    assert min(s.batch for s in decode) == 1 and max(s.batch for s in decode) == 256
    assert {128, 32768} <= {s.kv_len for s in decode}
    assert sum(s.phase == "paged_decode" and s.batch >= 64 for s in plan) >= 4
    assert len({s.label() for s in plan}) == len(plan)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"phase": "chunked"}, "phase"),
        ({"hq": 6, "hkv": 4}, "heads"),
        ({"q_len": 9, "kv_len": 8}, "q_len"),
        ({"phase": "decode", "q_len": 2}, "decode"),
        ({"dtype": "int8"}, "dtype"),
        ({"page": 16}, "page"),
        ({"batch": 0}, "batch"),
    ],
)
def test_shape_rejects_bad_fields(kwargs, match):
    base = {
        "phase": "prefill",
        "batch": 1,
        "q_len": 8,
        "kv_len": 8,
        "hq": 4,
        "hkv": 2,
        "head_dim": 8,
        "dtype": "float32",
    }
    with pytest.raises(lz.InvalidInputError, match=match):
        shapes.Shape(**{**base, **kwargs})


# ------------------------------------------------------------------------------------ reference slice
def test_reference_slice_agrees_with_reference_kernel_and_catches_a_head_swap():
    shape = shapes.Shape("paged_append", 3, 5, 40, 4, 2, 16, "float32", 16, seed=3)
    inp = shapes.build_inputs(shape, torch.device("cpu"))
    assert sum(inp.q_lens) == inp.args[0].shape[0] and all(30 <= n <= 40 for n in inp.seq_lens)
    assert inp.kv_bytes == 2 * sum(inp.seq_lens) * 2 * 16 * 4
    with lz.prefer("reference.paged_attention"):
        out = lz.paged_attention(*inp.args, **inp.kwargs)
    assert shapes.reference_error(shape, inp, out) < 1e-5
    bad = out.clone()
    bad[:, [0, 3]] = out[:, [3, 0]]  # query heads 0 and 3 swapped
    assert shapes.reference_error(shape, inp, bad) > 0.05
    assert shapes.reference_error(shape, inp, out[:-1]) == math.inf
    nan = out.clone()
    nan[0, 0, 0] = float("nan")
    assert shapes.reference_error(shape, inp, nan) == math.inf


def test_reference_slice_prefill_is_causal():
    shape = shapes.Shape("prefill", 2, 12, 12, 4, 1, 8, "float32", seed=1)
    inp = shapes.build_inputs(shape, torch.device("cpu"))
    q, k, v = (t.double() for t in inp.args)
    causal = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True
    )
    full = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    )
    assert shapes.reference_error(shape, inp, causal.float()) < 1e-6
    assert shapes.reference_error(shape, inp, full.float()) > 1e-2


# ------------------------------------------------------------------------------------- target math
def _row(
    sid,
    phase,
    kid,
    kind,
    status="ok",
    correct=True,
    med="",
    tmed="",
    pick_d=False,
    pick_t=False,
    sdpa=False,
    kv=0,
    b=1,
):
    row = dict.fromkeys(COLUMNS, "")
    row.update(
        shape_id=str(sid),
        op="attention",
        phase=phase,
        B=str(b),
        Sq="1",
        Skv="64",
        Hq="4",
        Hkv="2",
        D="8",
        dtype="bfloat16",
        page="16" if phase.startswith("paged") else "0",
        kernel_id=kid,
        row_kind=kind,
        status=status,
        correct=str(correct),
        median_us=str(med),
        tuned_median_us=str(tmed),
        is_pick_default=str(pick_d),
        is_pick_tuned=str(pick_t),
        is_sdpa_default=str(sdpa),
        kv_bytes=str(kv),
    )
    return row


HAND = [
    # shape 0: A 100 µs (default pick), B 80 µs (fastest, tuned pick), C fails its check; SDPA default 90 µs.
    # tuned pass: A 100, B 90, SDPA 88.
    _row(0, "prefill", "k.A", "kernel", med=100, tmed=100, pick_d=True),
    _row(0, "prefill", "k.B", "kernel", med=80, tmed=90, pick_t=True),
    _row(0, "prefill", "k.C", "kernel", status="incorrect", correct=False),
    _row(0, "prefill", SDPA_DEFAULT, "sdpa_default", med=90, tmed=88, sdpa=True),
    _row(0, "prefill", LZ_CALL, "lz_call", med=104, tmed=95),
    # shape 1: paged decode B=64, 4e6 KV bytes; K 50 µs (20 µs tuned) is the only kernel and the SDPA one;
    # copy 25 µs both passes.
    _row(
        1,
        "paged_decode",
        "k.K",
        "kernel",
        med=50,
        tmed=20,
        pick_d=True,
        pick_t=True,
        sdpa=True,
        kv=4_000_000,
        b=64,
    ),
    _row(1, "paged_decode", COPY, "copy", med=25, tmed=25, kv=4_000_000, b=64),
    # ... the lz call replayed from a CUDA graph: 12 µs (10 tuned; ran k.K, then k.G).
    {
        **_row(1, "paged_decode", LZ_GRAPH, "lz_graph", med=12, tmed=10, kv=4_000_000, b=64),
        "detail": "CUDA graph of 10 calls; ran k.K | tuned pass: CUDA graph of 10 calls; ran k.G",
    },
    # shape 2: the pick is the kernel SDPA itself runs (cuDNN): 21 µs vs SDPA 20 µs is host time, reported as
    # info.
    _row(2, "decode", "torch_sdpa.cudnn", "kernel", med=21, tmed=21, pick_d=True, pick_t=True),
    {
        **_row(2, "decode", SDPA_DEFAULT, "sdpa_default", med=20, tmed=20, sdpa=True),
        "sdpa_kernel": "torch_sdpa.cudnn",
    },
]


def test_summary_and_targets_on_a_hand_worked_table():
    s0, s1, s2 = report.summarize(HAND, "default")
    assert (s0["fastest"], s0["fastest_us"], s0["pick"], s0["ratio"]) == ("k.B", 80.0, "k.A", 0.8)
    assert s0["sdpa_ratio"] == pytest.approx(100 / 90) and s0["overhead_us"] == pytest.approx(4.0)
    assert s1["gbps"] == pytest.approx(80.0) and s1["copy_gbps"] == pytest.approx(320.0)  # 4e6/50µs; 8e6/25µs
    assert s1["bw_ratio"] == pytest.approx(0.25)
    assert s1["graph_gbps"] == pytest.approx(4e6 / 12e-6 / 1e9)
    assert s1["graph_bw_ratio"] == pytest.approx(333.3 / 320, 1e-3)
    assert s1["graph_kernel"] == "k.K" and report.summarize(HAND, "tuned")[1]["graph_kernel"] == "k.G"
    assert s2["same_as_sdpa"] and not s0["same_as_sdpa"] and s2["sdpa_kernel"] == "torch_sdpa.cudnn"
    targets = report.compute_targets(HAND)

    def t(mode: str, name: str) -> report.Target:
        (hit,) = [x for x in targets if x.mode == mode and x.name.startswith(name)]
        return hit

    assert t("default", "pick / fastest, geomean").value == pytest.approx(
        0.8 ** (1 / 3)
    )  # geomean(0.8, 1, 1)
    assert t("default", "pick / fastest, geomean").verdict() == "FAIL"
    assert t("default", "pick / fastest, worst").value == pytest.approx(0.8)
    assert t("default", "pick / fastest, worst").verdict() == "FAIL"
    sdpa = "pick / SDPA default (bare kernel, eager), max"
    main = next(x for x in targets if x.mode == "default" and x.name == sdpa)
    same = next(x for x in targets if x.mode == "default" and x.name.endswith("IS SDPA's kernel"))
    assert main.value == pytest.approx(100 / 90) and main.verdict() == "FAIL"  # shape 0 only
    assert same.value == pytest.approx(21 / 20) and same.verdict() == "info" and "1 shapes" in same.detail
    assert not any("CUDA-graph kernel time" in x.name for x in targets)  # no graph times in HAND
    # CUDA-graph kernel times of the pick and SDPA: an info ratio next to the eager one
    graphed = [dict(r) for r in HAND]
    graphed[0]["graph_us"], graphed[3]["graph_us"] = "50", "51"
    g0 = report.summarize(graphed, "default")[0]
    assert g0["graph_sdpa_ratio"] == pytest.approx(50 / 51) and s0["graph_sdpa_ratio"] is None
    info = next(
        x for x in report.compute_targets(graphed) if x.mode == "default" and "CUDA-graph kernel" in x.name
    )
    assert info.value == pytest.approx(50 / 51) and info.verdict() == "info"
    graph, eager = t("default", "paged decode B>=64 (CUDA graph)"), t("default", "paged decode B>=64 (eager")
    assert graph.value == pytest.approx((4e6 / 12e-6) / (8e6 / 25e-6)) and graph.verdict() == "PASS"  # 1.04
    assert "(k.K)" in graph.detail
    assert eager.value == pytest.approx(0.25) and eager.verdict() == "info"
    assert t("default", "lz call").value == pytest.approx(4.0) and t("default", "lz call").verdict() == "info"
    # tuned pass times: shape 0 fastest B 90 = tuned pick B -> 1.0; shape 1 K alone -> 1.0
    assert t("tuned", "pick / fastest, geomean").value == pytest.approx(1.0)
    assert t("tuned", "pick / fastest, worst").verdict() == "PASS"
    main = next(x for x in targets if x.mode == "tuned" and x.name == sdpa)
    assert main.value == pytest.approx(90 / 88) and main.verdict() == "PASS"
    assert t("tuned", "paged decode B>=64 (eager").value == pytest.approx(200 / 320)  # 4e6/20 µs vs copy
    assert t("tuned", "paged decode B>=64 (CUDA graph)").value == pytest.approx(
        1.25
    )  # 4e6/10 µs vs 8e6/25 µs
    assert t("tuned", "lz call").value == pytest.approx(5.0)  # 95 - 90


def test_incorrect_pick_counts_zero_and_missing_pick_fails():
    rows = [dict(r) for r in HAND]
    rows[2]["is_pick_default"], rows[0]["is_pick_default"] = "True", "False"  # pick = k.C (incorrect)
    s0 = report.summarize(rows, "default")[0]
    assert s0["ratio"] == 0.0
    gm = next(x for x in report.compute_targets(rows) if x.mode == "default" and "geomean" in x.name)
    assert gm.value == 0.0 and gm.verdict() == "FAIL"
    rows[2]["is_pick_default"] = "False"  # no pick at all
    gm = next(x for x in report.compute_targets(rows) if x.mode == "default" and "geomean" in x.name)
    assert gm.value == pytest.approx(1.0) and gm.verdict() == "FAIL" and "without a timed pick" in gm.detail


# ---------------------------------------------------------------------------------- end to end on CPU
def test_run_sweep_writes_every_kernel_and_the_targets(tmp_path):
    plan = [
        shapes.Shape("decode", 2, 1, 48, 4, 2, 16, "float32", seed=0),
        shapes.Shape("paged_decode", 64, 1, 20, 4, 4, 8, "bfloat16", 16, seed=1),
    ]
    before = lz.get_config().perfdb_path
    res = sweep.run_sweep(plan, torch.device("cpu"), tmp_path, timing=FAST, budget_s=300, command="test")
    assert lz.get_config().perfdb_path == before
    rows = report.read_csv(tmp_path / "sweep.csv")
    assert tuple(rows[0].keys()) == COLUMNS
    for sid, shape in enumerate(plan):
        inp = shapes.build_inputs(shape, torch.device("cpu"))
        rep = lz.explain(shape.op, *inp.args, **inp.kwargs)
        eligible = {c.kernel_id for c in rep.candidates if c.status.value != "rejected"}
        mine = [r for r in rows if r["shape_id"] == str(sid)]
        assert {r["kernel_id"] for r in mine if r["row_kind"] == "kernel"} == eligible
        kernels = [r for r in mine if r["row_kind"] == "kernel"]
        assert sum(r["is_pick_default"] == "True" for r in kernels) == 1
        assert sum(r["is_pick_tuned"] == "True" for r in kernels) == 1
        for r in kernels:
            assert r["status"] == "ok" and r["correct"] == "True" and float(r["max_rel_err"]) < 2e-2
            assert float(r["median_us"]) > 0 and float(r["tuned_median_us"]) > 0 and r["tuned_by"]
        assert sum(r["is_sdpa_default"] == "True" for r in mine) == 1
        assert any(r["row_kind"] == "lz_call" and float(r["median_us"]) > 0 for r in mine)
    copy = [r for r in rows if r["row_kind"] == "copy"]
    assert len(copy) == 1 and copy[0]["shape_id"] == "1" and float(copy[0]["gbps"]) > 0
    md = (tmp_path / "sweep.md").read_text()
    assert "## Targets" in md and ("PASS" in md or "FAIL" in md) and "decode B2 S1/48 H4/2 D16 fp32" in md
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["run"]["shapes_done"] == 2
    assert len(res["targets"]) == len(env["targets"]) >= 8


def test_budget_stops_adding_shapes_and_still_writes(tmp_path):
    plan = [shapes.Shape("decode", 1, 1, 16, 2, 1, 8, "float32")]
    res = sweep.run_sweep(plan, torch.device("cpu"), tmp_path, timing=FAST, budget_s=1e-9)
    assert res["meta"]["shapes_done"] == 0 and res["rows"] == []
    assert "0 of 1 shapes measured" in (tmp_path / "sweep.md").read_text()
    assert all(t.verdict() in ("n/a", "info") for t in res["targets"])
    with pytest.raises(lz.ConfigurationError, match="budget"):
        sweep.run_sweep(plan, torch.device("cpu"), tmp_path, timing=FAST, budget_s=0)


def test_exclude_and_too_big_kernels_are_recorded_as_skipped(tmp_path):
    plan = [shapes.Shape("prefill", 1, 16, 16, 2, 2, 8, "float32")]
    timing = Timing(
        warmup=1,
        iters=1,
        repeats=1,
        rounds=1,
        max_time_s=0.01,
        scores_gib_max=1e-9,
        exclude=("flex_attention.*",),
    )
    res = sweep.run_sweep(plan, torch.device("cpu"), tmp_path, timing=timing, budget_s=300, tune=False)
    by_id = {r["kernel_id"]: r for r in res["rows"]}
    assert (
        by_id["reference.attention"]["status"] == "skipped"
        and "GiB" in by_id["reference.attention"]["detail"]
    )
    assert by_id["flex_attention.attention"]["detail"] == "skipped: excluded by --exclude"
    assert by_id["torch_sdpa.flash"]["status"] == "ok"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is optional (plot_sweep runs on the lead's machine)")
    import plot_sweep

    report.write_csv(tmp_path / "sweep.csv", HAND, COLUMNS)
    out = plot_sweep.plot(tmp_path / "sweep.csv", tmp_path / "sweep.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sdpa_choice_names_the_sub_backend_sdpa_runs(tmp_path):
    """torch._fused_sdp_choice on CPU inputs names a torch_sdpa kernel; --fill-sdpa-choice fills old CSV
    rows."""
    from _sweep_measure import SDPA_KERNELS, fill_sdpa_choice, sdpa_choice

    shape = shapes.Shape("decode", 2, 1, 64, 4, 2, 16, "float32")
    inputs = shapes.build_inputs(shape, torch.device("cpu"))
    kid = sdpa_choice(shape, inputs)
    assert kid in SDPA_KERNELS.values(), kid
    rows = [_row(0, "decode", SDPA_DEFAULT, "sdpa_default", sdpa=True), _row(0, "decode", "k.A", "kernel")]
    rows[0].update(Skv="64", Hq="4", Hkv="2", D="16", dtype="float32", B="2")
    assert fill_sdpa_choice(rows, torch.device("cpu")) == 1
    assert rows[0]["sdpa_kernel"] == kid and rows[1]["sdpa_kernel"] == ""
    report.write_csv(tmp_path / "old.csv", [dict(r, sdpa_kernel="") for r in rows], COLUMNS)
    assert (
        sweep.main(
            [
                "--device",
                "cpu",
                "--fill-sdpa-choice",
                str(tmp_path / "old.csv"),
                "--out",
                str(tmp_path / "new"),
            ]
        )
        == 0
    )
    assert report.read_csv(tmp_path / "new" / "sweep.csv")[0]["sdpa_kernel"] == kid
