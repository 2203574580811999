"""lz.distributed.sync_selection on two GPUs over NCCL: the checks of tests/distributed/test_sync_selection.py
(ranks that differ on purpose all run rank 0's kernels, bit-identical outputs, float64 oracle, typed errors on
every rank, unsync, version refusal), with CUDA inputs (float16 attention) and a CUDA-graph capture after sync
that must run no collective (the capture-time choice was decided, collectively, on the first eager call)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from _dist_harness import check_main, spawn  # noqa: E402 - the shared harness lives in tests/distributed

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_nccl_available(),
    reason="needs torch.distributed with NCCL",
)
def test_two_gpus_follow_rank_0_over_nccl(tmp_path):
    results = spawn("main", 2, tmp_path, backend="nccl", limit_s=400)
    check_main(results, 2)
    assert all(r["graph_ok"] for r in results)
    assert all(r["tol"] == 5e-3 for r in results)  # float16 attention on CUDA
