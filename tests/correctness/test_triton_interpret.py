"""LayerZero's Triton kernels (``triton.rms_norm``, ``triton.rope``, ``triton.sample_topk/topp``,
``triton.fused_moe``) on CPU tensors
through the Triton interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py, and below as a fallback,
before any ``@triton.jit`` runs when no CUDA device is visible). Skipped with a reason without triton.

The interpreter is slow (milliseconds per program), so the cases are few and small; the GPU file
(tests/gpu/test_gpu_triton.py) runs >= 200 seeded cases per dtype. The interpreter rounds float32 -> bfloat16
by truncation where the GPU rounds to nearest even, so bfloat16 results may sit one bf16 ulp further from the
oracle here than on the GPU: the shared tolerance (2e-2 of the output scale) still holds.

- rms_norm / fused add: seeded cases of ``_shapes.rms_call`` (odd hidden sizes, leading dims, sliced and
  transposed rows, float32 weights with half x) vs the float64 oracle; h equals ``x + r`` rounded once to x's
  dtype; the tiled path (H > 8192); a hand-worked row.
- rope: seeded ``_shapes.rope_call`` cases (both pair styles, partial rotary, tables / int32 and int64
  position ids / gathered [B or 1, S, R], BHSD/BSHD, GQA) vs the complex-multiplication oracle; inputs
  unchanged.
- fused_moe: seeded small cases of ``test_fused_moe.moe_case`` (T in {0, 1, ragged}, odd H and I, E 1..8,
  K 1..E, both block configs) vs the float64 oracle; strided inputs; duplicate ids; ``moe_align``'s layout
  (every pair once, each tile one expert, padding only at group ends).
- sampling: with given uniforms u the token equals a float64 brute-force inverse CDF over the reference's kept
  set (candidates in descending probability; token order when nothing is cut); a chi-square test of the draw
  frequencies; k = 1, tiny p, temperature 0 (first index on ties); odd vocab sizes across several tiles;
  generator reproducibility.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first @triton.jit of the session (kernels load lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import F64, kept_oracle, mismatch, qk_norm_rope_call, rms_call, rope_call  # noqa: E402

from layerzero.core import knobs  # noqa: E402

pytestmark = [
    pytest.mark.correctness,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU_WORK = 60_000  # elements per seeded case at most (interpreter time)


def _kernels():
    from layerzero.backends.triton import norms, rope, sampling

    return norms, rope, sampling


def _small(call) -> bool:
    return sum(t.numel() for t in call.args if isinstance(t, torch.Tensor)) <= CPU_WORK


# ----------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_seeded_cases_match_float64(dtype):
    norms = _kernels()[0]
    ran, failures, fused = 0, [], 0
    for seed in range(200):
        call = rms_call(seed, dtype)
        if not _small(call):
            continue
        x, w, eps = call.args
        res = call.kwargs["residual"]
        snapshot = [t.clone() for t in (x, w, res) if t is not None]
        out = norms.rms_norm(x, w, eps, res)
        ref = call.oracle()
        outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
        for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
            msg = mismatch(o, r, dtype, f"output {i}")
            if msg:
                failures.append(f"[{call.case}] {msg}")
        assert all(
            torch.equal(a, b)
            for a, b in zip(snapshot, [t for t in (x, w, res) if t is not None], strict=True)
        ), "inputs were modified"
        fused += res is not None
        ran += 1
        if ran >= 12:
            break
    assert ran == 12 and 0 < fused < ran, (ran, fused)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_tiled_long_rows_and_fused_sum(dtype):
    norms = _kernels()[0]
    gen = torch.Generator().manual_seed(7)
    h = knobs.get(norms.KNOBS).one_pass_max + 1001  # the two-loop path (8192 + 1001), last tile partial
    x = torch.randn(2, h, generator=gen).to(dtype)
    r = torch.randn(2, h, generator=gen).to(dtype)
    w = (1 + 0.5 * torch.randn(h, generator=gen)).to(dtype)
    y, s = norms.rms_norm(x, w, 1e-5, r)
    exact = x.to(F64) + r.to(F64)
    # h is x + r rounded once to x's dtype: within half an ulp (one ulp for the interpreter's bf16 truncation)
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert bool(((s.to(F64) - exact).abs() <= ulp).all())
    y64 = s.to(F64) / torch.sqrt((s.to(F64) ** 2).mean(-1, keepdim=True) + 1e-5) * w.to(F64)
    assert mismatch(y, y64, dtype, "tiled y") is None
    assert (
        mismatch(
            norms.rms_norm(x, w, 1e-5),
            x.to(F64) / torch.sqrt((x.to(F64) ** 2).mean(-1, keepdim=True) + 1e-5) * w.to(F64),
            dtype,
        )
        is None
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_small_tiles_from_the_knobs(dtype):
    """``NormKnobs`` with a one-pass limit of 64 and 32-element tiles: a 200-wide row takes the two-loop path
    in 7 tiles (the last partial), a 64-wide one stays one pass; both match float64, with and without the
    fused residual."""
    norms = _kernels()[0]
    gen = torch.Generator().manual_seed(11)
    with knobs.knobs(norms.KNOBS, one_pass_max=64, tile=32):
        for h in (200, 64):
            x = torch.randn(3, h, generator=gen).to(dtype)
            r = torch.randn(3, h, generator=gen).to(dtype)
            w = (1 + 0.5 * torch.randn(h, generator=gen)).to(dtype)
            y, s = norms.rms_norm(x, w, 1e-5, r)
            y64 = s.to(F64) / torch.sqrt((s.to(F64) ** 2).mean(-1, keepdim=True) + 1e-5) * w.to(F64)
            assert mismatch(y, y64, dtype, f"y h={h}") is None
            y64 = x.to(F64) / torch.sqrt((x.to(F64) ** 2).mean(-1, keepdim=True) + 1e-5) * w.to(F64)
            assert mismatch(norms.rms_norm(x, w, 1e-5), y64, dtype, f"y h={h}, no residual") is None


def test_rms_norm_hand_worked_row_and_empty_input():
    norms = _kernels()[0]
    # [3, 4]: mean square 12.5, 1/sqrt(12.5) = 0.28284..., times weight [1, 2]
    y = norms.rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0]), 1e-12)
    torch.testing.assert_close(
        y, torch.tensor([[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]]), rtol=1e-6, atol=0
    )
    y, h = norms.rms_norm(torch.tensor([[1.0, 2.0]]), torch.ones(2), 1e-12, torch.tensor([[2.0, 2.0]]))
    torch.testing.assert_close(h, torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(
        y, torch.tensor([[3 / math.sqrt(12.5), 4 / math.sqrt(12.5)]]), rtol=1e-6, atol=0
    )
    empty = norms.rms_norm(torch.ones(0, 5), torch.ones(5), 1e-6)
    assert empty.shape == (0, 5)


# ----------------------------------------------------------------------------- rope


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_seeded_cases_match_float64(dtype):
    rope = _kernels()[1]
    ran, failures, seen = 0, [], set()
    for seed in range(300):
        call = rope_call(seed, dtype)
        if call.case.batch * call.case.s > 24:  # one program per token in the interpreter: keep them few
            continue
        q, k, cos, sin = call.args
        kw = call.kwargs
        before = (q.clone(), k.clone())
        out = rope.rope(q, k, cos, sin, kw["position_ids"], kw["interleaved"], kw["layout"])
        for i, (o, r) in enumerate(zip(out, call.oracle(), strict=True)):
            msg = mismatch(o, r, dtype, f"output {i}")
            if msg:
                failures.append(f"[{call.case}] {msg}")
        assert torch.equal(before[0], q) and torch.equal(before[1], k), "rope wrote into its inputs"
        c = call.case
        seen.update({c.form, c.layout, ("interleaved", c.interleaved), ("partial", c.rot < c.d)})
        ran += 1
        if ran >= 12:
            break
    assert ran == 12
    assert {"BHSD", "BSHD", ("interleaved", True), ("interleaved", False), ("partial", True)} <= seen, seen
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_rope_seeded_cases_match_float64(dtype):
    """``triton.qk_norm_rope`` (the rope kernel with its NORM prologue): 12 seeded cases per dtype (both pair
    styles, partial rotary: the pass-through dims count in the norm, every cos/sin form, BHSD/BSHD, GQA) equal
    the float64 norm-then-rotate oracle; inputs unchanged."""
    rope = _kernels()[1]
    ran, failures, seen = 0, [], set()
    for seed in range(300):
        call = qk_norm_rope_call(seed, dtype)
        if call.case.batch * call.case.s > 24:
            continue
        q, k, qw, kw, cos, sin = call.args
        o = call.kwargs
        before = (q.clone(), k.clone())
        out = rope.qk_norm_rope(
            q, k, qw, kw, cos, sin, o["position_ids"], o["interleaved"], o["layout"], o["eps"]
        )
        for i, (got, want) in enumerate(zip(out, call.oracle(), strict=True)):
            msg = mismatch(got, want, dtype, f"output {i}")
            if msg:
                failures.append(f"[{call.case}] {msg}")
        assert torch.equal(before[0], q) and torch.equal(before[1], k), "qk_norm_rope wrote into its inputs"
        c = call.case
        seen.update({c.layout, ("interleaved", c.interleaved), ("partial", c.rot < c.d)})
        ran += 1
        if ran >= 12:
            break
    assert ran == 12
    assert {"BHSD", "BSHD", ("interleaved", True), ("interleaved", False), ("partial", True)} <= seen, seen
    assert not failures, "\n".join(failures)


def test_rope_strided_views_are_read_in_place():
    """HF's q: a [B, S, H*D] projection viewed as [B, S, H, D] and transposed to BHSD (not contiguous)."""
    rope = _kernels()[1]
    gen = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 5, 3, 10
    q = torch.randn(b, s, h * d + 4, generator=gen)[..., 2 : 2 + h * d].unflatten(-1, (h, d)).transpose(1, 2)
    k = torch.randn(b, s, h, d, generator=gen).transpose(1, 2)
    ang = torch.arange(s, dtype=F64)[:, None] * torch.tensor([1.0, 0.1, 0.01], dtype=F64)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).float(), torch.cat((ang.sin(), ang.sin()), -1).float()
    qo, ko = rope.rope(q, k, cos, sin, None, False, "BHSD")

    def oracle(x):  # half rotation over R = 6 by hand, dims 6..9 pass
        x = x.to(F64)
        out = x.clone()
        c, sn = cos.to(F64)[None, None], sin.to(F64)[None, None]
        for i in range(3):
            out[..., i] = x[..., i] * c[..., i] - x[..., i + 3] * sn[..., i]
            out[..., i + 3] = x[..., i + 3] * c[..., i + 3] + x[..., i] * sn[..., i + 3]
        return out

    torch.testing.assert_close(qo.to(F64), oracle(q), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ko.to(F64), oracle(k), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- sampling


def inverse_cdf(order, kept, u):
    """(token, margin): the first candidate whose float64 cumulative probability exceeds u, and the distance
    of u to the nearest cumulative boundary (a float32 kernel may differ only when that is tiny)."""
    cum = torch.cumsum(kept, 0)
    i = int((cum > u).nonzero()[0]) if bool((cum > u).any()) else len(order) - 1
    return int(order[i]), float((cum - u).abs().min())


@pytest.mark.parametrize(
    ("vocab", "k", "p", "temperature"),
    [
        (1, 5, None, 1.0),
        (2, 1, None, 0.7),
        (7, 3, None, 1.0),
        (257, 40, None, 0.6),
        (3001, 1500, None, 1.3),
        (3001, None, 0.9, 1.0),
        (513, None, 0.5, 0.8),
        (7, None, 1.0, 1.0),
        (1025, 5000, None, 1.0),
        (2049, None, 0.3, 2.0),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_draw_with_given_u_equals_float64_inverse_cdf(vocab, k, p, temperature, dtype):
    sampling = _kernels()[2]
    gen = torch.Generator().manual_seed(vocab * 7 + (k or 0))
    rows = 3
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)  # continuous: no ties in random rows
    u = torch.rand(rows, generator=gen)
    tokens = sampling.draw(logits, u, k=k, p=p, temperature=temperature)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    for row in range(rows):
        order, kept = kept_oracle(logits[row], temperature, k, p)
        want, margin = inverse_cdf(order, kept, float(u[row]))
        if int(tokens[row]) != want:
            assert margin < 1e-5, f"row {row}: kernel {int(tokens[row])}, oracle {want} (margin {margin:.2e})"
            assert int(tokens[row]) in order.tolist()


@pytest.mark.parametrize(("op", "arg"), [("topk", 4), ("topp", 0.8)])
def test_draw_frequencies_chi_square(op, arg):
    """160 draws from one row: counts vs the renormalized kept distribution (chi-square, p-value 1e-4)."""
    sampling = _kernels()[2]
    logits = torch.tensor([1.0, 0.4, 0.2, -0.1, -1.5, -2.0, -3.0])
    n = 160
    gen = torch.Generator().manual_seed(11)
    fn = sampling.sample_topk if op == "topk" else sampling.sample_topp
    tokens = fn(logits.expand(n, -1).contiguous(), arg, 0.9, gen)
    order, kept = kept_oracle(logits, 0.9, **({"k": arg} if op == "topk" else {"p": arg}))
    counts = torch.bincount(tokens, minlength=7).to(F64)
    assert counts[[t for t in range(7) if t not in order.tolist()]].sum() == 0, "a token outside the kept set"
    expected = kept * n
    chi2 = float(((counts[order] - expected) ** 2 / expected).sum())
    crit = {2: 18.42, 3: 21.11, 4: 23.51}[len(order) - 1]  # chi-square quantile at 1 - 1e-4
    assert chi2 < crit, (chi2, counts.tolist(), expected.tolist())


def test_greedy_edge_cases_first_index_on_ties():
    sampling = _kernels()[2]
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [2.0, 2.0, -1.0, 2.0]])
    first = torch.tensor([1, 0])
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert torch.equal(sampling.sample_topk(logits, 3, 0.0, gen), first)
    assert torch.equal(sampling.sample_topp(logits, 0.9, 0.0, gen), first)
    assert torch.equal(sampling.sample_topk(logits, 1, 1.0, gen), first)  # k = 1 is argmax
    assert torch.equal(gen.get_state(), state), "greedy calls must not draw"
    # tiny p keeps only the most probable token (the first of tied maxima: stable sort)
    assert torch.equal(sampling.sample_topp(logits, 1e-9, 1.0, gen), first)
    assert not torch.equal(gen.get_state(), state)


