"""Packed decode inputs (``CudaGraphKnobs.packed_inputs``): a small decode bucket's graph reads its inputs
from one buffer that the step's single host-to-device copy writes. On CPU (the graph replay stubbed): the
packed batch equals the ordinary one in its rows, the padding rows are what a replay expects, the tables'
unused columns are 0 even after a wider step, pending ids are gathered into the buffer, the runner's views
alias what the copy wrote, a cascade step and big buckets keep the copy path, and a step built the ordinary
way for a packed bucket is copied into that bucket's buffer (never into buffers its graph does not read)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerzero import InvalidInputError
from layerzero.engine.config import CudaGraphKnobs
from layerzero.engine.worker.cascade import CascadePolicy
from layerzero.engine.worker.cuda_graph import CUDAGraphRunner, pack_nbytes
from layerzero.engine.worker.input_batch import (
    ScheduledChunk,
    build_forward_batch,
    build_packed_decode_batch,
)
from layerzero.engine.worker.staging import offsets

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")
FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens")
LANES = CudaGraphKnobs().lanes


class _Graph:
    """A captured graph stand-in: counts replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def stubbed_runner(max_num_seqs: int, width: int, outputs, lane_step: float = 1.0) -> CUDAGraphRunner:
    """A :class:`CUDAGraphRunner` on CPU (default knobs: packed inputs, two lanes) as if captured: every plain
    graph a :class:`_Graph`, bucket ``s``'s logits ``outputs(s)`` (lane ``l``'s plus ``l * lane_step``)."""
    r = CUDAGraphRunner(torch.nn.Identity(), [], max_num_seqs, width, CPU)
    r.graphs = {s: _Graph() for s in r.sizes}
    r.outputs = {s: outputs(s) for s in r.sizes}
    r.lane_graphs = {
        (s, lane): r.graphs[s] if lane == 0 else _Graph() for s in r.packs for lane in range(LANES)
    }
    r.lane_outputs = {(s, lane): r.outputs[s] + lane * lane_step for s in r.packs for lane in range(LANES)}
    return r


@pytest.fixture
def runner() -> CUDAGraphRunner:
    # buckets 1, 2, 4, 8, 16, 24, 32, 40, 48; width 6
    return stubbed_runner(48, 6, lambda s: torch.arange(s * 3, dtype=torch.float32).view(s, 3))


def _decode(pending=None):
    """Three decode chunks of block size 4 (tables [6, 2], [4], [1, 5, 3]); the second one's token pending."""
    return [
        ScheduledChunk([1, 2, 3, 4, 5], 4, 1, (), True),
        ScheduledChunk([9, 8, 7], 2, 1, (), True, pending_src=1 if pending is not None else None),
        ScheduledChunk(list(range(10)), 9, 1, (), True),
    ]


TABLES = np.array([[6, 2, 0], [4, 0, 0], [1, 5, 3]], dtype=np.int32)


def test_packed_batch_equals_the_ordinary_one_and_pads_the_bucket(runner):
    prev = torch.tensor([70, 71])
    target = runner.pack_for(3, TABLES.shape[1])
    assert target is not None and target.bs == 4 and target.width == 6
    packed = build_packed_decode_batch(_decode(prev), 4, TABLES, prev, target)
    plain = build_forward_batch(_decode(prev), 4, CPU, prev, tables=TABLES)
    assert packed.packed and not plain.packed and packed.num_seqs == 3
    for f in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        assert torch.equal(getattr(packed, f), getattr(plain, f)), f
    assert packed.input_ids.tolist() == [5, 71, 9]  # the pending id gathered from the previous step
    assert (
        torch.equal(packed.block_tables[:, :3], plain.block_tables) and not packed.block_tables[:, 3:].any()
    )
    assert packed.logits_indices.tolist() == [0, 1, 2] and packed.cu_seqlens_q is None
    ids, pos, slots, tables, lens = runner._packed_views(4)  # what the bucket's graph reads
    assert (
        ids.data_ptr() == packed.input_ids.data_ptr() and tables.data_ptr() == packed.block_tables.data_ptr()
    )
    assert slots.tolist() == [
        2 * 4 + 0,
        4 * 4 + 2,
        3 * 4 + 1,
        -1,
    ]  # block of position // 4, offset position % 4
    assert lens.tolist() == [5, 3, 10, 1] and not tables[3].any() and ids[3] == 0
    replays = runner.graphs[4].replays
    assert torch.equal(runner.run(packed), runner.outputs[4][:3]) and runner.graphs[4].replays == replays + 1


