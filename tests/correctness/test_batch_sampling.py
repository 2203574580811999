"""``lz.sample`` (batched per-row sampling) against a plain float64 oracle written per row.

- greedy rows (temperature 0 or below float32's smallest normal) return the first argmax, whatever the others
  do;
- per-row top-k / top-p / min-p never draw outside the set the oracle allows (odd sizes, every parameter mixed
  with its "off" value, float32/float16/bfloat16/float64 logits);
- 20k draws of one row with all four warpers on match the oracle's distribution (cosine similarity >= 0.99),
  from the generator and from counter-based seeds;
- seeded rows: the same (seed, offset) draws the same token in any batch, at any position and whatever the
  generator; other offsets draw other tokens;
- the counter hash: equal to a plain Python hash with unbounded ints, and no intermediate value of the int64
  computation reaches 2**63 (run on an int subclass that checks every result).
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.backends.reference import sampling as ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import DTYPES, dname  # noqa: E402

pytestmark = pytest.mark.correctness
_ids = lambda x: dname(x) if isinstance(x, torch.dtype) else x  # noqa: E731
TINY = float(torch.finfo(torch.float32).tiny)
SLACK = 1e-4  # relative slack at a cut's boundary: the kernel decides in float32, the oracle in float64


# ====================================================================== the float64 oracle, one row at a time
def oracle_row(
    logits: list[float],
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    slack: float = 0.0,
) -> tuple[dict[int, float], list[int]]:
    """The distribution one row samples from: ``({token: probability}, [tokens left after each warper])``.
    Hugging Face's warper order: temperature, top-k (ties at the k-th kept), top-p on the renormalized top-k
    (tokens whose mass ranked above them is below p), min-p (prob >= min_p * max prob). ``slack`` widens every
    cut a little (tokens within float32 rounding of a boundary are allowed too)."""
    vocab = len(logits)
    t = 1.0 if temperature is None else temperature
    if t < TINY:
        best = max(logits)
        return {logits.index(best): 1.0}, [1]
    top = max(logits)
    z = [(x - top) / t for x in logits]
    kept = list(range(vocab))
    sizes = [vocab]
    if top_k is not None and 0 < top_k < vocab:
        kth = sorted(z, reverse=True)[top_k - 1]
        kept = [i for i in kept if z[i] >= kth - slack * (1.0 + abs(kth))]
    sizes.append(len(kept))
    if top_p is not None and top_p < 1.0:
        total = sum(math.exp(z[i]) for i in kept)
        order = sorted(kept, key=lambda i: (-z[i], i))
        nucleus, before = [], 0.0
        for i in order:
            if before >= top_p + slack:
                break
            nucleus.append(i)
            before += math.exp(z[i]) / total
        kept = nucleus
    sizes.append(len(kept))
    if min_p is not None and min_p > 0.0:
        total = sum(math.exp(z[i]) for i in kept)
        pmax = max(math.exp(z[i]) for i in kept) / total
        kept = [i for i in kept if math.exp(z[i]) / total >= min_p * pmax * (1.0 - slack)]
    sizes.append(len(kept))
    total = sum(math.exp(z[i]) for i in kept)
    return {i: math.exp(z[i]) / total for i in kept}, sizes


def oracle_allowed(logits: torch.Tensor, params: dict[str, torch.Tensor | None]) -> list[set[int]]:
    """Per row, every token the oracle allows (with :data:`SLACK` at the boundaries)."""
    rows = logits.to(torch.float64).tolist()
    out = []
    for b, row in enumerate(rows):
        p = {name: None if t is None else t[b].item() for name, t in params.items()}
        probs, _ = oracle_row(
            row, p.get("temperature"), p.get("top_k"), p.get("top_p"), p.get("min_p"), SLACK
        )
        out.append(set(probs))
    return out


def random_params(batch: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Per-row parameters, each mixed with its 'off' value (and temperature with greedy rows)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(4, batch, generator=g)
    temperature = 0.3 + 1.5 * torch.rand(batch, generator=g)
    temperature[r[0] < 0.15] = 0.0
    top_k = torch.randint(1, vocab + 5, (batch,), generator=g)
    top_k[r[1] < 0.25] = 0
    top_p = 0.05 + 0.95 * torch.rand(batch, generator=g)
    top_p[r[2] < 0.25] = 1.0
    min_p = 0.3 * torch.rand(batch, generator=g)
    min_p[r[3] < 0.25] = 0.0
    return {
        "temperature": temperature.float(),
        "top_k": top_k,
        "top_p": top_p.float(),
        "min_p": min_p.float(),
    }


def cosine(counts: Counter, probs: dict[int, float], vocab: int) -> float:
    a = [counts.get(i, 0) for i in range(vocab)]
    b = [probs.get(i, 0.0) for i in range(vocab)]
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


# ============================================================================ greedy rows
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_greedy_rows_equal_the_first_argmax(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(9, 131, generator=g, dtype=torch.float64) * 3).to(dtype)
    logits[4, [7, 90]] = logits[4].max() + 1  # tied maxima: the first index wins
    temperature = torch.tensor([0.0, 1.0, 1e-40, 0.7, 0.0, 2.0, 5e-39, 0.0, 1.0])
    greedy = temperature < TINY
    first = logits.to(torch.float64).argmax(-1)
    assert first[4] == 7
    for seed in range(5):
        out = lz.sample(
            logits,
            temperature=temperature,
            top_k=torch.full((9,), 50),
            top_p=torch.full((9,), 0.9),
            min_p=torch.full((9,), 0.01),
            generator=torch.Generator().manual_seed(seed),
        )
        assert out.dtype == torch.int64 and out.shape == (9,)
        assert torch.equal(out[greedy], first[greedy])
    assert torch.equal(lz.sample(logits, temperature=torch.zeros(9)), first)
    k1 = lz.sample(
        logits, top_k=torch.ones(9, dtype=torch.int32)
    )  # k = 1 keeps ties at the k-th value (as HF)
    assert torch.equal(logits.gather(1, k1[:, None])[:, 0], logits.amax(-1)) and int(k1[4]) in (7, 90)


# ========================================================================== draws stay inside the allowed set
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize(("batch", "vocab"), [(37, 123), (5, 1), (3, 2), (16, 517)])
def test_tokens_stay_inside_the_oracle_set(dtype, batch, vocab):
    g = torch.Generator().manual_seed(batch * 1000 + vocab)
    logits = (torch.randn(batch, vocab, generator=g, dtype=torch.float64) * 2.5).to(dtype)
    params = random_params(batch, vocab, seed=vocab)
    allowed = oracle_allowed(logits, params)
    seeds = torch.where(
        torch.arange(batch) % 3 == 0, torch.arange(batch) * 11, -1
    )  # a third of the rows seeded
    for draw in range(12):
        kw = {"generator": torch.Generator().manual_seed(draw)}
        if draw % 2:
            kw.update(seeds=seeds, offsets=torch.full((batch,), draw, dtype=torch.int64))
        out = lz.sample(logits, **params, **kw)
        bad = [(b, int(out[b])) for b in range(batch) if int(out[b]) not in allowed[b]]
        assert not bad, f"rows drew tokens outside their sets: {bad[:5]}"


@pytest.mark.parametrize("which", ["top_k", "top_p", "min_p"])
def test_each_warper_alone_stays_inside_its_set(which):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(29, 211, generator=g) * 3
    params = {which: random_params(29, 211, seed=6)[which]}
    allowed = oracle_allowed(logits, params)
    for draw in range(10):
        out = lz.sample(logits, **params, generator=torch.Generator().manual_seed(draw))
        assert all(int(out[b]) in allowed[b] for b in range(29))


# ============================================================================ the distribution
ROW_SEED = 11
VOCAB = 64
PARAMS = {"temperature": 0.8, "top_k": 24, "top_p": 0.9, "min_p": 0.15}  # 64 -> 24 -> 15 -> 12 tokens


def _row_and_target():
    row = (
        torch.randn(VOCAB, generator=torch.Generator().manual_seed(ROW_SEED), dtype=torch.float64) * 2
    ).float()
    probs, sizes = oracle_row(row.double().tolist(), **PARAMS)
    assert sizes[0] > sizes[1] > sizes[2] > sizes[3] > 1, f"every warper must cut something here: {sizes}"
    return row, probs


@pytest.mark.parametrize("noise", ["generator", "seeds"])
def test_twenty_thousand_draws_match_the_float64_distribution(noise):
    row, probs = _row_and_target()
    n = 20_000
    logits = row[None].expand(n, -1)
    kw = {
        name: torch.full((n,), value, dtype=torch.int64 if name == "top_k" else torch.float32)
        for name, value in PARAMS.items()
    }
    if noise == "seeds":
        kw.update(
            seeds=torch.arange(n, dtype=torch.int64) * 7919, offsets=torch.full((n,), 3, dtype=torch.int64)
        )
    else:
        kw.update(generator=torch.Generator().manual_seed(1))
    counts = Counter(lz.sample(logits, **kw).tolist())
    assert set(counts) <= set(probs), sorted(set(counts) - set(probs))
    assert cosine(counts, probs, VOCAB) >= 0.99
    # every kept token with an expected count >= 50 shows up, within 6 sigma
    for tok, p in probs.items():
        if n * p >= 50:
            assert abs(counts[tok] - n * p) <= 6 * math.sqrt(n * p * (1 - p)), (tok, counts[tok], n * p)


def test_one_seeded_request_over_many_offsets_follows_the_distribution():
    """The usual way a seeded request draws: one row, offset = step. 20k steps, same row each time."""
    row, probs = _row_and_target()
    n = 20_000
    kw = {
        name: torch.full((1,), value, dtype=torch.int64 if name == "top_k" else torch.float32)
        for name, value in PARAMS.items()
    }
    # one call per step would be slow; the op is per row, so 20k rows with the same seed and offsets 0..n-1 is
    # the same computation (checked by test_seeded_rows_do_not_depend_on_the_batch)
    kw = {k: v.expand(n) for k, v in kw.items()}
    out = lz.sample(
        row[None].expand(n, -1),
        **kw,
        seeds=torch.full((n,), 1234, dtype=torch.int64),
        offsets=torch.arange(n, dtype=torch.int64),
    )
    assert cosine(Counter(out.tolist()), probs, VOCAB) >= 0.99


# ============================================================================ seeded rows
def test_seeded_rows_do_not_depend_on_the_batch_position_or_generator():
    g = torch.Generator().manual_seed(21)
    vocab = 301
    logits = torch.randn(8, vocab, generator=g) * 2
    params = random_params(8, vocab, seed=22)
    params["temperature"][params["temperature"] == 0] = (
        0.9  # sampled rows only: greedy rows are trivially equal
    )
    seeds = torch.tensor([5, 0, 2**40 + 3, 77, 2**63 - 1, 9, 123456789, 31], dtype=torch.int64)
    offsets = torch.tensor([0, 3, 17, 2**33, 1, 0, 5, 8], dtype=torch.int64)
    alone = torch.stack(
        [
            lz.sample(
                logits[b : b + 1],
                **{k: v[b : b + 1] for k, v in params.items()},
                seeds=seeds[b : b + 1],
                offsets=offsets[b : b + 1],
            )[0]
            for b in range(8)
        ]
    )
    base = lz.sample(
        logits, **params, seeds=seeds, offsets=offsets, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(base, alone)
    # shuffled, interleaved with unseeded rows of other logits, another generator: the seeded rows keep their
    # tokens
    perm = torch.randperm(8, generator=g)
    other = torch.randn(5, vocab, generator=g)
    mixed_logits = torch.cat((other[:2], logits[perm], other[2:]))
    mixed = {k: torch.cat((v[:2], v[perm], v[:3])) for k, v in params.items()}
    mixed_seeds = torch.cat((torch.full((2,), -1), seeds[perm], torch.full((3,), -5)))
    mixed_offsets = torch.cat(
        (torch.zeros(2, dtype=torch.int64), offsets[perm], torch.zeros(3, dtype=torch.int64))
    )
    out = lz.sample(
        mixed_logits,
        **mixed,
        seeds=mixed_seeds,
        offsets=mixed_offsets,
        generator=torch.Generator().manual_seed(99),
    )
    assert torch.equal(out[2:10], base[perm])


def test_offsets_change_the_draw_and_unseeded_rows_follow_the_generator():
    vocab = 1000
    logits = torch.zeros(64, vocab)  # uniform: every offset should land somewhere else
    seeds = torch.full((64,), 42, dtype=torch.int64)
    out = lz.sample(logits, seeds=seeds, offsets=torch.arange(64, dtype=torch.int64))
    assert len(set(out.tolist())) >= 55  # 64 uniform draws over 1000 tokens: ~62 distinct expected
    again = lz.sample(logits, seeds=seeds, offsets=torch.arange(64, dtype=torch.int64))
    assert torch.equal(out, again)
    assert (
        len(set(out.tolist()) & set(lz.sample(logits, seeds=seeds + 1, offsets=torch.arange(64)).tolist()))
        < 20
    )
    # offsets default to 0: equal to explicit zeros
    assert torch.equal(
        lz.sample(logits[:3], seeds=seeds[:3]),
        lz.sample(logits[:3], seeds=seeds[:3], offsets=torch.zeros(3, dtype=torch.int64)),
    )
    # unseeded rows (seed < 0 or no seeds): same generator seed -> same tokens, another seed -> others
    unseeded = torch.full((64,), -1, dtype=torch.int64)
    a = lz.sample(logits, seeds=unseeded, generator=torch.Generator().manual_seed(3))
    b = lz.sample(logits, generator=torch.Generator().manual_seed(3))
    c = lz.sample(logits, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(b, c)


# ============================================================================ the counter hash
MASK = 0xFFFFFFFF


def plain_lowbias32(x: int) -> int:
    """Wellons' lowbias32 with Python's unbounded ints: the textbook form, products masked after the fact."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK
    return x ^ (x >> 16)


