"""Narrow batch-1 decode graphs (``CudaGraphKnobs.narrow_tokens``, ``ModelRunner.narrow``): a one-sequence
decode step whose block table fits the narrow graphs' width is packed into and replayed by them; a wider
table, two sequences or a step built the ordinary way that does not fit goes to the main graphs; on by default
(2048 tokens), not captured when the main graphs are no wider. On CPU, the graph replays stubbed (as in
``test_packed_inputs.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerzero.engine import SamplingParams
from layerzero.engine.config import CudaGraphKnobs
from layerzero.engine.core.sched.output import SamplingMetadata, SchedulerOutput
from layerzero.engine.worker.cuda_graph import CUDAGraphRunner
from layerzero.engine.worker.input_batch import ScheduledChunk, build_forward_batch
from layerzero.engine.worker.model_runner import ModelRunner

from .test_packed_inputs import stubbed_runner

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")
BLOCK = 4


def _stubbed(max_num_seqs: int, width: int, tag: float) -> CUDAGraphRunner:
    """A stubbed runner whose logits are ``tag`` everywhere in every lane (which runner replayed)."""
    return stubbed_runner(max_num_seqs, width, lambda s: torch.full((s, 3), tag), lane_step=0.0)


@pytest.fixture
def runner() -> ModelRunner:
    """A ModelRunner (no model) with main graphs (4 sequences, tables of 8 blocks) and narrow ones (1, 2
    blocks)."""
    mr = ModelRunner.__new__(ModelRunner)
    mr.graphs, mr.narrow = _stubbed(4, 8, 1.0), _stubbed(1, 2, 2.0)
    mr._lane, mr.block_size, mr.device, mr.cascade = 0, BLOCK, CPU, None
    mr.cascade_steps = mr.cascade_saved_tokens = 0
    return mr


def _step(*lengths: int) -> SchedulerOutput:
    """A decode step of sequences with ``lengths`` tokens (the last one's KV not yet computed), as the
    scheduler sends it."""
    n = len(lengths)
    return SchedulerOutput(
        [f"r{i}" for i in range(n)],
        list(range(n)),
        [k - 1 for k in lengths],
        [1] * n,
        [[k] for k in lengths],
        [None] * n,
        [True] * n,
        _tables(*lengths),
        sampling=SamplingMetadata([SamplingParams()] * n, [None] * n, [0] * n, [None] * n, [None] * n),
    )


def _tables(*lengths: int) -> np.ndarray:
    w = max(-(-n // BLOCK) for n in lengths)
    return np.array([[i * 8 + j for j in range(w)] for i, _ in enumerate(lengths)], dtype=np.int32)


def test_a_short_single_sequence_runs_on_the_narrow_graphs(runner):
    for step in range(3):  # alternate lanes, every one the narrow runner's
        out = runner.execute(_step(7)).logits
        assert out.shape == (1, 3) and bool((out == 2.0).all()), step
    assert sum(g.replays for g in runner.narrow.lane_graphs.values()) == 3
    assert sum(g.replays for g in runner.graphs.lane_graphs.values()) == 0


@pytest.mark.parametrize("lengths", [(9,), (7, 5)], ids=["wider-table", "two-sequences"])
def test_wider_tables_and_bigger_batches_run_on_the_main_graphs(runner, lengths):
    out = runner.execute(_step(*lengths)).logits
    assert out.shape == (len(lengths), 3) and bool((out == 1.0).all())
    assert sum(g.replays for g in runner.narrow.lane_graphs.values()) == 0


def test_graphs_for_an_ordinary_batch_by_width(runner):
    """A step built the ordinary way (not packed): the narrow graphs take it when its table fits them."""

    def batch(n):
        chunk = ScheduledChunk(list(range(n)), n - 1, 1, (), True)
        return build_forward_batch([chunk], BLOCK, CPU, None, None, _tables(n))

    assert runner.graphs_for(batch(8)) is runner.narrow and runner.graphs_for(batch(9)) is runner.graphs
    runner.narrow = None
    assert runner.graphs_for(batch(8)) is runner.graphs


def test_default_width_is_the_small_tile_bound():
    """The narrow graphs exist to give short sequences ``triton.paged_decode``'s batch-1 small tiles: as wide
    as the widest table those apply to (wider and they would not apply; narrower and fewer steps would get
    them)."""
    from layerzero.backends.triton.paged import PagedDecodeKnobs

    assert CudaGraphKnobs().narrow_tokens == PagedDecodeKnobs().small_batch[1] == 2048


def test_only_for_wider_main_graphs_and_off_with_none(monkeypatch):
    mr = ModelRunner.__new__(ModelRunner)
    assert mr._narrow_graphs(40960, 16, CPU, CudaGraphKnobs(narrow_tokens=None)) is None
    captured: list[tuple[int, int]] = []
    knobs = CudaGraphKnobs()  # narrow_tokens 2048
    monkeypatch.setattr(
        CUDAGraphRunner, "capture", lambda self: captured.append((self.sizes[-1], self.block_tables.shape[1]))
    )
    mr.model, mr.kv_caches = torch.nn.Identity(), []
    assert mr._narrow_graphs(2048, 16, CPU, knobs) is None and mr._narrow_graphs(2040, 16, CPU, knobs) is None
    narrow = mr._narrow_graphs(2064, 16, CPU, knobs)
    assert narrow is not None and captured == [(1, 128)]  # one sequence, 2048 / 16 blocks
    assert narrow.knobs is knobs  # the narrow graphs take the engine's knobs too
