"""lz ops inside ``torch.compile`` (TorchDynamo traces their Python; CPU, backend "eager"): the compiled
function matches eager over calls with new data and a new shape. (On CUDA under ``mode="reduce-overhead"``
TorchDynamo mis-traced ``tuple.__new__`` of the NamedTuple keys; tests/gpu/test_gpu_graph_recipe.py covers
that case.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compile_cases import check_topk_topp_compiles, check_training_block  # noqa: E402

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
        args = (
            torch.randn(rows, 64, generator=gen),
            torch.rand(64, generator=gen) + 0.5,
            torch.randn(rows, 96, generator=gen),
            torch.randn(rows, 96, generator=gen),
            torch.randn(2, 4, s, 32, generator=gen),
            torch.randn(2, 2, s, 32, generator=gen),
            torch.randn(2, 2, s, 32, generator=gen),
        )
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
    return (
        torch.randn(rows, 64, generator=gen),
        torch.rand(64, generator=gen) + 0.5,
        torch.randn(rows, 96, generator=gen),
        torch.randn(rows, 96, generator=gen),
        torch.randn(2, 4, s, 32, generator=gen),
        torch.randn(2, 2, s, 32, generator=gen),
        torch.randn(2, 2, s, 32, generator=gen),
        cos,
        sin,
    )


def test_fullgraph_inductor_has_no_graph_break_and_matches_eager():
    """Every lz op of a decoder block is one ``torch.ops.layerzero`` node: ``fullgraph=True`` (which raises on
    a graph break) compiles with Inductor, the explain count is 0, outputs match eager on new data, and the
    kernels were selected by the compiled graph's real calls (``lz.trace`` sees them), not while tracing."""
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
            op for op, _ in t.counts
        }


def test_export_holds_layerzero_nodes():
    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return lz.attention(q, k, v, is_causal=True) * 2

    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(1, 4, 8, 16, generator=gen),
        torch.randn(1, 2, 8, 16, generator=gen),
        torch.randn(1, 2, 8, 16, generator=gen),
    )
    ep = torch.export.export(Attn(), (q, k, v))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "layerzero.attention.default" in targets
    torch.testing.assert_close(ep.module()(q, k, v), lz.attention(q, k, v, is_causal=True) * 2)


