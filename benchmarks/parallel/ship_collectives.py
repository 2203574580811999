"""Install measured ``lz.all_reduce`` timings (``bench_collectives.py``'s ``collectives.json``) as shipped
timing records in a device's data file (``src/layerzero/data/timings/<device>.json``; format:
``layerzero/core/shipped.py``), so selection scores the collective kernels by what they took on that machine,
per message size, world size and whether a CUDA graph is being captured, instead of by hand priorities alone.

One record per (message bytes, graph capture): the graph timings (32 calls in one graph) for
``graph_capture=True`` and the eager ones for ``False``; a kernel that refused the size has no median there.
The file's earlier ``all_reduce`` records are replaced; its fingerprint must match the measurement's torch
version (the data file and the collectives must come from the same image).

    PYTHONPATH=src python benchmarks/parallel/ship_collectives.py \\
        benchmarks/results/parallel/h200x2_2026-11-29/collectives.json \\
        --into src/layerzero/data/timings/nvidia-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

KERNELS = ("torch_dist.all_reduce", "symm_mem.one_shot", "symm_mem.two_shot", "symm_mem.one_shot_push")
BACKENDS = ("torch_dist", "symm_mem")  # both report torch's version


def records(measured: dict[str, Any]) -> tuple[dict[str, Any], list[list[Any]]]:
    """(the op's defaults, records) of ``collectives.json``'s rows, as :func:`layerzero.core.shipped.parse`
    reads them."""
    from layerzero.core.context import SelectionContext
    from layerzero.core.device import DeviceSpec
    from layerzero.core.shipped import bucket_fields

    world = int(measured["meta"]["world"])
    out = []
    for row in measured["rows"]:
        for capture, key in ((True, "graph_us"), (False, "eager_us")):
            med = {k: round(float(row[k][key]), 2) for k in KERNELS if key in row.get(k, {})}
            if not med:
                continue
            ctx = SelectionContext(
                op="all_reduce",
                device=DeviceSpec.detect("cpu"),
                dtype=torch.bfloat16,
                reduction="sum",
                world_size=world,
                comm_backend="nccl",
                comm_group="0",
                message_bytes=int(row["bytes"]),
                graph_capture=capture,
            )
            out.append(bucket_fields(ctx) | {"_med": med})
    common = {k: v for k, v in out[0].items() if k != "_med" and all(r.get(k) == v for r in out)}
    recs = [
        ["all_reduce", {k: v for k, v in r.items() if k != "_med" and k not in common}, r["_med"]]
        for r in out
    ]
    return common, recs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("collectives", type=Path)
    ap.add_argument("--into", type=Path, required=True)
    a = ap.parse_args(argv)
    measured = json.loads(a.collectives.read_text())
    doc = json.loads(a.into.read_text())
    torch_version = measured["meta"]["torch"]
    if doc["fingerprint"].get("torch") != torch_version:
        raise SystemExit(
            f"{a.into}: fingerprint torch {doc['fingerprint'].get('torch')!r}, measured with "
            f"{torch_version!r}: measure the collectives on the image the data file was made with"
        )
    common, recs = records(measured)
    doc["defaults"]["all_reduce"] = common
    doc["records"] = [r for r in doc["records"] if r[0] != "all_reduce"] + recs
    for b in BACKENDS:
        doc["backends"][b] = torch_version
    doc.setdefault("notes", []).append(
        f"all_reduce: {a.collectives.as_posix()} ({measured['meta']['date']}, world "
        f"{measured['meta']['world']})"
    )
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ship_timings import dump_document  # one record per line, checked by shipped.parse

    dump_document(doc, a.into)
    print(f"{a.into}: {len(recs)} all_reduce records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
