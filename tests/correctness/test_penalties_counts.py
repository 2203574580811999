"""``lz.apply_penalties``'s counts form (a bool ``[B, V]`` prompt mask and ``[B, V]`` output counts: what the
engine keeps on the device) against the float64 per-row oracle of ``test_penalties.py`` and against the ids
form on the same tokens (bit for bit), and its typed errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import mismatch  # noqa: E402
from test_penalties import oracle, padded, penalties, ragged  # noqa: E402

pytestmark = pytest.mark.correctness


def _counts(rows: list[list[int]], vocab: int, dtype=torch.int32) -> torch.Tensor:
    out = torch.zeros(len(rows), vocab, dtype=dtype)
    for b, r in enumerate(rows):
        for t in r:
            out[b, t] += 1
    return out


def _mask(rows: list[list[int]], vocab: int) -> torch.Tensor:
    return _counts(rows, vocab, torch.int64) > 0


@pytest.mark.parametrize(("batch", "vocab", "lp", "lo"), [(7, 131, 9, 13), (1, 50, 0, 6), (3, 33, 0, 0)])
def test_counts_form_matches_the_oracle_and_the_ids_form(batch, vocab, lp, lo):
    g = torch.Generator().manual_seed(batch * 7 + vocab)
    logits = torch.randn(batch, vocab, generator=g) * 3
    prompt, output = ragged(g, batch, vocab, lp), ragged(g, batch, vocab, lo)
    pen = penalties(g, batch)
    ref = oracle(
        logits,
        prompt,
        output,
        *(pen[k] for k in ("repetition_penalty", "presence_penalty", "frequency_penalty")),
    )
    ids = lz.apply_penalties(logits, padded(prompt, vocab, lp), padded(output, vocab, lo), **pen)
    for cdtype in (torch.int32, torch.int64):
        before = logits.clone()
        out = lz.apply_penalties(logits, _mask(prompt, vocab), _counts(output, vocab, cdtype), **pen)
        assert torch.equal(logits, before)
        assert mismatch(out, ref, torch.float32, "counts form", floor=1.0) is None
        assert torch.equal(out, ids)


def test_counts_form_hand_worked_row():
    """The ids form's hand-worked row: prompt {0}, output counts {1: 1, 3: 2}; r = 2, f = 0.1, p = 0.5."""
    out = lz.apply_penalties(
        torch.tensor([[2.0, -1.0, 3.0, 0.5]]),
        torch.tensor([[True, False, False, False]]),
        torch.tensor([[0, 1, 0, 2]], dtype=torch.int32),
        repetition_penalty=torch.tensor([2.0]),
        frequency_penalty=torch.tensor([0.1]),
        presence_penalty=torch.tensor([0.5]),
    )
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.6, 3.0, -0.45]]))


@pytest.mark.parametrize(
    ("mask", "counts", "match"),
    [
        (torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 6, dtype=torch.int32), "output_token_ids shape"),
        (torch.zeros(2, 4, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.int32), "prompt_token_ids shape"),
        (torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 5), "output_token_ids.dtype"),
        (torch.zeros(2, 5, dtype=torch.bool), -torch.ones(2, 5, dtype=torch.int32), "counts >= 0"),
    ],
)
def test_counts_form_bad_input_is_a_typed_error(mask, counts, match):
    with pytest.raises(lz.InvalidInputError, match=match):
        lz.apply_penalties(torch.zeros(2, 5), mask, counts, presence_penalty=torch.ones(2))
