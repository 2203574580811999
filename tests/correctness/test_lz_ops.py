"""End-to-end ops with LayerZero's *default* selection against float64 oracles and hand-worked cases:
lz.attention, lz.rms_norm (with residual), lz.layer_norm, lz.rope (both styles, partial rotary, position ids,
BSHD) and sampling (k=1 / temperature 0 == argmax, nothing outside the top-k / nucleus over many draws, same
seed -> same tokens, frequencies match the renormalized probabilities). The sampling kernels are also checked
one by one (locked), since sampling has no float64 output to compare."""

from __future__ import annotations

import math
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import (  # noqa: E402
    CALLS,
    DTYPES,
    F64,
    MIN_CASES,
    dname,
    kernel_dtype_params,
    mismatch,
    randn,
    rope_case,
    rope_oracle,
)

pytestmark = pytest.mark.correctness
_ids = lambda x: dname(x) if isinstance(x, torch.dtype) else x  # noqa: E731


# ============================================================ sampling oracles (shared with tests/gpu)
def probs64(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float64 ``softmax(logits / temperature)`` written out."""
    z = logits.to(F64) / temperature
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def argmax_set(logits: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` bool: tokens whose logit equals the row maximum (greedy may pick any on ties)."""
    return logits == logits.amax(-1, keepdim=True)


def topk_allowed(logits: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    """``[B, V]`` bool superset of what top-k may draw: probability >= the k-th largest (ties included)."""
    p = probs64(logits, temperature)
    return (p >= p.topk(min(k, p.shape[-1]), -1).values[..., -1:] * (1 - 1e-6)) & (p > 0)


def topp_allowed(logits: torch.Tensor, top_p: float, temperature: float, slack: float = 1e-4) -> torch.Tensor:
    """``[B, V]`` bool superset of what nucleus sampling may draw: tokens whose strictly-more-probable mass is
    < p (+ slack for float32 rounding); the most probable token is always allowed."""
    p = probs64(logits, temperature)
    asc = p.sort(-1).values
    suffix = torch.cat((asc.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(asc[:, :1])), -1)  # sum of asc[j:]
    above = suffix.gather(
        -1, torch.searchsorted(asc, p * (1 + 1e-9), right=True)
    )  # mass strictly above token
    return (above < top_p + slack) | (p >= p.amax(-1, keepdim=True))


def run_sampling_kernel(
    op: str, kernel_id: str, dtype: torch.dtype, device="cpu", n: int = MIN_CASES, draws: int = 4
) -> tuple[int, list[str]]:
    """Lock ``op`` to ``kernel_id``; on ``n`` seeded cases (B 1..8, V 1..32000, temperature 0 ~15%) draw
    ``draws`` times; every token must be in the oracle's allowed set (argmax set for temperature 0 or k = 1)
    and a fresh generator with the same seed must repeat the first draw. Returns (cases run, failures)."""
    fn, failures, ran = getattr(lz, op), [], 0
    lz.lock(op, kernel_id)
    try:
        for seed in range(n):
            rng = random.Random(seed * 2654435761 % 2**32)
            b, v = rng.randint(1, 8), 32000 if seed % 25 == 3 else rng.choice((1, 2, 5, 32, 100, 1000, 4096))
            logits = randn(
                (b, v), torch.Generator().manual_seed(seed), device, dtype, rng.choice((0.5, 2.0, 8.0))
            )
            k, p = rng.choice((1, 2, 5, 40, v, v + 3)), rng.choice((1e-6, 0.1, 0.5, 0.9, 0.99, 1.0))
            temp, arg = rng.choice((0.0, 0.3, 1.0, 1.0, 1.7)), k if op == "sample_topk" else p
            if lz.validate(kernel_id, op, logits, arg, temperature=temp):
                continue
            ran += 1
            if temp == 0 or (op == "sample_topk" and k == 1):
                allowed = argmax_set(logits)
            else:
                allowed = (
                    topk_allowed(logits, k, temp) if op == "sample_topk" else topp_allowed(logits, p, temp)
                )
            gen = torch.Generator(device=device).manual_seed(seed)
            tokens = torch.stack([fn(logits, arg, temperature=temp, generator=gen) for _ in range(draws)], 1)
            again = fn(
                logits, arg, temperature=temp, generator=torch.Generator(device=device).manual_seed(seed)
            )
            label = f"seed={seed} B,V={b},{v} k={k} p={p} T={temp}"
            if tokens.dtype != torch.int64 or tokens.shape != (b, draws):
                failures.append(f"[{label}] tokens {tokens.dtype} {tuple(tokens.shape)}, expected int64 [B]")
                continue
            bad = ~allowed.gather(1, tokens)
            if bad.any():
                row, col = bad.nonzero()[0].tolist()
                failures.append(
                    f"[{label}] drew token {int(tokens[row, col])} outside the allowed set of row {row}"
                )
            if not torch.equal(again, tokens[:, 0]):
                failures.append(
                    f"[{label}] same generator seed gave {tokens[:, 0].tolist()} then {again.tolist()}"
                )
    finally:
        lz.unlock(op)
    return ran, failures


def frequency_error(tokens: torch.Tensor, expected: torch.Tensor, sigmas: float = 5.0) -> str | None:
    """None if the token frequencies of ``tokens [N]`` match probabilities ``expected [V]`` within ``sigmas``
    binomial standard deviations per token (and no zero-probability token was drawn), else a description."""
    n, exp = tokens.numel(), expected.cpu().to(F64)
    freq = torch.bincount(tokens.cpu(), minlength=exp.numel()).to(F64) / n
    off = ((freq - exp).abs() > sigmas * torch.sqrt(exp * (1 - exp) / n).clamp_min(1e-12)) & (
        (exp > 0) | (freq > 0)
    )
    if off.any():
        i = int(off.nonzero()[0])
        return f"token {i}: frequency {float(freq[i]):.4f} vs probability {float(exp[i]):.4f} over {n} draws"
    return None


# ============================================================================ default selection vs oracle
def _default_selection(op: str, dtype: torch.dtype, seeds: range) -> tuple[Counter, list[str]]:
    """Run ``seeds`` cases of ``op`` through default selection; check the chosen kernel validates, is the one
    lz.trace saw (no runtime fallback), and that the output matches the oracle. Returns (kernels used,
    failures)."""
    served: Counter = Counter()
    failures: list[str] = []
    for seed in seeds:
        call = CALLS[op](seed, dtype)
        kid = lz.which(op, *call.args, **call.kwargs)
        reasons = lz.validate(kid, op, *call.args, **call.kwargs)
        with lz.trace() as t:
            out = getattr(lz, op)(*call.args, **call.kwargs)
        served[kid] += 1
        if reasons or t.kernels_for(op) != [kid] or t.fallbacks:
            failures.append(
                f"[{call.case}] chose {kid} (reasons {reasons}), ran {t.kernels_for(op)}, "
                f"fallbacks {t.fallbacks}"
            )
        ref = call.oracle()
        for i, (o, r) in enumerate(
            zip(*((out, ref) if isinstance(ref, tuple) else ((out,), (ref,))), strict=True)
        ):
            msg = mismatch(o, r, dtype, f"{kid} output {i}", call.floor)
            if msg:
                failures.append(f"[{call.case}] {msg}")
    return served, failures


@pytest.mark.parametrize("op", ["attention", "rms_norm", "layer_norm", "rope", "qk_norm_rope"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_default_selection_matches_oracle(op, dtype):
    """80 seeded cases, default selection: the chosen kernel validates, runs without fallback, matches the
    oracle."""
    served, failures = _default_selection(op, dtype, range(20_000, 20_080))
    assert not failures, f"kernels used {dict(served)}\n" + "\n".join(failures[:12])
    if op == "attention":  # mask + causal only the reference runs; the rest goes to a faster SDPA kernel
        assert served["reference.attention"] < sum(served.values()) and len(served) >= 2, dict(served)


def test_rope_cases_cover_both_styles_partial_rotary_position_ids_and_bshd():
    """The seeds used by the default-selection rope test cover every feature the brief names."""
    cases = [rope_case(s) for s in range(20_000, 20_080)]
    assert {c.interleaved for c in cases} == {False, True}
    assert {c.layout for c in cases} == {"BHSD", "BSHD"}
    assert {"gathered", "table", "ids", "ids32"} <= {c.form for c in cases}
    assert any(c.rot < c.d for c in cases) and any(c.rot == c.d for c in cases)
    assert any(c.hq != c.hkv for c in cases)


# ============================================================================ hand-worked cases
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_ids)
def test_attention_hand_worked(dtype):
    """q = 1, keys 0 and ln 3, scale 1: weights softmax([0, ln 3]) = [1/4, 3/4]; v = [4, 8] -> 7. Masking
    key 1 leaves v0 = 4. Two query heads share the one KV head (GQA) and both get 7."""
    q = torch.ones(1, 2, 1, 1, dtype=dtype)
    k = torch.tensor([0.0, math.log(3.0)], dtype=dtype).view(1, 1, 2, 1)
    v = torch.tensor([4.0, 8.0], dtype=dtype).view(1, 1, 2, 1)
    out = lz.attention(q, k, v, scale=1.0)
    torch.testing.assert_close(out, torch.full((1, 2, 1, 1), 7.0, dtype=dtype))
    out = lz.attention(q, k, v, scale=1.0, attn_mask=torch.tensor([[True, False]]))
    torch.testing.assert_close(out, torch.full((1, 2, 1, 1), 4.0, dtype=dtype))
    bshd = lz.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=1.0, layout="BSHD")
    torch.testing.assert_close(bshd, torch.full((1, 1, 2, 1), 7.0, dtype=dtype))


def test_norms_hand_worked():
    """rms([3, 4]) = sqrt(12.5) after the residual add; layer_norm([1, 3]) = [-1, 1] * w + b."""
    y, h = lz.rms_norm(torch.tensor([[1.0, 2.0]]), torch.ones(2), 1e-12, residual=torch.tensor([[2.0, 2.0]]))
    torch.testing.assert_close(h, torch.tensor([[3.0, 4.0]]))  # rms([3, 4]) = sqrt(12.5)
    torch.testing.assert_close(y, torch.tensor([[3.0, 4.0]]) / math.sqrt(12.5))
    w, b = torch.tensor([2.0, 3.0]), torch.tensor([0.5, -0.5])
    torch.testing.assert_close(
        lz.layer_norm(torch.tensor([[1.0, 3.0]]), w, b, 1e-12), torch.tensor([[-1.5, 2.5]])
    )


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_rope_hand_worked_90_degrees(layout):
    """Every pair rotated by 90 degrees: (a, b) -> (-b, a). NeoX pairs (x0, x2), (x1, x3); GPT-J pairs
    (x0, x1), (x2, x3); with R = 2 only the first pair turns and x2, x3 pass through."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    zeros, ones = torch.zeros(1, 4), torch.ones(1, 4)
    for interleaved, expected in ((False, [-3.0, -4.0, 1.0, 2.0]), (True, [-2.0, 1.0, -4.0, 3.0])):
        q, k = lz.rope(x, x, zeros, ones, interleaved=interleaved, layout=layout)
        assert q.flatten().tolist() == expected and k.flatten().tolist() == expected, (interleaved, q)
    q, _ = lz.rope(x, x, zeros[:, :2], ones[:, :2], layout=layout)
    assert q.flatten().tolist() == [-2.0, 1.0, 3.0, 4.0]


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_qk_norm_rope_hand_worked(layout):
    """Head [3, 4, 0, 0] (mean square 25 / 4) normalizes to [1.2, 1.6, 0, 0]; weights [1, 2, 3, 4] give [1.2,
    3.2, 0, 0]; a 90-degree NeoX turn of the pairs (x0, x2), (x1, x3) gives [0, 0, 1.2, 3.2]. With R = 2 only
    the GPT-J pair (x0, x1) turns: [-3.2, 1.2, 0, 0]. k has its own weight (all ones): [0, 0, 1.2, 1.6]."""
    x = torch.tensor([3.0, 4.0, 0.0, 0.0], dtype=F64).view(1, 1, 1, 4)
    w, ones = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64), torch.ones(4, dtype=F64)
    zeros, one = torch.zeros(1, 4, dtype=F64), torch.ones(1, 4, dtype=F64)
    q, k = lz.qk_norm_rope(x, x, w, ones, zeros, one, eps=1e-300, layout=layout)
    torch.testing.assert_close(q.flatten(), torch.tensor([0.0, 0.0, 1.2, 3.2], dtype=F64))
    torch.testing.assert_close(k.flatten(), torch.tensor([0.0, 0.0, 1.2, 1.6], dtype=F64))
    q, _ = lz.qk_norm_rope(
        x, x, w, ones, zeros[:, :2], one[:, :2], eps=1e-300, interleaved=True, layout=layout
    )
    torch.testing.assert_close(q.flatten(), torch.tensor([-3.2, 1.2, 0.0, 0.0], dtype=F64))


def test_rope_position_ids_equal_gathered_table():
    """Table + position_ids gives the same bits as the pre-gathered table, and matches the oracle."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 7, 64, generator=gen), torch.randn(2, 2, 7, 64, generator=gen)
    ang = torch.arange(50.0)[:, None] * 10000.0 ** (-torch.arange(0, 32, 2) / 32)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)  # R = 32 < D = 64
    ids = torch.randint(0, 50, (2, 7), generator=gen)
    via_ids = lz.rope(q, k, cos, sin, position_ids=ids)
    gathered = lz.rope(q, k, cos[ids], sin[ids])
    for a, b, x in zip(via_ids, gathered, (q, k), strict=True):
        assert torch.equal(a, b)
        assert mismatch(a, rope_oracle(x, cos, sin, ids, False, "BHSD"), torch.float32) is None


# ============================================================================ sampling, default selection
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_greedy_equals_argmax(dtype):
    """k = 1, temperature 0 and a vanishing nucleus all return the first argmax of each row."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(16, 1000, generator=gen, dtype=torch.float64) * 3).to(dtype)
    first = logits.double().argmax(-1)  # numpy/torch argmax: first index of the maximum
    assert torch.equal(lz.sample_topk(logits, 1), first)  # k = 1, temperature 1
    assert torch.equal(lz.sample_topk(logits, 1, temperature=2.5, generator=gen), first)
    assert torch.equal(lz.sample_topk(logits, 50, temperature=0.0), first)
    assert torch.equal(lz.sample_topp(logits, 0.9, temperature=0.0), first)
    assert torch.equal(lz.sample_topp(logits, 1e-9, generator=gen), first)  # only the most probable survives


def _draws(fn, logits, arg, n_rows, seed, temperature=1.0):
    rows = logits.expand(n_rows, -1)
    return fn(rows, arg, temperature=temperature, generator=torch.Generator().manual_seed(seed))


def test_topk_never_draws_outside_the_top_k_and_matches_frequencies():
    """40k draws of a known distribution: only the top 3 appear, at their renormalized rates (5 sigma), also
    at temperature 2."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=torch.float64)
    logits = (p.log() + 2.0).float()[None]
    tokens = _draws(lz.sample_topk, logits, 3, 40_000, 0)
    assert set(tokens.tolist()) == {0, 1, 2}
    expected = torch.cat((p[:3] / p[:3].sum(), torch.zeros(3, dtype=torch.float64)))
    assert frequency_error(tokens, expected) is None, frequency_error(tokens, expected)
    # temperature 2 flattens: p^(1/2), renormalized over the top 3
    t2 = _draws(lz.sample_topk, logits, 3, 40_000, 1, temperature=2.0)
    flat = p[:3].sqrt() / p[:3].sqrt().sum()
    assert frequency_error(t2, torch.cat((flat, torch.zeros(3, dtype=torch.float64)))) is None


def test_topp_never_draws_outside_the_nucleus_and_matches_frequencies():
    """p = 0.7 over [0.4, 0.25, 0.15, 0.1, ...]: mass before token 2 is 0.65 < 0.7 so it stays; before token 3
    it is 0.8 >= 0.7 so the nucleus is tokens {0, 1, 2}, renormalized by 0.8."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=torch.float64)
    logits = (p.log() - 1.0).float()[None]
    tokens = _draws(lz.sample_topp, logits, 0.7, 40_000, 0)
    assert set(tokens.tolist()) == {0, 1, 2}
    expected = torch.cat((p[:3] / 0.8, torch.zeros(3, dtype=torch.float64)))
    assert frequency_error(tokens, expected) is None, frequency_error(tokens, expected)
    full = _draws(lz.sample_topp, logits, 1.0, 40_000, 1)
    assert frequency_error(full, p) is None, frequency_error(full, p)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_random_logits_stay_inside_allowed_sets_and_seed_repeats(dtype):
    """Random logits: tokens inside the oracle's top-k / nucleus sets; same seed repeats, another seed
    differs."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 500, generator=gen, dtype=torch.float64) * 4).to(dtype)
    for k in (1, 7, 100):
        a = lz.sample_topk(logits, k, temperature=0.8, generator=torch.Generator().manual_seed(k))
        b = lz.sample_topk(logits, k, temperature=0.8, generator=torch.Generator().manual_seed(k))
        assert torch.equal(a, b)
        assert topk_allowed(logits, k, 0.8).gather(1, a[:, None]).all()
    for top_p in (0.05, 0.5, 0.95):
        draws = torch.stack([lz.sample_topp(logits, top_p, generator=gen) for _ in range(20)], 1)
        assert topp_allowed(logits, top_p, 1.0).gather(1, draws).all()
    c = lz.sample_topk(logits, 500, generator=torch.Generator().manual_seed(9))
    d = lz.sample_topk(logits, 500, generator=torch.Generator().manual_seed(10))
    assert not torch.equal(c, d), "different seeds gave identical tokens for 64 rows of 500-way sampling"


# ============================================================================ sampling kernels, locked
SAMPLING = kernel_dtype_params(["sample_topk", "sample_topp"], "cpu")


@pytest.mark.parametrize(("op", "kernel_id", "dtype"), SAMPLING, ids=_ids)
def test_sampling_kernel_draws_inside_oracle_sets(op, kernel_id, dtype):
    """Locked sampling kernel on 200 seeded cases: tokens inside the oracle's sets; same seed repeats."""
    ran, failures = run_sampling_kernel(op, kernel_id, dtype)
    assert not failures, f"{kernel_id} {dname(dtype)}: {ran} cases\n" + "\n".join(failures[:12])
    assert ran >= MIN_CASES, f"{kernel_id} {dname(dtype)}: only {ran} cases ran"


@pytest.mark.parametrize(("op", "kernel_id"), sorted({(op, kid) for op, kid, _ in SAMPLING}))
def test_sampling_kernel_frequencies(op, kernel_id):
    """Locked sampling kernel: 40k draws match the renormalized top-3 probabilities (5 sigma)."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=torch.float64)
    lz.lock(op, kernel_id)
    arg, kept = (3, p[:3] / p[:3].sum()) if op == "sample_topk" else (0.7, p[:3] / 0.8)
    tokens = _draws(getattr(lz, op), p.log().float()[None], arg, 40_000, 5)
    expected = torch.cat((kept, torch.zeros(3, dtype=torch.float64)))
    assert frequency_error(tokens, expected) is None, frequency_error(tokens, expected)