def test_same_seed_same_tokens_and_zero_probability_never_drawn():
    sampling = _kernels()[2]
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=gen)
    logits[:, ::2] = float("-inf")  # even tokens have probability 0
    a = sampling.sample_topp(logits, 0.95, 1.0, torch.Generator().manual_seed(42))
    b = sampling.sample_topp(logits, 0.95, 1.0, torch.Generator().manual_seed(42))
    assert torch.equal(a, b) and bool((a % 2 == 1).all())
    c = sampling.sample_topk(logits, 300, 1.0, torch.Generator().manual_seed(42))  # no cut: token order
    assert bool((c % 2 == 1).all())
    u = torch.ones(6) - 2**-24  # largest float32 below 1: the last candidate with non-zero probability
    last = sampling.draw(logits, u, k=None)
    assert torch.equal(last, torch.full((6,), 299))


# ----------------------------------------------------------------------------- fused_moe


def _moe():
    from layerzero.backends.triton import moe

    return moe


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_moe_seeded_cases_match_float64(dtype):
    from test_fused_moe import moe_case, oracle

    moe = _moe()
    failures, configs = [], set()
    for seed in range(6):
        c = moe_case(
            seed, dtype, tokens=(0, 1, 13, 5, 3, 40)[seed], ids_dtype=(torch.int32, torch.int64)[seed % 2]
        )
        snapshot = [t.clone() for t in c]
        out = moe.fused_moe(*c)
        msg = mismatch(
            out,
            oracle(*c),
            dtype,
            f"seed {seed} T={c.x.shape[0]} H={c.x.shape[1]} I={c.w2.shape[2]} "
            f"E={c.w13.shape[0]} K={c.ids.shape[1]}",
        )
        if msg:
            failures.append(msg)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, c, strict=True)), "inputs were modified"
        configs.add(moe.block_sizes(c.x.shape[0], c.w13.shape[0]))
    assert not failures, "\n".join(failures)
    assert len(configs) == 2, configs  # the decode (T <= E) and the prefill block sizes both ran


