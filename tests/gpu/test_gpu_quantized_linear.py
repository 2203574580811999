"""``triton.quantized_linear`` (the fused low-bit GEMM of ``lz.quantized_linear``) compiled on a real GPU
(``pytest -m gpu``): equal to a float64 oracle within the dtype's tolerance for int8 / fp8 / int4 weights on
Qwen3-0.6B's projection shapes and odd ones, 1 to 70 rows (the row kernel and both tl.dot tiles), through
``lz.quantized_linear`` (locked: the default only for int8 / fp8 e4m3 on Hopper); a captured CUDA graph replays it. The engine with it locked:
tests/engine/gpu/test_engine_gpu.py."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.backends.triton import quantized_linear as tq
from layerzero.testing.quant_oracle import oracle_weight

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_usable")]
DEV = "cuda"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (37, 160)]
FORMATS = [("int8", dict(axis=0)), ("fp8_e4m3", dict(axis=0)), ("fp8_e5m2", {}), ("int4", dict(group_size=128)),
           ("int4", dict(group_size=32))]


def _rel_err(out, want):
    return ((out.double() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


@pytest.fixture
def locked():
    lz.lock("quantized_linear", tq.KERNEL_ID)
    yield
    lz.unlock("quantized_linear")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(("fmt", "kw"), FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 12, 70])
def test_matches_float64_oracle(locked, dtype, fmt, kw, shape, rows):
    n, k = shape
    if fmt.startswith("fp8") and torch.cuda.get_device_capability() < tq.FP8_SM_MIN:
        pytest.skip("float8 weights need SM >= 8.9 in Triton")
    if fmt == "int4" and k % kw["group_size"]:
        pytest.skip(f"int4 groups of {kw['group_size']} do not divide K={k} (lz.quantize refuses it)")
    g = torch.Generator(device=DEV).manual_seed(n + k + rows)
    x = torch.randn(rows, k, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=dtype, generator=g) * 0.05
    b = torch.randn(n, device=DEV, dtype=dtype, generator=g) if rows == 3 else None
    qt = lz.quantize(w, fmt, **kw)
    assert lz.which("quantized_linear", x, qt, b) == tq.KERNEL_ID
    out = lz.quantized_linear(x, qt, b)
    want = x.double() @ oracle_weight(qt).t() + (0 if b is None else b.double())
    assert out.dtype == dtype and out.shape == (rows, n)
    assert _rel_err(out, want) <= TOL[dtype]


def test_graph_replay_matches_eager(locked):
    x = torch.randn(1, 1024, device=DEV, dtype=torch.bfloat16)
    qt = lz.quantize(torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16), "int4", group_size=128)
    eager = lz.quantized_linear(x, qt)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lz.quantized_linear(x, qt)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lz.quantized_linear(x, qt)
    graph.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
