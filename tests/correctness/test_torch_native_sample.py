"""``torch_native.sample`` (``lz.sample`` on CPU by inverse CDF) against the float64 softmax and the
reference: the default CPU kernel (CPU only); 20k draws of one row with temperature, top-k, top-p and min-p
match the float64 distribution of the kept set (cosine >= 0.99, every frequent token within 6 sigma) and never
leave it; seeded rows return exactly ``reference.sample``'s tokens in any batch; the generator makes unseeded
draws reproducible; a one-token row, greedy rows and a vocabulary of one. (The shared behaviour of
``lz.sample`` is in test_batch_sampling.py, which runs the default kernel, i.e. this one on CPU.)"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import layerzero as lz
from layerzero.backends.torch_native.sampling import sample as tn_sample

pytestmark = pytest.mark.correctness


def _target(row: torch.Tensor, t: float, k: int, p: float, min_p: float) -> dict[int, float]:
    """float64 oracle: temperature, top-k (ties kept), top-p on the renormalized top-k, min-p, then
    normalize."""
    z = row.double() / t
    keep = z >= z.topk(k).values[-1]
    pr = torch.where(keep, torch.softmax(z.masked_fill(~keep, -math.inf), 0), 0.0)
    order = torch.argsort(-pr, stable=True)
    before = torch.cumsum(pr[order], 0) - pr[order]
    cut = torch.zeros_like(keep)
    cut[order] = before >= p
    cut[order[0]] = False
    pr = pr.masked_fill(cut, 0.0)
    pr = pr / pr.sum()
    pr = pr.masked_fill(pr < min_p * pr.max(), 0.0)
    pr = pr / pr.sum()
    return {i: float(v) for i, v in enumerate(pr.tolist()) if v > 0}


def test_default_on_cpu_only():
    x = torch.randn(2, 50)
    assert lz.which("sample", x, temperature=torch.ones(2)) == "torch_native.sample"
    spec = next(
        s
        for s in lz.list_kernels("sample")
        if (s["kernel_id"] if isinstance(s, dict) else s.kernel_id) == "torch_native.sample"
    )
    devices = spec["device_types"] if isinstance(spec, dict) else spec.device_types
    assert set(devices) == {"cpu"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["f32", "bf16", "f64"])
def test_twenty_thousand_draws_match_the_float64_distribution(dtype):
    row = (torch.randn(64, generator=torch.Generator().manual_seed(11), dtype=torch.float64) * 2).to(dtype)
    t, k, p, mp = 0.8, 24, 0.9, 0.15
    probs = _target(row.double(), t, k, p, mp)
    assert 1 < len(probs) < 24
    n = 20_000
    out = tn_sample(
        row[None].expand(n, -1),
        temperature=torch.full((n,), t),
        top_k=torch.full((n,), k),
        top_p=torch.full((n,), p),
        min_p=torch.full((n,), mp),
        generator=torch.Generator().manual_seed(1),
    )
    counts = Counter(out.tolist())
    assert set(counts) <= set(probs), sorted(set(counts) - set(probs))
    a = [counts.get(i, 0) for i in range(64)]
    b = [probs.get(i, 0.0) for i in range(64)]
    cos = sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b)
    )
    assert cos >= 0.99
    for tok, q in probs.items():
        if n * q >= 50:
            assert abs(counts[tok] - n * q) <= 6 * math.sqrt(n * q * (1 - q)), (tok, counts[tok], n * q)


def test_seeded_rows_equal_the_reference_in_any_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 301, generator=g) * 2
    temp = 0.4 + torch.rand(9, generator=g)
    seeds = torch.tensor([5, -1, 2**40 + 3, 77, -1, 9, 123456789, 31, 0], dtype=torch.int64)
    offsets = torch.arange(9, dtype=torch.int64) * 3
    seeded = seeds >= 0
    ref_kw = dict(temperature=temp, top_k=torch.full((9,), 50), seeds=seeds, offsets=offsets)
    lz.lock("sample", "reference.sample")
    try:
        want = lz.sample(logits, **ref_kw, generator=torch.Generator().manual_seed(0))
    finally:
        lz.unlock("sample")
    got = tn_sample(logits, **ref_kw, generator=torch.Generator().manual_seed(5))
    assert torch.equal(got[seeded], want[seeded])
    alone = torch.stack(
        [
            tn_sample(
                logits[i : i + 1],
                temperature=temp[i : i + 1],
                top_k=torch.full((1,), 50),
                seeds=seeds[i : i + 1],
                offsets=offsets[i : i + 1],
            )[0]
            for i in range(9)
        ]
    )
    assert torch.equal(alone[seeded], got[seeded])


def test_generator_reproducible_and_edge_rows():
    logits = torch.zeros(64, 1000)
    a = tn_sample(logits, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, tn_sample(logits, generator=torch.Generator().manual_seed(3)))
    assert not torch.equal(a, tn_sample(logits, generator=torch.Generator().manual_seed(4)))
    assert len(set(a.tolist())) >= 55  # uniform over 1000 tokens
    one_hot = torch.full((4, 7), -math.inf)
    one_hot[:, 5] = 0.0
    assert tn_sample(one_hot, generator=torch.Generator().manual_seed(0)).tolist() == [5] * 4
    skewed = torch.tensor([[0.0, -1e4, -1e4], [-1e4, -1e4, 0.0]])
    assert tn_sample(skewed, temperature=torch.ones(2)).tolist() == [0, 2]
    greedy = tn_sample(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), temperature=torch.zeros(1))
    assert greedy.tolist() == [1]
    assert tn_sample(torch.randn(3, 1)).tolist() == [0, 0, 0]