def test_every_id_pending_is_one_gather_into_the_buffer(runner):
    """Async decode: every chunk's token pending (rows 0..n-1 in order) takes the one-kernel gather straight
    into the buffer; the ids equal the per-row gather's."""
    prev = torch.tensor([40, 41, 42, 43])
    chunks = [
        ScheduledChunk([1, 2, 3, 4, 5], 4, 1, (), True, pending_src=3),
        ScheduledChunk([9, 8, 7], 2, 1, (), True, pending_src=0),
    ]
    tables = TABLES[:2]
    packed = build_packed_decode_batch(chunks, 4, tables, prev, runner.pack_for(2, 3))
    plain = build_forward_batch(chunks, 4, CPU, prev, tables=tables)
    assert packed.input_ids.tolist() == plain.input_ids.tolist() == [43, 40]
    assert runner._packed_views(2)[0].tolist() == [43, 40]


def test_a_narrower_step_leaves_no_stale_columns(runner):
    wide = np.array([[6, 2, 9, 9, 9, 9]], dtype=np.int32)
    one = [ScheduledChunk(list(range(30)), 20, 1, (), True)]
    build_packed_decode_batch(one, 4, wide, None, runner.pack_for(1, 6))
    narrow = build_packed_decode_batch(
        [ScheduledChunk([1, 2, 3], 2, 1, (), True)],
        4,
        np.array([[8]], dtype=np.int32),
        None,
        runner.pack_for(1, 1),
    )
    assert narrow.block_tables.tolist() == [[8, 0, 0, 0, 0, 0]]


def test_layout_matches_the_staging_offsets(runner):
    sizes = pack_nbytes(8, 6)
    offs, total = offsets(sizes)
    assert (
        [b.numel() for b in runner.packs[8]] == [total] * LANES
        and offs[3] == 3 * 64
        and sizes[3] == 8 * 6 * 4
    )
    assert len(runner.packs[16]) == 1 and runner.pack_for(9, 6, 1).lane == 0  # above lane_max_batch: one lane
    ids, pos, slots, tables, lens = runner._packed_views(8)
    assert tables.shape == (8, 6) and lens.dtype == torch.int32 and slots.dtype == torch.int64
    assert slots.tolist() == [-1] * 8 and lens.tolist() == [1] * 8  # a capture's dummy step


def test_big_buckets_and_cascade_steps_keep_the_copy_path(runner):
    knobs = CudaGraphKnobs(pack_max_bytes=offsets(pack_nbytes(8, 6))[1])
    r = CUDAGraphRunner(torch.nn.Identity(), [], 48, 6, CPU, knobs=knobs)
    r.graphs = {s: _Graph() for s in r.sizes}
    assert set(r.packs) == {1, 2, 4, 8} and r.pack_for(9, 3) is None and r.pack_for(8, 3).bs == 8
    assert r.pack_for(2, 7) is None  # wider than the graphs' tables
    shared = [
        ScheduledChunk(list(range(20)), 19, 1, (), True) for _ in range(2)
    ]  # two sequences, same 4 blocks
    tables = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], dtype=np.int32)
    policy = CascadePolicy(always=True)
    casc = build_packed_decode_batch(shared, 4, tables[:, :5], None, r.pack_for(2, 5), policy)
    plain = build_forward_batch(shared, 4, CPU, None, policy, tables[:, :5])
    assert (
        not casc.packed and casc.cascade is not None and casc.logits_all
    )  # built as build_forward_batch builds it
    for name in FIELDS:
        assert torch.equal(getattr(casc, name), getattr(plain, name)), name
    assert torch.equal(casc.cascade.prefix_tables, plain.cascade.prefix_tables)
    assert casc.cascade.saved_tokens == plain.cascade.saved_tokens
    with pytest.raises(InvalidInputError, match="one row per chunk"):
        build_packed_decode_batch(shared, 4, tables[:1], None, r.pack_for(2, 5))


