"""``triton.gemv`` (``lz.linear`` for 1-8 rows) compiled on a real GPU (``pytest -m gpu``): equal to a float64
product within the dtype's tolerance on Qwen3-0.6B's projection shapes and odd ones, through ``lz.linear``
(the default for 1-8 rows; refused beyond 8 rows and for float32) and inside a captured CUDA graph (replays
match eager)."""

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
    for x, wt in (
        (torch.randn(9, 2048, device=DEV, dtype=torch.bfloat16), w),
        (torch.randn(1, 2048, device=DEV, dtype=torch.float32), w.float()),
    ):
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


# ------------------------------------------------------------------------------------ lz.rms_norm_linear
def _norm_oracle(x, nw, w, r, eps):
    h = (x.double() + r.double()).to(x.dtype) if r is not None else x
    hd = h.double()
    return (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * nw.double()) @ w.double().t(), h


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(1, 4096, 1024), (1, 6144, 1024), (2, 4096, 1024), (3, 1024, 2048), (1, 37, 129), (4, 70, 3001)],
    ids=str,
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_linear_matches_float64_and_is_chosen(dtype, rows, n, k, residual):
    g = torch.Generator(device=DEV).manual_seed(rows * n + k)
    x = torch.randn(rows, k, device=DEV, dtype=dtype, generator=g) * 3
    nw = (torch.rand(k, device=DEV, generator=g) + 0.5).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(dtype)
    r = torch.randn(rows, k, device=DEV, dtype=dtype, generator=g) if residual else None
    assert lz.which("rms_norm_linear", x, nw, w, residual=r) == tg.NORM_KERNEL_ID
    out = lz.rms_norm_linear(x, nw, w, eps=1e-6, residual=r)
    y = out[0] if residual else out
    want, h = _norm_oracle(x, nw, w, r, 1e-6)
    assert _rel_err(y, want) <= TOL[dtype]
    if residual:
        assert torch.equal(out[1], h)


def test_rms_norm_linear_in_a_pdl_graph_replays_eager_bits():
    """Captured (PDL-launched on SM 9.0+: the weight slab read before the wait), chained after another kernel
    that writes its input, replayed after the input changes: equal to eager calls of the same kernels
    (rms_norm_linear, then swiglu_linear and gemv reading its output)."""
    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(1, 1024, device=DEV, dtype=torch.bfloat16, generator=g)
    r = torch.randn(1, 1024, device=DEV, dtype=torch.bfloat16, generator=g)
    nw = torch.rand(1024, device=DEV, generator=g).to(torch.bfloat16) + 0.5
    w1 = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16, generator=g) * 0.03
    w2 = torch.randn(1024, 4096, device=DEV, dtype=torch.bfloat16, generator=g) * 0.03

    w3 = torch.randn(1024, 2048, device=DEV, dtype=torch.bfloat16, generator=g) * 0.03

    def step():
        y, h = lz.rms_norm_linear(x * 1.0, nw, w1, eps=1e-6, residual=r)
        return lz.swiglu_linear(*y.chunk(2, dim=-1), w3) + lz.linear(y, w2), h

    with lz.capture_selection():
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, h = step()
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device=DEV, generator=g, dtype=torch.bfloat16))
        graph.replay()
        with lz.capture_selection():
            want, want_h = step()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(h, want_h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(
    ("rows", "n", "i"),
    [(1, 1024, 3072), (2, 1024, 3072), (4, 1024, 3072), (1, 37, 129), (3, 70, 3001)],
    ids=str,
)
def test_swiglu_linear_matches_float64_and_is_chosen(dtype, rows, n, i):
    g = torch.Generator(device=DEV).manual_seed(rows * n + i)
    gate_up = torch.randn(rows, 2 * i, device=DEV, dtype=dtype, generator=g) * 2
    w = (torch.randn(n, i, device=DEV, generator=g) / i**0.5).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert lz.which("swiglu_linear", gate, up, w) == tg.SWIGLU_KERNEL_ID
    gd = gate.double()
    want = (gd * torch.sigmoid(gd) * up.double()) @ w.double().t()
    assert _rel_err(lz.swiglu_linear(gate, up, w), want) <= TOL[dtype]
