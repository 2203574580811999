"""N-gram (prompt lookup) drafts on hand-worked sequences."""

from __future__ import annotations

import pytest

from layerzero.engine.spec_decode.ngram import ngram_propose

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("tokens", "k", "lo", "hi", "want"),
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 2, 1, 3, [4, 5]),  # "1 2 3" occurred at 0: then 4 5
        ([1, 2, 3, 4, 5, 1, 2, 3], 5, 1, 3, [4, 5, 1, 2, 3]),  # up to the end
        ([9, 1, 2, 7, 7, 1, 2, 8, 8, 1, 2], 2, 2, 2, [8, 8]),  # the latest full match wins
        ([9, 1, 2, 7, 7, 1, 2], 3, 2, 2, [7, 7, 1]),
        ([5, 5, 5, 5], 3, 1, 2, [5, 5]),  # a one-token loop: earliest "5 5" has the longest continuation
        ([5, 5, 5, 5, 5, 5], 3, 1, 2, [5, 5, 5]),
        ([1, 2, 3, 4], 3, 1, 2, []),  # nothing repeats
        ([3, 1, 2, 3], 2, 2, 2, []),  # "2 3" never occurred before; n = 1 not allowed
        ([3, 1, 2, 3], 2, 1, 2, [1, 2]),  # n = 1: "3" at 0
        ([7], 2, 1, 1, []),
        ([4, 8, 4, 9, 1, 4, 8, 4], 2, 1, 3, [9, 1]),  # the longest n first: "4 8 4" at 0
    ],
)
def test_hand_worked_drafts(tokens, k, lo, hi, want):
    assert ngram_propose(tokens, k, lo, hi) == want
