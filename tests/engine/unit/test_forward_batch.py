"""The step metadata, worked out by hand: positions, slot mapping, padded block tables, sequence lengths,
cu_seqlens_q (None for a pure decode step) and the sampled rows."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit


def _chunk(tokens, start, length, table, sample=True):
    from layerzero.engine.worker.input_batch import ScheduledChunk

    return ScheduledChunk(tokens, start, length, table, sample)


def test_mixed_step():
    from layerzero.engine.worker.input_batch import build_forward_batch

    # block size 4; seq A: 6 new tokens from position 0 (blocks 7, 2); seq B: 1 token at position 9 (blocks 5,
    # 1, 3)
    a = _chunk(list(range(100, 106)), 0, 6, [7, 2])
    b = _chunk(list(range(200, 210)), 9, 1, [5, 1, 3])
    fb = build_forward_batch([a, b], 4, torch.device("cpu"))
    assert fb.input_ids.tolist() == [100, 101, 102, 103, 104, 105, 209]
    assert fb.positions.tolist() == [0, 1, 2, 3, 4, 5, 9]
    assert fb.slot_mapping.tolist() == [28, 29, 30, 31, 8, 9, 3 * 4 + 1]
    assert fb.block_tables.tolist() == [[7, 2, 0], [5, 1, 3]] and fb.block_tables.dtype == torch.int32
    assert fb.seq_lens.tolist() == [6, 10] and fb.cu_seqlens_q.tolist() == [0, 6, 7]
    assert fb.logits_indices.tolist() == [5, 6] and not fb.is_decode


def test_decode_step_and_an_unsampled_chunk():
    from layerzero.engine.worker.input_batch import build_forward_batch

    a = _chunk([1, 2, 3, 4, 5], 4, 1, [6, 0])
    b = _chunk([9, 8, 7], 2, 1, [4])
    fb = build_forward_batch([a, b], 4, torch.device("cpu"))
    assert fb.is_decode and fb.cu_seqlens_q is None
    assert fb.input_ids.tolist() == [5, 7] and fb.positions.tolist() == [4, 2]
    assert fb.slot_mapping.tolist() == [0 * 4 + 0, 4 * 4 + 2] and fb.seq_lens.tolist() == [5, 3]
    assert fb.block_tables.tolist() == [[6, 0], [4, 0]] and fb.logits_indices.tolist() == [0, 1]
    part = build_forward_batch(
        [_chunk([1, 2, 3, 4, 5, 6], 0, 3, [2, 3], sample=False)], 4, torch.device("cpu")
    )
    assert part.logits_indices.tolist() == [] and part.cu_seqlens_q.tolist() == [0, 3]


def test_logits_all_only_when_every_row_is_sampled_in_order():
    """``logits_all`` (the model skips the ``logits_indices`` gather) holds exactly when ``logits_indices`` is
    ``arange(T)``: a decode step whose chunks all sample; not a decode step with an unsampled chunk, not a
    mixed step (even one whose every chunk samples: only the last token of each chunk is a row)."""
    from layerzero.engine.worker.input_batch import build_forward_batch

    cpu = torch.device("cpu")
    a, b = _chunk([1, 2, 3, 4, 5], 4, 1, [6, 0]), _chunk([9, 8, 7], 2, 1, [4])
    for chunks, want in (
        ([a, b], True),
        ([a, _chunk([9, 8, 7, 6], 2, 1, [4], sample=False)], False),
        ([_chunk(list(range(6)), 0, 6, [7, 2]), b], False),
        ([b], True),
    ):
        fb = build_forward_batch(chunks, 4, cpu)
        assert fb.logits_all is want
        assert (fb.logits_indices.tolist() == list(range(fb.input_ids.shape[0]))) is want


def test_pending_last_token_is_gathered_from_the_previous_step():
    """Async scheduling: a chunk whose last token is pending takes its input id from the previous step's
    sampled tokens (row ``pending_src``), in the decode path and in a mixed step; known ids are untouched."""
    from layerzero.engine.worker.input_batch import ScheduledChunk, build_forward_batch

    prev = torch.tensor([70, 71, 72])
    a = ScheduledChunk([1, 2, 3, 4], 4, 1, [6, 0], True, pending_src=2)  # position 4 = the pending token
    b = ScheduledChunk([9, 8, 7], 2, 1, [4], True)
    fb = build_forward_batch([a, b], 4, torch.device("cpu"), prev)
    assert fb.input_ids.tolist() == [72, 7] and fb.positions.tolist() == [4, 2] and fb.is_decode
    c = ScheduledChunk([5, 6, 7], 0, 3, [3], True)
    d = ScheduledChunk([1, 2], 1, 2, [8], True, pending_src=0)  # known token 2 at position 1, pending at 2
    fb = build_forward_batch([c, d], 4, torch.device("cpu"), prev)
    assert fb.input_ids.tolist() == [5, 6, 7, 2, 70] and fb.positions.tolist() == [0, 1, 2, 1, 2]
    with pytest.raises(RuntimeError, match="prev_tokens"):
        build_forward_batch([a], 4, torch.device("cpu"))


def test_decode_graphs_only_take_steps_that_sample_every_row():
    """A one-token chunk that does not end its prompt (a budget's last token) is not sampled; the decode
    graphs return every row's logits, so such a step runs eager (its logits rows follow
    ``logits_indices``)."""
    from layerzero.engine.worker.cuda_graph import CUDAGraphRunner
    from layerzero.engine.worker.input_batch import build_forward_batch

    runner = CUDAGraphRunner(torch.nn.Identity(), [], 8, 4, torch.device("cpu"))
    runner.graphs = {s: None for s in runner.sizes}  # as if captured (nothing is replayed here)
    a = _chunk([1, 2, 3, 4, 5], 4, 1, [6, 0])
    b = _chunk([9, 8, 7], 2, 1, [4])
    assert runner.can_run(build_forward_batch([a, b], 4, torch.device("cpu")))
    partial = _chunk([9, 8, 7, 6], 2, 1, [4], sample=False)  # position 2 of 4 tokens: the prompt goes on
    assert not runner.can_run(build_forward_batch([a, partial], 4, torch.device("cpu")))


def test_a_table_matrix_gives_the_same_batch_as_the_lists():
    """The engine passes the step's block tables as one ``[B, W]`` matrix (the KV manager's gather); the batch
    is the one the per-chunk lists give, in a mixed and in a decode step; a matrix with the wrong row count is
    refused."""
    import numpy as np

    from layerzero import InvalidInputError
    from layerzero.engine.worker.input_batch import ScheduledChunk, build_forward_batch

    def both(chunks, prev=None):
        lists = build_forward_batch(chunks, 4, torch.device("cpu"), prev)
        width = max(len(c.block_table) for c in chunks)
        matrix = np.zeros((len(chunks), width + 2), dtype=np.int32)  # wider than needed: padding is harmless
        for i, c in enumerate(chunks):
            matrix[i, : len(c.block_table)] = c.block_table
        bare = [ScheduledChunk(c.token_ids, c.start, c.length, (), c.sample, c.pending_src) for c in chunks]
        got = build_forward_batch(bare, 4, torch.device("cpu"), prev, tables=matrix)
        for f in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices"):
            assert torch.equal(getattr(got, f), getattr(lists, f)), f
        assert (
            torch.equal(got.block_tables[:, :width], lists.block_tables)
            and not got.block_tables[:, width:].any()
        )
        return got

    fb = both([_chunk(list(range(100, 106)), 0, 6, [7, 2]), _chunk(list(range(200, 210)), 9, 1, [5, 1, 3])])
    assert fb.slot_mapping.tolist() == [28, 29, 30, 31, 8, 9, 13]
    fb = both(
        [ScheduledChunk([1, 2, 3, 4], 4, 1, [6, 0], True, pending_src=1), _chunk([9, 8, 7], 2, 1, [4])],
        torch.tensor([70, 71]),
    )
    assert fb.is_decode and fb.slot_mapping.tolist() == [0, 18] and fb.input_ids.tolist() == [71, 7]
    with pytest.raises(InvalidInputError, match="expected 1 rows"):
        build_forward_batch(
            [_chunk([1, 2], 1, 1, [3])], 4, torch.device("cpu"), tables=np.zeros((2, 1), np.int32)
        )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_mixed_steps_match_a_token_by_token_oracle(seed):
    """Seeded ragged mixed steps (decode rows, prefill and chunked-prefill chunks, pending ids, drafts,
    unsampled chunks; odd block size 5; ids given whole or as the chunk only) against an oracle that walks
    every token one at a time: input id, position, slot (block table entry x block size + offset),
    seq_lens, cu_seqlens_q, the sampled rows (a sampled chunk's last ``num_spec + 1`` tokens) and the
    pending-id gathers."""
    import random

    from layerzero.engine.worker.input_batch import ScheduledChunk, build_forward_batch

    rng, bs = random.Random(seed), 5
    prev = torch.arange(1000, 1040)
    chunks = []
    for _ in range(rng.randrange(2, 40)):
        start = rng.randrange(0, 60)
        length = 1 if rng.random() < 0.6 else rng.randrange(2, 23)
        seq = [rng.randrange(1, 900) for _ in range(start + length)]
        table = rng.sample(range(1, 400), (start + length + bs - 1) // bs + rng.randrange(2))
        pending = rng.randrange(40) if rng.random() < 0.4 else None
        spec = rng.randrange(min(length, 4)) if length > 1 and rng.random() < 0.3 else 0
        offset = start if rng.random() < 0.5 else 0
        chunks.append(
            ScheduledChunk(seq[offset:], start, length, table, rng.random() < 0.8, pending, offset, spec)
        )
    if all(c.length == 1 for c in chunks):
        chunks.append(ScheduledChunk([3, 4, 5], 0, 3, [9], True))
    want = {k: [] for k in ("ids", "pos", "slots", "lens", "cu", "sample")}
    want["cu"].append(0)
    for c in chunks:
        for j, p in enumerate(range(c.start, c.start + c.length)):
            last = j == c.length - 1
            pending = last and c.pending_src is not None
            want["ids"].append(int(prev[c.pending_src]) if pending else c.token_ids[p - c.offset])
            want["pos"].append(p)
            want["slots"].append(c.block_table[p // bs] * bs + p % bs)
            if c.sample and j >= c.length - 1 - c.num_spec:
                want["sample"].append(len(want["ids"]) - 1)
        want["lens"].append(c.start + c.length)
        want["cu"].append(len(want["ids"]))
    fb = build_forward_batch(chunks, bs, torch.device("cpu"), prev)
    assert fb.input_ids.tolist() == want["ids"]
    assert fb.positions.tolist() == want["pos"] and fb.slot_mapping.tolist() == want["slots"]
    assert fb.seq_lens.tolist() == want["lens"] and fb.cu_seqlens_q.tolist() == want["cu"]
    assert fb.logits_indices.tolist() == want["sample"]
