"""``Sampler.launch(tokens=...)``: a plain greedy step whose ids a greedy decode graph already took returns those ids
(no sampling of its own); any other step refuses them (they would skip its penalties, bias, min_tokens ban or
logprobs)."""

from __future__ import annotations

import pytest
import torch

from layerzero.engine.sampler import Sampler
from layerzero.engine.sampling_params import SamplingParams
from layerzero.engine.sequence import Sequence

pytestmark = pytest.mark.unit


def _seq(i: int, **kw) -> Sequence:
    return Sequence(f"r{i}", 0, [1, 2, 3], 3, SamplingParams(temperature=0.0, **kw))


def test_graph_tokens_are_the_step_tokens():
    sampler = Sampler(10, (0,), torch.device("cpu"), seed=0)
    logits = torch.zeros(2, 10)
    logits[0, 3] = logits[1, 8] = 1.0  # the argmax a sampler of its own would take
    out = Sampler.resolve(sampler.launch(logits, [_seq(0), _seq(1)], torch.tensor([5, 6])))
    assert out.token_ids == [5, 6] and out.logprobs == [None, None]
    assert Sampler.resolve(sampler.launch(logits, [_seq(0), _seq(1)])).token_ids == [3, 8]


@pytest.mark.parametrize("kw", [dict(logprobs=2), dict(repetition_penalty=1.5), dict(logit_bias={3: -5.0}),
                                dict(min_tokens=2)])
def test_graph_tokens_are_refused_for_a_step_that_is_not_plain_greedy(kw):
    sampler = Sampler(10, (0,), torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match="not plain greedy"):
        sampler.launch(torch.zeros(2, 10), [_seq(0), _seq(1, **kw)], torch.tensor([5, 6]))
