"""Backward formulas of ``torch.ops.layerzero.rope`` / ``.attention`` / ``.embedding``
(``layerzero/custom_ops/_grad.py``): ``gradcheck`` against finite differences in float64,
``torch.library.opcheck`` with gradients, a compiled (fullgraph, Inductor) training block whose gradients
equal a float64 oracle written with plain torch math, and the calls that stay on the Python path (cos/sin that
require grad, dropout with gradients, ALiBi). The training block over the older formulas (linear, rms_norm,
swiglu) is in test_torch_compile_ops.py."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import layerzero as lz
from layerzero.core.errors import InvalidInputError
from layerzero.custom_ops import register

register()  # registers torch.ops.layerzero

pytestmark = pytest.mark.integration


def _r(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _tables(gen, rows, r, interleaved, dtype=torch.float64):
    f = _r(gen, rows, r // 2, dtype=dtype)
    if interleaved:
        return f.cos().repeat_interleave(2, -1), f.sin().repeat_interleave(2, -1)
    return torch.cat((f.cos(), f.cos()), -1), torch.cat((f.sin(), f.sin()), -1)


def _grad_cases():
    """(name, op, args, indices of the differentiable args): odd sizes, GQA, partial rotary, both layouts."""
    gen = torch.Generator().manual_seed(21)
    ops = torch.ops.layerzero
    cos, sin = _tables(gen, 20, 12, False)
    ci, si = _tables(gen, 20, 12, True)
    pos = torch.randint(0, 20, (2, 7), generator=gen)
    q, k, qs, ks = _r(gen, 2, 3, 7, 16), _r(gen, 2, 1, 7, 16), _r(gen, 2, 7, 3, 16), _r(gen, 2, 7, 1, 16)
    aq, ak, av = _r(gen, 2, 4, 5, 8), _r(gen, 2, 2, 7, 8), _r(gen, 2, 2, 7, 6)  # GQA 4:2, Sq 5 != Sk 7, Dv 6
    sq, sk, sv = (t.transpose(1, 2).contiguous() for t in (aq, ak, av))
    dead = torch.rand(2, 1, 5, 7, generator=gen) > 0.3
    dead[0, 0, 1] = False  # a fully masked query row: output 0, gradient 0
    none3 = (None, None, None)
    return [
        ("rope neox table, partial", ops.rope, (q, k, cos, sin, None, False, "BHSD"), (0, 1)),
        ("rope gptj table", ops.rope, (q, k, ci, si, None, True, "BHSD"), (0, 1)),
        ("rope neox position_ids", ops.rope, (q, k, cos, sin, pos, False, "BHSD"), (0, 1)),
        ("rope gptj gathered BSHD", ops.rope, (qs, ks, ci[pos], si[pos], None, True, "BSHD"), (0, 1)),
        ("rope int32 [1, S] ids BSHD", ops.rope, (qs, ks, cos, sin, pos[:1].int(), False, "BSHD"), (0, 1)),
        (
            "attention causal GQA Sq!=Sk (SDPA)",
            ops.attention,
            (aq, ak, av, None, True, None, 0.0, "BHSD", *none3),
            (0, 1, 2),
        ),
        (
            "attention scale BSHD (SDPA)",
            ops.attention,
            (sq, sk, sv, None, False, 0.3, 0.0, "BSHD", *none3),
            (0, 1, 2),
        ),
        (
            "attention float mask + causal + softcap",
            ops.attention,
            (aq, ak, av, _r(gen, 5, 7), True, None, 0.0, "BHSD", None, None, 2.0),
            (0, 1, 2, 3),
        ),
        (
            "attention bool mask, dead row, window",
            ops.attention,
            (aq, ak, av, dead, False, None, 0.0, "BHSD", 1, 2, None),
            (0, 1, 2),
        ),
        (
            "attention causal window softcap BSHD",
            ops.attention,
            (sq, sk, sv, None, True, None, 0.0, "BSHD", 2, 0, 1.5),
            (0, 1, 2),
        ),
        (
            "attention key-padding float mask BSHD",
            ops.attention,
            (sq, sk, sv, _r(gen, 7), False, None, 0.0, "BSHD", *none3),
            (0, 1, 2, 3),
        ),
        ("embedding", ops.embedding, (torch.tensor([[1, 3, 3], [0, 8, 1]]), _r(gen, 9, 5), None), (1,)),
        (
            "embedding int32 ids",
            ops.embedding,
            (torch.tensor([4, 4, 0], dtype=torch.int32), _r(gen, 9, 5), None),
            (1,),
        ),
        (
            "attention ALiBi [Hq] causal GQA Sq!=Sk",
            ops.attention,
            (aq, ak, av, None, True, None, 0.0, "BHSD", *none3, torch.tensor([0.5, 0.25, 0.125, 0.0625])),
            (0, 1, 2),
        ),
        (
            "attention ALiBi [B, Hq] + softcap + float mask BSHD",
            ops.attention,
            (
                sq,
                sk,
                sv,
                _r(gen, 5, 7),
                False,
                None,
                0.0,
                "BSHD",
                None,
                None,
                1.5,
                torch.rand(2, 4, generator=gen),
            ),
            (0, 1, 2, 3),
        ),
    ]


def _with_grad(args, diff):
    return tuple(a.detach().clone().requires_grad_() if i in diff else a for i, a in enumerate(args))


@pytest.mark.parametrize("case", range(15))
def test_formulas_match_finite_differences(case):
    """Each formula's gradients equal central finite differences of the op's forward
    (``torch.autograd.gradcheck``, float64): q/k of RoPE (NeoX and GPT-J pairs, partial rotary R=12 < D=16,
    every cos/sin form, both layouts); q/k/v of attention and a float mask's own gradient (GQA, causal with Sq
    != Sk, soft-cap, window, a fully masked row; ALiBi slopes [Hq] and [B, Hq], bottom-right aligned); the
    embedding table."""
    cases = _grad_cases()
    assert len(cases) == 15
    name, op, args, diff = cases[case]
    args = _with_grad(args, diff)

    def fn(*xs):
        full = list(args)
        for i, x in zip(diff, xs, strict=True):
            full[i] = x
        return op(*full)

    assert torch.autograd.gradcheck(fn, tuple(args[i] for i in diff), atol=1e-6, rtol=1e-5), name


def test_padding_row_gets_no_gradient():
    """``padding_idx`` (negative counts from the end, as torch.nn.Embedding): its row's gradient is 0; the
    others are the scatter-added output gradients."""
    w = torch.randn(6, 3, requires_grad=True)
    ids = torch.tensor([[1, 2, 1], [5, 5, 0]])
    torch.ops.layerzero.embedding(ids, w, -1).backward(torch.ones(2, 3, 3))
    assert w.grad.sum(-1).tolist() == [3.0, 6.0, 3.0, 0.0, 0.0, 0.0]


DYNAMIC_CASES = (0, 5, 7, 11)
"""The cases that also run opcheck's dynamic-shape AOT dispatch (3-6 s each, three quarters of a case's time):
one per op and path (rope, attention through SDPA, attention's textbook path with a mask gradient,
embedding); the other cases vary masks and layouts, which the static dispatch covers."""


@pytest.mark.parametrize("case", [0, 3, 4, 5, 7, 8, 11, 14])
def test_custom_ops_with_gradients_keep_the_torch_library_contract(case):
    """``torch.library.opcheck`` with inputs that require grad (schema, fake, autograd registration, AOT
    dispatch with its backward) on rope, attention (the SDPA path and the textbook path with a mask gradient)
    and embedding, in float32."""
    name, op, args, diff = _grad_cases()[case]
    args = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    static = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")
    utils = (*static, "test_aot_dispatch_dynamic") if case in DYNAMIC_CASES else static
    torch.library.opcheck(op, _with_grad(args, diff), test_utils=utils)


def _rope_ref(x, cos, sin):
    r, half = cos.shape[-1], cos.shape[-1] // 2
    xr = x[..., :r]
    rot = torch.cat((-xr[..., half:], xr[..., :half]), -1)
    return torch.cat((xr * cos + rot * sin, x[..., r:]), -1)


def _attention_ref(q, k, v, mask=None, softcap=None):  # BSHD, top-left causal, GQA by consecutive groups
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s + mask
    causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    return (s.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def train_block(ids, emb, w_norm, w_qkv, cos, sin, pos, mem_k, mem_v, bias, w_o, w1, w2, *, heads=(4, 2)):
    """Embedding, RMSNorm, a GQA attention layer (RoPE over part of each head; one causal self-attention, one
    causal attention over a memory prefix + the keys, Sq != Sk, with a learned additive bias and soft-cap), a
    SwiGLU MLP, residuals: every op an lz op."""
    hq, hkv = heads
    x = lz.embedding(ids, emb)
    b, s, _ = x.shape
    q, k, v = lz.linear(lz.rms_norm(x, w_norm), w_qkv).split((hq * 10, hkv * 10, hkv * 10), -1)
    q, k = lz.rope(
        q.reshape(b, s, hq, 10), k.reshape(b, s, hkv, 10), cos, sin, position_ids=pos, layout="BSHD"
    )
    v = v.reshape(b, s, hkv, 10)
    a = lz.attention(q, k, v, is_causal=True, layout="BSHD")
    kk, vv = torch.cat((mem_k.expand(b, -1, -1, -1), k), 1), torch.cat((mem_v.expand(b, -1, -1, -1), v), 1)
    a2 = lz.attention(q, kk, vv, attn_mask=bias, is_causal=True, softcap=5.0, layout="BSHD")
    h, res = lz.rms_norm(lz.linear((a + a2).flatten(2), w_o), w_norm, residual=x)
    gate, up = lz.linear(h, w1).chunk(2, -1)
    return lz.linear(lz.swiglu(gate, up), w2) + res


def _oracle(ids, emb, w_norm, w_qkv, cos, sin, pos, mem_k, mem_v, bias, w_o, w1, w2):
    def rms(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w_norm

    x = emb[ids]
    b, s, _ = x.shape
    q, k, v = torch.nn.functional.linear(rms(x), w_qkv).split((40, 20, 20), -1)
    c, sn = cos[pos].unsqueeze(2), sin[pos].unsqueeze(2)
    q, k, v = (
        _rope_ref(q.reshape(b, s, 4, 10), c, sn),
        _rope_ref(k.reshape(b, s, 2, 10), c, sn),
        v.reshape(b, s, 2, 10),
    )
    kk, vv = torch.cat((mem_k.expand(b, -1, -1, -1), k), 1), torch.cat((mem_v.expand(b, -1, -1, -1), v), 1)
    att = _attention_ref(q, k, v) + _attention_ref(q, kk, vv, bias, 5.0)
    hh = torch.nn.functional.linear(att.flatten(2), w_o) + x
    gate, up = torch.nn.functional.linear(rms(hh), w1).chunk(2, -1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2) + hh


def _block_inputs(gen, b, s, mem=4, vocab=37, hidden=28):
    cos, sin = _tables(gen, 32, 6, False, torch.float32)  # rotary dim 6 of head dim 10
    scaled = {
        "emb": (vocab, hidden),
        "w_norm": (hidden,),
        "w_qkv": (80, hidden),
        "mem_k": (1, mem, 2, 10),
        "mem_v": (1, mem, 2, 10),
        "bias": (s, mem + s),
        "w_o": (hidden, 40),
        "w1": (64, hidden),
        "w2": (hidden, 32),
    }
    t = {n: torch.randn(*shape, generator=gen) * 0.3 for n, shape in scaled.items()}
    t["w_norm"] = t["w_norm"] + 1.0
    t["emb"] = t["emb"] * 3
    ids, pos = torch.randint(0, vocab, (b, s), generator=gen), torch.randint(0, 32, (b, s), generator=gen)
    return ids, cos, sin, pos, t


@pytest.mark.skipif(
    sys.flags.optimize > 0,
    reason=(
        "known open defect: compiled under python -O this block's q / k gradients are wrong (torch "
        "2.13.0+cpu, seen 2026-11-28; eager, each op alone, and plain-torch blocks are right): "
        "docs/torch_compile.md, 'Known problem: python -O'"
    ),
)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_training_block_with_rope_attention_embedding_matches_float64_gradients(dtype, device):
    """The block compiles fullgraph with Inductor: no graph break, and lz.rope / lz.attention / lz.embedding
    are custom-op nodes (with lz.linear / rms_norm / swiglu), not traced Python. Every differentiable input's
    gradient (embedding table, weights, the attention memory and its learned bias) equals a float64 autograd
    oracle within 1e-4 (fp32) / 3e-2 (bf16) of its largest entry, at two sizes (odd: B 3, S 5 and 7). On CPU
    and on CUDA (the oracle runs on CPU in float64 from the same rounded inputs)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    compiled = torch.compile(train_block, fullgraph=True)
    with _inductor_workarounds(device):
        _check_training_block(compiled, gen, dtype, device)


