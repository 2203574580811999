"""Shipped timings score the collective kernels (issue 38: "selection by dtype, bytes and world size, shipped
H200 timings"): a data file of this CPU with ``all_reduce`` records turns the choice (one Gloo rank,
in-process); the process group's name is not part of the bucket (records measured on one group serve another
of the same world size and transport); a message between two measured sizes uses the nearer one. And the
committed H200 records (benchmarks/parallel/ship_collectives.py from bench_collectives.py's measurement) hold
a graph and an eager record for every size, each kernel's median where it ran, checked against the measured
JSON they came from."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.core import shipped
from layerzero.core.device import DeviceSpec

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "benchmarks/results/parallel/h200x2_2026-11-30c/collectives.json"


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=20),
    )  # fmt: skip
    shipped.clear_cache()
    try:
        yield dist
    finally:
        lz.configure(use_shipped_timings=True, shipped_timings_dir=None)
        shipped.clear_cache()
        dist.destroy_process_group()


def _versions() -> dict[str, str]:
    from layerzero.core.runtime import RUNTIME

    RUNTIME.ensure_ready()
    reg = RUNTIME.registry
    return {b: reg.backends.get(b).version for b in reg.backends if reg.backends.get(b).version is not None}


def _file(directory: Path, records) -> None:
    doc = {
        "schema": shipped.SCHEMA_VERSION,
        "fingerprint": shipped.device_fingerprint(DeviceSpec.detect("cpu")),
        "backends": _versions(),
        "date": "2026-11-29",
        "records": [["all_reduce", shipped.bucket_fields(ctx), med] for ctx, med in records],
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cpu-here.json").write_text(json.dumps(doc))
    lz.configure(use_shipped_timings=True, shipped_timings_dir=str(directory))


def test_shipped_records_turn_the_collective_choice(one_rank, tmp_path):
    x = torch.randn(1000)  # 4,000 bytes -> bucket 4096
    before = lz.explain("all_reduce", x)
    assert before.chosen == "torch_dist.all_reduce"  # priority 50 over the reference's 0
    # measured (by hand) 10x faster: the reference wins; the shipped term is what changed the choice
    _file(tmp_path / "d", [(before.context, {"torch_dist.all_reduce": 100.0, "reference.all_reduce": 10.0})])
    after = lz.explain("all_reduce", x)
    assert after.chosen == "reference.all_reduce", str(after)
    assert "shipped timings: cpu-here.json, exact bucket" in str(after)
    # another group of the same world size and transport: same bucket (its name is not part of it)
    other = one_rank.new_group([0])
    assert str(other.group_name) != str(one_rank.group.WORLD.group_name)
    assert lz.which("all_reduce", x, group=other) == "reference.all_reduce"
    # 16 KiB was not measured: the nearest record (4 KiB, two doublings away) still decides
    assert lz.which("all_reduce", torch.randn(4000)) == "reference.all_reduce"
    # 256 KiB is six doublings away: past shipped.MAX_DISTANCE, hand priorities again
    assert lz.which("all_reduce", torch.randn(64000)) == "torch_dist.all_reduce"


def test_committed_h200_records_match_the_measurement():
    doc = json.loads((ROOT / "src/layerzero/data/timings/nvidia-h200.json").read_text())
    measured = json.loads(MEASURED.read_text())
    assert doc["fingerprint"]["torch"] == measured["meta"]["torch"]
    assert doc["backends"]["symm_mem"] == doc["backends"]["torch_dist"] == measured["meta"]["torch"]
    shipped.parse((ROOT / "src/layerzero/data/timings/nvidia-h200.json").read_text(), "nvidia-h200.json")
    defaults = doc["defaults"]["all_reduce"]
    assert defaults["world_size"] == 2 and defaults["comm_backend"] == "nccl" and "comm_group" not in defaults
    recs = {
        (r[1]["message_bytes"], r[1]["graph_capture"]): r[2] for r in doc["records"] if r[0] == "all_reduce"
    }
    assert len(recs) == 2 * len(measured["rows"])
    for row in measured["rows"]:
        for capture, key in ((True, "graph_us"), (False, "eager_us")):
            med = recs[(row["bytes"], capture)]
            for k, v in row.items():
                if isinstance(v, dict) and "." in k and key in v:
                    assert med[k] == pytest.approx(v[key], abs=0.01)
                elif isinstance(v, dict) and "refused" in v:
                    assert k not in med  # one-shot past 1 MiB, two-shot past the 8 MiB buffer
    # what the hand priorities pick in a graph is the measured fastest, or within the 10% tie margin
    for (nbytes, capture), med in recs.items():
        if capture:
            best = min(med.values())
            pick = "symm_mem.one_shot_push" if nbytes <= 1 << 20 else "symm_mem.two_shot"
            pick = pick if pick in med else "torch_dist.all_reduce"
            assert med[pick] <= 1.1 * best, (nbytes, med)
