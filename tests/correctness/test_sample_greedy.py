"""``lz.sample_greedy``'s kernels against a pure-Python oracle: ``reference.sample_greedy`` (PyTorch) and
``triton.sample_greedy`` on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py
when no CUDA device is visible; tests/gpu/test_gpu_sample_greedy.py runs it compiled).

The oracle walks each row's values in Python (float32, the exact cast of float16 / bfloat16): the first NaN's
index if there is one, else the first index whose value beats every earlier one (ties -> the lowest index, an
all ``-inf`` row -> 0). Cases: hand-worked rows with their answers written out; values planted at the Triton
split's chunk boundaries (the split's geometry read from ``greedy_chunks``, its tile lowered so small rows cut
into many chunks of several tiles): the same maximum in two chunks, a NaN in a later chunk than the maximum,
NaN in two chunks, ``+inf`` in two chunks, the maximum in the short last chunk; seeded random rows (S in {0,
1, 3, 7}, V in {1, 5, 2049}, one row of 151936, all three dtypes) with ties, NaN, ``+inf`` and all ``-inf``
rows mixed in; strided logits (a transposed view, a column slice). A last test runs the same checks on wrong
kernels (last index on ties, NaN ignored, the later chunk winning a tie) and requires each to fail."""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator

import pytest
import torch
from _triton_interp import needs_interpreter

from layerzero.backends.reference import sampling as ref
from layerzero.backends.triton import sampling as ts
from layerzero.core.knobs import knobs

pytestmark = pytest.mark.correctness

interpreted = needs_interpreter("tests/gpu/test_gpu_sample_greedy.py")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAN, INF = math.nan, math.inf


def oracle(logits: torch.Tensor) -> list[int]:
    """Per row: the first NaN's index, else the first index of the maximum (a plain loop over Python
    floats)."""
    out = []
    for row in logits.float().tolist():
        pick = 0
        for i, v in enumerate(row):
            if math.isnan(v):
                pick = i
                break
            if v > row[pick]:
                pick = i
        out.append(pick)
    return out


SMALL = 4
"""The lowered tile (elements) of the Triton runs on short rows: many chunks of several tiles each."""


def _triton(programs: int | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: ts.sample_greedy(x, programs=programs)


def _kernels(small_block: bool = True) -> list:
    """(kernel, tile, programs) to run: the reference; the Triton kernel at its own tile and split; with
    ``small_block``, at a :data:`SMALL` tile split for 4 programs (a 37-column row: 4 chunks of 3 tiles, the
    last chunk one column) and for 1 (one program a row over every tile, no merge)."""
    ks = [
        pytest.param(ref.sample_greedy, None, None, id="reference"),
        pytest.param(_triton(), None, None, id="triton", marks=interpreted),
    ]
    if small_block:
        ks += [
            pytest.param(_triton(4), SMALL, 4, id="triton-block4", marks=interpreted),
            pytest.param(_triton(1), SMALL, 1, id="triton-block4-one-chunk", marks=interpreted),
        ]
    return ks


KERNEL_ARGS = ("kernel", "block_size", "programs")


@pytest.fixture
def set_block() -> Iterator[Callable[[int | None], None]]:
    """``set_block(size)``: the ``greedy_block`` knob is ``size`` until the test ends (None: the default
    tile)."""
    with contextlib.ExitStack() as stack:
        yield lambda size: None if size is None else stack.enter_context(knobs(ts.KNOBS, greedy_block=size))


def _check(
    kernel: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor, want: list[int] | None = None
):
    got = kernel(logits)
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],) and got.device == logits.device
    expected = oracle(logits) if want is None else want
    assert got.tolist() == expected, (logits.dtype, tuple(logits.shape))


