"""The engine's symmetric-memory set-up decision (``parallel.launch.enable_symm_all_reduce``): the ranks agree
through an all-reduce MIN; any rank with ``LAYERZERO_SYMM_MEM=0`` or one that set symmetric memory up before
in its process keeps every rank on NCCL (a second engine in one process hung in PyTorch's rendezvous on two
H200s). The collective and the allocation are stand-ins here: what is checked is the decision each rank
reports and that no rank allocates unless all agreed; the real allocation runs in tests/gpu."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from layerzero.engine.parallel import launch
from layerzero.engine.parallel.state import ParallelState

TP2 = ParallelState(tp_rank=0, tp_size=2)
CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake(monkeypatch):
    """Stand-ins: the other rank's vote (``other``) for the MIN, and a recorder of allocations."""
    state = SimpleNamespace(other=2, allocated=[], votes=[])

    def all_reduce_min(value, parallel, device):
        state.votes.append(value)
        return min(value, state.other)

    def enable_symm_mem(group=None, *, max_bytes):
        state.allocated.append(max_bytes)
        return SimpleNamespace(p2p=True, why_not="")

    monkeypatch.setattr(launch, "all_reduce_min", all_reduce_min)
    monkeypatch.setattr(launch.lz.distributed, "enable_symm_mem", enable_symm_mem)
    monkeypatch.setattr(launch, "_symm_set_up", 0)
    monkeypatch.delenv("LAYERZERO_SYMM_MEM", raising=False)
    return state


def test_first_engine_sets_up_second_keeps_nccl(fake, caplog):
    assert launch.enable_symm_all_reduce(TP2, CUDA) is True
    assert fake.allocated == [launch.SYMM_MEM_BYTES]
    with caplog.at_level(logging.WARNING, logger="layerzero.engine"):
        assert launch.enable_symm_all_reduce(TP2, CUDA) is False
    assert fake.votes == [2, 1] and len(fake.allocated) == 1
    assert "earlier engine" in caplog.text


def test_a_rank_that_set_up_before_keeps_every_rank_on_nccl(fake):
    fake.other = 1  # the peer's process had an engine before: this fresh rank must not allocate alone
    assert launch.enable_symm_all_reduce(TP2, CUDA) is False
    assert fake.allocated == []


def test_env_off_on_any_rank(fake, monkeypatch):
    monkeypatch.setenv("LAYERZERO_SYMM_MEM", "0")
    assert launch.enable_symm_all_reduce(TP2, CUDA) is False
    fake.other, fake.votes = 0, []
    monkeypatch.delenv("LAYERZERO_SYMM_MEM")
    assert launch.enable_symm_all_reduce(TP2, CUDA) is False  # the peer turned it off
    assert fake.votes == [2] and fake.allocated == []


def test_nothing_on_cpu_or_one_rank(fake):
    assert launch.enable_symm_all_reduce(TP2, torch.device("cpu")) is False
    assert launch.enable_symm_all_reduce(ParallelState(), CUDA) is False
    assert fake.votes == [] and fake.allocated == []
