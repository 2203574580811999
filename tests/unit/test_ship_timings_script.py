"""benchmarks/ship_timings.py and benchmarks/hidden_shapes.py on CPU with tiny cases: the grid and the hidden
shapes, the data file they write (and that selection then reads), merging of parts, and the acceptance report.

Oracles: the script's own CSV (every recorded median is an ``ok`` row of it), ``lz.explain`` for the set of
eligible kernels, hand-worked geometric means and distributions, ``core.shipped.lookup`` on the written file.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.core import shipped
from layerzero.core.device import DeviceSpec
from layerzero.core.errors import ConfigurationError
from layerzero.core.report import CandidateStatus
from layerzero.core.runtime import RUNTIME

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _ship_grid as grid  # noqa: E402
import hidden_shapes  # noqa: E402
import ship_timings  # noqa: E402
from _ship_measure import prepare_case  # noqa: E402

pytestmark = pytest.mark.unit
FAST = ["--warmup", "0", "--iters", "1", "--repeats", "2", "--max-time-ms", "5"]


@pytest.fixture(autouse=True)
def _fresh_tables():
    shipped.clear_cache()
    yield
    shipped.clear_cache()


def _point(c: grid.Case) -> tuple:
    return (c.kind, c.batch, c.q_len, c.kv_len, c.hq, c.hkv, c.head_dim, c.dtype, c.dist)


# ---------------------------------------------------------------------------------------- the grids
def test_gpu_grid_covers_the_issue():
    cases = grid.gpu_grid()
    kinds = {c.kind for c in cases}
    assert kinds == set(grid.KINDS)
    dense = [c for c in cases if c.op == "attention"]
    assert {c.dtype for c in dense} == {"bfloat16", "float16"} and {c.head_dim for c in dense} == {
        64,
        128,
        256,
    }
    assert {c.hq // c.hkv for c in dense} == {1, 4, 8}
    prefill = [c for c in dense if c.kind == "prefill"]
    assert {c.q_len for c in prefill} == {128 << i for i in range(8)} and all(
        c.q_len == c.kv_len for c in prefill
    )
    assert {c.kv_len for c in dense if c.kind == "decode"} >= {128, 32768}
    cross = [c for c in dense if c.kind == "cross"]
    assert {c.q_len for c in cross} == {16, 128, 512} and {c.kv_len for c in cross} == {1024, 4096, 8192}
    paged = [c for c in cases if c.kind == "paged_decode"]
    assert {c.batch for c in paged} == {1, 4, 8, 16, 32, 64, 128, 256} and {
        (c.hq, c.hkv) for c in paged
    } == set(grid.PAGED_HEADS)
    assert {c.kv_len for c in paged} == {128, 512, 2048, 8192} and {c.page for c in paged} == {16}
    assert any(c.kind == "paged_append" for c in cases)
    # JIT signatures: one FlashInfer / Triton variant set per (kind, dtype, D, heads, page)
    assert len({c.signature for c in cases}) <= 160


def test_hidden_shapes_are_not_grid_points():
    hidden = hidden_shapes.hidden_cases()
    assert (
        sum(c.op == "attention" for c in hidden) >= 20 and sum(c.kind == "paged_decode" for c in hidden) >= 10
    )
    points = {_point(c) for c in grid.gpu_grid()}
    assert not [c.label() for c in hidden if _point(c) in points]
    assert {c.dist for c in hidden if c.page} - {"uniform", "narrow"}  # other distributions
    assert len({c.seed for c in hidden}) == len(hidden)
    cpu_points = {_point(c) for c in grid.cpu_grid()}
    assert not [c.label() for c in hidden_shapes.cpu_hidden_cases() if _point(c) in cpu_points]


def test_ragged_distributions():
    g = torch.Generator().manual_seed(0)
    assert grid.ragged_lengths("equal", 3, 100, g) == [100, 100, 100]
    assert all(75 <= n <= 125 for n in grid.ragged_lengths("narrow", 200, 100, g))
    assert all(1 <= n <= 199 for n in grid.ragged_lengths("uniform", 200, 100, g))
    bi = grid.ragged_lengths("bimodal", 6, 100, g)
    assert all(22 <= n <= 28 for n in bi[0::2]) and all(157 <= n <= 193 for n in bi[1::2])
    sk = grid.ragged_lengths("skewed", 4000, 100, g, minimum=5)
    assert min(sk) >= 5 and max(sk) <= 800 and 80 < sum(sk) / len(sk) < 115  # lognormal mean ~100
    with pytest.raises(lz.InvalidInputError, match="distribution"):
        grid.ragged_lengths("zipf", 2, 10, g)


def test_paged_case_inputs_are_consistent():
    case = grid.Case("paged_append", 3, 4, 40, 4, 2, 16, "float32", 16, "skewed", seed=5)
    args, kwargs = grid.build(case, torch.device("cpu"))
    q, cache, table, lens = args
    assert q.shape == (12, 4, 16) and kwargs["cu_seqlens_q"].tolist() == [0, 4, 8, 12]
    assert table.shape[1] == math.ceil(int(lens.max()) / 16) and int(lens.min()) >= 4
    used = [int(table[s, j]) for s in range(3) for j in range(math.ceil(int(lens[s]) / 16))]
    assert len(set(used)) == len(used) and max(used) < cache.shape[0]  # distinct, in range
    ctx, _ = prepare_case(case, torch.device("cpu"))
    assert ctx.op == "paged_attention" and ctx.seq_len_kv >= int(lens.max()) and ctx.page_size == 16


def test_prewarm_worker_calls_every_eligible_kernel_of_its_cases(capsys):
    import _ship_measure

    cases = [
        grid.Case("decode", 5, 1, 70, 4, 2, 16, "float32"),
        grid.Case("rms_norm", 3, 9, 64, dtype="float32"),
    ]
    tiny = [c.tiny() for c in cases]
    assert tiny[0].signature == cases[0].signature and tiny[0].batch == 2 and tiny[0].kv_len == 64
    assert _ship_measure._worker("cpu", json.dumps([c.to_dict() for c in tiny])) == 0
    assert capsys.readouterr().out == ""


def test_combine_compact_expand_and_parts():
    assert ship_timings.combine([{"a": 1.0, "b": 4.0}, {"a": 4.0}]) == {"a": 2.0}  # geomean; b not in both
    recs = [
        ("rms_norm", {"op": "rms_norm", "hidden_size": 64, "tp_size": 1}, {"k": 1.0}),
        ("rms_norm", {"op": "rms_norm", "hidden_size": 128}, {"k": 2.0}),
    ]
    doc = ship_timings.compact({"schema": 1}, recs)
    assert doc["defaults"]["rms_norm"] == {"op": "rms_norm"}
    assert sorted(map(str, ship_timings.expand(doc))) == sorted(map(str, recs))
    cases = grid.gpu_grid(("bfloat16",))
    parts = [ship_timings.select_part(cases, (i, 3)) for i in (1, 2, 3)]
    assert sorted(map(_point, sum(parts, []))) == sorted(map(_point, cases))
    sigs = [{c.signature for c in p} for p in parts]
    assert max(map(len, parts)) - min(map(len, parts)) <= max(
        sum(c.signature == s for c in cases) for s in sigs[0]
    )
    assert not (sigs[0] & sigs[1]) and not (sigs[1] & sigs[2]) and not (sigs[0] & sigs[2])


def test_merge_documents():
    fp = {"device_type": "cpu", "torch": "x"}
    a = ship_timings.compact(
        {"schema": 1, "fingerprint": fp, "backends": {"t": "1"}, "cases": {"planned": 2, "measured": 2}},
        [("op", {"op": "op", "n": 1}, {"k": 1.0}), ("op", {"op": "op", "n": 2}, {"k": 3.0})],
    )
    b = ship_timings.compact(
        {"schema": 1, "fingerprint": fp, "backends": {"u": "2"}, "cases": {"planned": 1, "measured": 1}},
        [("op", {"op": "op", "n": 1}, {"k": 4.0})],
    )
    merged = ship_timings.merge_documents([a, b])
    got = {json.dumps(f, sort_keys=True): m for _, f, m in ship_timings.expand(merged)}
    assert got == {'{"n": 1, "op": "op"}': {"k": 2.0}, '{"n": 2, "op": "op"}': {"k": 3.0}}
    assert merged["backends"] == {"t": "1", "u": "2"} and merged["cases"] == {"planned": 3, "measured": 3}
    with pytest.raises(ConfigurationError, match="fingerprint"):
        ship_timings.merge_documents([a, {**b, "fingerprint": {"device_type": "cuda"}}])
    with pytest.raises(ConfigurationError, match="backend t version"):
        ship_timings.merge_documents([a, {**b, "backends": {"t": "9"}}])


# ---------------------------------------------------------------------------------- end to end
def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_ship_timings_quick_run_writes_a_file_selection_reads(tmp_path):
    data = tmp_path / "data"
    out = tmp_path / "out"
    assert (
        ship_timings.main(["--device", "cpu", "--quick", "--out", str(out), "--data-dir", str(data), *FAST])
        == 0
    )
    host = DeviceSpec.detect("cpu")
    name = ship_timings.slug(host) + ".json"
    assert (data / name).read_text() == (out / "timings" / name).read_text()
    f = shipped.parse((data / name).read_text(), name)
    assert dict(f.fingerprint) == shipped.device_fingerprint(host)
    assert f.backends["torch_sdpa"] == torch.__version__ and "flex_attention.compiled" not in str(f.records)
    rows = _csv(out / "ship_timings.csv")
    ok = {(r["bucket"], r["kernel_id"]): float(r["median_us"]) for r in rows if r["status"] == "ok"}
    buckets = {r["bucket"] for r in rows if r["status"] == "ok"}
    assert len(f.records) == len(buckets) == len(grid.quick_grid())  # one bucket per quick case
    for rec in f.records:
        key = ";".join(f"{k}={v}" for k, v in sorted(rec.fields.items()))
        assert {k for b, k in ok if b == key} == set(rec.medians)
        assert all(rec.medians[k] == pytest.approx(ok[(key, k)], abs=1e-3) for k in rec.medians)
    # the eligible kernels of a case are all in the CSV
    case = grid.quick_grid()[0]
    args, kwargs = grid.build(case, torch.device("cpu"))
    eligible = {
        c.kernel_id
        for c in lz.explain(case.op, *args, **kwargs).candidates
        if c.status is not CandidateStatus.REJECTED
    } - {"flex_attention.compiled"}
    assert eligible == {
        r["kernel_id"]
        for r in rows
        if r["case"]
        == str(next(i for i, c in enumerate(ship_timings.select_part(grid.quick_grid(), None)) if c == case))
    }
    # selection reads the written file: the pick is the fastest recorded kernel of that bucket
    lz.configure(use_shipped_timings=True, shipped_timings_dir=str(data))
    rep = lz.explain(case.op, *args, **kwargs)
    key = rep.context.bucket_key()
    fastest = min((k for b, k in ok if b == key), key=lambda k: ok[(key, k)])
    assert rep.chosen == fastest and rep.shipped_source == f"{name}, exact bucket"
    env = json.loads((out / "env.json").read_text())
    assert env["cases_measured"] == len(grid.quick_grid()) and env["fingerprint"] == dict(f.fingerprint)


def test_parts_are_not_installed_and_merge_installs(tmp_path):
    data = tmp_path / "data"
    for i in (1, 2):
        assert (
            ship_timings.main(
                [
                    "--device",
                    "cpu",
                    "--quick",
                    "--kinds",
                    "rms_norm",
                    "swiglu",
                    "--part",
                    f"{i}/2",
                    "--out",
                    str(tmp_path / f"p{i}"),
                    "--data-dir",
                    str(data),
                    *FAST,
                ]
            )
            == 0
        )
    assert not data.exists()
    parts = sorted(tmp_path.glob("p*/timings/*.part*of2.json"))
    assert len(parts) == 2
    assert (
        ship_timings.main(
            [
                "--device",
                "cpu",
                "--merge",
                *map(str, parts),
                "--out",
                str(tmp_path / "m"),
                "--data-dir",
                str(data),
            ]
        )
        == 0
    )
    (installed,) = data.glob("*.json")
    ops = sorted(r.op for r in shipped.parse(installed.read_text()).records)
    assert (
        ops == ["rms_norm", "swiglu"]
        and installed.name == ship_timings.slug(DeviceSpec.detect("cpu")) + ".json"
    )
    # merged elsewhere: the file is named after the measured machine, not the merging one
    gpu = json.loads(parts[0].read_text())
    gpu["fingerprint"] = {
        "device_type": "cuda",
        "name": "NVIDIA H100 80GB HBM3",
        "sm": "9.0",
        "torch": "t",
        "cudnn": "1",
    }
    (tmp_path / "gpu.json").write_text(json.dumps(gpu))
    assert (
        ship_timings.main(
            [
                "--device",
                "cpu",
                "--merge",
                str(tmp_path / "gpu.json"),
                "--out",
                str(tmp_path / "g"),
                "--data-dir",
                str(data),
            ]
        )
        == 0
    )
    assert (data / "nvidia-h100-80gb-hbm3.json").exists()


def test_hidden_shapes_quick_run(tmp_path):
    out = tmp_path / "hidden"
    assert (
        hidden_shapes.main(
            [
                "--device",
                "cpu",
                "--quick",
                "--out",
                str(out),
                "--iters",
                "1",
                "--repeats",
                "2",
                "--max-time-ms",
                "5",
            ]
        )
        == 0
    )
    rows = _csv(out / "hidden_shapes.csv")
    env = json.loads((out / "env.json").read_text())
    cases = hidden_shapes.quick_cases()
    assert env["shapes_done"] == len(cases) and {r["shape"] for r in rows} == {
        str(i) for i in range(len(cases))
    }
    ratios = {"default": [], "autotune": [], "priority": []}
    for i, case in enumerate(cases):
        mine = [r for r in rows if r["shape"] == str(i)]
        args, kwargs = grid.build(case, torch.device("cpu"))
        eligible = {
            c.kernel_id
            for c in lz.explain(case.op, *args, **kwargs).candidates
            if c.status is not CandidateStatus.REJECTED
        } - {"flex_attention.compiled"}
        assert {r["kernel_id"] for r in mine} == eligible
        ok = {r["kernel_id"]: float(r["median_us"]) for r in mine if r["status"] == "ok"}
        for pick in ratios:
            (chosen,) = [r["kernel_id"] for r in mine if r[f"is_{pick}"] == "True"]
            ratios[pick].append(min(ok.values()) / ok[chosen] if chosen in ok else 0.0)
    for pick, xs in ratios.items():  # the summary is the geomean / min of the CSV's ratios
        s = env["summary"][pick]
        assert s["geomean"] == pytest.approx(math.exp(sum(math.log(x) for x in xs) / len(xs)))
        assert s["min"] == pytest.approx(min(xs)) and s["verdict"] in (
            ("info",) if pick == "priority" else ("PASS", "FAIL")
        )
    md = (out / "hidden_shapes.md").read_text()
    assert "| default |" in md and "| autotune |" in md and cases[0].label() in md
    assert RUNTIME.perfdb() is not None and lz.get_config().use_shipped_timings is False  # config restored
