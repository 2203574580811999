"""``lz.apply_penalties`` against a plain per-row Python oracle and Hugging Face's repetition-penalty
processor.

- random ragged batches (odd vocabulary, right padding with V, Lp = 0 / Lo = 0, int32 and int64 ids, repeated
  tokens, every penalty mixed with its 'off' value) equal the float64 oracle within each dtype's tolerance;
- the repetition penalty alone equals ``transformers``' ``RepetitionPenaltyLogitsProcessor`` on the prompt and
  the output concatenated (bit for bit in float32);
- padding never counts, however wide; the input is never modified; None everywhere returns an equal copy.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import DTYPES, dname, mismatch  # noqa: E402

pytestmark = pytest.mark.correctness
_ids = lambda x: dname(x) if isinstance(x, torch.dtype) else x  # noqa: E731


def oracle(logits, prompt, output, repetition=None, presence=None, frequency=None) -> torch.Tensor:
    """float64, one row and one token at a time: repetition over prompt or output tokens, then frequency and
    presence over output tokens (vLLM's order). ``prompt`` / ``output``: per-row lists of real token ids."""
    rows = logits.to(torch.float64).tolist()
    for b, row in enumerate(rows):
        seen = set(prompt[b]) | set(output[b])
        counts = Counter(output[b])
        for j in range(len(row)):
            x = row[j]
            if repetition is not None and j in seen:
                r = float(repetition[b])
                x = x / r if x > 0 else x * r
            if frequency is not None:
                x -= float(frequency[b]) * counts[j]
            if presence is not None:
                x -= float(presence[b]) * (1 if counts[j] else 0)
            row[j] = x
    return torch.tensor(rows, dtype=torch.float64)


def padded(rows: list[list[int]], vocab: int, width: int, dtype=torch.int64) -> torch.Tensor:
    """Right-pad ragged rows with ``vocab`` to ``width`` columns."""
    return torch.tensor([r + [vocab] * (width - len(r)) for r in rows], dtype=dtype).reshape(len(rows), width)


def ragged(g: torch.Generator, batch: int, vocab: int, max_len: int) -> list[list[int]]:
    """Rows of random lengths 0..max_len, drawn from a small part of the vocabulary so tokens repeat."""
    hot = max(1, vocab // 4)
    return [
        torch.randint(0, hot, (int(torch.randint(0, max_len + 1, (1,), generator=g)),), generator=g).tolist()
        for _ in range(batch)
    ]


def penalties(g: torch.Generator, batch: int) -> dict[str, torch.Tensor]:
    rep = 0.5 + 1.5 * torch.rand(batch, generator=g)
    rep[::3] = 1.0
    pres = 4 * torch.rand(batch, generator=g) - 2
    pres[1::3] = 0.0
    freq = 4 * torch.rand(batch, generator=g) - 2
    freq[2::4] = 0.0
    return {"repetition_penalty": rep, "presence_penalty": pres, "frequency_penalty": freq}


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize(
    ("batch", "vocab", "lp", "lo"),
    [(7, 131, 9, 13), (5, 1, 3, 2), (1, 50, 0, 6), (4, 77, 8, 0), (3, 33, 0, 0)],
)
def test_matches_the_per_row_oracle(dtype, batch, vocab, lp, lo):
    g = torch.Generator().manual_seed(batch * 100 + vocab)
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(dtype)
    logits[0, 0] = 0.0  # a zero logit: unchanged by the repetition penalty either way
    prompt, output = ragged(g, batch, vocab, lp), ragged(g, batch, vocab, lo)
    pen = penalties(g, batch)
    for ids_dtype in (torch.int64, torch.int32):
        p_ids, o_ids = padded(prompt, vocab, lp, ids_dtype), padded(output, vocab, lo, ids_dtype)
        for which in (("repetition_penalty",), ("presence_penalty", "frequency_penalty"), tuple(pen)):
            kw = {name: pen[name] for name in which}
            before = logits.clone()
            out = lz.apply_penalties(logits, p_ids, o_ids, **kw)
            assert torch.equal(logits, before), "logits were modified"
            ref = oracle(
                logits,
                prompt,
                output,
                kw.get("repetition_penalty"),
                kw.get("presence_penalty"),
                kw.get("frequency_penalty"),
            )
            assert mismatch(out, ref, dtype, f"{which} ids {ids_dtype}", floor=1.0) is None, mismatch(
                out, ref, dtype, f"{which} ids {ids_dtype}", floor=1.0
            )


def test_repetition_penalty_equals_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(3)
    batch, vocab = 6, 211
    logits = torch.randn(batch, vocab, generator=g) * 4
    prompt, output = ragged(g, batch, vocab, 17), ragged(g, batch, vocab, 11)
    rep = torch.tensor([1.0, 1.3, 0.7, 2.0, 1.05, 1.2])
    out = lz.apply_penalties(
        logits, padded(prompt, vocab, 17), padded(output, vocab, 11), repetition_penalty=rep
    )
    for b in range(batch):
        ids = torch.tensor([prompt[b] + output[b]], dtype=torch.int64).reshape(1, -1)
        hf = RepetitionPenaltyLogitsProcessor(penalty=float(rep[b]))(ids, logits[b : b + 1].clone())
        assert torch.equal(out[b : b + 1], hf), b


def test_padding_never_counts_and_none_is_a_copy():
    g = torch.Generator().manual_seed(4)
    vocab = 40
    logits = torch.randn(3, vocab, generator=g)
    prompt, output = [[1, 2], [], [5, 5, 5]], [[2, 2, 9], [7], []]
    pen = {
        "repetition_penalty": torch.tensor([1.5, 1.5, 1.5]),
        "presence_penalty": torch.tensor([0.5, 0.5, 0.5]),
        "frequency_penalty": torch.tensor([0.25, 0.25, 0.25]),
    }
    narrow = lz.apply_penalties(logits, padded(prompt, vocab, 3), padded(output, vocab, 3), **pen)
    wide = lz.apply_penalties(logits, padded(prompt, vocab, 50), padded(output, vocab, 64), **pen)
    assert torch.equal(narrow, wide)
    ref = oracle(
        logits, prompt, output, pen["repetition_penalty"], pen["presence_penalty"], pen["frequency_penalty"]
    )
    assert mismatch(narrow, ref, torch.float32, floor=1.0) is None
    untouched = [j for j in range(vocab) if j not in {1, 2, 5, 9, 7}]
    assert torch.equal(narrow[:, untouched], logits[:, untouched])
    empty = torch.empty(3, 0, dtype=torch.int64)
    same = lz.apply_penalties(logits, empty, empty, **pen)
    assert torch.equal(same, logits) and same.data_ptr() != logits.data_ptr()
    copy = lz.apply_penalties(logits, padded(prompt, vocab, 3), padded(output, vocab, 3))
    assert torch.equal(copy, logits) and copy.data_ptr() != logits.data_ptr()


def test_hand_worked_row():
    """V = 4, prompt [0], output [1, 3, 3]; r = 2, frequency 0.1, presence 0.5:
    token 0 (prompt, 2.0 > 0) -> 1.0; token 1 (-1.0) -> -2.0 - 0.1 - 0.5; token 2 unseen; token 3 (0.5, twice)
    -> 0.25 - 0.2 - 0.5."""
    out = lz.apply_penalties(
        torch.tensor([[2.0, -1.0, 3.0, 0.5]]),
        torch.tensor([[0, 4]]),
        torch.tensor([[1, 3, 3]]),
        repetition_penalty=torch.tensor([2.0]),
        frequency_penalty=torch.tensor([0.1]),
        presence_penalty=torch.tensor([0.5]),
    )
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.6, 3.0, -0.45]]))
