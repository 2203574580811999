"""``triton.sample_greedy`` (``lz.sample_greedy``'s split-vocabulary argmax) on a real GPU
(``pytest -m gpu``): equal to ``reference.sample_greedy`` and to ``torch.argmax`` of the float32 cast
(NaN-free rows) for float32 / float16 / bfloat16 logits at [1, 151936], [8, 151936] and [256, 32000] with ties
across chunks, NaN, ``+inf`` and all ``-inf`` rows planted; every split of a row (one chunk to one chunk a
tile) gives the same ids; strided logits; the default pick on CUDA; a CUDA-graph capture whose replays follow
new logits. Skipped with the backend's reason when triton is not usable (and with "needs a CUDA GPU" without
one: tests/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

import layerzero as lz
from layerzero.backends.reference import sampling as ref
from layerzero.backends.triton import sampling as ts

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_usable")]
DEV = "cuda"
KID = "triton.sample_greedy"
SHAPES = [(1, 151936), (8, 151936), (256, 32000)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _logits(s: int, v: int, dtype: torch.dtype, seed: int, *, special: bool = True) -> torch.Tensor:
    """Random logits; with ``special`` (``v`` > 3000), rows 1.. get (in turn) a tie across far-apart columns,
    a NaN after the maximum, two NaN, ``+inf`` twice, all ``-inf``, a single finite value among ``-inf``."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(s, v, generator=g, device=DEV) * 3
    if special:
        for r in range(1, s):
            kind = r % 7
            if kind == 1:
                x[r, [v // 3, v - 5]] = 40.0
            elif kind == 2:
                x[r, 7], x[r, v - 2] = 40.0, math.nan
            elif kind == 3:
                x[r, [v // 2, v // 4]] = math.nan
            elif kind == 4:
                x[r, [v - 1, 2049]] = math.inf
            elif kind == 5:
                x[r] = -math.inf
            elif kind == 6:
                x[r] = -math.inf
                x[r, v - 3000] = -1.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("s", "v"), SHAPES, ids=lambda x: str(x))
def test_equals_the_reference_and_argmax(s, v, dtype):
    x = _logits(s, v, dtype, seed=s + v)
    got = ts.sample_greedy(x)
    want = ref.sample_greedy(x)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    clean = _logits(s, v, dtype, seed=s * 7 + v, special=False)
    assert torch.equal(ts.sample_greedy(clean), torch.argmax(clean.float(), dim=-1))
    if s > 5:  # the planted answers, worked out by hand
        assert got[1].item() == v // 3 and got[2].item() == v - 2 and got[3].item() == v // 4
        assert got[4].item() == 2049 and got[5].item() == 0 and got[6].item() == v - 3000


@pytest.mark.parametrize("programs", [1, 2, 7, 132, 264, 10**6])
def test_every_split_gives_the_same_ids(programs):
    x = _logits(8, 151936, torch.bfloat16, seed=programs)
    assert torch.equal(ts.sample_greedy(x, programs=programs), ref.sample_greedy(x))


def test_strided_logits():
    x = _logits(64, 4099, torch.bfloat16, seed=3)
    assert torch.equal(ts.sample_greedy(x[:, 17:4001]), ref.sample_greedy(x[:, 17:4001]))  # row stride > V
    t = _logits(2049, 9, torch.float16, seed=4, special=False).t()  # [9, 2049], column stride 9
    assert torch.equal(ts.sample_greedy(t), ref.sample_greedy(t))
    assert ts.sample_greedy(x[:0]).shape == (0,)


def test_lz_sample_greedy_picks_it_on_cuda():
    x = _logits(4, 151936, torch.bfloat16, seed=5)
    assert lz.which("sample_greedy", x) == KID
    with lz.trace() as t:
        out = lz.sample_greedy(x)
    assert t.counts[("sample_greedy", KID)] == 1 and torch.equal(out, ref.sample_greedy(x))


@pytest.mark.parametrize(("s", "v"), [(1, 151936), (8, 151936), (256, 32000)], ids=str)
def test_replays_in_a_cuda_graph(s, v):
    """PyTorch's recipe (an eager call, a side-stream warm-up, the capture), the warm-up also under
    ``lz.capture_selection()`` (it compiles the PDL variant a capture of few rows uses on SM >= 9.0): replays
    with new logits copied in give the reference's ids."""
    x = _logits(s, v, torch.bfloat16, seed=11)
    lz.sample_greedy(x)
    with lz.capture_selection():
        assert lz.which("sample_greedy", x) == KID
        lz.sample_greedy(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lz.sample_greedy(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lz.sample_greedy(x)
    for seed in (12, 13):
        x.copy_(_logits(s, v, torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref.sample_greedy(x)), seed
    check = lz.validate_graph_capture(lambda t: lz.sample_greedy(t), x)
    assert check.ok and check.kernels == (f"sample_greedy:{KID}",), str(check)
