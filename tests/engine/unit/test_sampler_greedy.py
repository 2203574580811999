"""The sampler's greedy paths on hand-built logits: a plain greedy step reads the logits in the model's dtype
(bf16 here) without casting or changing them and returns each row's first maximum; a greedy step with a logit
bias or a min_tokens ban goes through the float32 path (on a copy: the model's bf16 output stays as it was)
and the ban or bias moves the token; ``plain_greedy`` says which is which."""

from __future__ import annotations

import pytest
import torch

from layerzero.engine import SamplingParams
from layerzero.engine.core.sched.output import SamplingMetadata
from layerzero.engine.core.sequence import Sequence
from layerzero.engine.worker.sampler import Sampler
from layerzero.engine.worker.sampler import plain_greedy as _plain_greedy

pytestmark = pytest.mark.unit
EOS = 3


def _seq(prompt_len: int = 2, outputs: int = 0, **kw) -> Sequence:
    kw.setdefault("temperature", 0.0)
    toks = list(range(10, 10 + prompt_len + outputs))
    return Sequence("r", 0, toks, prompt_len, SamplingParams(**kw))


def _logits() -> torch.Tensor:
    """Row 0: maximum 2.5 at columns 3 (EOS) and 6: the first, 3, wins. Row 1: maximum at column 0."""
    x = torch.tensor(
        [[0.0, 1.0, -1.0, 2.5, 0.5, -2.0, 2.5, 1.0], [4.0, 1.0, -1.0, 2.0, 0.5, 3.5, 2.5, 1.0]],
        dtype=torch.bfloat16,
    )
    return x


def test_plain_greedy_reads_bf16_logits_as_they_are():
    sampler = Sampler(8, (EOS,), torch.device("cpu"), seed=0)
    logits = _logits()
    before = logits.clone()
    out = sampler(logits, SamplingMetadata.from_seqs([_seq(), _seq()]))
    assert out.sampled_token_ids == [[3], [0]]  # ties: the first maximum
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, before)


@pytest.mark.parametrize(
    ("kw", "outputs", "want"),
    [
        ({"min_tokens": 2}, 0, 6),  # EOS banned before min_tokens: the other maximum
        ({"min_tokens": 2}, 2, 3),  # min_tokens reached: plain again, EOS allowed
        ({"logit_bias": {4: 5.0}}, 0, 4),  # 0.5 + 5
    ],
)
def test_greedy_with_bias_or_ban_takes_the_float32_path(kw, outputs, want):
    sampler = Sampler(8, (EOS,), torch.device("cpu"), seed=0)
    seqs = [_seq(outputs=outputs, **kw), _seq()]
    assert plain_greedy(seqs) is (outputs >= kw.get("min_tokens", 0) and "logit_bias" not in kw)
    logits = _logits()
    before = logits.clone()
    out = sampler(logits, SamplingMetadata.from_seqs(seqs))
    assert out.sampled_token_ids == [[want], [0]]
    assert torch.equal(logits, before)  # the bias / ban went into a float32 copy


def test_plain_greedy_needs_every_row_greedy_and_unread():
    assert plain_greedy([_seq(), _seq()])
    assert not plain_greedy([_seq(), _seq(temperature=0.7)])
    assert not plain_greedy([_seq(logprobs=2)])
    assert not plain_greedy([_seq(repetition_penalty=1.2)])


def plain_greedy(seqs):
    """``sampler.plain_greedy`` of the rows of ``seqs`` (what a scheduler output carries for them)."""
    return _plain_greedy(SamplingMetadata.from_seqs(seqs))
