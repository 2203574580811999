"""``triton.gemv`` (``lz.linear`` for 1-8 rows) compiled on a real GPU (``pytest -m gpu``): equal to a float64
product within the dtype's tolerance on Qwen3-0.6B's projection shapes and odd ones, through ``lz.linear`` (the
default for 1-8 rows; refused beyond 8 rows and for float32) and inside a captured CUDA graph (replays match eager)."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.backends.triton import gemv as tg

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_usable")]
DEV = "cuda"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (37, 129), (2100, 2050), (151936, 1024)]


def _rel_err(out, want):
    return ((out.double() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_matches_float64_and_is_chosen(dtype, shape, rows):
    n, k = shape
    g = torch.Generator(device=DEV).manual_seed(n + k + rows)
    x = torch.randn(rows, k, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=dtype, generator=g) * 0.05
    b = torch.randn(n, device=DEV, dtype=dtype, generator=g) if rows == 3 else None
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert lz.which("linear", x, w, b) == tg.KERNEL_ID  # the default for 1-8 rows (gemv.PRIORITY)
    with lz.trace() as t:
        out = lz.linear(x, w, b)
    assert [k for _, k in t.counts] == [tg.KERNEL_ID]
    assert out.dtype == dtype and out.shape == (rows, n)
    assert _rel_err(out, want) <= TOL[dtype]


def test_refused_beyond_eight_rows_and_for_float32():
    w = torch.randn(1024, 2048, device=DEV, dtype=torch.bfloat16)
    for x, wt in ((torch.randn(9, 2048, device=DEV, dtype=torch.bfloat16), w),
                  (torch.randn(1, 2048, device=DEV, dtype=torch.float32), w.float())):
        report = lz.explain("linear", x, wt)
        assert report.candidate(tg.KERNEL_ID).reasons


@pytest.fixture
def gemv_locked():
    lz.lock("linear", tg.KERNEL_ID)
    yield
    lz.unlock("linear")


def test_graph_replay_matches_eager(gemv_locked):
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(1, 2048, device=DEV, dtype=torch.bfloat16, generator=g)
    x4 = torch.randn(4, 2048, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(1024, 2048, device=DEV, dtype=torch.bfloat16, generator=g)
    eager, eager4 = lz.linear(x, w), lz.linear(x4, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lz.linear(x, w), lz.linear(x4, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out4 = lz.linear(x, w), lz.linear(x4, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(out4, eager4)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, lz.linear(x, w))
