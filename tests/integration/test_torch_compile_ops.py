"""lz ops inside ``torch.compile`` (TorchDynamo traces their Python; CPU, backend "eager"): the compiled function
matches eager over calls with new data and a new shape. (On CUDA under ``mode="reduce-overhead"`` TorchDynamo
mis-traced ``tuple.__new__`` of the NamedTuple keys; tests/gpu/test_gpu_graph_recipe.py covers that case.)"""

from __future__ import annotations

import pytest
import torch

import layerzero as lz

pytestmark = pytest.mark.integration


def block(x, w, gate, up, q, k, v):
    h = lz.rms_norm(x, w)
    h2, res = lz.rms_norm(x, w, residual=h)
    return h2 + res, lz.swiglu(gate, up), lz.attention(q, k, v, is_causal=True)


def test_compiled_block_matches_eager():
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="eager")
    gen = torch.Generator().manual_seed(0)
    for rows, s in ((4, 16), (4, 16), (6, 9)):
        args = (torch.randn(rows, 64, generator=gen), torch.rand(64, generator=gen) + 0.5,
                torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen),
                torch.randn(2, 4, s, 32, generator=gen), torch.randn(2, 2, s, 32, generator=gen),
                torch.randn(2, 2, s, 32, generator=gen))
        for got, want in zip(compiled(*args), block(*args), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def full_block(x, w, gate, up, q, k, v, cos, sin):
    h = lz.rms_norm(x, w)
    h2, res = lz.rms_norm(x, w, residual=h)
    qr, kr = lz.rope(q, k, cos, sin)
    att = lz.attention(qr, kr, v, is_causal=True)
    mlp = lz.swiglu(gate, up) + lz.geglu(gate, up, approximate="tanh") + lz.reglu(gate, up)
    return lz.layer_norm(h2 + res, w), mlp, att


def _full_args(gen, rows=4, s=16):
    half = torch.randn(s, 16, generator=gen)
    cos, sin = torch.cat((half.cos(), half.cos()), -1), torch.cat((half.sin(), half.sin()), -1)
    return (torch.randn(rows, 64, generator=gen), torch.rand(64, generator=gen) + 0.5,
            torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen),
            torch.randn(2, 4, s, 32, generator=gen), torch.randn(2, 2, s, 32, generator=gen),
            torch.randn(2, 2, s, 32, generator=gen), cos, sin)


def test_fullgraph_inductor_has_no_graph_break_and_matches_eager():
    """Every lz op of a decoder block is one ``torch.ops.layerzero`` node: ``fullgraph=True`` (which raises on a
    graph break) compiles with Inductor, the explain count is 0, outputs match eager on new data, and the kernels
    were selected by the compiled graph's real calls (``lz.trace`` sees them), not while tracing."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    args = _full_args(gen)
    explained = torch._dynamo.explain(full_block)(*args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(full_block, fullgraph=True)
    for rows, s in ((4, 16), (4, 16), (3, 16)):
        new = _full_args(gen, rows, s)
        with lz.trace() as t:
            got = compiled(*new)
        for g, want in zip(got, full_block(*new), strict=True):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
        assert {"attention", "rms_norm", "rope", "swiglu", "geglu", "reglu", "layer_norm"} <= {
            op for op, _ in t.counts}


def test_export_holds_layerzero_nodes():
    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return lz.attention(q, k, v, is_causal=True) * 2

    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 4, 8, 16, generator=gen), torch.randn(1, 2, 8, 16, generator=gen), torch.randn(
        1, 2, 8, 16, generator=gen)
    ep = torch.export.export(Attn(), (q, k, v))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "layerzero.attention.default" in targets
    torch.testing.assert_close(ep.module()(q, k, v), lz.attention(q, k, v, is_causal=True) * 2)


def test_calls_that_need_gradients_stay_differentiable():
    """The custom ops have no autograd formulas yet: with inputs that require grad the ops are traced as Python (as
    before) and backward through the compiled function equals eager backward."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    x0, w0 = torch.randn(4, 32, generator=gen), torch.rand(32, generator=gen) + 0.5

    def f(x, w):
        return (lz.rms_norm(x, w) * lz.swiglu(x, x)).sum()

    grads = []
    for fn in (f, torch.compile(f, backend="aot_eager")):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn(x, w).backward()
        grads.append((x.grad, w.grad))
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def serving_step(k, v, cache, slots, q, tables, lens, x, w13, w2, tw, tid):
    lz.reshape_and_cache(k, v, cache, slots)
    return lz.paged_attention(q, cache, tables, lens), lz.fused_moe(x, w13, w2, tw, tid)


def test_paged_cache_write_attention_and_moe_compile_without_breaks():
    """The serving ops are custom ops too: the cache write mutates ``kv_cache`` through the compiled graph (the
    following paged attention reads the new tokens), and the step has no graph break."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(4)

    def inputs():
        cache = lz.allocate_kv_cache(4, 4, 2, 8, dtype=torch.float32)
        cache.copy_(torch.randn(cache.shape, generator=gen))
        k, v = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 2, 8, generator=gen)
        return (k, v, cache, torch.tensor([5, 15]), torch.randn(2, 4, 8, generator=gen),
                torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([6, 8], dtype=torch.int32),
                torch.randn(2, 16, generator=gen), torch.randn(4, 6, 16, generator=gen),
                torch.randn(4, 16, 3, generator=gen), torch.full((2, 2), 0.5), torch.tensor([[0, 1], [2, 3]]))

    args = inputs()
    assert torch._dynamo.explain(serving_step)(*args).graph_break_count == 0
    compiled = torch.compile(serving_step, fullgraph=True)
    a, b = inputs(), None
    b = tuple(t.clone() for t in a)
    got, want = compiled(*a), serving_step(*b)
    assert torch.equal(a[2], b[2])  # the compiled cache write happened, exactly as eager's
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def sampling_step(logits, prompt, output, rep, temp, seeds, offsets):
    penalized = lz.apply_penalties(logits, prompt, output, repetition_penalty=rep)
    return lz.sample(penalized, temperature=temp, seeds=seeds, offsets=offsets)


def test_sampling_step_compiles_without_breaks_and_draws_the_seeded_tokens():
    """``lz.apply_penalties`` and ``lz.sample`` (no generator) are custom ops: no graph break, and seeded rows draw
    exactly eager's tokens (counter-based noise)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    args = (torch.randn(3, 50, generator=gen), torch.randint(0, 50, (3, 7), generator=gen),
            torch.randint(0, 50, (3, 4), generator=gen), torch.full((3,), 1.3), torch.tensor([0.0, 0.7, 1.1]),
            torch.tensor([11, 12, 13]), torch.tensor([0, 5, 9]))
    assert torch._dynamo.explain(sampling_step)(*args).graph_break_count == 0
    compiled = torch.compile(sampling_step, fullgraph=True)
    assert torch.equal(compiled(*args), sampling_step(*args))
