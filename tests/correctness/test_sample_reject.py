"""Sort-free top-k / top-p / min-p (pivot rejection, ``torch_native.sample``: ``lz.sample``'s CPU kernel)
against the float64 oracle of test_batch_sampling.py (``oracle_row``: the sorted cuts written per row):

- 20k draws per configuration (ties at the k-th value and at the top-p boundary included; top-k with top-p;
  min-p) follow the float64 target: chi-square p > 0.001 over the bins with >= 5 expected draws, and never a
  token outside the kept set; from the generator and from 20k distinct seeds;
- hand-worked ties: a flat row keeps every tie at the k-th value, and top-p keeps the lower ids first;
- seeded rows draw the reference sort's tokens (same noise, so the same argmax over the kept set) and the same
  token alone or in any batch."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from layerzero.backends.reference.sampling import sample as ref_sample
from layerzero.backends.torch_native.sampling import sample as tn_sample

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_batch_sampling import oracle_row  # noqa: E402

pytestmark = pytest.mark.correctness
V = 40
N = 20_000


def _row() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    row = (torch.randn(V, generator=g, dtype=torch.float64) * 1.5).float()
    order = row.argsort(descending=True)
    row[order[4:7]] = row[order[4]].clone()  # three tokens tied at the 5th-6th-7th place (a top-k 5 boundary)
    row[order[10:13]] = row[order[10]].clone()
    return row


CONFIGS = {
    "top_k 5 (ties at the k-th)": dict(temperature=0.9, top_k=5),
    "top_p 0.7": dict(temperature=1.0, top_p=0.7),
    "top_k 12 + top_p 0.8 + min_p 0.05": dict(temperature=0.8, top_k=12, top_p=0.8, min_p=0.05),
    "min_p 0.1": dict(temperature=1.2, min_p=0.1),
    "top_p 0.95, T 2": dict(temperature=2.0, top_p=0.95),
}


def chi2_pvalue(counts: Counter, probs: dict[int, float], n: int) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs`` (bins under 5 expected draws merged)."""
    big = [t for t, q in probs.items() if n * q >= 5]
    obs = [counts.get(t, 0) for t in big]
    exp = [n * probs[t] for t in big]
    rest_exp = n - sum(exp)
    if rest_exp > 0:
        obs.append(n - sum(obs))
        exp.append(rest_exp)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def _tensors(cfg: dict, n: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, v in cfg.items():
        dtype = torch.int64 if name == "top_k" else torch.float32
        out[name] = torch.full((n,), v, dtype=dtype)
    return out


@pytest.mark.parametrize("noise", ["generator", "seeds"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_draws_follow_the_float64_target(name, noise):
    cfg = CONFIGS[name]
    row = _row()
    probs, sizes = oracle_row(
        row.double().tolist(), cfg.get("temperature"), cfg.get("top_k"), cfg.get("top_p"), cfg.get("min_p")
    )
    assert 1 < len(probs) < V, sizes
    kw = _tensors(cfg, N)
    if noise == "seeds":
        kw.update(
            seeds=torch.arange(N, dtype=torch.int64) * 7919 + 1, offsets=torch.zeros(N, dtype=torch.int64)
        )
    out = tn_sample(row[None].expand(N, -1), **kw, generator=torch.Generator().manual_seed(5))
    counts = Counter(out.tolist())
    assert set(counts) <= set(probs), sorted(set(counts) - set(probs))
    assert chi2_pvalue(counts, probs, N) > 1e-3


def test_a_test_that_can_fail():
    """The chi-square check rejects a sampler off by a little (the target without its least likely kept
    token, renormalized)."""
    row = _row()
    probs, _ = oracle_row(row.double().tolist(), 0.9, 5, None, None)
    worst = min(probs, key=probs.get)
    bent = {t: q / (1 - probs[worst]) for t, q in probs.items() if t != worst}
    out = tn_sample(row[None].expand(N, -1), **_tensors({"temperature": 0.9, "top_k": 5}, N))
    assert chi2_pvalue(Counter(out.tolist()), bent, N) < 1e-3


def test_hand_worked_ties():
    """A flat row of 8: top-k 3 keeps all 8 (ties at the k-th kept); top-p 0.5 keeps tokens 0-3 (mass
    ranked above token 4 is 4/8, not < 0.5; equal probabilities rank by lower id)."""
    flat = torch.zeros(4000, 8)
    k = tn_sample(flat, top_k=torch.full((4000,), 3), generator=torch.Generator().manual_seed(0))
    assert set(k.tolist()) == set(range(8))
    p = tn_sample(flat, top_p=torch.full((4000,), 0.5), generator=torch.Generator().manual_seed(0))
    assert set(p.tolist()) == {0, 1, 2, 3}
    seeded = tn_sample(
        flat,
        top_p=torch.full((4000,), 0.5),
        seeds=torch.arange(4000),
        offsets=torch.zeros(4000, dtype=torch.int64),
    )
    assert set(seeded.tolist()) == {0, 1, 2, 3}


def test_seeded_rows_equal_the_reference_sort_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(9)
    b = 48
    logits = torch.randn(b, 301, generator=g) * 2.5
    kw = dict(
        temperature=0.3 + 1.2 * torch.rand(b, generator=g),
        top_k=torch.randint(0, 60, (b,), generator=g),
        top_p=torch.where(torch.rand(b, generator=g) < 0.3, 1.0, 0.2 + 0.8 * torch.rand(b, generator=g)),
        min_p=torch.where(torch.rand(b, generator=g) < 0.5, 0.0, 0.2 * torch.rand(b, generator=g)),
        seeds=torch.arange(b, dtype=torch.int64) * 31,
        offsets=torch.randint(0, 100, (b,), generator=g),
    )
    got = tn_sample(logits, **kw)
    assert torch.equal(got, ref_sample(logits, **kw))
    for i in (0, 17, 47):  # alone, and in a shuffled batch
        alone = tn_sample(logits[i : i + 1], **{k: v[i : i + 1] for k, v in kw.items()})
        assert int(alone) == int(got[i])
    perm = torch.randperm(b, generator=g)
    shuffled = tn_sample(logits[perm], **{k: v[perm] for k, v in kw.items()})
    assert torch.equal(shuffled, got[perm])