def test_fused_moe_strided_inputs_and_duplicate_ids():
    from test_fused_moe import moe_case, oracle

    moe = _moe()
    c = moe_case(21, torch.float32, tokens=6, hidden=19, inter=11, experts=3, top_k=2)
    x = torch.randn(6, 38)[:, ::2].copy_(c.x)
    w13 = c.w13.transpose(1, 2).contiguous().transpose(1, 2)
    w2 = c.w2.transpose(0, 1).contiguous().transpose(0, 1)
    ids = (
        torch.tensor([[1, 1], [0, 2], [2, 2], [0, 1], [1, 0], [2, 1]], dtype=torch.int32).t().contiguous().t()
    )
    weights = c.weights.t().contiguous().t()
    assert (
        mismatch(moe.fused_moe(x, w13, w2, weights, ids), oracle(x, w13, w2, weights, ids), torch.float32)
        is None
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_moe_no_expert_slots_match_float64(dtype):
    """Slots of id E (no expert here: expert parallelism's slots on other ranks), K > E: the float64 oracle
    that skips them, in both block configurations (T <= E and T > E)."""
    from test_fused_moe import no_expert_case, oracle

    moe = _moe()
    for tokens in (3, 17):
        c = no_expert_case(tokens, dtype, tokens=tokens)
        assert mismatch(moe.fused_moe(*c), oracle(*c), dtype, f"T={tokens}") is None


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m"),
    [(1, 8, 2, 16), (13, 5, 3, 4), (40, 3, 1, 16), (7, 1, 1, 2), (9, 6, 6, 64)],
)
def test_moe_align_layout(tokens, experts, top_k, block_m):
    moe = _moe()
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    sorted_ids, block_expert = moe.moe_align(ids, experts, block_m)
    pairs, flat = tokens * top_k, ids.reshape(-1)
    assert sorted_ids.numel() == block_expert.numel() * block_m
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs)), "every pair exactly once"
    assert bool((sorted_ids <= pairs).all())
    tiles = sorted_ids.view(-1, block_m)
    used = int((block_expert < experts).sum())
    assert bool((block_expert[used:] == experts).all()) and bool((tiles[used:] == pairs).all())
    counts = torch.bincount(flat, minlength=experts)
    assert used == int(((counts + block_m - 1) // block_m).sum())
    for tile, e in zip(tiles[:used], block_expert[:used].tolist(), strict=True):
        rows = tile[tile < pairs].long()
        assert rows.numel() > 0 and bool((flat[rows] == e).all()), "a tile holds one expert's pairs"
        assert bool((tile[: rows.numel()] < pairs).all()), "padding only at the end of a group"
    assert block_expert[:used].tolist() == sorted(block_expert[:used].tolist())
