"""``lz.sampling_probs``, ``lz.seeded_exponential``, ``lz.seeded_uniform`` (layerzero/sampling_dist.py): the
distribution ``lz.sample`` draws from and its seeded rows' streams, public so that speculative decoding (and
anyone else) agrees with ``lz.sample`` exactly. Oracles: a case worked out by hand; ``lz.sample`` itself, each
CPU kernel locked in turn: a seeded row's token is exactly ``argmax(log probs - log E)`` of these functions;
the stream identity ``E = -log u``."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz

pytestmark = pytest.mark.unit


def test_cuts_worked_by_hand() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    t = torch.ones(1, dtype=torch.float64)
    full = torch.softmax(logits, -1)
    k2 = lz.sampling_probs(logits, t, top_k=torch.tensor([2]))
    assert k2.dtype == torch.float64
    assert torch.allclose(k2[0, :2], full[0, :2] / full[0, :2].sum()) and k2[0, 2:].sum() == 0
    # top-p 0.8: mass ranked above token 1 (0.665) < 0.8 keeps it, above token 2 (0.910) cuts
    p8 = lz.sampling_probs(logits, t, top_p=torch.tensor([0.8], dtype=torch.float64))
    assert (p8[0, :2] > 0).all() and p8[0, 2:].sum() == 0
    mp = lz.sampling_probs(logits, t, min_p=torch.tensor([0.3], dtype=torch.float64))  # keep >= 0.3 * max
    assert (mp[0, :2] > 0).all() and mp[0, 2:].sum() == 0 and float(mp.sum()) == pytest.approx(1.0)
    greedy = lz.sampling_probs(logits, torch.zeros(1, dtype=torch.float64))
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    t2 = lz.sampling_probs(logits, torch.full((1,), 2.0, dtype=torch.float64))  # temperature 2
    assert torch.allclose(t2, torch.softmax(logits / 2.0, -1))
    assert lz.sampling_probs(logits.float()).dtype == torch.float32  # no parameter: the plain softmax


@pytest.mark.parametrize("kernel", ["torch_native.sample", "reference.sample"])
def test_lz_sample_draws_from_these_probs_with_this_noise(kernel) -> None:
    g = torch.Generator().manual_seed(7)
    b, v = 37, 103  # odd sizes; every cut mixed over the rows
    logits = torch.randn(b, v, generator=g, dtype=torch.float64) * 3
    temp = torch.rand(b, generator=g) * 1.5 + 0.2  # lz.sample's parameters are float32
    temp[::9] = 0.0  # greedy rows
    top_k = torch.randint(0, 40, (b,), generator=g)
    top_p = torch.rand(b, generator=g) * 0.7 + 0.3
    min_p = torch.rand(b, generator=g) * 0.2
    seeds = torch.randint(0, 2**62, (b,), generator=g)
    offsets = torch.randint(0, 1000, (b,), generator=g)
    lz.lock("sample", kernel)
    try:
        got = lz.sample(
            logits, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds, offsets=offsets
        )
    finally:
        lz.unlock("sample")
    probs = lz.sampling_probs(logits, temp, top_k, top_p, min_p)
    assert torch.allclose(probs.sum(-1), torch.ones(b, dtype=torch.float64))
    e = lz.seeded_exponential(seeds, offsets, v)
    want = torch.argmax(torch.log(probs) - torch.log(e), dim=-1)
    assert torch.equal(got, want)
    # a different offset is a different stream (so the check above could fail)
    other = torch.argmax(torch.log(probs) - torch.log(lz.seeded_exponential(seeds, offsets + 1, v)), dim=-1)
    assert not torch.equal(other, want)


def test_streams() -> None:
    seeds = torch.tensor([[0], [5], [2**40 + 3]])  # [3, 1] against offsets [4]: broadcast [3, 4]
    offsets = torch.arange(4)
    e = lz.seeded_exponential(seeds, offsets, 11)
    assert e.shape == (3, 4, 11) and e.dtype == torch.float64 and bool((e > 0).all())
    # token j's noise is -log of the uniform of index j; the default index (2**32 - 1) is no token's
    assert torch.allclose(lz.seeded_uniform(seeds, offsets, 6), torch.exp(-e[..., 6]))
    u = lz.seeded_uniform(seeds, offsets)
    assert u.shape == (3, 4) and bool(((u > 0) & (u < 1)).all())
    assert not torch.isclose(u[..., None], torch.exp(-e)).any()
    assert torch.equal(lz.seeded_exponential(seeds[1:2], offsets, 11), e[1:2])  # a function of its inputs


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: lz.sampling_probs(torch.zeros(3)), r"logits: expected a \[B, V\] float tensor"),
        (lambda: lz.sampling_probs(torch.zeros(2, 5), torch.ones(3)), r"temperature: expected a \[2\] fl"),
        (lambda: lz.sampling_probs(torch.zeros(2, 5), top_k=torch.ones(2)), r"top_k: expected a \[2\] int"),
        (lambda: lz.seeded_exponential(torch.ones(2), torch.zeros(2, dtype=torch.long), 4), "seeds: exp"),
        (lambda: lz.seeded_exponential(torch.ones(2, dtype=torch.long), torch.zeros(3, dtype=torch.long), 4),
         "broadcastable"),
        (lambda: lz.seeded_exponential(torch.ones(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 0),
         "vocab: expected an int >= 1"),
        (lambda: lz.seeded_uniform(torch.ones(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), -1),
         r"index: expected an int in \[0, 2\*\*32\)"),
    ],
)  # fmt: skip
def test_bad_input_is_typed(call, match) -> None:
    with pytest.raises(lz.InvalidInputError, match=match):
        call()