def test_an_ordinary_batch_for_a_packed_bucket_lands_in_its_buffer(runner):
    """Whatever builds the batch, the bucket's graph reads its packed buffer: run() copies there."""
    plain = build_forward_batch(_decode(), 4, CPU, tables=TABLES)
    runner.run(plain)
    ids, pos, slots, tables, lens = runner._packed_views(4)
    assert ids[:3].tolist() == [5, 7, 9] and lens.tolist() == [5, 3, 10, 1] and slots[3] == -1
    assert tables[:3, :3].tolist() == TABLES.tolist()


def test_on_by_default_and_off_packs_nothing():
    assert (
        CudaGraphKnobs().packed_inputs is True and CUDAGraphRunner(torch.nn.Identity(), [], 8, 4, CPU).packs
    )
    r = CUDAGraphRunner(torch.nn.Identity(), [], 8, 4, CPU, knobs=CudaGraphKnobs(packed_inputs=False))
    r.graphs = {s: _Graph() for s in r.sizes}
    assert r.packs == {} and r.pack_for(1, 2) is None


def _greedy(runner, bs: int, lane: int, tokens: list[int]) -> torch.Tensor:
    """Give (bucket ``bs``, ``lane``) a stub greedy graph whose last replay sampled ``tokens``: written into
    the other lane's id slots, as the real graph does. Returns those slots (what the sampler's caller got)."""
    runner.greedy_graphs[bs, lane] = _Graph()
    runner.greedy_outputs[bs, lane] = torch.full((bs, 3), 7.0)
    ids = runner._targets[bs, (lane + 1) % LANES].views[0]
    ids.copy_(torch.tensor(tokens))
    return ids


def _steady(n: int) -> list[ScheduledChunk]:
    """``n`` decode chunks, chunk i's token pending from row i of the previous step (steady decode)."""
    return [ScheduledChunk(list(range(5 + i)), 4 + i, 1, (), True, pending_src=i) for i in range(n)]


def test_lanes_have_their_own_buffers_and_views(runner):
    a, b = runner.pack_for(3, 2, 0), runner.pack_for(3, 2, 1)
    assert (a.bs, a.lane, b.bs, b.lane) == (4, 0, 4, 1) and a.buffer.data_ptr() != b.buffer.data_ptr()
    assert runner._packed_views(4, 1)[0].data_ptr() == b.buffer.data_ptr()
    batch = build_packed_decode_batch(_decode(), 4, TABLES, None, b)
    assert batch.lane == 1 and batch.input_ids.data_ptr() == b.buffer.data_ptr()
    out = runner.run(batch)  # lane 1's plain graph, not lane 0's
    assert runner.lane_graphs[4, 1].replays == 1 and runner.graphs[4].replays == 0
    assert torch.equal(out, runner.lane_outputs[4, 1][:3])


