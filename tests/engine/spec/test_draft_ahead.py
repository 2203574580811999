"""The next round's first draft step launched before a greedy verification is read (``spec_decode/ahead.py``):
its batch worked out by hand (inputs, positions, slots, the unallocated slot of a chunk that ended a block),
when its drafts are taken, and in the engine: the tokens equal plain greedy decoding's (the oracle) and the
same engine's with it off, for both device drafters, with batching, stops at different lengths (rounds that
do not match what was assumed), chunked prefill and preemption; sampled rounds never launch it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerzero.engine.spec_decode.ahead import Ahead, ahead_batch, ahead_drafts
from layerzero.engine.spec_decode.proposer import DraftProposer

from .test_spec_engine import OPTS, PROMPTS


def _out(starts, k, tables, greedy=(True, True), counts=None):
    from layerzero.engine.core.sched.output import SamplingMetadata, SchedulerOutput
    from layerzero.engine.sampling_params import SamplingParams

    counts = counts or [k] * len(starts)
    params = [SamplingParams(temperature=0.0 if g else 0.7) for g in greedy]
    n = len(starts)
    return SchedulerOutput(
        req_ids=[str(i) for i in range(n)],
        seq_ids=[10 + i for i in range(n)],
        num_computed_tokens=list(starts),
        num_scheduled_tokens=[c + 1 for c in counts],
        new_token_ids=[[7] * (c + 1) for c in counts],
        sample=[True] * n,
        sampling=SamplingMetadata(params, [None] * n, [0] * n, [[]] * n, [[]] * n),
        block_tables=np.asarray(tables, dtype=np.int32),
        spec_token_ids=[[-1] * c for c in counts],
    )


def test_the_batch_worked_out_by_hand():
    # block size 4, k = 2; row 0 starts at 5 (its chunk 5..7 ends block 1), row 1 at 10 (chunk 10..12)
    out = _out([5, 10], 2, [[3, 8, 0, 0], [4, 6, 9, 2]])
    tokens = torch.tensor([[100, 101, 102], [200, 201, 202]])
    # row 0 accepted both drafts (its next position 8 is the unallocated slot), row 1 one
    batch, starts, ends = ahead_batch(out, 2, tokens, torch.tensor([2, 1]), 4)
    assert starts == [5, 10] and ends == [True, False]
    assert batch.input_ids.tolist() == [102, 201]
    assert batch.positions.tolist() == [7, 12]  # row 0 runs at its chunk's last position instead
    assert batch.slot_mapping.tolist() == [
        -1,
        2 * 4 + 0,
    ]  # row 1: position 12 is its block 3 (id 2), offset 0
    assert batch.seq_lens.tolist() == [8, 13] and batch.seq_lens.dtype == torch.int32
    assert batch.is_decode and batch.logits_all and batch.num_seqs == 2
    # a rejected first draft: the next input is the target's token at position start + 1
    batch, _, _ = ahead_batch(out, 2, tokens, torch.tensor([0, 2]), 4)
    assert batch.input_ids.tolist() == [100, 202]
    assert batch.positions.tolist() == [6, 13]
    assert batch.slot_mapping.tolist() == [8 * 4 + 2, 2 * 4 + 1]


def test_which_steps_launch_it():
    tables = [[1, 2], [3, 4]]
    assert ahead_drafts(_out([2, 3], 2, tables)) == 2
    assert ahead_drafts(_out([2, 3], 2, tables, greedy=(True, False))) == 0  # sampled rows draw noise
    assert ahead_drafts(_out([2, 3], 2, tables, counts=[2, 1])) == 0  # unequal draft counts
    plain = _out([2, 3], 2, tables)
    plain.spec_token_ids[1] = []  # a plain row in the step
    assert ahead_drafts(plain) == 0


def test_its_drafts_are_taken_only_for_the_round_it_assumed():
    tokens = torch.tensor([5, 6])
    ahead = Ahead([10, 11], [5, 10], 2, [True, False], tokens)
    out = _out([7, 12], 2, [[1, 2, 3, 4]] * 2)
    assert not ahead.matches(out, [0, 1])  # not read yet
    ahead.accepted = [1, 1]
    assert ahead.matches(out, [0, 1])
    ahead.accepted = [1, 0]
    assert not ahead.matches(out, [0, 1])  # row 1 would start at 11
    ahead.accepted = [2, 1]  # row 0 took every draft and its chunk ended a block: its slot was not allocated
    assert not ahead.matches(_out([8, 12], 2, [[1, 2, 3, 4]] * 2), [0, 1])
    ahead.accepted = [1, 1]
    assert not ahead.matches(out, [1])  # another set of rows (one finished)


@pytest.mark.integration
@pytest.mark.parametrize(
    "spec",
    [
        {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 1},
        {"method": "draft_model", "num_speculative_tokens": 3},
    ],
    ids=["layer_skip", "draft_model"],
)
def test_tokens_equal_plain_greedy_with_it_on_and_off(checkpoints, spec, monkeypatch):
    from layerzero.engine import LLM, SamplingParams

    ckpt = checkpoints["qwen3"]
    if spec["method"] == "draft_model":
        spec = dict(spec, model=str(ckpt))
    # different lengths: rows end at different rounds, so later rounds are not the ones assumed
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (37, 23, 40, 31, 29)]
    plain = LLM(ckpt, **OPTS)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    got, stats = {}, {}
    for on in (True, False):
        monkeypatch.setattr(DraftProposer, "draft_ahead", on)
        llm = LLM(ckpt, speculative_config=spec, **OPTS)
        got[on] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        stats[on] = llm.engine.scheduler.spec.as_dict()
        drafter = llm.engine.executor.worker.drafter
        if on:
            assert 0 < drafter.ahead_used < drafter.ahead_launched, (
                drafter.ahead_used,
                drafter.ahead_launched,
            )
            if spec["method"] == "layer_skip":  # 30 blocks for 5 rows: some are preempted and recomputed
                assert llm.engine.scheduler.num_preemptions > 0
        else:
            assert drafter.ahead_launched == 0
        # alone, a row's every round is the one assumed except where a chunk ended a block
        one = llm.generate([PROMPTS[0]], params[0], use_tqdm=False)[0].outputs[0].token_ids
        assert one == want[0]
    assert got[True] == want and got[False] == want
    # the drafts themselves are the same (the verification would hide wrong ones in the tokens)
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"):
        assert stats[True][key] == stats[False][key], key


@pytest.mark.integration
def test_sampled_rounds_never_launch_it(checkpoints):
    from layerzero.engine import LLM, SamplingParams

    spec = {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 1}
    llm = LLM(checkpoints["qwen3"], speculative_config=spec, **OPTS)
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    assert llm.engine.scheduler.spec.as_dict()["num_drafts"] > 0
    assert llm.engine.executor.worker.drafter.ahead_launched == 0
