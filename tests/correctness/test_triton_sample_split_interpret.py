"""``triton.sample``'s split-vocabulary path (``_sampling_split_kernels.py``: chunk maxima, chunk races,
merge) on CPU through the Triton interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py when no CUDA
device is visible): it must return exactly the ids of the one-program-per-row kernel ``_race_row``
(``split=False``).

Cases: odd vocabularies (1, 7, 1000, 5003) cut into many chunks (``split_block`` / ``split_programs`` lowered
so small rows split, the last chunk short), 1-5 rows, with and without temperature (greedy rows at 0 and below
float32's smallest normal, and just above it), with and without min-p, seeded and unseeded rows (the call's
base seed fixed by a seeded generator), ties of the max across chunks, ``-inf`` entries, all-``-inf`` rows and
``+inf`` logits; the top-k / top-p path; the merge's tie rule (smallest column) on crafted partials; the split
rule."""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch
from _triton_interp import needs_interpreter

from layerzero.backends.triton import _sampling_race
from layerzero.backends.triton import sampling as ts
from layerzero.core.knobs import knobs

pytestmark = pytest.mark.correctness

interpreted = needs_interpreter("tests/gpu/test_gpu_triton_sample.py")
TINY = float(torch.finfo(torch.float32).tiny)


@pytest.fixture
def sampling_knobs():
    """``sampling_knobs(field=value, ...)``: set ``triton.sampling`` knobs until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(knobs(ts.KNOBS, **fields))


@pytest.fixture
def small_chunks():
    """Split rows of a few hundred columns into many chunks (the real sizes need 150k-column rows)."""
    with knobs(ts.KNOBS, split_block=64, split_programs=24):
        yield


def _logits(rnd: random.Random, g: torch.Generator, b: int, v: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(b, v, generator=g) * rnd.choice([1.0, 3.0])
    for r in range(b):
        kind = rnd.choice(["plain", "ties", "ninf", "ties", "ninf"] + (["all_ninf", "pinf"] if r > 0 else []))
        if kind == "ties":  # the max repeated in several chunks: the first column must win
            cols = rnd.sample(range(v), min(v, 4))
            x[r, cols] = x[r].max() + 1.0
        elif kind == "ninf":
            x[r, rnd.sample(range(v), v // 3)] = -math.inf
        elif kind == "all_ninf":
            x[r] = -math.inf
        elif kind == "pinf":
            x[r, rnd.sample(range(v), min(v, 2))] = math.inf
    if rnd.random() < 0.5 and v > 1:  # equal values everywhere in one row: ties of the noise-free race terms
        x[0] = 0.5
    return x.to(dtype)


def _both(logits: torch.Tensor, seed: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    one = ts.sample(logits, generator=torch.Generator().manual_seed(seed), split=False, **kw)
    split = ts.sample(logits, generator=torch.Generator().manual_seed(seed), split=True, **kw)
    return one, split


# 2 and 4 rows run on the small vocabularies only, and the large vocabularies take few row counts: the
# interpreter's time grows with rows x vocabulary (5003 x 5 took 29 s, 5003 x 3 19 s on this VM; CI's budget)
SPLIT_CASES = [(v, r) for v in (1, 7) for r in (1, 2, 3, 4, 5)] + [(1000, 1), (1000, 5), (5003, 1)]


@interpreted
@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize(("vocab", "rows"), SPLIT_CASES, ids=[f"{v}-{r}" for v, r in SPLIT_CASES])
def test_split_returns_the_one_program_ids(vocab, rows, sampling_knobs):
    if vocab == 7:
        sampling_knobs(split_block=2)  # 4 chunks of 2 columns
    rnd = random.Random(vocab * 10 + rows)
    g = torch.Generator().manual_seed(vocab * 10 + rows)
    if vocab > 1:
        n_chunks = ts.split_chunks(rows, vocab)[0]
        assert n_chunks > 1, "the case must exercise the split path"
    for case in range(4):
        dtype = rnd.choice([torch.float32, torch.bfloat16])
        logits = _logits(rnd, g, rows, vocab, dtype)
        kw: dict = {}
        if case % 2 == 1:
            kw["temperature"] = torch.tensor(
                [rnd.choice([0.0, TINY / 2, TINY * 2, 0.3, 0.7, 1.0, 1.6]) for _ in range(rows)],
                dtype=torch.float32,
            )
        if case >= 2:
            kw["min_p"] = torch.tensor(
                [rnd.choice([0.0, 0.05, 0.3, 1.0]) for _ in range(rows)], dtype=torch.float32
            )
        if rnd.random() < 0.7:
            kw["seeds"] = torch.tensor(
                [rnd.choice([-1, rnd.randint(0, 2**40)]) for _ in range(rows)], dtype=torch.int64
            )
            kw["offsets"] = torch.tensor([rnd.randint(0, 2**33) for _ in range(rows)], dtype=torch.int64)
        one, split = _both(logits, seed=case, **kw)
        assert split.dtype == torch.int64 and split.shape == (rows,)
        assert torch.equal(one, split), (case, kw, one, split)
        if "temperature" in kw:  # greedy rows: the first argmax
            greedy = kw["temperature"] < TINY
            assert torch.equal(split[greedy], logits.float().argmax(-1)[greedy])


@interpreted
@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("seed", range(2))
def test_split_matches_after_top_k_and_top_p(seed):
    rnd = random.Random(seed)
    b, v = 4, 1000
    logits = _logits(rnd, torch.Generator().manual_seed(seed), b, v, torch.float32)
    logits[logits.isinf()] = 0.0  # the cut (torch.sort of z) is the reference's, not under test here
    kw = dict(
        temperature=torch.tensor([0.0, 0.5, 1.0, 1.3]),
        top_k=torch.tensor([0, 5, 50, 1000]),
        top_p=torch.tensor([0.9, 1.0, 0.5, 0.95]),
        seeds=torch.tensor([3, -1, 5, 2**35]),
        offsets=torch.tensor([0, 1, 2, 3]),
    )
    one, split = _both(logits, seed=7, **kw)
    assert torch.equal(one, split)


@interpreted
def test_merge_takes_the_smallest_column_among_equal_scores():
    mod = _sampling_race._SPLIT_KERNELS.get()
    n_chunks = 5
    fp = torch.full((4, 2, n_chunks), -math.inf)
    ip = torch.zeros((4, 2, n_chunks), dtype=torch.int32)
    # row 0: chunk maxima tie in chunks 1 and 3, race scores tie in chunks 2 and 4
    fp[0, 0] = torch.tensor([1.0, 2.0, 0.5, 2.0, -math.inf])
    ip[0, 0] = torch.tensor([3, 17, 30, 61, 0], dtype=torch.int32)
    fp[0, 1] = torch.tensor([-1.0, 0.0, 4.0, 3.0, 4.0])
    ip[0, 1] = torch.tensor([2, 19, 33, 50, 77], dtype=torch.int32)
    # row 1: nothing beat -inf (an all -inf row): column 0 either way
    # row 2: a NaN partial is ignored (tl.max ignores NaN, as CUDA's maxnum does in _race_row's fold)
    fp[2, 1] = torch.tensor([-1.0, math.nan, 1.0, 0.0, 0.0])
    ip[2, 1] = torch.tensor([4, 20, 40, 60, 80], dtype=torch.int32)
    # row 3: only NaN partials (an all -inf row: every z is NaN): column 0, as _race_row gives
    fp[3, 1] = math.nan
    ip[3, 1] = 9
    out = torch.empty(4, dtype=torch.int64)
    t = torch.tensor([0.0, 1.0, 1.0, 1.0])
    mod._split_merge[(4,)](t, fp, ip, out, n_chunks, ts.GREEDY_BELOW, HAS_T=True, CHUNKS=8)
    assert out.tolist() == [17, 0, 40, 0]
    mod._split_merge[(4,)](t, fp, ip, out, n_chunks, ts.GREEDY_BELOW, HAS_T=False, CHUNKS=8)
    assert out.tolist() == [33, 0, 40, 0]


def test_split_rule():
    kn = ts.SamplingKnobs()
    assert ts.split_chunks(1, 151936) == (75, kn.split_block)  # one tile per chunk at batch 1
    n, length = ts.split_chunks(17, 151936)
    assert (
        1 < n <= math.ceil(kn.split_programs / 17) and length % kn.split_block == 0 and n * length >= 151936
    )
    assert (n - 1) * length < 151936
    assert ts.split_chunks(kn.split_programs, 151936)[0] == 1  # enough rows: one program per row
    assert ts.split_chunks(1, kn.split_block)[0] == 1  # one tile: nothing to split


def test_the_chunk_vector_width_is_one_constant_per_vocabulary(monkeypatch):
    """``CHUNKS`` (a ``tl.constexpr``: one compiled variant per value) depends on the vocabulary only, never
    on the number of rows: a launch spy sees one value for 1-300 rows of Qwen3's vocabulary, wide enough for
    the most chunks (75 at one row) and launched with the same warps."""
    block = ts.SamplingKnobs().split_block
    assert ts.chunk_pad(151936) == 128 and ts.chunk_pad(block) == 1 and ts.chunk_pad(block + 1) == 2
    seen = set()
    calls = []
    monkeypatch.setattr(
        _sampling_race, "launch", lambda fn, grid, *a, **kw: calls.append((fn.__name__, grid, kw))
    )
    for rows in (1, 2, 3, 5, 17, 40, 300):
        calls.clear()
        ts.sample(torch.zeros(rows, 151936), split=None if rows > 1 else True)
        n_chunks = ts.split_chunks(rows, 151936)[0]
        if n_chunks == 1:
            assert [c[0] for c in calls] == ["_race_row"]
            continue
        assert n_chunks <= ts.chunk_pad(151936)
        seen |= {(name, kw["CHUNKS"], kw["num_warps"]) for name, _, kw in calls if "CHUNKS" in kw}
    assert seen == {("_split_race", 128, 4), ("_split_merge", 128, 1)}
