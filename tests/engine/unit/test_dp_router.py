"""``DPRouter`` (data-parallel request routing) on cases worked out by hand: least loaded first, a shared
prefix goes to the replica that holds it unless that replica is too busy, whole blocks only, LRU memory."""

from __future__ import annotations

import pytest

import layerzero as lz
from layerzero.engine.frontend.dp_router import DPRouter


def test_least_loaded_then_freed():
    r = DPRouter(3, 4)
    assert [r.pick(f"r{i}", [i] * 3) for i in range(4)] == [0, 1, 2, 0]  # 3 tokens: no full block
    assert r.load == [2, 1, 1]
    r.finished("r1")
    r.finished("r1")  # twice: ignored
    r.finished("unknown")
    assert r.load == [2, 0, 1] and r.replica_of("r1") is None and r.replica_of("r3") == 0
    assert r.pick("r4", [9]) == 1


def test_a_shared_prefix_follows_its_replica():
    r = DPRouter(2, 4)
    sys_prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    assert r.pick("a", sys_prompt + [10]) == 0
    assert r.pick("b", [50, 51, 52, 53, 54]) == 1  # no match: least loaded
    assert r.pick("c", [60]) == 0  # loads were 1, 1: the first least loaded
    # loads 2, 1: replica 0 holds the 2-block prefix and is within the slack (4) of the least loaded
    assert r.pick("d", sys_prompt + [11, 12]) == 0 and r.prefix_routed == 1
    # a match of one block of the other prompt is a match too (the deepest remembered block decides)
    assert r.pick("e", [50, 51, 52, 53, 99]) == 1 and r.prefix_routed == 2
    # the first block differs: no match at all, even though the second equals a remembered second block
    assert r.pick("f", [0, 2, 3, 4, 5, 6, 7, 8]) == 1 and r.prefix_routed == 2


def test_load_wins_beyond_the_slack():
    r = DPRouter(2, 2, balance_slack=1)
    p = [7, 7, 7, 7]
    assert r.pick("a", p) == 0
    assert r.pick("b", p) == 0  # loads 1, 0: 1 <= 0 + 1
    assert r.pick("c", p) == 1  # loads 2, 0: too busy, the least loaded takes it (and now owns the blocks)
    assert r.pick("d", p) == 1  # loads 2, 1: the owner is replica 1 now, within the slack


def test_memory_is_bounded_lru():
    r = DPRouter(2, 1, max_blocks=3)
    r.pick("a", [1, 2, 3])  # blocks (1), (1,2), (1,2,3) -> replica 0
    r.finished("a")
    r.pick("b", [9])  # replica 0 (loads 0, 0); evicts the oldest block, (1)
    r.finished("b")
    r.load = [0, 5]  # make replica 1 look busy: only a remembered prefix could send a request there
    assert r.pick("c", [1, 2, 3]) == 0 and r.prefix_routed == 0  # (1) forgotten: the chain starts unmatched


@pytest.mark.parametrize(
    "kw", [{"num_replicas": 0}, {"block_size": 0}, {"balance_slack": -1}, {"max_blocks": True}]
)
def test_bad_arguments_are_typed(kw):
    args = {"num_replicas": 2, "block_size": 16} | kw
    with pytest.raises(lz.ConfigurationError, match="DPRouter"):
        DPRouter(args.pop("num_replicas"), args.pop("block_size"), **args)
