"""The step metadata, worked out by hand: positions, slot mapping, padded block tables, sequence lengths,
cu_seqlens_q (None for a pure decode step) and the sampled rows."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit


def _chunk(tokens, start, length, table, sample=True):
    from layerzero.engine.runner.forward_batch import ScheduledChunk

    return ScheduledChunk(tokens, start, length, table, sample)


def test_mixed_step():
    from layerzero.engine.runner.forward_batch import build_forward_batch

    # block size 4; seq A: 6 new tokens from position 0 (blocks 7, 2); seq B: 1 token at position 9 (blocks 5, 1, 3)
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
    from layerzero.engine.runner.forward_batch import build_forward_batch

    a = _chunk([1, 2, 3, 4, 5], 4, 1, [6, 0])
    b = _chunk([9, 8, 7], 2, 1, [4])
    fb = build_forward_batch([a, b], 4, torch.device("cpu"))
    assert fb.is_decode and fb.cu_seqlens_q is None
    assert fb.input_ids.tolist() == [5, 7] and fb.positions.tolist() == [4, 2]
    assert fb.slot_mapping.tolist() == [0 * 4 + 0, 4 * 4 + 2] and fb.seq_lens.tolist() == [5, 3]
    assert fb.block_tables.tolist() == [[6, 0], [4, 0]] and fb.logits_indices.tolist() == [0, 1]
    part = build_forward_batch([_chunk([1, 2, 3, 4, 5, 6], 0, 3, [2, 3], sample=False)], 4, torch.device("cpu"))
    assert part.logits_indices.tolist() == [] and part.cu_seqlens_q.tolist() == [0, 3]


def test_pending_last_token_is_gathered_from_the_previous_step():
    """Async scheduling: a chunk whose last token is pending takes its input id from the previous step's sampled
    tokens (row ``pending_src``), in the decode path and in a mixed step; known ids are untouched."""
    from layerzero.engine.runner.forward_batch import ScheduledChunk, build_forward_batch

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


def test_mixed_step_with_decode_rows_first():
    """A mixed step whose one-token chunks lead (the scheduler's order): ``num_decode`` counts them and
    ``prefill_cu`` is the prefill chunks' own cu_seqlens_q; the cascade plan covers the decode rows only (rows 0 and
    1 share block 7; the prefill chunk also starts with block 7 and is not in any group)."""
    from layerzero.engine.runner.cascade import CascadePolicy
    from layerzero.engine.runner.forward_batch import build_forward_batch

    a = _chunk(list(range(10)), 9, 1, [7, 2, 3])  # position 9: KV 10 = block 7 full, 2 full, 3 holds the new one
    b = _chunk(list(range(10)), 8, 1, [7, 4, 5])
    c = _chunk(list(range(12)), 8, 4, [7, 6, 9])
    d = _chunk(list(range(3)), 0, 3, [8])
    fb = build_forward_batch([a, b, c, d], 4, torch.device("cpu"), cascade=CascadePolicy(always=True))
    assert fb.num_decode == 2 and fb.cu_seqlens_q.tolist() == [0, 1, 2, 6, 9]
    assert fb.prefill_cu.tolist() == [0, 4, 7] and fb.prefill_cu.dtype == torch.int32
    c_ = fb.cascade
    assert c_.rows.tolist() == [0, 1] and c_.cu_prefix.tolist() == [0, 2]
    assert c_.prefix_lens.tolist() == [4] and c_.suffix_lens.tolist() == [6, 5]
    plain = build_forward_batch([c, a], 4, torch.device("cpu"))  # a one-token chunk after a prefill: not split
    assert plain.num_decode == 0 and plain.prefill_cu is None and plain.cascade is None
