"""``lz.fused_moe`` on CPU against oracles.

- ``reference.fused_moe`` vs a float64 loop over tokens and slots written plainly below (:func:`oracle`), on
  seeded random cases: T in {0, 1, ragged 2..40}, odd H and I, E 1..8, K 1..E, router weights softmaxed and
  renormalised; float32 within 1e-5, float16 2e-3, bfloat16 2e-2 of the output scale (``_shapes.TOL``).
- Hand-worked cases: one token and one expert by hand; duplicate expert ids in one row count twice; a zero
  router weight contributes nothing; non-contiguous inputs (transposed weights, a strided x) give the same
  result.
- Hugging Face parity: transformers' ``Qwen3MoeSparseMoeBlock`` (tiny ``Qwen3MoeConfig``, ``norm_topk_prob``
  on and off) vs ``lz.fused_moe`` on its experts' ``gate_up_proj`` / ``down_proj`` with routing computed the
  way transformers does (softmax in float32, top-k, renormalise); float32 to 1e-5, bfloat16 both within
  tolerance of the float64 oracle.
- The Triton kernel runs through the interpreter in tests/correctness/test_triton_interpret.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import F64, mismatch  # noqa: E402

import layerzero as lz  # noqa: E402
from layerzero.backends.reference.moe import fused_moe as reference  # noqa: E402

pytestmark = pytest.mark.correctness
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class MoECase(NamedTuple):
    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor


def oracle(x, w13, w2, weights, ids) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])), e = ids[t, k]
    (a slot of id E, no expert, skipped); float64, one token and one slot at a time."""
    tokens, hidden = x.shape
    inter = w2.shape[2]
    out = torch.zeros(tokens, hidden, dtype=F64)
    for t in range(tokens):
        xt = x[t].to(F64)
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e == w13.shape[0]:  # no expert here: the slot adds nothing
                continue
            gate = w13[e, :inter].to(F64) @ xt
            up = w13[e, inter:].to(F64) @ xt
            h = gate / (1 + torch.exp(-gate)) * up
            out[t] += float(weights[t, k]) * (w2[e].to(F64) @ h)
    return out


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Router weights and ids like transformers' Qwen3-MoE: softmax in float32, top-k, renormalise."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_case(
    seed: int,
    dtype: torch.dtype,
    *,
    tokens: int | None = None,
    hidden: int | None = None,
    inter: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    ids_dtype: torch.dtype = torch.int64,
) -> MoECase:
    """A seeded random case; sizes not given are drawn (T in {0, 1, 2..40}, H 1..70 and I 1..50 often odd)."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    t = tokens if tokens is not None else (0, 1, draw(2, 40))[draw(0, 2) if seed % 3 else 2]
    h = hidden or draw(1, 70)
    i = inter or draw(1, 50)
    e = experts or draw(1, 8)
    k = top_k or draw(1, e)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    weights, ids = route(torch.randn(t, e, generator=g) * 2, k)
    return MoECase(x, w13, w2, weights, ids.to(ids_dtype))


def test_cases_cover_the_edges():
    cases = [moe_case(seed, torch.float32) for seed in range(60)]
    tokens = {c.x.shape[0] for c in cases}
    assert {0, 1} <= tokens and max(tokens) > 16
    assert {c.w13.shape[0] for c in cases} == set(range(1, 9))
    assert any(c.ids.shape[1] == c.w13.shape[0] > 1 for c in cases)  # K = E
    assert any(c.x.shape[1] % 2 and c.w2.shape[2] % 2 for c in cases)  # odd H and I


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_matches_float64_oracle(dtype):
    failures = []
    for seed in range(60):
        c = moe_case(seed, dtype, ids_dtype=torch.int32 if seed % 2 else torch.int64)
        out = reference(*c)
        msg = mismatch(
            out,
            oracle(*c),
            dtype,
            f"seed {seed} T={c.x.shape[0]} H={c.x.shape[1]} "
            f"I={c.w2.shape[2]} E={c.w13.shape[0]} K={c.ids.shape[1]}",
        )
        if msg:
            failures.append(msg)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lz_fused_moe_default_on_cpu_is_the_reference(dtype):
    c = moe_case(5, dtype, tokens=7)
    assert lz.which("fused_moe", *c) == "reference.fused_moe"
    assert torch.equal(lz.fused_moe(*c), reference(*c))
    empty = moe_case(5, dtype, tokens=0)
    out = lz.fused_moe(*empty)
    assert out.shape == (0, empty.x.shape[1]) and out.dtype == dtype


def test_hand_worked_token():
    # one expert, H = 2, I = 1: gate = x0, up = x1; out = w * silu(x0) * x1 * w2 (column per hidden unit)
    x = torch.tensor([[1.0, 3.0]])
    w13 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    w2 = torch.tensor([[[2.0], [-1.0]]])
    silu1 = 1.0 / (1.0 + torch.exp(torch.tensor(-1.0, dtype=F64)))
    want = torch.tensor([[2.0, -1.0]], dtype=F64) * 0.25 * float(silu1) * 3.0
    out = lz.fused_moe(x, w13, w2, torch.tensor([[0.25]]), torch.tensor([[0]]))
    torch.testing.assert_close(out.to(F64), want, rtol=1e-6, atol=0)


def test_duplicate_ids_count_twice_and_zero_weight_contributes_nothing():
    c = moe_case(11, torch.float32, tokens=4, experts=3, top_k=2)
    dup = torch.tensor([[1, 1], [0, 2], [2, 2], [0, 1]])
    weights = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.3, 0.7], [0.0, 0.0]])
    out = lz.fused_moe(c.x, c.w13, c.w2, weights, dup)
    single = lz.fused_moe(c.x, c.w13, c.w2, torch.ones(4, 1), torch.tensor([[1], [0], [2], [0]]))
    torch.testing.assert_close(out[:3], single[:3], rtol=1e-5, atol=1e-6)
    assert torch.equal(out[3], torch.zeros(c.x.shape[1]))
    assert mismatch(out, oracle(c.x, c.w13, c.w2, weights, dup), torch.float32) is None


def no_expert_case(seed: int, dtype: torch.dtype, tokens: int = 9) -> MoECase:
    """Expert parallelism's routes on one rank: a case of E = 5 local experts and K = 7 slots (K > E), about
    half the slots marked E (no expert here), their weights 0 or not (either way they add nothing)."""
    c = moe_case(seed, dtype, tokens=tokens, hidden=13, inter=7, experts=5, top_k=5)
    g = torch.Generator().manual_seed(seed + 100)
    ids = torch.randint(0, 5, (tokens, 7), generator=g)
    ids[torch.rand(tokens, 7, generator=g) < 0.5] = 5
    weights = torch.rand(tokens, 7, generator=g)
    return MoECase(c.x, c.w13, c.w2, weights, ids)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_expert_slots_add_nothing(dtype):
    """``topk_ids == E`` marks a slot with no expert (EP: another rank's): the reference equals the float64
    oracle that skips those slots, and equals itself with those slots' weights zeroed."""
    for seed in range(3):
        c = no_expert_case(seed, dtype)
        assert mismatch(reference(*c), oracle(*c), dtype, f"seed {seed}") is None
        zeroed = c.weights * (c.ids < 5)
        assert torch.equal(lz.fused_moe(*c), lz.fused_moe(c.x, c.w13, c.w2, zeroed, c.ids))


def test_strided_inputs_give_the_contiguous_result():
    c = moe_case(3, torch.float32, tokens=9, hidden=13, inter=7, experts=4, top_k=2)
    x = torch.randn(9, 26)[:, ::2].copy_(c.x)  # row stride 26, column stride 2
    w13 = c.w13.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H] with stride(-1) != 1
    w2 = c.w2.transpose(0, 1).contiguous().transpose(0, 1)
    weights, ids = c.weights.t().contiguous().t(), c.ids.t().contiguous().t()
    assert not any(t.is_contiguous() for t in (x, w13, w2, weights, ids))
    torch.testing.assert_close(lz.fused_moe(x, w13, w2, weights, ids), lz.fused_moe(*c), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- transformers Qwen3-MoE


def _qwen3_block(hidden: int, inter: int, experts: int, top_k: int, norm_topk_prob: bool, seed: int):
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        hidden_act="silu",
    )
    block = modeling.Qwen3MoeSparseMoeBlock(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():  # transformers leaves them uninitialized: fill them ourselves
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return block


@pytest.mark.parametrize(
    ("hidden", "inter", "experts", "top_k", "norm"),
    [(32, 16, 8, 2, True), (24, 40, 6, 4, False), (17, 9, 5, 1, True), (40, 24, 4, 4, True)],
)
def test_matches_transformers_qwen3_moe_block_float32(hidden, inter, experts, top_k, norm):
    block = _qwen3_block(hidden, inter, experts, top_k, norm, seed=hidden)
    x = torch.randn(3, 5, hidden, generator=torch.Generator().manual_seed(1))
    flat = x.reshape(-1, hidden)
    weights, ids = route(torch.nn.functional.linear(flat, block.gate.weight.detach()), top_k, norm)
    experts_ = block.experts
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(flat)  # the same routing, computed by transformers' router
        assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
        want = block(x).reshape(-1, hidden)
        out = lz.fused_moe(flat, experts_.gate_up_proj, experts_.down_proj, weights, ids)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_matches_transformers_qwen3_moe_block_bfloat16():
    block = _qwen3_block(48, 24, 8, 2, True, seed=4).to(torch.bfloat16)
    x = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    flat = x.reshape(-1, 48)
    w13, w2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    with torch.no_grad():
        _, hf_weights, ids = block.gate(flat)  # transformers rounds the router weights to bfloat16
        weights = hf_weights.float()
        want = block(x).reshape(-1, 48)
        out = lz.fused_moe(flat, w13, w2, weights, ids)
    exact = oracle(flat, w13, w2, weights, ids)
    assert mismatch(out, exact, torch.bfloat16, "lz") is None
    assert mismatch(want, exact, torch.bfloat16, "transformers") is None
    assert (out.to(F64) - exact).abs().max() <= (want.to(F64) - exact).abs().max()  # one rounding vs several
