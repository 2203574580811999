"""The next round's first draft step launched before a greedy verification is read (``spec_decode/ahead.py``):
its batch worked out by hand (inputs, positions, slots), which steps launch it (not one whose chunk ends a
block, whose row may end, or of more than AHEAD_MAX_ROWS rows), when its drafts are taken, and in the
engine: the tokens equal plain greedy decoding's (the oracle) and the same engine's with it off, for both
device drafters, with a batch of four, chunked prefill and rows that stop at rounds no launch foresaw;
sampled rounds never launch it. (It is on by default, so test_spec_engine's equality tests, with
preemption, run it too where at most four rows speculate.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerzero.engine.sampling_params import SamplingParams
from layerzero.engine.spec_decode.ahead import AHEAD_MAX_ROWS, Ahead, ahead_batch, ahead_drafts

from .test_spec_engine import OPTS, PROMPTS


def _out(starts, k, tables, greedy=(True, True), counts=None):
    from layerzero.engine.core.sched.output import SamplingMetadata, SchedulerOutput

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
    # block size 4, k = 2; row 0 starts at 4 (its chunk 4..6, next slot 7 in the same block), row 1 at 10
    out = _out([4, 10], 2, [[3, 8, 0, 0], [4, 6, 9, 2]])
    tokens = torch.tensor([[100, 101, 102], [200, 201, 202]])
    # row 0 accepted both drafts (next: the bonus token at 7), row 1 one (next: its token 1 at 12)
    batch = ahead_batch(out, tokens, torch.tensor([2, 1]), 4)
    assert batch.input_ids.tolist() == [102, 201]
    assert batch.positions.tolist() == [7, 12]
    assert batch.slot_mapping.tolist() == [8 * 4 + 3, 2 * 4 + 0]  # 7: block 1 (id 8); 12: block 3 (id 2)
    assert batch.seq_lens.tolist() == [8, 13] and batch.seq_lens.dtype == torch.int32
    assert batch.is_decode and batch.logits_all and batch.num_seqs == 2
    # a rejected first draft: the next input is the target's token at position start + 1
    batch = ahead_batch(out, tokens, torch.tensor([0, 2]), 4)
    assert batch.input_ids.tolist() == [100, 202]
    assert batch.positions.tolist() == [5, 13]
    assert batch.slot_mapping.tolist() == [8 * 4 + 1, 2 * 4 + 1]


def test_which_steps_launch_it():
    tables = [[1, 2], [3, 4]]
    assert ahead_drafts(_out([2, 3], 2, tables), 4) == 2
    assert ahead_drafts(_out([2, 3], 2, tables, greedy=(True, False)), 4) == 0  # sampled rows draw noise
    assert ahead_drafts(_out([2, 3], 2, tables, counts=[2, 1]), 4) == 0  # unequal draft counts
    plain = _out([2, 3], 2, tables)
    plain.spec_token_ids[1] = []  # a plain row in the step
    assert ahead_drafts(plain, 4) == 0
    # row 1's chunk 5..7 ends its block: its next slot (8) is not allocated yet
    assert ahead_drafts(_out([2, 5], 2, tables), 4) == 0
    near = _out([2, 3], 2, tables)
    near.sampling.params[0] = SamplingParams(temperature=0.0, max_tokens=5)
    near.sampling.num_output_tokens[0] = 2  # 3 tokens left: this round may emit them all
    assert ahead_drafts(near, 4) == 0
    near.sampling.num_output_tokens[0] = 1
    assert ahead_drafts(near, 4) == 2
    wide = _out(
        [2] * (AHEAD_MAX_ROWS + 1), 2, [[1, 2]] * (AHEAD_MAX_ROWS + 1), greedy=[True] * (AHEAD_MAX_ROWS + 1)
    )
    assert ahead_drafts(wide, 4) == 0


def test_its_drafts_are_taken_only_for_the_round_it_assumed():
    ahead = Ahead([10, 11], [5, 10], torch.tensor([5, 6]))
    out = _out([7, 12], 2, [[1, 2, 3, 4]] * 2)
    assert not ahead.matches(out, [0, 1])  # not read yet
    ahead.accepted = [1, 1]
    assert ahead.matches(out, [0, 1])
    ahead.accepted = [1, 0]
    assert not ahead.matches(out, [0, 1])  # row 1 would start at 11
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
def test_tokens_equal_plain_greedy_with_it_on_and_off(checkpoints, spec):
    from layerzero.engine import LLM, SamplingParams

    ckpt = checkpoints["qwen3"]
    if spec["method"] == "draft_model":
        spec = dict(spec, model=str(ckpt))
    # different lengths, and two rows stopped by a token of their own output: rows end at rounds no launch
    # foresaw, so the next round is not the one assumed
    prompts = PROMPTS[:AHEAD_MAX_ROWS]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (37, 23, 40, 31)]
    opts = {
        **OPTS,
        "block_size": 16,
        "num_kv_blocks": 24,
    }  # 4-token blocks: most rounds have a chunk ending one
    plain = LLM(ckpt, **opts)
    free = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for r, at in ((0, 17), (2, 26)):
        params[r] = SamplingParams(
            temperature=0.0, max_tokens=params[r].max_tokens, ignore_eos=True, stop_token_ids=[free[r][at]]
        )
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert len(want[0]) <= 18 and len(want[2]) <= 27
    got, stats = {}, {}
    for on in (True, False):
        llm = LLM(ckpt, speculative_config=spec, **opts)
        if not on:
            llm.engine.executor.worker.drafter.ahead_max_rows = 0
        got[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        batched = llm.engine.executor.worker.drafter.ahead_used
        stats[on] = llm.engine.scheduler.spec.as_dict()
        one = llm.generate([PROMPTS[1]], params[1], use_tqdm=False)[0].outputs[0].token_ids
        assert one == want[1]  # alone
        drafter = llm.engine.executor.worker.drafter
        if on:
            assert 0 < batched and drafter.ahead_used <= drafter.ahead_launched, (
                drafter.ahead_used,
                drafter.ahead_launched,
            )
        else:
            assert drafter.ahead_launched == 0
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
