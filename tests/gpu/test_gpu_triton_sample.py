"""``triton.sample`` (``lz.sample``'s fused exponential race) on a real GPU (``pytest -m gpu``): the float64
race as the oracle for seeded rows at a real vocabulary (151936, odd sizes), greedy rows exact, agreement with
``reference.sample`` on seeded rows, batch invariance of a seeded request, unseeded frequencies against the
softmax, and that ``lz.sample`` picks it on CUDA. Skipped with the backend's reason when triton is not
usable."""

from __future__ import annotations

import math

import pytest
import torch

import layerzero as lz
from layerzero.backends.reference import sampling as ref
from layerzero.backends.triton import sampling as ts

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_usable")]
DEV = "cuda"


def _batch(b: int, v: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = (torch.randn(b, v, generator=g, device=DEV) * 2).to(dtype)
    temp = torch.rand(b, generator=g, device=DEV) * 1.4 + 0.2
    temp[::7] = 0.0  # greedy rows
    seeds = torch.randint(0, 2**40, (b,), generator=g, device=DEV)
    offsets = torch.randint(0, 1000, (b,), generator=g, device=DEV)
    return logits, temp, seeds, offsets


def _race64(logits, temp, seeds, offsets, min_p=None):
    x = logits.double()
    z = (x - x.amax(-1, keepdim=True)) / torch.where(temp > 0, temp, 1.0).double()[:, None]
    if min_p is not None:
        z = z.masked_fill(z.exp() < min_p.double()[:, None] * (1 - 1e-6), -math.inf)
    return z - ref.seeded_exponential(seeds, offsets, logits.shape[1]).log()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("b", "v"), [(64, 151936), (5, 32000), (33, 4097)])
def test_seeded_rows_pick_the_float64_winner(dtype, b, v):
    logits, temp, seeds, offsets = _batch(b, v, dtype, seed=b + v)
    min_p = torch.full((b,), 0.05, device=DEV) if b == 33 else None
    tokens = ts.sample(logits, temperature=temp, min_p=min_p, seeds=seeds, offsets=offsets)
    greedy = temp == 0
    assert torch.equal(tokens[greedy], logits.float().argmax(-1)[greedy])
    s = _race64(logits, temp, seeds, offsets, min_p)[~greedy]
    got = s.gather(-1, tokens[~greedy][:, None]).squeeze(-1)
    best = s.max(-1).values
    assert torch.isfinite(got).all() and (got >= best - 1e-4 * (1 + best.abs())).all()


def test_agrees_with_the_reference_and_is_batch_invariant():
    logits, temp, seeds, offsets = _batch(512, 151936, torch.bfloat16, seed=1)
    tokens = ts.sample(logits, temperature=temp, seeds=seeds, offsets=offsets)
    want = ref.sample(logits, temp, None, None, None, seeds, offsets)
    assert (tokens == want).float().mean() >= 0.99  # only float32 near-ties may differ
    alone = torch.cat(
        [
            ts.sample(
                logits[i : i + 1],
                temperature=temp[i : i + 1],
                seeds=seeds[i : i + 1],
                offsets=offsets[i : i + 1],
            )
            for i in range(0, 512, 37)
        ]
    )
    assert torch.equal(alone, tokens[::37])


def test_unseeded_rows_follow_the_softmax_and_the_generator():
    rows, temp = 200_000, 0.8
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5, -3.0, 1.5]], device=DEV).repeat(rows, 1)
    t = torch.full((rows,), temp, device=DEV)
    tokens = ts.sample(logits, temperature=t, generator=torch.Generator(device=DEV).manual_seed(5))
    freq = torch.bincount(tokens, minlength=7).double().cpu() / rows
    want = torch.softmax(logits[0].double().cpu() / temp, dim=-1)
    assert (freq - want).abs().max() < 0.005, (freq, want)
    again = ts.sample(logits, temperature=t, generator=torch.Generator(device=DEV).manual_seed(5))
    assert torch.equal(tokens, again)


def test_lz_sample_picks_it_by_default_and_under_a_lock():
    """The default pick on CUDA (sampling.PRIORITY_SAMPLE, above the reference), and served under a lock."""
    logits0 = torch.randn(8, 32000, device=DEV, dtype=torch.bfloat16)
    assert lz.which("sample", logits0, temperature=torch.full((8,), 0.7, device=DEV)) == "triton.sample"
    logits = torch.randn(8, 32000, device=DEV, dtype=torch.bfloat16)
    temp = torch.full((8,), 0.7, device=DEV)
    lz.lock("sample", "triton.sample")
    try:
        assert lz.which("sample", logits, temperature=temp) == "triton.sample"
        seeds = torch.arange(8, device=DEV)
        assert torch.equal(
            lz.sample(logits, temperature=temp, seeds=seeds), ts.sample(logits, temperature=temp, seeds=seeds)
        )
    finally:
        lz.unlock("sample")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b", [1, 3, 17])
def test_split_vocabulary_path_returns_the_one_program_ids(dtype, b):
    """The split path (``_sampling_split_kernels.py``, the default at these batch sizes) against ``_race_row``
    (``split=False``): the same ids, bit for bit, with ties of the max across chunks, ``-inf`` entries, an all
    ``-inf`` row, greedy rows, min-p, and seeded and unseeded rows under one generator seed."""
    v = 151936
    assert ts.split_chunks(b, v)[0] > 1
    logits, temp, seeds, offsets = _batch(b, v, torch.float32, seed=100 + b)
    logits[0, [5, 70000, 151935]] = logits[0].max() + 1  # tied maxima in three chunks
    if b > 1:
        logits[1, ::3] = -math.inf
        logits[-1] = -math.inf
    logits = logits.to(dtype)
    temp[b // 2] = 1e-30  # tiny but not greedy
    seeds[::2] = -1  # unseeded rows: noise from the generator's base seed
    min_p = torch.full((b,), 0.05, device=DEV)
    for kw in (
        dict(temperature=temp, seeds=seeds, offsets=offsets),
        dict(temperature=temp, min_p=min_p),
        dict(seeds=seeds, offsets=offsets),
        {},
    ):
        one = ts.sample(logits, generator=torch.Generator(device=DEV).manual_seed(9), split=False, **kw)
        split = ts.sample(logits, generator=torch.Generator(device=DEV).manual_seed(9), split=True, **kw)
        dflt = ts.sample(logits, generator=torch.Generator(device=DEV).manual_seed(9), **kw)
        assert torch.equal(one, split), (kw.keys(), one, split)
        assert torch.equal(split, dflt)
