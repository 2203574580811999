"""The front end's output processing on its own (no model): core outputs of hand-picked tokens of the test
tokenizer become text, stop strings end completions (and ask the core to stop them), ``min_tokens`` delays
the check, streaming deltas hold back what may become a stop string.

The oracle, worked by hand: the trained test tokenizer splits "the cat sat" into 't' 'he' ' c' 'at' ' s' 'at'
(ids 86 275 273 274 261 274)."""

from __future__ import annotations

import pytest

from layerzero.engine import SamplingParams
from layerzero.engine.core.messages import EngineCoreAbort, EngineCoreOutput
from layerzero.engine.frontend.output_processor import OutputProcessor

pytestmark = pytest.mark.unit
THE_CAT_SAT = [86, 275, 273, 274, 261, 274]


@pytest.fixture(scope="module")
def tok():
    from layerzero.testing.checkpoints import train_tokenizer

    t = train_tokenizer()
    assert [t.decode([i]) for i in THE_CAT_SAT] == ["t", "he", " c", "at", " s", "at"]  # the oracle's premise
    return t


def _run(tok, params, kind, finish_last=None):
    """Feed THE_CAT_SAT one token per step (the last one finishing with ``finish_last``); the outputs and
    aborts of every step."""
    op = OutputProcessor(tok)
    op.add_request("r", None, [1], params, output_kind=kind)
    steps = []
    for i, t in enumerate(THE_CAT_SAT):
        reason = finish_last if i == len(THE_CAT_SAT) - 1 else None
        res = op.process_outputs([EngineCoreOutput("r", 0, [t], finish_reason=reason)])
        steps.append(res)
        if not op.has_unfinished_requests():
            break
    return op, steps


def test_a_stop_string_across_three_tokens_stops_and_is_cut(tok):
    op, steps = _run(tok, SamplingParams(stop="e ca", max_tokens=6), "cumulative")
    assert len(steps) == 4  # 't' 'he' ' c' 'at': "the cat" holds "e ca" once 'at' arrives
    (last,) = steps[-1].request_outputs
    c = last.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == ("th", THE_CAT_SAT[:4], "stop", "e ca")
    assert last.finished and steps[-1].aborts == [EngineCoreAbort("r", 0, "stop", "e ca")]
    assert all(not s.aborts for s in steps[:-1])
    assert not op.has_unfinished_requests()


def test_streaming_deltas_hold_back_a_possible_stop_string(tok):
    _, steps = _run(tok, SamplingParams(stop="e ca", max_tokens=6), "delta")
    deltas = [
        (s.request_outputs[0].outputs[0].text, s.request_outputs[0].outputs[0].token_ids) for s in steps
    ]
    # "t"; "the" ends in "e" (may start "e ca"): "h" only; "the c" ends in "e c": nothing; then the stop
    assert deltas == [("t", [86]), ("h", [275]), ("", [273]), ("", [274])]
    assert steps[-1].request_outputs[0].finished


def test_min_tokens_skips_a_stop_string_completed_before_it(tok):
    """With min_tokens=5 the stop string completed at token 4 is not searched for, and the search after token
    5 starts past it: the completion runs to max_tokens (the core's "length")."""
    _, steps = _run(tok, SamplingParams(stop="e ca", max_tokens=6, min_tokens=5), "cumulative", "length")
    assert len(steps) == 6 and all(not s.aborts for s in steps)
    c = steps[-1].request_outputs[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("the cat sat", "length", None)


def test_final_only_returns_one_output_and_a_core_stop_token_adds_no_text(tok):
    op = OutputProcessor(tok)
    op.add_request("r", "p", [1], SamplingParams(max_tokens=9, logprobs=1), output_kind="final_only")
    res = op.process_outputs([EngineCoreOutput("r", 0, [86, 275], [{86: -0.5}, {275: -0.25}], -0.75)])
    assert res.request_outputs == []  # not finished yet
    res = op.process_outputs(
        [EngineCoreOutput("r", 0, [tok.eos_token_id], [{2: -0.1}], -0.85, finish_reason="stop")]
    )
    (out,) = res.request_outputs
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == ("the", [86, 275, 2], "stop")
    assert c.logprobs == [{86: -0.5}, {275: -0.25}, {2: -0.1}] and c.cumulative_logprob == -0.85
    assert out.prompt == "p" and out.finished


def test_abort_finishes_locally_and_late_core_outputs_are_ignored(tok):
    op = OutputProcessor(tok)
    op.add_request("r", None, [1], SamplingParams(n=2, max_tokens=9), output_kind="delta")
    op.process_outputs([EngineCoreOutput("r", 0, [86]), EngineCoreOutput("r", 1, [275])])
    out = op.abort_request("r")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert op.abort_request("r") is None and not op.has_unfinished_requests()
    assert op.process_outputs([EngineCoreOutput("r", 0, [273])]).request_outputs == []
