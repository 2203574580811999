"""SelectionReport: JSON form, the printed table, candidate lookup, fallback notes and scores, checked on
real selections whose outcome is worked out by hand (CPU float32 attention: flash 80, math 20,
reference 0; cudnn and efficient rejected)."""

from __future__ import annotations

import io
import json

import pytest
import torch

import layerzero as lz
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.report import CandidateReport, CandidateStatus, Score, SelectionReport

pytestmark = pytest.mark.unit


def _qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))


@pytest.fixture
def report() -> SelectionReport:
    return lz.explain("attention", *_qkv())


def test_report_fields(report):
    assert isinstance(report, lz.SelectionReport)
    assert report.op == "attention" and report.chosen == "torch_sdpa.flash" and report.locked is None
    assert len(report.policy_hash) == 64 and int(report.policy_hash, 16) >= 0
    statuses = {c.kernel_id: c.status for c in report.candidates}
    expected = {
        "torch_sdpa.flash": CandidateStatus.SELECTED,
        "torch_sdpa.math": CandidateStatus.ELIGIBLE,
        "reference.attention": CandidateStatus.ELIGIBLE,
        "torch_sdpa.cudnn": CandidateStatus.REJECTED,
        "torch_sdpa.efficient": CandidateStatus.REJECTED,
    }
    assert {k: statuses.get(k) for k in expected} == expected
    assert list(statuses.values()).count(CandidateStatus.SELECTED) == 1
    assert all(c.score is None for c in report.candidates if c.status is CandidateStatus.REJECTED)
    assert all(c.reasons for c in report.candidates if c.status is CandidateStatus.REJECTED)
    ctx = report.context
    assert (ctx.op, ctx.dtype, ctx.num_heads_q, ctx.head_dim, ctx.seq_len_q) == (
        "attention",
        torch.float32,
        2,
        8,
        4,
    )


def test_candidate_lookup_unknown_raises_keyerror(report):
    assert report.candidate("torch_sdpa.math").score.total == 20.0
    with pytest.raises(KeyError):
        report.candidate("torch_sdpa.nope")


def test_to_dict_round_trips_through_json(report):
    d = report.to_dict()
    text = json.dumps(d)
    assert json.loads(text) == d
    assert d["chosen"] == "torch_sdpa.flash" and d["op"] == "attention" and d["locked"] is None
    assert d["context"]["dtype"] == "float32" and d["context"]["device"] == "cpu"
    by_id = {c["kernel_id"]: c for c in d["candidates"]}
    assert by_id["torch_sdpa.flash"]["status"] == "selected"
    assert by_id["torch_sdpa.flash"]["score"] == {
        "priority": 80.0,
        "boost": 0.0,
        "perf": 0.0,
        "shipped": 0.0,
        "transform_cost": 0.0,
        "total": 80.0,
    }
    reasons = [Reason.from_dict(r) for r in by_id["torch_sdpa.cudnn"]["reasons"]]
    assert reasons == list(report.candidate("torch_sdpa.cudnn").reasons)
    assert {r["category"] for r in by_id["torch_sdpa.cudnn"]["reasons"]} == {"hardware", "dtype"}
    assert json.loads(report.to_json()) == json.loads(json.dumps(d, sort_keys=True, default=str))


def test_str_is_a_table_with_every_kernel_in_rank_order(report):
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "LayerZero selection for op 'attention': chosen torch_sdpa.flash"
    header = next(i for i, line in enumerate(lines) if line.startswith("kernel"))
    body = [line.split()[0] for line in lines[header + 2 :]]
    assert body[:3] == ["torch_sdpa.flash", "torch_sdpa.math", "reference.attention"]
    every = {k["kernel_id"] for k in lz.list_kernels("attention")}
    assert sorted(body) == sorted(every) and {"torch_sdpa.cudnn", "torch_sdpa.efficient"} <= set(body[3:])
    assert "DEVICE_TYPE_UNSUPPORTED" in text and "DTYPE_UNSUPPORTED" in text


def test_rows_order_and_scores(report):
    rows = report.rows()
    assert [(r[0], r[1], r[2]) for r in rows[:3]] == [
        ("torch_sdpa.flash", "selected", "80.0"),
        ("torch_sdpa.math", "eligible", "20.0"),
        ("reference.attention", "eligible", "0.0"),
    ]
    assert (rows[3][0], rows[3][1], rows[3][2]) == ("flex_attention.attention", "eligible", "-1.0")
    assert {r[1] for r in rows[4:]} == {"rejected"} and all(r[2] == "" for r in rows[4:])


def test_transforms_and_notes_show_in_the_table():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 2, 8, generator=g)  # BSHD
    rep = lz.explain("attention", q, q, q, layout="BSHD")
    assert "transforms: BSHD->BHSD" in str(rep)
    mask = torch.ones(4, 4, dtype=torch.bool)
    q2 = torch.randn(1, 2, 4, 8, generator=g)
    rep2 = lz.explain("attention", q2, q2, q2, attn_mask=mask, is_causal=True)
    assert rep2.fell_back and any(line.startswith("note: fallback") for line in str(rep2).splitlines())


def test_locked_report_says_so():
    lz.lock("attention", "torch_sdpa.math")
    rep = lz.explain("attention", *_qkv())
    assert rep.locked == "torch_sdpa.math" and "locked to: torch_sdpa.math" in str(rep)
    assert rep.to_dict()["locked"] == "torch_sdpa.math"


def test_fell_back_reads_the_notes(report):
    assert report.fell_back is False
    fake = SelectionReport(report.op, report.context, "x.y", (), notes=("fallback: because",))
    assert fake.fell_back is True
    other = SelectionReport(report.op, report.context, "x.y", (), notes=("lock: something",))
    assert other.fell_back is False


def test_score_total_hand_worked():
    s = Score(priority=80.0, boost=1000.0, perf=10.0, transform_cost=1.0)
    assert s.total == 1089.0
    assert s.to_dict()["total"] == 1089.0
    c = CandidateReport("a.b", CandidateStatus.ELIGIBLE, (), s, ("t",), 3.5)
    assert json.loads(json.dumps(c.to_dict())) == c.to_dict()
    assert c.to_dict()["measured_us"] == 3.5


def test_rich_rendering(report):
    pytest.importorskip("rich")
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None).print(report)
    out = buf.getvalue()
    for kid in ("torch_sdpa.flash", "torch_sdpa.math", "reference.attention", "torch_sdpa.cudnn"):
        assert kid in out


def test_report_for_other_ops():
    x, w = torch.ones(2, 8), torch.ones(8)
    rep = lz.explain("rms_norm", x, w)
    assert rep.chosen == "torch_native.rms_norm"
    assert {"torch_native.rms_norm", "reference.rms_norm"} <= {c.kernel_id for c in rep.candidates}
    assert rep.context.hidden_size == 8
    json.dumps(rep.to_dict())


def test_reason_code_values_in_report_are_reason_codes(report):
    for c in report.candidates:
        for r in c.reasons:
            assert isinstance(r.code, ReasonCode)