def test_calls_that_need_gradients_stay_differentiable():
    """With inputs that require grad, backward through the compiled function equals eager backward:
    ``lz.rms_norm``, ``lz.swiglu`` and ``lz.attention`` are custom-op nodes with backward formulas
    (``custom_ops/_grad.py``; more in test_torch_compile_grad.py)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    x0, w0 = torch.randn(4, 32, generator=gen), torch.rand(32, generator=gen) + 0.5

    def f(x, w):
        q = x.reshape(1, 2, 2, 32)
        return (lz.rms_norm(x, w) * lz.swiglu(x, x)).sum() + lz.attention(q, q, q).sum()

    grads = []
    for fn in (f, torch.compile(f, backend="aot_eager")):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn(x, w).backward()
        grads.append((x.grad, w.grad))
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_training_block_compiles_without_breaks_and_matches_float64_gradients(dtype):
    """A training step over ``lz.rms_norm`` (plain and with ``residual``), ``lz.linear`` and ``lz.swiglu``
    compiles fullgraph with Inductor (no graph break: each op one custom-op node with its backward formula),
    and every input's gradient equals a float64 autograd oracle of the same math within the dtype's tolerance
    (``_compile_cases.check_training_block``)."""
    check_training_block(dtype, "cpu", 32, {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype])


def serving_step(k, v, cache, slots, q, tables, lens, x, w13, w2, tw, tid):
    lz.reshape_and_cache(k, v, cache, slots)
    return lz.paged_attention(q, cache, tables, lens), lz.fused_moe(x, w13, w2, tw, tid)


def test_paged_cache_write_attention_and_moe_compile_without_breaks():
    """The serving ops are custom ops too: the cache write mutates ``kv_cache`` through the compiled graph
    (the following paged attention reads the new tokens), and the step has no graph break."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(4)

    def inputs():
        cache = lz.allocate_kv_cache(4, 4, 2, 8, dtype=torch.float32)
        cache.copy_(torch.randn(cache.shape, generator=gen))
        k, v = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 2, 8, generator=gen)
        return (
            k,
            v,
            cache,
            torch.tensor([5, 15]),
            torch.randn(2, 4, 8, generator=gen),
            torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
            torch.tensor([6, 8], dtype=torch.int32),
            torch.randn(2, 16, generator=gen),
            torch.randn(4, 6, 16, generator=gen),
            torch.randn(4, 16, 3, generator=gen),
            torch.full((2, 2), 0.5),
            torch.tensor([[0, 1], [2, 3]]),
        )

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
    """``lz.apply_penalties`` and ``lz.sample`` (no generator) are custom ops: no graph break, and seeded rows
    draw exactly eager's tokens (counter-based noise)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    args = (
        torch.randn(3, 50, generator=gen),
        torch.randint(0, 50, (3, 7), generator=gen),
        torch.randint(0, 50, (3, 4), generator=gen),
        torch.full((3,), 1.3),
        torch.tensor([0.0, 0.7, 1.1]),
        torch.tensor([11, 12, 13]),
        torch.tensor([0, 5, 9]),
    )
    assert torch._dynamo.explain(sampling_step)(*args).graph_break_count == 0
    compiled = torch.compile(sampling_step, fullgraph=True)
    assert torch.equal(compiled(*args), sampling_step(*args))


def test_sample_topk_and_topp_without_a_generator_compile_without_breaks():
    """``lz.sample_topk`` / ``lz.sample_topp`` without a generator (the global RNG) are custom ops: no graph
    break; with the same global seed the compiled function draws eager's tokens, and k = 1 is the argmax
    (``_compile_cases.check_topk_topp_compiles``). (With a generator they are traced as Python: a custom op
    cannot take one.)"""
    check_topk_topp_compiles(torch.randn(4, 40, generator=torch.Generator().manual_seed(3)))


def greedy_step(logits, bias):
    return lz.sample_greedy(logits + bias)


def test_sample_greedy_compiles_without_breaks():
    """``lz.sample_greedy`` is one custom op: no graph break, and the compiled function picks eager's tokens
    (NaN and tie rows included) on new data and a new shape."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(4)
    args = (torch.randn(4, 40, generator=gen), torch.zeros(40))
    assert torch._dynamo.explain(greedy_step)(*args).graph_break_count == 0
    compiled = torch.compile(greedy_step, fullgraph=True)
    for rows, v in ((4, 40), (4, 40), (3, 17)):
        x = torch.randn(rows, v, generator=gen)
        x[0, 5] = float("nan")
        x[1, [2, 9]] = 99.0
        bias = torch.zeros(v)
        assert torch.equal(compiled(x, bias), greedy_step(x, bias))
        assert compiled(x, bias)[:2].tolist() == [5, 2]


