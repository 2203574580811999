"""lz ops under ``torch.compile(fullgraph=True)`` with Inductor on CUDA (issue 10 part 1's GPU half; the CPU
half is tests/integration/test_torch_compile_ops.py): a decoder block and a serving step (cache write, paged
attention, linear) compile with zero graph breaks, the compiled graph's real calls select the kernels
(``lz.trace``), and the outputs equal eager's on new data (bf16: the same kernels run, so within one bf16
rounding of the ops Inductor fuses around them); ``torch.export`` of ``lz.attention`` on CUDA holds the
``layerzero`` node."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _compile_cases import check_topk_topp_compiles, check_training_block  # noqa: E402

pytestmark = pytest.mark.gpu
DEV, DT = "cuda", torch.bfloat16
TOL = dict(rtol=2e-2, atol=2e-2)


def block(x, w, gate, up, q, k, v, cos, sin, wl):
    h = lz.rms_norm(x, w)
    h2, res = lz.rms_norm(x, w, residual=h)
    qr, kr = lz.rope(q, k, cos, sin)
    att = lz.attention(qr, kr, v, is_causal=True)
    return lz.linear(h2 + res, wl), lz.swiglu(gate, up), att


def _args(gen, rows=5, s=37):
    half = torch.randn(s, 32, generator=gen)
    cos, sin = torch.cat((half.cos(), half.cos()), -1), torch.cat((half.sin(), half.sin()), -1)
    cpu = (
        torch.randn(rows, 256, generator=gen),
        torch.rand(256, generator=gen) + 0.5,
        torch.randn(rows, 384, generator=gen),
        torch.randn(rows, 384, generator=gen),
        torch.randn(2, 8, s, 64, generator=gen),
        torch.randn(2, 2, s, 64, generator=gen),
        torch.randn(2, 2, s, 64, generator=gen),
        cos,
        sin,
        torch.randn(512, 256, generator=gen) * 0.05,
    )
    return tuple(t.to(DEV, DT) for t in cpu)


def test_fullgraph_inductor_block_matches_eager_on_cuda():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    assert torch._dynamo.explain(block)(*_args(gen)).graph_break_count == 0
    compiled = torch.compile(block, fullgraph=True)
    for rows, s in ((5, 37), (5, 37), (1, 64)):
        new = _args(gen, rows, s)
        with lz.trace() as t:
            got = compiled(*new)
        for g, want in zip(got, block(*new), strict=True):
            assert g.dtype == want.dtype and g.device.type == "cuda"
            torch.testing.assert_close(g.float(), want.float(), **TOL)
        assert {"attention", "rms_norm", "rope", "swiglu", "linear"} <= {op for op, _ in t.counts}


def serving_step(k, v, cache, slots, q, tables, lens, x, w):
    lz.reshape_and_cache(k, v, cache, slots)
    return lz.paged_attention(q, cache, tables, lens), lz.linear(x, w)


def test_serving_step_compiles_without_breaks_on_cuda():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)

    def inputs():
        cache = lz.allocate_kv_cache(8, 16, 2, 64, dtype=DT, device=DEV)
        cache.copy_(torch.randn(cache.shape, generator=gen).to(DEV, DT))
        k, v = (torch.randn(3, 2, 64, generator=gen).to(DEV, DT) for _ in range(2))
        return (
            k,
            v,
            cache,
            torch.tensor([20, 47, 100], device=DEV),
            torch.randn(3, 8, 64, generator=gen).to(DEV, DT),
            torch.tensor([[0, 1, 0], [2, 3, 0], [4, 5, 6]], dtype=torch.int32, device=DEV),
            torch.tensor([21, 32, 37], dtype=torch.int32, device=DEV),
            torch.randn(3, 256, generator=gen).to(DEV, DT),
            (torch.randn(128, 256, generator=gen) * 0.05).to(DEV, DT),
        )

    assert torch._dynamo.explain(serving_step)(*inputs()).graph_break_count == 0
    compiled = torch.compile(serving_step, fullgraph=True)
    a = inputs()
    b = tuple(t.clone() for t in a)
    got, want = compiled(*a), serving_step(*b)
    assert torch.equal(a[2].view(torch.uint8), b[2].view(torch.uint8))  # the compiled cache write == eager's
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), **TOL)


def test_export_of_attention_on_cuda():
    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return lz.attention(q, k, v, is_causal=True) * 2

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 40, 64, generator=gen).to(DEV, DT) for h in (8, 2, 2))
    ep = torch.export.export(Attn(), (q, k, v))
    assert any("layerzero" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(q, k, v).float(), Attn()(q, k, v).float(), **TOL)


def quantized_block(x, w8, w4, b, wq):
    h = lz.quantized_linear(x, w8, b)
    xq = lz.quantize(x, "int8", axis=0)  # per-token activations
    norm_w = torch.ones(h.shape[-1], device=h.device, dtype=h.dtype)
    return (lz.quantized_linear(lz.rms_norm(h, norm_w), w4), lz.dequantize(wq), lz.dequantize(xq), xq.scale)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_quantized_ops_compile_without_breaks_on_cuda(fmt):
    """The CUDA half of tests/integration's quantized compile test: ``lz.quantize`` / ``lz.dequantize`` /
    ``lz.quantized_linear`` (custom ops over a QuantizedTensor's fields) in one fullgraph Inductor compile, no
    graph break, outputs equal eager's for new data and a new row count (the same kernels run: bf16 tolerance
    for the ops Inductor fuses around them), every op ran (lz.trace)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(9)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(DEV, DT)

    w8, w4 = lz.quantize(r(96, 128), fmt, axis=0), lz.quantize(r(64, 96, s=0.1), "int4", group_size=32)
    wq, b = lz.quantize(r(4, 64), "nvfp4"), r(96)
    assert torch._dynamo.explain(quantized_block)(r(3, 128), w8, w4, b, wq).graph_break_count == 0
    compiled = torch.compile(quantized_block, fullgraph=True)
    for n in (3, 3, 17):
        x = r(n, 128)
        with lz.trace() as t:
            got = compiled(x, w8, w4, b, wq)
        want = quantized_block(x, w8, w4, b, wq)
        for g, e in zip(got, want, strict=True):
            assert g.device.type == "cuda" and g.dtype == e.dtype
            torch.testing.assert_close(g.float(), e.float(), **TOL)
        assert {"quantized_linear", "dequantize", "quantize"} <= {op for op, _ in t.counts}


def test_sampling_without_a_generator_compiles_and_draws_eagers_tokens_on_cuda():
    """``lz.sample_topk`` / ``lz.sample_topp`` without a generator (custom ops drawing from the global CUDA
    RNG): no graph break, the same global seed gives the compiled function eager's tokens, k = 1 is the
    argmax."""
    check_topk_topp_compiles(torch.randn(6, 1000, generator=torch.Generator().manual_seed(3)).to(DEV))


def test_training_block_compiles_and_matches_float64_gradients_on_cuda():
    """A training step over ``lz.rms_norm`` (plain and with residual), ``lz.linear`` and ``lz.swiglu`` on CUDA
    in bf16: fullgraph Inductor (each op one custom-op node with its registered backward), every input's
    gradient within bf16 tolerance of a float64 oracle run on the CPU."""
    check_training_block(DT, DEV, 64, 3e-2)
