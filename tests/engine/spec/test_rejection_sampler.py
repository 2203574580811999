"""Exactness of the rejection sampler (spec_decode.rejection): every emitted token has the target's
distribution, checked by chi-square over >= 10^6 draws on small vocabularies (vLLM's rejection-sampler tests
are the anchor), with random draft distributions q and with one-hot (deterministic) drafts; plus the random
streams: a seeded row gives the same tokens alone or in any batch."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from layerzero.engine.core.sched.output import SamplingMetadata
from layerzero.engine.sampling_params import SamplingParams
from layerzero.engine.spec_decode.rejection import rejection_sample
from layerzero.engine.spec_decode.verify import verify_rows

N = 1_000_000
V = 6
K = 2


def _chi2(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double().numpy()
    q = p.double().numpy()
    return chisquare(counts, counts.sum() * q / q.sum()).pvalue


@pytest.mark.parametrize("one_hot", [False, True])
def test_emitted_tokens_have_the_target_distribution(one_hot: bool) -> None:
    g = torch.Generator().manual_seed(1 + one_hot)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)  # the target per position
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)  # the draft per position
    target = p.expand(N, K + 1, V)
    drafts = torch.multinomial(q, N, replacement=True, generator=g).T.contiguous()  # [N, K] ~ q
    if one_hot:  # a deterministic proposer: each row's drafts are fixed tokens, q one-hot at them
        draft_probs = None
    else:
        draft_probs = q.expand(N, K, V)
    num = torch.randint(0, K + 1, (N,), generator=g)  # rows with 0, 1 or 2 drafts
    u = torch.rand(N, K, generator=g, dtype=torch.float64)
    e = torch.empty(N, K + 1, V).exponential_(generator=g)
    out, acc = rejection_sample(target, drafts, num, u, e, draft_probs)
    assert (acc <= num).all() and (out[torch.arange(N), acc] >= 0).all()
    assert (out[:, 1:][torch.arange(K)[None, :] >= acc[:, None]] == -1).all()
    # accepted drafts are the drafts
    m = torch.arange(K)[None, :] < acc[:, None]
    assert torch.equal(out[:, :K][m], drafts[m])
    # the first token ~ p[0] whatever the drafts; the second (rows that accepted the first draft) ~ p[1]
    assert _chi2(out[:, 0], p[0]) > 0.001
    second = out[acc >= 1, 1]
    assert second.numel() > 100_000
    assert _chi2(second, p[1]) > 0.001
    # the sampler is not trivially emitting its draws: drafts are accepted at the theoretical rate
    if one_hot:
        has = num >= 1
        rate = (acc[has] >= 1).double().mean().item()
        expect = p[0][drafts[has, 0]].double().mean().item()
        assert abs(rate - expect) < 0.005
    # a wrong target fails the test: the same draws against a shifted p[0]
    assert _chi2(out[:, 0], torch.roll(p[0], 1)) < 1e-6


def test_seeded_rows_give_the_same_tokens_alone_or_in_a_batch() -> None:
    g = torch.Generator().manual_seed(0)
    r, v = 5, 50
    logits = torch.randn(r, K + 1, v, generator=g)
    drafts = logits.argmax(-1)[:, :K]  # likely accepted
    drafts[1] = torch.tensor([3, 4])  # likely rejected
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i) for i in range(r)]
    meta = SamplingMetadata(params, [7 + i for i in range(r)], [i for i in range(r)], [None] * r, [None] * r)
    together, _ = verify_rows(logits, drafts, [K] * r, meta, torch.Generator().manual_seed(1))
    for i in range(r):
        one = SamplingMetadata([params[i]], [7 + i], [i], [None], [None])
        alone, _ = verify_rows(
            logits[i : i + 1], drafts[i : i + 1], [K], one, torch.Generator().manual_seed(9)
        )
        assert alone[0] == together[i]
    assert len({tuple(t) for t in together}) > 1
    # another seed changes the draws
    other = SamplingMetadata(params, [100 + i for i in range(r)], list(range(r)), [None] * r, [None] * r)
    moved, _ = verify_rows(logits, drafts, [K] * r, other, torch.Generator().manual_seed(1))
    assert moved != together


def test_large_steps_verify_in_row_blocks_with_the_same_seeded_tokens() -> None:
    g = torch.Generator().manual_seed(3)
    r, v = 7, 40
    logits = torch.randn(r, K + 1, v, generator=g)
    drafts = logits.argmax(-1)[:, :K]
    params = [SamplingParams(temperature=0.7 + 0.1 * (i % 3), top_k=20, seed=i) for i in range(r)]
    meta = SamplingMetadata(params, list(range(r)), [3] * r, [None] * r, [None] * r)
    nd = [K, 1, 0, K, 2, K, 1]
    whole = verify_rows(logits, drafts, nd, meta, torch.Generator().manual_seed(0))
    blocks = 2 * (K + 1) * v  # blocks of 2 rows
    assert (
        verify_rows(logits, drafts, nd, meta, torch.Generator().manual_seed(0), max_elements=blocks) == whole
    )
    assert [len(t) for t in whole[0]] == [a + 1 for a in whole[1]] and all(
        a <= n for a, n in zip(whole[1], nd, strict=True)
    )