def plain_counter_hash(seed: int, offset: int, index: int) -> int:
    h = 0
    for v in (seed & MASK, seed >> 32 & MASK, offset & MASK, offset >> 32 & MASK, index & MASK):
        h = plain_lowbias32(((h ^ v) + 0x9E3779B9) & MASK)
    return h


class Checked(int):
    """An int whose every arithmetic result must fit a signed int64 (and stay >= 0): runs the kernel's own
    hash code and fails on the first intermediate value that would overflow there."""

    def _wrap(self, value):
        assert 0 <= value < 2**63, f"intermediate {value} leaves int64"
        return Checked(value)


for _name in ("add", "radd", "mul", "rmul", "xor", "rxor", "and", "rand", "rshift", "lshift"):

    def _op(self, other, _m=f"__{_name}__"):
        return self._wrap(getattr(int, _m)(self, other))

    setattr(Checked, f"__{_name}__", _op)


INPUTS = [
    (0, 0, 0),
    (1, 0, 0),
    (0, 1, 0),
    (0, 0, 1),
    (2**32 - 1, 2**32 - 1, 2**32 - 1),
    (2**63 - 1, 2**63 - 1, 151935),
    (2**32, 7, 3),
    (123456789, 2**40 + 5, 65535),
    (42, 17, 100_000),
    (2**31, 2**31, 2**31),
]