def test_a_chained_step_keeps_the_ids_the_greedy_graph_wrote(runner):
    """Every row pending from the same row of the previous step, which was the other lane's greedy graph: the
    ids in this lane's slots (where that graph wrote them) are used as they are, no gather and no copy over
    them; the rest of the step is copied as always."""
    tok = _greedy(runner, 4, 0, [50, 51, 52, 53])
    tables = np.array([[3, 2], [4, 1], [5, 6]], dtype=np.int32)
    buf = runner.pack_for(3, 2, 1).buffer
    before = buf.clone()
    batch = build_packed_decode_batch(_steady(3), 4, tables, tok[:3], runner.pack_for(3, 2, 1))
    assert batch.input_ids.tolist() == [50, 51, 52] and batch.input_ids.data_ptr() == tok.data_ptr()
    assert torch.equal(buf[:32], before[:32])  # the id slots' bytes untouched (4 x int64)
    assert batch.positions.tolist() == [4, 5, 6] and batch.seq_lens.tolist() == [5, 6, 7]
    assert batch.slot_mapping.tolist() == [2 * 4 + 0, 1 * 4 + 1, 6 * 4 + 2]
    # the same step with the same ids from another tensor is gathered, in this lane or the other
    for lane in (1, 0):
        runner._packed_views(4, lane)[0].fill_(0)
        batch = build_packed_decode_batch(
            _steady(3), 4, tables, torch.tensor([50, 51, 52]), runner.pack_for(3, 2, lane)
        )
        assert batch.input_ids.tolist() == [50, 51, 52]


def test_an_unchained_step_reads_the_ids_before_overwriting_them(runner):
    """The previous step's ids are this lane's id slots (the other lane's greedy graph wrote them there), but
    the rows moved (or one is new): the step's copy rewrites those slots, so the gather must read them
    first."""
    tables = np.array([[3, 2], [4, 1], [5, 6]], dtype=np.int32)
    swapped = _steady(3)
    swapped[0], swapped[1] = (
        ScheduledChunk(c.token_ids, c.start, 1, (), True, pending_src=s)
        for c, s in ((swapped[0], 1), (swapped[1], 0))
    )
    tok = _greedy(runner, 4, 0, [50, 51, 52, 53])
    target = runner.pack_for(3, 2, 1)
    assert build_packed_decode_batch(swapped, 4, tables, tok[:3], target).input_ids.tolist() == [51, 50, 52]
    tok = _greedy(runner, 4, 0, [50, 51, 52, 53])
    fresh = _steady(2) + [ScheduledChunk([9, 8, 7], 2, 1, (), True)]  # a row whose id the host knows
    assert build_packed_decode_batch(fresh, 4, tables, tok[:3], target).input_ids.tolist() == [50, 51, 7]


def test_run_greedy_replays_the_greedy_graph_of_a_packed_batch(runner):
    tok = _greedy(runner, 4, 0, [50, 51, 52, 53])
    packed = build_packed_decode_batch(_decode(), 4, TABLES, None, runner.pack_for(3, 3, 0))
    logits, ids, host, event = runner.run_greedy(packed)
    assert runner.greedy_graphs[4, 0].replays == 1 and runner.lane_graphs[4, 0].replays == 0
    assert logits.shape == (3, 3) and ids.tolist() == [50, 51, 52] and ids.data_ptr() == tok.data_ptr()
    assert (
        host.tolist() == [50, 51, 52] and host.data_ptr() != tok.data_ptr() and event is None
    )  # CPU: a copy
    assert runner.run_greedy(build_forward_batch(_decode(), 4, CPU, tables=TABLES)) is None  # not packed
    lane1 = build_packed_decode_batch(_decode(), 4, TABLES, None, runner.pack_for(3, 3, 1))
    assert runner.run_greedy(lane1) is None  # no greedy graph on lane 1 here
    assert runner.greedy_graphs[4, 0].replays == 1


def test_greedy_graphs_are_on_by_default_for_two_lane_buckets(runner):
    assert CudaGraphKnobs().greedy_in_graph is True and LANES == 2
    assert runner._kinds(8) == [("plain", 0), ("plain", 1), ("greedy", 0), ("greedy", 1)]
    assert runner._kinds(16) == [("plain", 0)]
