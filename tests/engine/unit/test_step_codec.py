"""The tensor-parallel step message (``executor/step_codec.py``): every decoded step equals the plain
``SchedulerOutput.from_dict(out.to_dict())`` of what rank 0 encoded (the independent path), a request's
parameters travel once, changed parameters and forgotten requests travel again, and a skipped message is an
error, not a wrong step."""

from __future__ import annotations

import numpy as np
import pytest

from layerzero.engine.core.sched.output import PromptLogprobsRows, SamplingMetadata, SchedulerOutput
from layerzero.engine.executor.channel import unpack
from layerzero.engine.executor.step_codec import StepDecoder, StepEncoder
from layerzero.engine.sampling_params import SamplingParams

P = {
    "a": SamplingParams(temperature=0.7, top_p=0.9, stop=["\n\n"], max_tokens=33, seed=3),
    "b": SamplingParams(temperature=0.0, logprobs=2, logit_bias={5: -1.5}),
    "c": SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, min_tokens=2),
}


def step(rows: list[str], *, prefill: str | None = None, params: dict | None = None) -> SchedulerOutput:
    """Decode rows ``rows`` (one token each, sampled) and optionally a prefill chunk of ``prefill`` that is
    not sampled yet (a middle chunk), with ragged block tables and a prompt-logprobs entry."""
    params = params or P
    ids = rows + ([prefill] if prefill else [])
    n = len(ids)
    widths = np.arange(n) % 3 + 1
    tables = np.full((n, 3), -1, dtype=np.int32)
    for i, w in enumerate(widths):
        tables[i, :w] = np.arange(10 * i, 10 * i + w)
    pen = [[1, 2, 3] if params[r].repetition_penalty != 1.0 else None for r in rows]
    return SchedulerOutput(
        req_ids=ids,
        seq_ids=list(range(n)),
        num_computed_tokens=[7 * (i + 1) for i in range(n)],
        num_scheduled_tokens=[1] * len(rows) + ([5] if prefill else []),
        new_token_ids=[[] for _ in rows] + ([[9, 8, 7, 6, 5]] if prefill else []),
        pending_src=list(range(len(rows))) + ([None] if prefill else []),
        sample=[True] * len(rows) + ([False] if prefill else []),
        block_tables=tables,
        preempted_seq_ids=[42],
        sampling=SamplingMetadata(
            params=[params[r] for r in rows],
            seeds=[params[r].seed for r in rows],
            num_output_tokens=[4] * len(rows),
            prompt_token_ids=pen,
            output_token_ids=[[4, 4] if p else None for p in pen],
            seq_ids=list(range(len(rows))),
            penalty_reset=[p is not None for p in pen],
            free_seq_ids=[77, 78],
        ),
        prompt_logprobs=PromptLogprobsRows(chunks=[0], num_rows=[2], top_n=[1], target_ids=[[3, 4]]),
    )


def plain(out: SchedulerOutput) -> dict:
    return SchedulerOutput.from_dict(out.to_dict()).to_dict()


def test_every_step_decodes_as_the_plain_path_and_params_travel_once():
    enc, dec = StepEncoder(), StepDecoder()
    steps = [step(["a", "b"], prefill="c"), step(["a", "b", "c"]), step(["c", "a"])]
    sizes = []
    for out in steps:
        data = enc.encode(out)
        sizes.append(len(unpack(data)[3]))  # requests whose parameters this message carries
        assert dec.decode(data).to_dict() == plain(out)
    assert sizes == [2, 1, 0]  # a, b; then c (its first sampled step); then none


def test_changed_params_travel_again():
    enc, dec = StepEncoder(), StepDecoder()
    dec.decode(enc.encode(step(["a"])))
    other = {**P, "a": SamplingParams(temperature=1.3)}
    data = enc.encode(step(["a"], params=other))
    assert list(unpack(data)[3]) == [0]
    assert dec.decode(data).sampling.params[0].temperature == 1.3


def test_forgotten_requests_are_named_and_sent_again():
    enc, dec = StepEncoder(capacity=2), StepDecoder()
    dec.decode(enc.encode(step(["a", "b"])))
    data = enc.encode(step(["c"]))  # 3 known: the least recently used, a, is forgotten on both sides
    assert unpack(data)[4] == ["a"]
    dec.decode(data)
    assert set(dec._params) == {"b", "c"}
    back = enc.encode(step(["a"]))  # a again: its parameters travel again
    assert list(unpack(back)[3]) == [0]
    assert dec.decode(back).to_dict() == plain(step(["a"]))


def test_a_skipped_message_is_an_error_not_a_wrong_step():
    enc, dec = StepEncoder(), StepDecoder()
    enc.encode(step(["a"]))  # never delivered
    with pytest.raises(KeyError):
        dec.decode(enc.encode(step(["a"])))


def test_no_block_tables():
    out = step(["b"])
    out.block_tables = None
    assert StepDecoder().decode(StepEncoder().encode(out)).to_dict() == plain(out)