@pytest.mark.parametrize(("seed", "offset", "index"), INPUTS)
def test_counter_hash_equals_the_plain_python_hash_without_int64_overflow(seed, offset, index):
    expected = plain_counter_hash(seed, offset, index)
    assert ref.counter_hash(Checked(seed), Checked(offset), Checked(index)) == expected
    got = ref.counter_hash(torch.tensor([seed]), torch.tensor([offset]), torch.tensor([index]))
    assert got.dtype == torch.int64 and int(got) == expected


def test_mul32_worst_case_and_hash_spread():
    assert ref.mul32(Checked(MASK), 0xFFFFFFFF) == (MASK * MASK) & MASK
    assert (
        plain_lowbias32(0) == 0 and plain_counter_hash(0, 0, 0) != 0
    )  # the golden-ratio step avoids the 0 fixpoint
    e = ref.seeded_exponential(torch.arange(200, dtype=torch.int64), None, 1000)  # 200k values
    assert e.dtype == torch.float64 and bool(torch.isfinite(e).all()) and bool((e > 0).all())
    u = torch.exp(-e)
    assert abs(float(u.mean()) - 0.5) < 0.003 and abs(float(e.mean()) - 1.0) < 0.01
    hist = torch.histc(u, bins=16, min=0.0, max=1.0)
    assert float((hist - hist.mean()).abs().max()) < 6 * math.sqrt(float(hist.mean()))


def test_half_precision_logits_and_int32_top_k():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 97, generator=g) * 2
    for dtype in (torch.bfloat16, torch.float16):
        low = logits.to(dtype)
        params = {
            "temperature": torch.full((6,), 0.7),
            "top_k": torch.full((6,), 5, dtype=torch.int32),
            "top_p": torch.full((6,), 0.8),
            "min_p": torch.full((6,), 0.1),
        }
        allowed = oracle_allowed(low, params)
        out = lz.sample(low, **params, seeds=torch.arange(6, dtype=torch.int64))
        assert out.dtype == torch.int64 and all(int(out[b]) in allowed[b] for b in range(6))


def test_docstring_examples_run():
    import doctest

    from layerzero.backends.reference import penalties as ref_penalties
    from layerzero.ops import penalties, sampling, sampling_batch, sampling_greedy

    for module in (sampling, sampling_batch, sampling_greedy, penalties, ref, ref_penalties):
        result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted >= 1, (module.__name__, result)
