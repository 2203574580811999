"""``triton.sample`` (``lz.sample``'s exponential race in one Triton launch) on CPU through the Triton
interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py when no CUDA device is visible), against float64
oracles:

- seeded rows: the race re-scored in float64 from the reference's own noise (``reference.sampling.
  seeded_exponential``): the kernel's pick must carry the largest score, up to a float32-rounding margin (so a
  near-tie may go either way, anything else may not), and must survive the min-p / top-k / top-p cuts;
- greedy rows (T = 0): the first argmax, exactly;
- unseeded rows: frequencies over many rows against ``softmax(logits / T)`` in float64;
- the counter hash itself, bit for bit against the reference's int64 implementation.

Seeded ragged shapes: odd vocabularies on both sides of the kernel's 4096-element tile, float32 and bfloat16
logits."""

from __future__ import annotations

import math
import random

import pytest
import torch
from _triton_interp import needs_interpreter

from layerzero.backends import _sampling_common as common
from layerzero.backends.reference import sampling as ref
from layerzero.backends.triton import sampling as ts

pytestmark = pytest.mark.correctness

interpreted = needs_interpreter("tests/gpu/test_gpu_triton.py")


def _case(seed: int, dtype: torch.dtype, *, min_p: bool = False):
    rnd = random.Random(seed)
    b, v = rnd.randint(1, 6), rnd.choice([7, 1000, 4099, 5003])
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, v, generator=g) * rnd.choice([1.0, 3.0])).to(dtype)
    temp = torch.tensor([rnd.choice([0.0, 0.3, 0.7, 1.0, 1.6]) for _ in range(b)], dtype=torch.float32)
    seeds = torch.tensor([rnd.randint(0, 2**40) for _ in range(b)], dtype=torch.int64)
    offsets = torch.tensor([rnd.randint(0, 500) for _ in range(b)], dtype=torch.int64)
    mp = (
        torch.tensor([rnd.choice([0.0, 0.05, 0.3]) for _ in range(b)], dtype=torch.float32) if min_p else None
    )
    return logits, temp, seeds, offsets, mp


def _scores64(logits, temp, seeds, offsets, cut=None):
    """The race's scores in float64 with the reference's noise: ``z - log(E)``, -inf where cut."""
    x = logits.to(torch.float64)
    z = (x - x.amax(dim=-1, keepdim=True)) / torch.where(temp > 0, temp, 1.0).to(torch.float64)[:, None]
    if cut is not None:
        z = z.masked_fill(cut, -math.inf)
    return z - ref.seeded_exponential(seeds, offsets, logits.shape[1]).log()


def _assert_wins(tokens, scores, margin=1e-4):
    best = scores.max(dim=-1).values
    got = scores.gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.isfinite(got).all(), (tokens, got)
    assert (got >= best - margin * (1 + best.abs())).all(), (tokens, scores.argmax(dim=-1), got, best)


@interpreted
def test_counter_hash_matches_the_reference_bit_for_bit():
    seeds = torch.tensor([0, 1, 2**32 + 5, 2**40 + 123], dtype=torch.int64)
    offsets = torch.tensor([0, 7, 2**33, 99], dtype=torch.int64)
    vocab = 37
    # one-hot logits at the token the reference noise ranks first: the race picks exactly the noise's argmax
    e = ref.seeded_exponential(seeds, offsets, vocab)
    logits = torch.zeros(4, vocab)
    tokens = ts.sample(logits, seeds=seeds, offsets=offsets)
    assert torch.equal(tokens, (-e.log()).argmax(dim=-1))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_seeded_rows_pick_the_float64_winner(seed, dtype):
    logits, temp, seeds, offsets, mp = _case(seed, dtype, min_p=seed % 2 == 1)
    tokens = ts.sample(logits, temperature=temp, min_p=mp, seeds=seeds, offsets=offsets)
    assert tokens.dtype == torch.int64 and tokens.shape == (logits.shape[0],)
    greedy = temp == 0
    first_max = logits.float().argmax(dim=-1)
    assert torch.equal(tokens[greedy], first_max[greedy])
    cut = None
    if mp is not None:
        x = logits.double()
        z = (x - x.amax(-1, keepdim=True)) / torch.where(temp > 0, temp, 1.0).double()[:, None]
        cut = z.exp() < mp.double()[:, None] * (1 - 1e-6)
    s = _scores64(logits, temp, seeds, offsets, cut)
    _assert_wins(tokens[~greedy], s[~greedy])


@interpreted
@pytest.mark.parametrize("seed", range(3))
def test_top_k_and_top_p_rows_stay_in_the_kept_set(seed):
    logits, temp, seeds, offsets, _ = _case(100 + seed, torch.float32)
    b, v = logits.shape
    temp = temp.clamp_min(0.5)
    top_k = torch.tensor([random.Random(seed + i).choice([0, 1, 5, 50]) for i in range(b)], dtype=torch.int64)
    top_p = torch.tensor(
        [random.Random(seed - i).choice([1.0, 0.5, 0.9]) for i in range(b)], dtype=torch.float32
    )
    tokens = ts.sample(logits, temperature=temp, top_k=top_k, top_p=top_p, seeds=seeds, offsets=offsets)
    # the reference's cut, then the float64 race over it
    z = (logits - logits.amax(-1, keepdim=True)) / temp[:, None]
    sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
    cut_z = torch.empty_like(z).scatter_(-1, order, common._cut_sorted(sorted_z, top_k, top_p))
    _assert_wins(tokens, _scores64(logits, temp, seeds, offsets, cut_z == -math.inf))


@interpreted
def test_unseeded_rows_follow_the_softmax():
    # one program per row, ~28 ms each in the interpreter: 400 rows at temperature 0.5, where the top token's
    # probability is 0.635 (0.418 with the temperature ignored, 0.217 away): 0.09 is 3.7 sigma of its
    # frequency
    rows, temp = 400, 0.5
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5, -3.0, 1.5]]).repeat(rows, 1)
    g = torch.Generator().manual_seed(3)
    tokens = ts.sample(logits, temperature=torch.full((rows,), temp), generator=g)
    freq = torch.bincount(tokens, minlength=7).double() / rows
    want = torch.softmax(logits[0].double() / temp, dim=-1)
    assert (freq - want).abs().max() < 0.09, (freq, want)
    few = 40  # the generator decides the unseeded rows' noise: the first rows again, from the same seed
    again = ts.sample(
        logits[:few], temperature=torch.full((few,), temp), generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(tokens[:few], again)
