"""LayerZero's Triton kernels on a real GPU (``pytest -m gpu tests/gpu/test_gpu_triton.py``; < 60 s on an
H200).

- ``triton.rms_norm``, ``triton.rope`` and ``triton.qk_norm_rope`` locked with ``lz.lock`` on >= 200 seeded
  cases per dtype of ``tests/correctness/_shapes.py`` (odd hidden sizes / head dims, fused residual,
  mixed-precision weights, sliced rows, partial rotary, both pair styles, every cos/sin form, BHSD/BSHD, GQA)
  against float64 oracles. Outputs come from ``torch.empty``; before every case the CUDA caching allocator is
  filled with NaN blocks that are then freed, so an element a kernel forgets to write shows up as NaN against
  the oracle.
- rms_norm hidden sizes up to 65536 (the tiled path) and strided rows; rope on HF-style strided views.
- sampling: with given uniforms the token equals a float64 brute-force inverse CDF (vocab up to 151936, odd
  sizes); a chi-square test over 200k draws; k = 1 / tiny p / temperature 0; same seed -> same tokens.
- CUDA graphs: rms_norm (+ fused residual) and rope captured after ``lz.warmup`` replay equal to eager;
  ``lz.qk_norm_rope`` is chosen by default (``triton.qk_norm_rope``) and captures after one eager call.
Skipped with the backend's reason when triton is not usable here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from _shapes import MIN_CASES, kept_oracle, mismatch, run_kernel  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_usable")]
DEV = "cuda"
F64 = torch.float64
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _poison_allocator(nbytes: int = 64 << 20) -> None:
    """Fill freed cached blocks of several sizes with NaN so torch.empty hands out NaN memory."""
    blocks = [torch.full((n // 4,), float("nan"), device=DEV) for n in (nbytes, 1 << 20, 1 << 16, 4096, 512)]
    del blocks


# ----------------------------------------------------------------------------- seeded oracle runs


@pytest.mark.parametrize("op", ["rms_norm", "rope", "qk_norm_rope"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_seeded_cases_match_float64(op, dtype, monkeypatch):
    import _shapes

    make = _shapes.CALLS[op]

    def poisoned(seed, dt, device="cpu"):
        _poison_allocator(8 << 20)
        return make(seed, dt, device)

    monkeypatch.setitem(_shapes.CALLS, op, poisoned)
    run = run_kernel(op, f"triton.{op}", dtype, DEV)
    print(run.report())
    assert not run.failures, run.report()
    assert run.traced == run.ran and run.ran >= MIN_CASES, run.report()


def _rms64(x, w, eps):
    x = x.to(F64)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.to(F64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h", [8191, 8192, 8193, 16384, 32000, 65536])
def test_rms_norm_long_rows_and_strided_rows(dtype, h):
    gen = torch.Generator(device=DEV).manual_seed(h)
    x = torch.randn(5, 3, h + 16, device=DEV, dtype=dtype, generator=gen)[..., 8 : 8 + h]  # row stride h + 16
    r = torch.randn(5, 3, h, device=DEV, dtype=dtype, generator=gen)
    w = (1 + 0.3 * torch.randn(h, device=DEV, generator=gen)).to(dtype)
    lz.lock("rms_norm", "triton.rms_norm")
    try:
        _poison_allocator()
        y = lz.rms_norm(x, w, 1e-6)
        assert mismatch(y, _rms64(x, w, 1e-6), dtype, f"h={h}") is None
        _poison_allocator()
        y, s = lz.rms_norm(x, w, 1e-6, residual=r)
        torch.testing.assert_close(s, x + r, rtol=0, atol=0)  # torch adds in x's dtype the same way
        assert mismatch(y, _rms64(s, w, 1e-6), dtype, f"fused h={h}") is None
    finally:
        lz.unlock("rms_norm")


def test_rope_hf_strided_views():
    gen = torch.Generator(device=DEV).manual_seed(2)
    b, s, h, d = 3, 37, 8, 128
    proj = torch.randn(b, s, 3 * h * d, device=DEV, dtype=torch.bfloat16, generator=gen)
    q = proj[..., : h * d].unflatten(-1, (h, d)).transpose(1, 2)  # BHSD view of fused-QKV memory
    k = proj[..., h * d : 2 * h * d].unflatten(-1, (h, d)).transpose(1, 2)
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=F64, device=DEV) / d)
    ang = torch.arange(4096, dtype=F64, device=DEV)[:, None] * inv
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).float(), torch.cat((ang.sin(), ang.sin()), -1).float()
    ids = torch.randint(0, 4096, (b, s), device=DEV, generator=gen)
    lz.lock("rope", "triton.rope")
    try:
        qo, ko = lz.rope(q, k, cos, sin, position_ids=ids)
    finally:
        lz.unlock("rope")
    c, sn = cos[ids].to(F64)[:, None], sin[ids].to(F64)[:, None]
    for x, o in ((q, qo), (k, ko)):
        x64 = x.to(F64)
        ref = x64 * c + torch.cat((-x64[..., d // 2 :], x64[..., : d // 2]), -1) * sn
        assert mismatch(o, ref, torch.bfloat16) is None


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize(
    ("vocab", "k", "p", "temperature"),
    [
        (151936, 50, None, 0.7),
        (151936, None, 0.9, 1.0),
        (151936, None, 1.0, 1.0),
        (32001, 1000, None, 1.3),
        (50257, None, 0.5, 0.6),
        (7, 3, None, 1.0),
        (1, 4, None, 1.0),
        (129, None, 0.99, 2.0),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_draw_with_given_u_equals_float64_inverse_cdf(vocab, k, p, temperature, dtype):
    from layerzero.backends.triton import sampling

    gen = torch.Generator(device=DEV).manual_seed(vocab + (k or 0))
    rows = 16
    logits = (torch.randn(rows, vocab, device=DEV, generator=gen) * 4).to(dtype)
    u = torch.rand(rows, device=DEV, generator=gen)
    tokens = sampling.draw(logits, u, k=k, p=p, temperature=temperature).cpu()
    for row in range(rows):
        order, kept = kept_oracle(logits[row], temperature, k, p)
        cum = torch.cumsum(kept, 0)
        uu = float(u[row])
        want = int(order[int((cum > uu).nonzero()[0])]) if bool((cum > uu).any()) else int(order[-1])
        got = int(tokens[row])
        if got != want:
            # allowed only at a float32 rounding boundary, or between tokens with equal logits (half
            # precision)
            if got not in order.tolist():  # top-k: torch.topk may break a tie at the k-th place differently
                assert bool(logits[row, got] == logits[row, int(order[-1])]), (
                    f"row {row}: {got} outside the kept set"
                )
                continue
            near = float((cum - uu).abs().min()) < 1e-4  # float32 sums over up to 151936 terms
            tie = bool(logits[row, got] == logits[row, want])
            assert near or tie, f"row {row}: kernel {got}, oracle {want}"


@pytest.mark.parametrize(("op", "arg"), [("sample_topk", 5), ("sample_topp", 0.8), ("sample_topk", 100)])
def test_chi_square_over_many_draws(op, arg):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.5, -1.0, -3.0, -4.0], device=DEV)
    n = 200_000
    lz.lock(op, f"triton.{op}")
    try:
        tokens = getattr(lz, op)(
            logits.expand(n, -1).contiguous(),
            arg,
            temperature=0.8,
            generator=torch.Generator(device=DEV).manual_seed(3),
        ).cpu()
    finally:
        lz.unlock(op)
    order, kept = kept_oracle(logits, 0.8, **({"k": arg} if op == "sample_topk" else {"p": arg}))
    counts = torch.bincount(tokens, minlength=9).to(F64)
    outside = [t for t in range(9) if t not in order.tolist()]
    assert counts[outside].sum() == 0
    expected = kept * n
    chi2 = float(((counts[order] - expected) ** 2 / expected).sum())
    # chi-square quantiles at 1 - 1e-5 (computed with torch.special.gammaincc)
    crit = {1: 19.51, 2: 23.03, 3: 25.9, 4: 28.47, 5: 30.86, 6: 33.11, 7: 35.26, 8: 37.33}[len(order) - 1]
    assert chi2 < crit, (chi2, counts.tolist(), expected.tolist())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_edges_and_seed_reproducibility(dtype):
    logits = torch.full((3, 151936), -2.0, device=DEV, dtype=dtype)
    logits[0, [17, 90001]] = 5.0  # tie: the first index wins
    logits[1, 151935] = 3.0
    logits[2, 0] = 1.0
    first = torch.tensor([17, 151935, 0], device=DEV)
    for op in ("sample_topk", "sample_topp"):
        lz.lock(op, f"triton.{op}")
    try:
        gen = torch.Generator(device=DEV).manual_seed(0)
        assert torch.equal(lz.sample_topk(logits, 40, temperature=0.0, generator=gen), first)
        assert torch.equal(lz.sample_topk(logits, 1, generator=gen), first)
        assert torch.equal(lz.sample_topp(logits, 1e-9, generator=gen), first)
        assert torch.equal(lz.sample_topp(logits, 0.9, temperature=0.0), first)
        noisy = torch.randn(8, 151936, device=DEV, generator=gen).to(dtype)
        for op, arg in (("sample_topk", 50), ("sample_topp", 0.95), ("sample_topk", 151936)):
            a = getattr(lz, op)(noisy, arg, generator=torch.Generator(device=DEV).manual_seed(9))
            b = getattr(lz, op)(noisy, arg, generator=torch.Generator(device=DEV).manual_seed(9))
            assert torch.equal(a, b), op
    finally:
        lz.unlock("sample_topk")
        lz.unlock("sample_topp")


# ----------------------------------------------------------------------------- CUDA graphs


def test_rms_norm_and_rope_capture_after_warmup():
    gen = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(4, 64, 4096, device=DEV, dtype=torch.bfloat16, generator=gen)
    r = torch.randn_like(x)
    w = torch.randn(4096, device=DEV, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(4, 32, 64, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(4, 8, 64, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
    cos, sin = torch.rand(4096, 128, device=DEV), torch.rand(4096, 128, device=DEV)
    ids = torch.randint(0, 4096, (4, 64), device=DEV, generator=gen)
    lz.lock("rms_norm", "triton.rms_norm")
    lz.lock("rope", "triton.rope")
    try:
        lz.warmup("rms_norm", [((x, w), {}), ((x, w), {"residual": r})])
        lz.warmup("rope", [((q, k, cos, sin), {"position_ids": ids})])

        def step(x, r, w, q, k, cos, sin, ids):
            y, h = lz.rms_norm(x, w, residual=r)
            return y, h, lz.rope(q, k, cos, sin, position_ids=ids)

        check = lz.validate_graph_capture(step, x, r, w, q, k, cos, sin, ids)
        assert check.ok and check.max_error == 0.0, str(check)
        assert {"rms_norm:triton.rms_norm", "rope:triton.rope"} <= set(check.kernels)
    finally:
        lz.unlock("rms_norm")
        lz.unlock("rope")


def test_qk_norm_rope_is_the_default_and_captures():
    """Qwen3's decode shape (one token, 16 q / 8 k heads of 128 as views of a fused projection, BSHD, a bf16
    table with position ids): default selection takes the fused kernel, whose output equals the float64 oracle
    and, replayed from a CUDA graph after one eager call, eager's bits."""
    import _shapes

    gen = torch.Generator(device=DEV).manual_seed(9)
    qkv = torch.randn(1, 3, 16 + 8 + 8, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
    q, k = qkv[:, :, :16], qkv[:, :, 16:24]
    qw, kw = (
        (torch.rand(128, device=DEV, generator=gen) + 0.5).bfloat16(),
        torch.rand(128, device=DEV).bfloat16(),
    )
    ang = torch.arange(4096, device=DEV)[:, None] * torch.rand(64, device=DEV, generator=gen)[None]
    cos, sin = (
        torch.cat((ang.cos(), ang.cos()), -1).bfloat16(),
        torch.cat((ang.sin(), ang.sin()), -1).bfloat16(),
    )
    ids = torch.tensor([[7, 4000, 123]], device=DEV)
    assert (
        lz.which("qk_norm_rope", q, k, qw, kw, cos, sin, position_ids=ids, layout="BSHD")
        == "triton.qk_norm_rope"
    )
    eager = lz.qk_norm_rope(q, k, qw, kw, cos, sin, eps=1e-6, position_ids=ids, layout="BSHD")
    for got, x, w in zip(eager, (q, k), (qw, kw), strict=True):
        x64 = x.double()
        normed = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6) * w.double()
        want = _shapes.rope_oracle(normed, cos, sin, ids, False, "BSHD")
        assert mismatch(got, want, torch.bfloat16) is None

    def step(q, k, qw, kw, cos, sin, ids):
        return lz.qk_norm_rope(q, k, qw, kw, cos, sin, eps=1e-6, position_ids=ids, layout="BSHD")

    check = lz.validate_graph_capture(step, q, k, qw, kw, cos, sin, ids)
    assert check.ok and check.max_error == 0.0, str(check)
    assert "qk_norm_rope:triton.qk_norm_rope" in set(check.kernels)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(1, 16, 8, 128), (3, 16, 8, 128), (37, 6, 3, 40)], ids=str)