def _opcheck_cases():
    """(name, custom op, args) for every ``torch.ops.layerzero`` op: contiguous inputs and the strided ones a
    model passes (transposed activations, BSHD views of a fused projection, chunks of a gate/up
    projection)."""
    from layerzero.custom_ops import _ops as library  # importing it registers the ops

    ops = torch.ops.layerzero
    gen = torch.Generator().manual_seed(6)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    w = torch.rand(64, generator=gen) + 0.5
    xt = r(64, 4).t()  # [4, 64], strides (1, 4)
    gu = r(4, 192)
    half = r(16, 16)
    cos, sin = torch.cat((half.cos(), half.cos()), -1), torch.cat((half.sin(), half.sin()), -1)
    qkv = r(2, 16, 3, 4, 32)  # a fused projection viewed [B, S, 3, H, D]
    q, k, v = qkv.unbind(2)
    cache = lz.allocate_kv_cache(4, 4, 2, 8, dtype=torch.float32)
    cache.copy_(r(*cache.shape))
    tables, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([6, 8], dtype=torch.int32)
    cases = [
        (
            "attention",
            ops.attention,
            (
                r(2, 4, 16, 32),
                r(2, 2, 16, 32),
                r(2, 2, 16, 32),
                None,
                True,
                None,
                0.0,
                "BHSD",
                None,
                None,
                None,
            ),
        ),
        (
            "attention BHSD transposed",
            ops.attention,
            (
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                None,
                False,
                None,
                0.0,
                "BHSD",
                None,
                None,
                None,
            ),
        ),
        ("attention BSHD views", ops.attention, (q, k, v, None, True, None, 0.0, "BSHD", None, None, None)),
        ("rms_norm", ops.rms_norm, (r(4, 64), w, 1e-6)),
        ("rms_norm transposed", ops.rms_norm, (xt, w, 1e-6)),
        ("fused_add_rms_norm", ops.fused_add_rms_norm, (r(4, 64), w, 1e-6, r(4, 64))),
        ("fused_add_rms_norm transposed", ops.fused_add_rms_norm, (xt, w, 1e-6, r(4, 64))),
        ("layer_norm", ops.layer_norm, (r(4, 64), w, r(64), 1e-5)),
        ("layer_norm transposed", ops.layer_norm, (xt, w, None, 1e-5)),
        ("rope", ops.rope, (r(2, 4, 16, 32), r(2, 2, 16, 32), cos, sin, None, False, "BHSD")),
        ("rope transposed", ops.rope, (q.transpose(1, 2), k.transpose(1, 2), cos, sin, None, True, "BHSD")),
        ("rope partial BSHD views", ops.rope, (q, k, cos[:, :16], sin[:, :16], None, False, "BSHD")),
        (
            "qk_norm_rope BSHD views",
            ops.qk_norm_rope,
            (q, k, w[:32], w[32:], cos, sin, 1e-6, None, False, "BSHD"),
        ),
        (
            "qk_norm_rope partial, ids",
            ops.qk_norm_rope,
            (
                r(2, 4, 16, 32),
                r(2, 2, 16, 32),
                w[:32],
                w[:32],
                cos[:, :16],
                sin[:, :16],
                1e-5,
                torch.randint(0, 16, (1, 16), generator=gen),
                True,
                "BHSD",
            ),
        ),
        ("swiglu", ops.swiglu, (r(4, 96), r(4, 96))),
        ("swiglu chunks", ops.swiglu, gu.chunk(2, -1)),
        ("geglu chunks", ops.geglu, (*gu.chunk(2, -1), "tanh")),
        ("reglu chunks", ops.reglu, gu.chunk(2, -1)),
        ("paged_attention", ops.paged_attention, (r(2, 4, 8), cache, tables, lens, None, None, True, "NHD")),
        (
            "reshape_and_cache",
            ops.reshape_and_cache,
            (r(2, 2, 8), r(2, 2, 8), cache.clone(), torch.tensor([5, 15]), "NHD"),
        ),
        (
            "fused_moe",
            ops.fused_moe,
            (r(2, 16), r(4, 6, 16), r(4, 16, 3), torch.full((2, 2), 0.5), torch.tensor([[0, 1], [2, 3]])),
        ),
        (
            "apply_penalties",
            ops.apply_penalties,
            (
                r(3, 50),
                torch.randint(0, 50, (3, 7), generator=gen),
                torch.randint(0, 50, (3, 4), generator=gen),
                torch.full((3,), 1.3),
                None,
                None,
            ),
        ),
        (
            "sample",
            ops.sample,
            (
                r(3, 50),
                torch.tensor([0.0, 0.7, 1.1]),
                None,
                None,
                None,
                torch.tensor([11, 12, 13]),
                torch.tensor([0, 5, 9]),
            ),
        ),
        ("linear", ops.linear, (r(5, 64), r(7, 64), r(7))),
        ("rms_norm_linear", ops.rms_norm_linear, (r(5, 64), w, r(7, 64), r(7), 1e-6)),
        (
            "qk_norm_rope_cache",
            ops.qk_norm_rope_cache,
            (
                r(2, 4, 8),
                r(2, 2, 8),
                r(2, 2, 8),
                w[:8],
                w[8:16],
                cos[:, :8],
                sin[:, :8],
                cache.clone(),
                torch.tensor([5, -1]),
                torch.tensor([3, 1]),
                1e-6,
                False,
                "NHD",
            ),
        ),
        (
            "rope_paged_attention decode, q/k norm",
            ops.rope_paged_attention,
            (
                r(2, 4, 8),
                r(2, 2, 8),
                r(2, 2, 8),
                cos[:, :8],
                sin[:, :8],
                cache.clone(),
                torch.tensor([5, -1]),
                tables,
                lens,
                torch.tensor([5, 7]),
                w[:8],
                w[8:16],
                1e-6,
                None,
                None,
                False,
                "NHD",
            ),
        ),
        (
            "rope_paged_attention append, rope only",
            ops.rope_paged_attention,
            (
                q[0, :3, :, :8],
                k[0, :3, :2, :8],
                v[0, :3, :2, :8],
                cos[:, :4],
                sin[:, :4],
                cache.clone(),
                torch.tensor([4, 5, 15]),
                tables,
                lens,
                torch.tensor([4, 5, 7]),
                None,
                None,
                1e-6,
                torch.tensor([0, 2, 3], dtype=torch.int32),
                0.3,
                True,
                "NHD",
            ),
        ),
        ("swiglu_linear chunks", ops.swiglu_linear, (*gu.chunk(2, -1), r(7, 96), r(7))),
        (
            "fused_add_rms_norm_linear transposed",
            ops.fused_add_rms_norm_linear,
            (xt, w, r(7, 64), None, 1e-5, r(4, 64)),
        ),
        ("linear transposed, no bias", ops.linear, (xt, r(7, 64), None)),
        ("embedding", ops.embedding, (torch.tensor([[1, 0, 3]]), r(5, 16), None)),
        (
            "linear_cross_entropy mean",
            ops.linear_cross_entropy,
            (r(6, 16), r(11, 16), torch.tensor([1, 0, 3, -100, 10, 2]), None, -100, "mean", 0.1, None),
        ),
        (
            "linear_cross_entropy none",
            ops.linear_cross_entropy,
            (r(2, 3, 16), r(11, 16), torch.tensor([[1, 0, 3], [4, 5, 6]]), r(11), -100, "none", 0.0, 30.0),
        ),
    ]
    wq = r(7, 64)
    int4, int8 = lz.quantize(wq, "int4", group_size=32), lz.quantize(wq, "int8", axis=0)
    nvfp4 = lz.quantize(r(4, 32), "nvfp4")
    cases += [
        ("dequantize int4", ops.dequantize, library._qt_args(int4)),
        ("dequantize nvfp4 (global scale)", ops.dequantize, library._qt_args(nvfp4)),
        ("quantized_linear int8 + bias", ops.quantized_linear, (r(5, 64), *library._qt_args(int8), r(7))),
        ("quantized_linear int4 transposed", ops.quantized_linear, (xt, *library._qt_args(int4), None)),
        (
            "fp8_linear per channel + bias, transposed",
            ops.fp8_linear,
            (xt, *library._qt_args(lz.quantize(wq, "fp8_e4m3", axis=0)), r(7)),
        ),
        ("quantize int8 per token", ops.quantize, (r(5, 64), "int8", 0, None, True)),
        ("quantize int4 transposed", ops.quantize, (xt, "int4", None, [32], True)),
        ("quantize fp8 2-D blocks", ops.quantize, (r(8, 64), "fp8_e4m3", None, [4, 32], True)),
        ("quantize nvfp4", ops.quantize, (r(4, 32), "nvfp4", None, [16], False)),
        (
            "linear, gradients",
            ops.linear,
            (r(5, 64).requires_grad_(), r(7, 64).requires_grad_(), r(7).requires_grad_()),
        ),
        ("rms_norm, gradients", ops.rms_norm, (r(4, 64).requires_grad_(), w.clone().requires_grad_(), 1e-6)),
        (
            "fused_add_rms_norm, gradients",
            ops.fused_add_rms_norm,
            (r(4, 64).requires_grad_(), w.clone().requires_grad_(), 1e-6, r(4, 64).requires_grad_()),
        ),
        ("swiglu, gradients", ops.swiglu, (r(4, 96).requires_grad_(), r(4, 96).requires_grad_())),
        ("sample_topk k=1", ops.sample_topk, (r(3, 50), 1, 0.8)),  # deterministic: opcheck compares two runs
        ("sample_topp tiny p", ops.sample_topp, (r(3, 50), 1e-6, 1.2)),
        ("sample_greedy", ops.sample_greedy, (r(3, 50),)),
        ("sample_greedy transposed bf16", ops.sample_greedy, (r(50, 3).t().to(torch.bfloat16),)),
    ]
    return cases


