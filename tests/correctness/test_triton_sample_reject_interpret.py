"""``triton.sample``'s sort-free top-k / top-p kernel (``_sampling_reject_kernels.py``) on CPU through the
Triton interpreter, on tiny vocabularies (the interpreter runs a program in ~0.1-0.3 s): seeded rows draw
exactly ``reference.sample``'s tokens (the race over the sorted-and-cut row) -- ties at the k-th value and at
the top-p boundary, both cuts with min-p, greedy rows, rows over several tiles -- and the same token alone as
in the batch; unseeded rows stay in the float64 oracle's kept set. The distribution over many draws is
tested on the GPU (tests/gpu/test_gpu_sample_reject.py) and, for the same algorithm in torch, in
test_sample_reject.py."""

from __future__ import annotations

import pytest
import torch
from _triton_interp import needs_interpreter
from test_batch_sampling import oracle_allowed

from layerzero.backends.reference import sampling as ref
from layerzero.backends.triton import sampling as ts
from layerzero.core.knobs import knobs

pytestmark = pytest.mark.correctness
interpreted = needs_interpreter("tests/gpu/test_gpu_sample_reject.py")


def _case(b: int, v: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g) * 2
    logits[0, :4] = logits[0].max() + 0.5  # tied maxima
    top = logits[1].argsort(descending=True)
    logits[1, top[2:6]] = logits[1, top[2]].clone()  # ties across the k-th place
    logits[2] = 0.0  # flat: top-k keeps every tie, top-p the lowest ids
    kw = dict(
        temperature=torch.tensor([0.7, 1.0, 1.0, 0.0, 1.3, 0.5, 2.0, 0.9][:b]),
        top_k=torch.tensor([3, 3, 2, 5, 2**33 + 2, 4, 0, 7][:b]),  # a k past int32: no cut
        top_p=torch.tensor([0.9, 0.6, 0.5, 1.0, 0.8, 1.0, 0.3, 0.75][:b]),
        min_p=torch.tensor([0.0, 0.05, 0.0, 0.1, 0.0, 0.2, 0.0, 0.02][:b]),
    )
    return logits, kw


@interpreted
@pytest.mark.parametrize(("v", "block"), [(8, 4096), (37, 16)], ids=["one-tile", "three-tiles"])
def test_seeded_rows_draw_the_reference_tokens(v, block):
    logits, kw = _case(8, v, seed=v)
    with knobs(ts.KNOBS, race_block=block):
        for off in (3,):
            seeded = dict(
                kw, seeds=torch.arange(8, dtype=torch.int64) * 97 + 5, offsets=torch.full((8,), off)
            )
            got = ts.sample(logits, **seeded)
            assert torch.equal(got, ref.sample(logits, **seeded)), (got, ref.sample(logits, **seeded))
        alone = ts.sample(logits[4:5], **{k: t[4:5] for k, t in seeded.items()})
        assert int(alone) == int(got[4])


@interpreted
def test_unseeded_rows_stay_in_the_kept_set():
    logits, kw = _case(8, 37, seed=1)
    allowed = oracle_allowed(logits, kw)
    got = ts.sample(logits, **kw, generator=torch.Generator().manual_seed(0))
    assert all(int(got[i]) in allowed[i] for i in range(8)), got
    assert int(got[3]) == int(logits[3].argmax())  # temperature 0: the first argmax


@interpreted
def test_top_p_is_relative_to_the_top_k_mass():
    """Top-k 3 of ``z = [0, -0.05, -0.1]`` then 253 tokens at -5, top-p 0.5: the top-k mass is 2.856, so
    tokens 0 and 1 are kept (mass ranked above token 1: 1 < 1.428) and token 2 is cut (1.951). A mass over the
    top 2 only would cut token 1, one over the whole row (4.55) would keep token 2: 8 seeded draws give
    exactly {0, 1}, as the reference."""
    n, v = 8, 256
    row = torch.full((v,), -5.0)
    row[:3] = torch.tensor([0.0, -0.05, -0.1])
    kw = dict(
        top_k=torch.full((n,), 3),
        top_p=torch.full((n,), 0.5),
        seeds=torch.arange(n, dtype=torch.int64) * 7 + 1,
        offsets=torch.zeros(n, dtype=torch.int64),
    )
    logits = row[None].expand(n, -1).contiguous()
    got = ts.sample(logits, **kw)
    assert set(got.tolist()) == {0, 1}
    assert torch.equal(got, ref.sample(logits, **kw))