def _inductor_workarounds(device):
    """Inductor's coalescing analysis before torch 2.12 asserts on the dynamic-shape backward of this block on
    CUDA (``get_pw_red_splits``: a factored vs an expanded size expression, pytorch/pytorch#181563, fixed by
    #181793); seen with torch 2.11 on an H200. Its documented switch turns the analysis off there."""
    import contextlib

    if device == "cuda" and tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 12):
        return torch._inductor.config.patch({"triton.coalesce_tiling_analysis": False})
    return contextlib.nullcontext()


def _check_training_block(compiled, gen, dtype, device):
    for b, s in ((3, 5), (3, 7)):
        ids, cos, sin, pos, t = _block_inputs(gen, b, s)

        def call(fn, tensors, cast, ids=ids, cos=cos, sin=sin, pos=pos):
            return fn(
                ids,
                tensors["emb"],
                tensors["w_norm"],
                tensors["w_qkv"],
                cast(cos),
                cast(sin),
                pos,
                tensors["mem_k"],
                tensors["mem_v"],
                tensors["bias"],
                tensors["w_o"],
                tensors["w1"],
                tensors["w2"],
            )

        ins = {n: v.to(device, dtype).clone().requires_grad_() for n, v in t.items()}
        ids_d, pos_d = ids.to(device), pos.to(device)

        def on_device(fn, tensors, cast, ids=ids_d, pos=pos_d):
            return call(fn, tensors, cast, ids=ids, pos=pos)

        if s == 5:
            explained = torch._dynamo.explain(train_block)(
                *on_device(lambda *a: a, ins, lambda c: c.to(device, dtype))
            )
            assert explained.graph_break_count == 0
            targets = {
                str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"
            }
            assert {
                f"layerzero.{op}.default"
                for op in (
                    "embedding",
                    "rope",
                    "attention",
                    "linear",
                    "rms_norm",
                    "fused_add_rms_norm",
                    "swiglu",
                )
            } <= targets, targets
        dy = torch.randn(b, s, 28, generator=gen)
        on_device(compiled, ins, lambda c: c.to(device, dtype)).backward(dy.to(device, dtype))
        ref = {
            n: v.detach().cpu().double().requires_grad_() for n, v in ins.items()
        }  # the same (rounded) inputs
        call(_oracle, ref, lambda c: c.to(dtype).double()).backward(dy.to(dtype).double())
        tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
        for name in t:
            err = (
                (ins[name].grad.cpu().double() - ref[name].grad).abs().max() / ref[name].grad.abs().max()
            ).item()
            assert err <= tol, (s, name, err)


