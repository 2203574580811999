"""lz ops under ``torch.compile(fullgraph=True)`` with Inductor on CUDA (issue 10 part 1's GPU half; the CPU half is
tests/integration/test_torch_compile_ops.py): a decoder block and a serving step (cache write, paged attention,
linear) compile with zero graph breaks, the compiled graph's real calls select the kernels (``lz.trace``), and the
outputs equal eager's on new data (bf16: the same kernels run, so within one bf16 rounding of the ops Inductor fuses
around them); ``torch.export`` of ``lz.attention`` on CUDA holds the ``layerzero`` node."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz

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
    cpu = (torch.randn(rows, 256, generator=gen), torch.rand(256, generator=gen) + 0.5,
           torch.randn(rows, 384, generator=gen), torch.randn(rows, 384, generator=gen),
           torch.randn(2, 8, s, 64, generator=gen), torch.randn(2, 2, s, 64, generator=gen),
           torch.randn(2, 2, s, 64, generator=gen), cos, sin, torch.randn(512, 256, generator=gen) * 0.05)
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
        return (k, v, cache, torch.tensor([20, 47, 100], device=DEV), torch.randn(3, 8, 64, generator=gen).to(DEV, DT),
                torch.tensor([[0, 1, 0], [2, 3, 0], [4, 5, 6]], dtype=torch.int32, device=DEV),
                torch.tensor([21, 32, 37], dtype=torch.int32, device=DEV), torch.randn(3, 256, generator=gen).to(DEV, DT),
                (torch.randn(128, 256, generator=gen) * 0.05).to(DEV, DT))

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