# ------------------------------------------------------------------------------------------- hand-worked rows
HAND = [
    ([0.0, 5.0, 5.0], 1),  # a tie: the lower index
    ([1.0, NAN, 9.0], 1),  # NaN before a larger value: the NaN
    ([9.0, 1.0, NAN], 2),  # NaN after the maximum: still the NaN
    ([NAN, NAN, 3.0], 0),  # the first of two NaN
    ([-INF, -INF, -INF], 0),  # all -inf: 0
    ([-INF, -INF, -7.0], 2),
    ([1.0, INF, INF], 1),  # +inf is a maximum like any other: the first
    ([-INF, 3.0, NAN, INF], 2),
    ([-0.0, 0.0, -1.0], 0),  # -0.0 == 0.0: a tie
    ([-2.5], 0),  # V = 1
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(KERNEL_ARGS, _kernels())
def test_hand_worked_rows(kernel, block_size, programs, dtype, set_block):
    set_block(block_size)
    for row, want in HAND:
        logits = torch.tensor([row], dtype=dtype)
        assert oracle(logits) == [want], row  # the oracle agrees with the hand-worked answer
        _check(kernel, logits, [want])
    rows = [r for r, _ in HAND if len(r) == 3]  # several rows in one call
    _check(kernel, torch.tensor(rows, dtype=dtype), [w for r, w in HAND if len(r) == 3])


# ------------------------------------------------------------------------------------------- chunk boundaries
def _planted(
    v: int, n_chunks: int, chunk_len: int, dtype: torch.dtype
) -> list[tuple[str, torch.Tensor, int]]:
    """(name, one-row logits, expected id) with values planted around the split's chunk boundaries."""
    assert n_chunks >= 3, "the plants need three chunks"
    g = torch.Generator().manual_seed(v + n_chunks)
    base = torch.rand(1, v, generator=g) * 2 - 1  # in [-1, 1): below every plant
    b1, b2 = chunk_len, 2 * chunk_len  # first columns of chunks 1 and 2
    cases = []

    def plant(name, values, want):
        x = base.clone()
        for col, val in values.items():
            x[0, col] = val
        cases.append((name, x.to(dtype), want))

    plant("same max at the end of chunk 0 and the start of chunk 1", {b1 - 1: 4.0, b1: 4.0}, b1 - 1)
    plant("same max at the start of chunks 1 and 2", {b1: 4.0, b2: 4.0}, b1)
    plant("same max in chunk 0 and the last column", {3 % b1: 4.0, v - 1: 4.0}, 3 % b1)
    plant("max in the (short) last chunk", {v - 1: 4.0}, v - 1)
    plant("NaN in a later chunk than the max", {1: 4.0, b2 + 1: NAN}, b2 + 1)
    plant("NaN in two chunks", {b1 + 2: NAN, b2: NAN, 0: 4.0}, b1 + 2)
    plant("NaN at the end of chunk 0 and the start of chunk 1", {b1: NAN, b1 - 1: NAN}, b1 - 1)
    plant("+inf in two chunks", {b2: INF, b1 + 1: INF}, b1 + 1)
    plant("-inf everywhere but one late column", {**{c: -INF for c in range(v)}, b2 + 3: -5.0}, b2 + 3)
    plant("all -inf", {c: -INF for c in range(v)}, 0)
    return cases


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(KERNEL_ARGS, _kernels())
def test_values_planted_at_chunk_boundaries(kernel, block_size, programs, dtype, set_block):
    """The plants sit at the boundaries of the split this kernel runs (the one-chunk run: of the 4-program
    split, tile boundaries there): 6145 columns at the default tile (4 chunks of 2048, the last one column),
    37 at the small one (4 chunks of 12, the last one column)."""
    set_block(block_size)
    v = 37 if block_size == SMALL else 6145
    n_chunks, chunk_len = ts.greedy_chunks(1, v, 4 if block_size == SMALL else 264)
    assert n_chunks == 4 and v - 3 * chunk_len == 1 and chunk_len == (12 if block_size == SMALL else 2048)
    cases = _planted(v, n_chunks, chunk_len, dtype)
    for name, logits, want in cases:
        assert oracle(logits) == [want], name
        _check(kernel, logits, [want])
    _check(kernel, torch.cat([x for _, x, _ in cases]), [w for _, _, w in cases])  # all in one call


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_planted_at_the_default_tile_boundary(dtype):
    """V = 2049 at the default 2048-element tile: two chunks for one row (the second one column long)."""
    assert ts.greedy_chunks(1, 2049, 264) == (2, ts.SamplingKnobs().greedy_block) == (2, 2048)
    x = torch.zeros(3, 2049)
    x[0, [2047, 2048]] = 4.0  # a tie across the boundary: 2047
    x[1, 0], x[1, 2048] = 4.0, NAN  # NaN in the second chunk wins
    x[2, 2048] = 1.0  # the one-column chunk holds the max
    _check(ts.sample_greedy, x.to(dtype), [2047, 2048, 2048])


# ----------------------------------------------------------------------------------------- seeded random rows
def _random_logits(
    rnd: random.Random, g: torch.Generator, s: int, v: int, dtype: torch.dtype
) -> torch.Tensor:
    x = torch.randn(s, v, generator=g) * rnd.choice([1.0, 4.0])
    for r in range(s):
        kind = rnd.choice(["plain", "ties", "nan", "ties", "pinf", "ninf", "all_ninf", "nan2"])
        cols = rnd.sample(range(v), min(v, 3))
        if kind == "ties":  # the maximum repeated at random columns
            x[r, cols] = x[r].max() + 1.0
        elif kind == "nan":
            x[r, cols[0]] = NAN
        elif kind == "nan2":
            x[r, cols[:2]] = NAN
        elif kind == "pinf":
            x[r, cols] = INF
        elif kind == "ninf":
            x[r, rnd.sample(range(v), v // 2)] = -INF
        elif kind == "all_ninf":
            x[r] = -INF
    return x.to(dtype)


def _random_params() -> list:
    """(kernel, tile, programs, V): V 1, 5 and 2049 at the default tile; 1, 5 and 37 at the small one (2049
    columns in 4-element tiles take minutes in the interpreter)."""
    out = []
    for p in _kernels():
        for v in (1, 5, 37) if p.values[1] == SMALL else (1, 5, 2049):
            out.append(pytest.param(*p.values, v, id=f"{p.id}-V{v}", marks=p.marks))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize((*KERNEL_ARGS, "v"), _random_params())
def test_seeded_random_rows(kernel, block_size, programs, v, dtype, set_block):
    set_block(block_size)
    rnd = random.Random(v)
    g = torch.Generator().manual_seed(v)
    for s in (0, 1, 3, 7):
        _check(kernel, _random_logits(rnd, g, s, v, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(KERNEL_ARGS, _kernels(small_block=False))
def test_one_row_of_a_real_vocabulary(kernel, block_size, programs, dtype):
    """V = 151936 (Qwen's vocabulary), one row: 75 chunks of one 2048-element tile at the default split."""
    g = torch.Generator().manual_seed(151936)
    x = torch.randn(1, 151936, generator=g)
    x[0, [70000, 150000]] = 9.0  # a tie far apart: 70000
    _check(kernel, x.to(dtype), [70000])
    x[0, 151935] = NAN  # the last column
    _check(kernel, x.to(dtype), [151935])


@pytest.mark.parametrize(KERNEL_ARGS, _kernels())
def test_strided_logits(kernel, block_size, programs, set_block):
    """A transposed view (column stride S) and a column slice of a wider buffer (row stride > V)."""
    set_block(block_size)
    g = torch.Generator().manual_seed(7)
    t = _random_logits(random.Random(7), g, 37, 5, torch.float32).t()  # [5, 37], strides (1, 5)
    assert t.stride() == (1, 5)
    _check(kernel, t)
    wide = _random_logits(random.Random(8), g, 3, 60, torch.bfloat16)[:, 7:50]  # [3, 43], strides (60, 1)
    _check(kernel, wide)


# ----------------------------------------------------------------------------------------- the tests can fail
def _last_on_ties(x: torch.Tensor) -> torch.Tensor:
    return x.shape[1] - 1 - ref.sample_greedy(x.flip(-1))


def _nan_ignored(x: torch.Tensor) -> torch.Tensor:
    return ref.sample_greedy(x.float().nan_to_num(nan=-INF))


def _later_chunk_on_ties(x: torch.Tensor) -> torch.Tensor:
    """A merge that takes the last chunk holding the max (chunks of 8 columns), the first within a chunk."""
    out = []
    for row in x.float():
        m = row.max()
        chunks = [c for c in range(0, row.shape[0], 8) if (row[c : c + 8] == m).any()] or [0]  # NaN rows: 0
        out.append(chunks[-1] + int((row[chunks[-1] : chunks[-1] + 8] == m).int().argmax()))
    return torch.tensor(out)


@pytest.mark.parametrize("wrong", [_last_on_ties, _nan_ignored, _later_chunk_on_ties])
def test_the_checks_catch_a_wrong_kernel(wrong):
    cases = _planted(37, 4, 8, torch.float32)  # 8-column chunks, as _later_chunk_on_ties merges
    failed = False
    for _, logits, want in cases:
        try:
            _check(wrong, logits, want)
        except AssertionError:
            failed = True
    assert failed, f"{wrong.__name__} passed the planted cases"