@pytest.mark.parametrize("case", range(51))
def test_custom_ops_keep_the_torch_library_contract(case):
    """``torch.library.opcheck`` (schema: no undeclared mutation or aliasing; fake impl: the real outputs'
    shapes, dtypes and strides; autograd registration; AOT dispatch) passes for every custom op, also with
    strided inputs, and no output shares memory with an input or another output: Inductor frees, reuses and
    writes into custom-op outputs in place (``inplace_buffers``, ``allow_buffer_reuse``) on the strength of
    that contract."""
    cases = _opcheck_cases()
    assert len(cases) == 51
    name, op, args = cases[case]
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if (
        "nvfp4" in name or "fp8" in name
    ):  # the schema check multiplies the inputs; torch's CPU build cannot for
        # float8 (nvfp4's scales, fp8_linear's codes)
        utils = utils[1:]
    torch.library.opcheck(op, args, test_utils=utils)
    out = op(*args)
    outs = [
        o for o in (out if isinstance(out, tuple) else (out,)) if o is not None and o.numel()
    ]  # empty: no memory
    ptrs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    for o in outs:
        assert o.is_contiguous(), name
        assert o.untyped_storage().data_ptr() not in ptrs, name
    assert len({o.untyped_storage().data_ptr() for o in outs}) == len(outs), name