def _graph_targets(fn, *args):
    explained = torch._dynamo.explain(fn)(*args)
    return {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}


def test_calls_the_formulas_do_not_cover_stay_python_and_differentiable():
    """Dropout with gradients and trainable ``alibi_slopes`` are traced as Python (no custom-op node), and the
    compiled function's values and gradients equal eager's; the raw ops refuse them in backward with an
    ``InvalidInputError`` instead of a silently wrong gradient. Fixed ALiBi slopes are a custom-op node (until
    2026-11-25 the node had no slopes argument and silently dropped the bias) equal to eager."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 2, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)
    cos, sin = _tables(gen, 5, 8, False, torch.float32)

    def alibi(q, k, slopes):
        return lz.attention(q, k, k, alibi_slopes=slopes, is_causal=True)

    slopes = torch.tensor([0.5, 0.25])
    assert "layerzero.attention.default" in _graph_targets(alibi, q, k, slopes)
    torch.testing.assert_close(torch.compile(alibi, backend="aot_eager")(q, k, slopes), alibi(q, k, slopes))
    assert not torch.allclose(alibi(q, k, slopes), alibi(q, k, torch.zeros(2)))  # the bias matters here
    trainable = slopes.clone().requires_grad_()
    assert "layerzero.attention.default" not in _graph_targets(alibi, q, k, trainable)
    want = torch.autograd.grad(alibi(q, k, trainable).sum(), trainable)[0]
    got = torch.autograd.grad(torch.compile(alibi, backend="aot_eager")(q, k, trainable).sum(), trainable)[0]
    torch.testing.assert_close(got, want)
    with pytest.raises(InvalidInputError, match="alibi_slopes that require grad"):
        torch.ops.layerzero.attention(
            q.clone().requires_grad_(), k, k, None, True, None, 0.0, "BHSD", None, None, None, trainable
        ).sum().backward()

    def dropped(q):
        return lz.attention(q, q, q, dropout_p=0.5)

    qg = q.clone().requires_grad_()
    assert "layerzero.attention.default" not in _graph_targets(dropped, qg)
    with torch.no_grad():
        assert "layerzero.attention.default" in _graph_targets(
            dropped, q
        )  # inference: dropout needs no backward
    with pytest.raises(InvalidInputError, match="dropout_p=0.5 with gradients"):
        torch.ops.layerzero.attention(
            qg, q, q, None, False, None, 0.5, "BHSD", None, None, None
        ).sum().backward()


def _learned_rope_cases():
    """(name, args) of ``torch.ops.layerzero.rope`` with learned cos/sin in float64: every cos/sin form (a
    table read at positions 0..S-1, a table with ``position_ids`` that repeat positions, gathered
    ``[B, S, R]`` and ``[1, S, R]``), NeoX and GPT-J pairs, partial rotary (R = 12 < D = 16), both layouts,
    GQA 3:1."""
    gen = torch.Generator().manual_seed(27)
    cos, sin = _r(gen, 20, 12), _r(gen, 20, 12)  # arbitrary learned values: every entry its own parameter
    pos = torch.tensor([[0, 3, 3, 19, 7, 1, 0], [5, 5, 5, 2, 18, 9, 4]])
    q, k, qs, ks = _r(gen, 2, 3, 7, 16), _r(gen, 2, 1, 7, 16), _r(gen, 2, 7, 3, 16), _r(gen, 2, 7, 1, 16)
    return [
        ("table, positions 0..S-1, neox BHSD", (q, k, cos, sin, None, False, "BHSD")),
        ("table + repeated position_ids, gptj BHSD", (q, k, cos, sin, pos, True, "BHSD")),
        ("table + int32 [1, S] ids, neox BSHD", (qs, ks, cos, sin, pos[:1].int(), False, "BSHD")),
        ("gathered [B, S, R], gptj BSHD", (qs, ks, cos[pos], sin[pos], None, True, "BSHD")),
        (
            "gathered [1, S, R] shared by the batch, neox BHSD",
            (q, k, cos[:7][None], sin[:7][None], None, False, "BHSD"),
        ),
    ]


@pytest.mark.parametrize("case", range(5))
def test_learned_cos_sin_gradients_match_finite_differences(case):
    """The cos/sin gradients (with q's and k's) equal central finite differences of the op (``gradcheck``,
    float64), for every table form; rows of a table no position reads get 0."""
    name, args = _learned_rope_cases()[case]
    diff = (0, 1, 2, 3)
    args = _with_grad(args, diff)

    def fn(*xs):
        return torch.ops.layerzero.rope(*xs, *args[4:])

    assert torch.autograd.gradcheck(fn, tuple(args[i] for i in diff), atol=1e-6, rtol=1e-5), name
    if args[2].dim() == 2:
        fn(*(args[i] for i in diff))[0].sum().backward()
        read = set(range(7)) if args[4] is None else set(args[4].reshape(-1).tolist())
        unread = [i for i in range(20) if i not in read]
        assert (
            torch.count_nonzero(args[2].grad[unread]) == 0
            and torch.count_nonzero(args[2].grad[sorted(read)]) > 0
        )


def test_learned_rope_compiles_to_one_node_and_matches_eager_gradients():
    """A compiled step with learned cos/sin tables (an ``nn.Parameter`` table read through ``position_ids``,
    and cos computed from a learned frequency) keeps ``lz.rope`` one ``torch.ops.layerzero.rope`` node (no
    graph break; was traced as Python until 2026-11-27) and its values and every gradient equal eager's and a
    float64 oracle's."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    table, freq = (
        torch.randn(9, 4, generator=gen),
        torch.randn(5, 4, generator=gen),
    )  # angles: halves equal, as RoPE
    pos = torch.tensor([[0, 1, 2, 8, 8], [4, 3, 2, 1, 0]])

    def step(q, k, table, freq):
        t = torch.cat((table, table), -1)
        a, b = lz.rope(q, k, t.cos(), t.sin(), position_ids=pos)
        f = torch.cat((freq, freq), -1)
        c, d = lz.rope(a, b, f.cos(), f.sin())
        return (c * c).sum() + (d * torch.arange(8.0)).sum()

    def oracle(q, k, table, freq):
        def rot(x, c, s):
            return x * c + torch.cat((-x[..., 4:], x[..., :4]), -1) * s

        t = torch.cat((table, table), -1)
        c1, s1 = t.cos()[pos][:, None], t.sin()[pos][:, None]
        f = torch.cat((freq, freq), -1)
        a, b = rot(q, c1, s1), rot(k, c1, s1)
        c, d = rot(a, f.cos(), f.sin()), rot(b, f.cos(), f.sin())
        return (c * c).sum() + (d * torch.arange(8.0, dtype=d.dtype)).sum()

    inputs = (q, k, table, freq)
    assert "layerzero.rope.default" in _graph_targets(step, *(t.clone().requires_grad_() for t in inputs))
    results = []
    for fn, dtype in (
        (step, torch.float32),
        (torch.compile(step, backend="inductor", fullgraph=True), torch.float32),
        (oracle, torch.float64),
    ):
        args = [t.to(dtype).clone().requires_grad_() for t in inputs]
        out = fn(*args)
        out.backward()
        results.append((out.double(), [a.grad.double() for a in args]))
    for got, _ in results[:2]:
        torch.testing.assert_close(got, results[2][0], rtol=1e-5, atol=1e-4)
    for _, grads in results[:2]:
        for g, want in zip(grads, results[2][1], strict=True):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-4)


def test_compiled_backward_under_python_o_is_warned_once(monkeypatch, caplog):
    """Under ``python -O`` (stood in for) a backward formula traced by ``torch.compile`` logs the
    known-problem warning once per process; eager backward and runs without ``-O`` log nothing."""
    from layerzero.custom_ops import _grad as lg

    monkeypatch.setattr(lg, "_WARNED", [])
    with caplog.at_level("WARNING", logger="layerzero"):
        lg._warn_if_optimized_compile()  # not compiling, not -O
        monkeypatch.setattr(lg, "_optimized", lambda: True)
        lg._warn_if_optimized_compile()  # -O, eager
        assert not [r for r in caplog.records if "python -O" in r.getMessage()]
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        lg._warn_if_optimized_compile()
        lg._warn_if_optimized_compile()
    hits = [r for r in caplog.records if "python -O" in r.getMessage()]
    assert len(hits) == 1 and hits[0].levelname == "WARNING" and "Known problem" in hits[0].getMessage()
