"""lz.all_reduce on 2 GPUs: symm_mem one-shot / two-shot / one-shot push against NCCL and the float64 oracle,
the choice by message size, CUDA-graph capture and replay of each kernel, the push kernel raced through
changing sizes eagerly and in a graph (bitwise equal on every rank); every collective op over NCCL against the
oracle (the scenario: tests/distributed/_coll_gpu.py). Run by hand on a 2-GPU host (NVLink multicast stays
off)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from _coll_harness import spawn  # noqa: E402 - the shared harness lives in tests/distributed

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (symm_mem vs NCCL)")
@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_nccl_available(),
    reason="needs torch.distributed with NCCL",
)
def test_symm_mem_all_reduce_against_nccl_on_two_gpus(tmp_path):
    for r in spawn(2, tmp_path, backend="nccl", limit_s=300):
        assert not r["nccl_bad"], r["nccl_bad"]
        assert r["multicast_env"] == "1"
        if not r["p2p"]:
            pytest.skip(f"no CUDA peer access between the GPUs: {r['why_not']}")
        small = {"symm_mem.one_shot_push", "symm_mem.one_shot"}  # by the shipped H200 timings
        assert r["which"]["1000"] in small and r["which"]["65536"] in small, r["which"]
        assert r["which"]["1048576"] == "symm_mem.two_shot", r["which"]
        assert r["which"]["8388608"] == "torch_dist.all_reduce", r["which"]
        assert r["push_race"]["same_bits"] and r["push_race"]["err"] < 2e-2, r["push_race"]
        for key, err in r["err"].items():
            if key.startswith("symm_mem.one_shot") and key.endswith(("1048576", "8388608")):
                assert err == "NoKernelFoundError", (key, err)  # over one-shot's 1 MiB limit
            elif key.startswith("symm_mem.two_shot") and key.endswith("8388608"):
                assert err == "NoKernelFoundError", (key, err)  # over the 8 MiB buffer
            else:
                assert isinstance(err, float) and err < 2e-2, (key, err)
        assert all(v <= 0.0625 for v in r["vs_nccl"].values()), r["vs_nccl"]  # bf16 summation order
        for k, (first, second) in r["graph"].items():
            assert first < 1e-2 and second < 1e-1, (k, first, second)
        assert r["which_after_disable"] == "torch_dist.all_reduce"