def test_owned_copies_only_outputs_that_alias_an_input_or_are_strided():
    from layerzero.custom_ops._common import _owned

    x = torch.randn(4, 8)
    fresh = x * 2
    assert _owned(fresh, x) is fresh  # the common case costs nothing
    for aliasing in (x, x.view(8, 4), x[1:], x.t()):
        got = _owned(aliasing, x)
        assert got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        assert got.is_contiguous() and torch.equal(got, aliasing)
    strided = torch.randn(8, 4).t()
    got = _owned(strided, x)
    assert got.is_contiguous() and torch.equal(got, strided)
    empty = torch.empty(0, 8)
    assert _owned(empty, empty) is not empty


def strided_block(x, w, qkv, gu, cos, sin):
    """A decoder block as a model feeds it: a transposed activation, BSHD q/k/v views of one fused projection,
    attention in BHSD through transposes, gate/up chunks of one projection."""
    h = lz.layer_norm(x.t(), w)
    h2, res = lz.rms_norm(h, w, residual=x.t())
    q, k, v = qkv.unbind(2)
    qr, kr = lz.rope(q, k, cos, sin, layout="BSHD")
    qn, kn = lz.qk_norm_rope(q, k, w[:32], w[32:], cos, sin, layout="BSHD")  # Qwen3's q/k norm + RoPE
    att = lz.attention(qr.transpose(1, 2), kr.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    g, u = gu.chunk(2, -1)
    mlp = lz.swiglu(g, u) + lz.geglu(g, u, approximate="tanh") + lz.reglu(g, u)
    return lz.layer_norm(h2 + res, w) * 2, mlp + 1, att.transpose(1, 2) * 3, qn - kn.sum(2, keepdim=True)


def test_fullgraph_inductor_with_strided_inputs_matches_eager():
    """Strided inputs: the eager kernels return other strides than contiguous for them (SDPA follows q's
    layout), so before the custom-op boundary normalized outputs Inductor's ``assert_size_stride`` failed on
    them; run several times so a freed-or-reused buffer would show up as a mismatch."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(7)

    def args(rows, s):
        half = torch.randn(s, 16, generator=gen)
        return (
            torch.randn(64, rows, generator=gen),
            torch.rand(64, generator=gen) + 0.5,
            torch.randn(2, s, 3, 4, 32, generator=gen),
            torch.randn(rows, 192, generator=gen),
            torch.cat((half.cos(), half.cos()), -1),
            torch.cat((half.sin(), half.sin()), -1),
        )

    compiled = torch.compile(strided_block, fullgraph=True)
    for rows, s in ((4, 16), (4, 16), (6, 9), (6, 9)):
        new = args(rows, s)
        for got, want in zip(compiled(*new), strided_block(*new), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def lm_block(ids, table, w_qkv, w_o, b_o, norm_w):
    h = lz.embedding(ids, table)
    x = lz.rms_norm(lz.linear(h, w_qkv), norm_w)
    return lz.linear(x, w_o, b_o)


def test_embedding_and_linear_compile_without_breaks():
    """``lz.embedding`` and ``lz.linear`` (every projection of the engine's models) are custom-op nodes too: a
    fullgraph Inductor compile of embedding -> projection -> norm -> projection matches eager."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)

    def args(n):
        return (
            torch.randint(0, 50, (n,), generator=gen),
            torch.randn(50, 32, generator=gen),
            torch.randn(48, 32, generator=gen),
            torch.randn(32, 48, generator=gen),
            torch.randn(32, generator=gen),
            torch.rand(48, generator=gen) + 0.5,
        )

    first = args(6)
    explained = torch._dynamo.explain(lm_block)(*first)
    assert explained.graph_break_count == 0
    compiled = torch.compile(lm_block, fullgraph=True)
    for n in (6, 6, 9):
        new = args(n)
        with lz.trace() as t:
            got = compiled(*new)
        torch.testing.assert_close(got, lm_block(*new), rtol=1e-5, atol=1e-5)
        assert {"embedding", "linear", "rms_norm"} <= {op for op, _ in t.counts}


def test_linear_cross_entropy_compiles_for_evaluation():
    """An evaluation loss (no grad) through ``lz.linear_cross_entropy`` is one custom-op node: no graph break,
    the eager loss; a training call (grad) stays differentiable (traced as Python)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(8)

    def loss(h, w, t):
        return lz.linear_cross_entropy(h, w, t, reduction="sum", label_smoothing=0.05)

    h, w = torch.randn(7, 16, generator=gen), torch.randn(13, 16, generator=gen)
    t = torch.randint(0, 13, (7,), generator=gen)
    with torch.no_grad():
        assert torch._dynamo.explain(loss)(h, w, t).graph_break_count == 0
        got = torch.compile(loss, fullgraph=True)(h, w, t)
    torch.testing.assert_close(got, loss(h, w, t), rtol=1e-5, atol=1e-5)
    hg = h.clone().requires_grad_()
    torch.compile(loss)(hg, w, t).backward()
    hd = h.double().requires_grad_()
    torch.nn.functional.cross_entropy(
        hd @ w.double().t(), t, reduction="sum", label_smoothing=0.05
    ).backward()
    torch.testing.assert_close(hg.grad.double(), hd.grad, rtol=1e-5, atol=1e-5)


def quantized_block(x, w8, w4, b, wq):
    h = lz.quantized_linear(x, w8, b)
    xq = lz.quantize(x, "int8", axis=0)  # per-token activations
    return (
        lz.quantized_linear(lz.rms_norm(h, torch.ones(h.shape[-1])), w4),
        lz.dequantize(wq),
        lz.dequantize(xq),
        xq.scale,
    )


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_quantized_linear_and_dequantize_compile_without_breaks(fmt):
    """``lz.quantized_linear`` and ``lz.dequantize`` take a QuantizedTensor (a NamedTuple): their custom ops
    take its fields, and ``lz.quantize``'s returns them: a fullgraph Inductor compile of two quantized
    projections, a per-token activation quantization and two dequantizes has no graph break, matches eager for
    new data and a new row count, runs the three ops (lz.trace), and ``torch.export`` keeps their nodes."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(9)
    w8 = lz.quantize(torch.randn(24, 32, generator=gen), fmt, axis=0)
    w4 = lz.quantize(torch.randn(16, 24, generator=gen) * 0.1, "int4", group_size=8)
    wq = lz.quantize(torch.randn(4, 32, generator=gen), "nvfp4")
    b = torch.randn(24, generator=gen)
    explained = torch._dynamo.explain(quantized_block)(torch.randn(3, 32, generator=gen), w8, w4, b, wq)
    assert explained.graph_break_count == 0
    compiled = torch.compile(quantized_block, fullgraph=True)
    for n in (3, 3, 5):
        x = torch.randn(n, 32, generator=gen)
        with lz.trace() as t:
            got = compiled(x, w8, w4, b, wq)
        want = quantized_block(x, w8, w4, b, wq)
        for g, e in zip(got, want, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        assert {"quantized_linear", "dequantize", "quantize"} <= {op for op, _ in t.counts}

    class M(torch.nn.Module):
        def forward(self, x):
            out = quantized_block(x, w8, w4, b, wq)
            return out[0], out[3]

    ep = torch.export.export(M(), (torch.randn(3, 32, generator=gen),))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"layerzero.quantized_linear.default", "layerzero.quantize.default"} <= targets


def test_fp8_linear_compiles_without_breaks():
    """``lz.fp8_linear`` (W8A8) takes a QuantizedTensor like ``lz.quantized_linear``: a fullgraph Inductor
    compile of two W8A8 projections (one with bias, one on a strided view) has no graph break, matches eager
    (within float32 noise: the same kernel), runs the op (lz.trace), and ``torch.export`` keeps its node."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    wa = lz.quantize(torch.randn(32, 48, generator=gen), "fp8_e4m3", axis=0)
    wb = lz.quantize(torch.randn(16, 32, generator=gen), "fp8_e4m3")
    b = torch.randn(32, generator=gen)

    def block(x):
        return lz.fp8_linear(lz.fp8_linear(x, wa, b).t().contiguous().t(), wb)

    assert torch._dynamo.explain(block)(torch.randn(3, 48, generator=gen)).graph_break_count == 0
    compiled = torch.compile(block, fullgraph=True)
    for n in (3, 5):
        x = torch.randn(n, 48, generator=gen)
        with lz.trace() as t:
            got = compiled(x)
        torch.testing.assert_close(got, block(x), rtol=1e-5, atol=1e-5)
        assert "fp8_linear" in {op for op, _ in t.counts}

    class M(torch.nn.Module):
        def forward(self, x):
            return block(x)

    ep = torch.export.export(M(), (torch.randn(3, 48, generator=gen),))
    assert "layerzero.fp8_linear.default" in {
        str(n.target) for n in ep.graph.nodes if n.op == "call_function"
    }
