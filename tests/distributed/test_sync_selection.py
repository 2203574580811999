"""lz.distributed.sync_selection: every rank runs rank 0's kernel (TP-invariant mode), over Gloo on CPU.

Multi-process tests spawn 2 and 4 ranks (tests/distributed/_dist_harness.py) whose local views differ on
purpose (a lock, a policy file, a lower free memory, PerfDB measurements); single-process tests use a 1-rank
Gloo group for what needs no peer (no communication on cache hits, explain notes, errors without a process
group).
"""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest
import torch
from _dist_harness import check_main, spawn

import layerzero as lz

pytestmark = pytest.mark.distributed


def test_two_ranks_follow_rank_0(tmp_path):
    check_main(spawn("main", 2, tmp_path), 2)


def test_four_ranks_follow_rank_0(tmp_path):
    check_main(spawn("main", 4, tmp_path, limit_s=120), 4)


def test_a_call_only_one_rank_makes_fails_typed_instead_of_hanging(tmp_path):
    results = spawn("extra_call", 2, tmp_path, pg_timeout_s=3.0)
    extra = results[1]["extra"]
    assert extra["type"] == "DistributedSelectionError" and extra["rank"] == 1, extra
    assert "SPMD" in extra["message"] and "rms_norm" in extra["message"]
    assert results[1]["waited_s"] < 20


def test_collectives_out_of_step_fail_typed_on_both_sides(tmp_path):
    r0, r1 = (r["error"] for r in spawn("out_of_step", 2, tmp_path))
    assert (r0["type"], r0["rank"], r0["field"], r0["got"]) == (
        "DistributedMismatchError",
        1,
        "kind",
        "lz.selection",
    ), r0
    assert (r1["type"], r1["rank"], r1["field"]) == ("DistributedMismatchError", 0, "collective"), r1
    assert "out of step" in r1["message"]


# ---------------------------------------------------------------------------------------------- one process
@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'init'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        yield
    finally:
        lz.distributed.unsync()
        dist.destroy_process_group()


def test_cache_hits_and_kept_decisions_do_not_communicate(one_rank_group, monkeypatch):
    import torch.distributed as dist

    from layerzero.core.runtime import RUNTIME

    x, w = torch.randn(4, 32), torch.ones(32)
    sync = lz.distributed.sync_selection()
    assert RUNTIME.coordinator is sync and lz.distributed.current() is sync
    first = lz.rms_norm(x, w)
    assert len(sync.decisions()) == 1

    def no_collective(*a, **k):
        raise AssertionError("a collective ran on a cache hit or a kept decision")

    monkeypatch.setattr(dist, "all_gather_object", no_collective)
    torch.testing.assert_close(lz.rms_norm(x, w), first)  # hit
    lz.configure(log_fallbacks=False)  # a configuration change invalidates the cache; the decision is kept
    torch.testing.assert_close(lz.rms_norm(x, w), first)
    with pytest.raises(lz.DistributedSelectionError, match="collective") as err:
        lz.rms_norm(torch.randn(4, 48), torch.ones(48))  # a new key needs the collective
    assert err.value.rank == 0


def test_context_manager_and_unsync(one_rank_group):
    from layerzero.core.runtime import RUNTIME

    with lz.distributed.sync_selection() as sync:
        assert sync.active and sync.world_size == 1
    assert not sync.active and RUNTIME.coordinator is None and lz.distributed.current() is None
    assert lz.distributed.unsync() is False
    lz.distributed.sync_selection()
    assert lz.distributed.unsync() is True


def test_locked_choice_keeps_lock_semantics_under_sync(one_rank_group):
    x, w = torch.randn(4, 32), torch.ones(32)
    lz.lock("rms_norm", "reference.rms_norm")
    lz.distributed.sync_selection()
    assert lz.which("rms_norm", x, w) == "reference.rms_norm"
    plan = lz.select("rms_norm", x, w)
    assert plan.locked and plan.fallbacks == ()


def test_sync_needs_an_initialized_process_group():
    with pytest.raises(lz.ConfigurationError, match="init_process_group"):
        lz.distributed.sync_selection()


def test_errors_are_typed():
    assert issubclass(lz.DistributedMismatchError, lz.ConfigurationError)
    assert issubclass(lz.DistributedSelectionError, lz.LayerZeroError)
    assert issubclass(lz.DistributedSelectionError, RuntimeError)
    assert lz.distributed.DistributedMismatchError is lz.DistributedMismatchError


def test_import_layerzero_does_not_import_the_distributed_module():
    code = (
        "import sys, layerzero as lz; assert 'layerzero.distributed' not in sys.modules; "
        "lz.distributed.sync_selection; assert 'layerzero.distributed' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