def test_qk_norm_rope_cache_is_the_default_and_matches_float64(dtype, layout, t, hq, hkv, d):
    """``triton.qk_norm_rope_cache`` chosen by default (``rope.CACHE_PRIORITY``); its outputs against the
    float64 oracle of the correctness file, the cache holding exactly the returned k and v at the slots, -1
    slots and every other slot untouched; captured in a graph, it replays what it computes eagerly."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
    from test_qk_norm_rope_cache import case, check

    args = [a.cuda() for a in case(dtype, t, hq, hkv, d, seed=t + d, layout=layout, blocks=8, page=16)]
    q, k, v, qw, kw, cos, sin, pos, slots, cache = args
    before = cache.clone()
    assert (
        lz.which(
            "qk_norm_rope_cache", q, k, v, qw, kw, cos, sin, cache, slots, position_ids=pos, kv_layout=layout
        )
        == "triton.qk_norm_rope_cache"
    )
    out = lz.qk_norm_rope_cache(q, k, v, qw, kw, cos, sin, cache, slots, position_ids=pos, kv_layout=layout)
    check([o.cpu() for o in out], [a.cpu() for a in args], layout, before.cpu())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gq, gk = lz.qk_norm_rope_cache(
            q, k, v, qw, kw, cos, sin, cache, slots, position_ids=pos, kv_layout=layout
        )
    cache.copy_(before)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gq, out[0]) and torch.equal(gk, out[1])
    check([gq.cpu(), gk.cpu()], [a.cpu() for a in args], layout, before.cpu())
