"""``triton.quantized_linear`` (the fused low-bit GEMM of ``lz.quantized_linear``) compiled on a real GPU
(``pytest -m gpu``): equal to a float64 oracle within the dtype's tolerance for int8 / fp8 / int4 weights on
Qwen3-0.6B's projection shapes and odd ones, 1 to 70 rows (the row kernels and both tl.dot tiles), through
``lz.quantized_linear`` (locked: the default only for int8 / fp8 e4m3 on Hopper); a captured CUDA graph
replays it. The int4 decode kernel (``_qgemv_int4``, 1-8 rows): every row count on Qwen3-0.6B's shapes, groups
of 32 / 64 / 128, its loop mode (K beyond one slab), the old row kernel (knob ``int4_decode=False``) beside
it, and inside CUDA graphs (PDL-launched on SM 9.0+, the weight read before its wait) chained after kernels
that write its input. The engine with it locked: tests/engine/gpu/test_engine_gpu.py."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.backends.triton import quantized_linear as tq
from layerzero.core.knobs import knobs
from layerzero.testing.quant_oracle import oracle_weight

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_usable")]
DEV = "cuda"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (37, 160)]
FORMATS = [
    ("int8", dict(axis=0)),
    ("fp8_e4m3", dict(axis=0)),
    ("fp8_e5m2", {}),
    ("int4", dict(group_size=128)),
    ("int4", dict(group_size=32)),
]


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


# ----------------------------------------------------------------------- the int4 decode kernel (_qgemv_int4)
QWEN = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
DECODE_TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _int4_case(n, k, group, rows, dtype, bias, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, k, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=dtype, generator=g) * 0.05
    b = torch.randn(n, device=DEV, dtype=dtype, generator=g) if bias else None
    qt = lz.quantize(w, "int4", group_size=group)
    return x, qt, b, x.double() @ oracle_weight(qt).t() + (0 if b is None else b.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", QWEN + [(37, 160), (1000, 12288)], ids=str)  # the last: the loop mode
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_decode_kernel_matches_float64_oracle(locked, dtype, group, shape, rows):
    n, k = shape
    if k % group:
        pytest.skip(f"groups of {group} do not divide K={k}")
    x, qt, b, want = _int4_case(n, k, group, rows, dtype, rows == 3, seed=n + k + rows + group)
    assert tq.config(rows, n, k, group)["kernel"] == "int4"
    assert lz.which("quantized_linear", x, qt, b) == tq.KERNEL_ID
    out = lz.quantized_linear(x, qt, b)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert _rel_err(out, want) <= DECODE_TOL[dtype]


@pytest.mark.parametrize("rows", range(1, 9))
def test_int4_decode_kernel_every_row_count_and_the_old_row_kernel(rows):
    x, qt, b, want = _int4_case(4096, 1024, 128, rows, torch.bfloat16, rows % 2 == 0, seed=rows)
    new = tq.quantized_linear(x, qt, b)
    assert _rel_err(new, want) <= DECODE_TOL[torch.bfloat16]
    with knobs(tq.KNOBS, int4_decode=False):
        assert tq.config(rows, 4096, 1024, 128)["kernel"] == "rows"
        assert _rel_err(tq.quantized_linear(x, qt, b), want) <= DECODE_TOL[torch.bfloat16]


@pytest.mark.parametrize("rows", [1, 4])
def test_int4_decode_kernel_in_a_pdl_graph_replays_eager_bits(locked, rows):
    """The four Qwen3-0.6B projections chained in one captured graph (each PDL-launched on SM 9.0+: its weight
    read before the wait), each after a kernel that writes its input (``lz.rms_norm``), replayed after the
    input changes: equal to eager calls of the same kernels, and to the float64 oracle of each step."""
    g = torch.Generator(device=DEV).manual_seed(11)
    x = torch.randn(rows, 1024, device=DEV, dtype=torch.bfloat16, generator=g)
    qts = [
        lz.quantize(
            torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=g) * 0.05, "int4", group_size=128
        )
        for n, k in QWEN
    ]
    nws = [torch.rand(k, device=DEV, generator=g).to(torch.bfloat16) + 0.5 for _, k in QWEN]

    def step():
        outs, h = [], x
        for (_, k), qt, nw in zip(QWEN, qts, nws, strict=True):
            h = lz.rms_norm(h[:, :k], nw, 1e-6)
            outs.append((h, lz.quantized_linear(h, qt)))
            h = outs[-1][1]
        return outs

    with lz.capture_selection():
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device=DEV, generator=g, dtype=torch.bfloat16))
        graph.replay()
        with lz.capture_selection():
            want = step()
        torch.cuda.synchronize()
        for (h, y), (_, y_eager), qt in zip(outs, want, qts, strict=True):
            assert torch.equal(y, y_eager)
            assert _rel_err(y, h.double() @ oracle_weight(qt).t()) <= DECODE_TOL[torch.bfloat16]
