"""flex_attention.attention (CPU, eager) against the float64 einsum oracle of ``_shapes``.

- >= 200 seeded cases per dtype (float32, bfloat16) of small shapes built for flex: GQA ratios 1/2/4, causal
  with Sq != Sk (top-left), bool and float masks of every broadcast form (with fully masked rows), mask AND
  causal together (which SDPA refuses), custom scale, BHSD/BSHD; the op locked to the kernel with ``lz.lock``.
- the dynamo-free eager call (``direct_eager``) gives exactly what torch's public eager ``flex_attention``
  gives.
- hand-worked: Sq=2, Sk=3 causal with q = 0 -> uniform weights over the visible keys.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import attention_oracle, make_mask, mismatch, randn  # noqa: E402

pytestmark = pytest.mark.correctness

KERNEL = "flex_attention.attention"
CASES = 220


def flex_case(seed: int, dtype: torch.dtype):
    """A small seeded case: ``(q, k, v, kwargs, description)``; shapes drawn from a few values so the suite
    stays fast (every kernel call is a few ms)."""
    rng = random.Random(seed * 6007 + 1)
    gen = torch.Generator().manual_seed(seed)
    b, hkv = rng.randint(1, 2), rng.randint(1, 2)
    hq = hkv * rng.choice((1, 2, 4))
    d = rng.choice((8, 16, 24, 32))
    dv = d if rng.random() < 0.85 else rng.choice((8, 16))
    sq, sk = rng.choice((1, 2, 5, 13, 32)), rng.choice((1, 3, 7, 16, 33))
    if rng.random() < 0.3:
        sk = sq
    mask_kind = rng.choice(("none", "none", "bool", "float"))
    causal = rng.random() < 0.5
    form = rng.choice(("SS", "B1SS", "1HSS", "BHSS"))
    dead = mask_kind != "none" and rng.random() < 0.25
    scale = None if rng.random() < 0.7 else rng.uniform(0.05, 0.5)
    layout = rng.choice(("BHSD", "BHSD", "BSHD"))
    shapes = ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv))
    q, k, v = (randn(s, gen, "cpu", dtype) for s in shapes)
    mask = make_mask(mask_kind, form, dead, b, hq, sq, sk, gen, "cpu", dtype)
    if layout == "BSHD":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    kw = {"attn_mask": mask, "is_causal": causal, "scale": scale, "layout": layout}
    what = (
        f"seed={seed} b={b} hq={hq} hkv={hkv} sq={sq} sk={sk} d={d} dv={dv} mask={mask_kind}/{form} "
        f"dead={dead} causal={causal} scale={scale} {layout}"
    )
    return q, k, v, kw, what


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_flex_matches_float64_oracle(dtype):
    failures, ran, combos = [], 0, set()
    lz.lock("attention", KERNEL)
    try:
        with lz.trace() as tr:
            for seed in range(CASES):
                q, k, v, kw, what = flex_case(seed, dtype)
                assert lz.validate(KERNEL, "attention", q, k, v, **kw) == [], what
                out = lz.attention(q, k, v, **kw)
                ran += 1
                combos.add(
                    (
                        kw["attn_mask"] is not None and kw["attn_mask"].dtype == torch.bool,
                        kw["attn_mask"] is not None,
                        kw["is_causal"],
                        q.shape[1] != k.shape[1],
                    )
                )
                ref = attention_oracle(q, k, v, kw["attn_mask"], kw["is_causal"], kw["scale"], kw["layout"])
                msg = mismatch(out, ref, dtype, what)
                if msg:
                    failures.append(msg)
    finally:
        lz.unlock("attention")
    assert not failures, "\n".join(failures[:10])
    assert ran >= 200 and tr.counts[("attention", KERNEL)] == ran
    # bool+causal, float+causal, causal GQA and plain GQA all occurred
    assert {(True, True, True), (False, True, True)} <= {c[:3] for c in combos}
    assert any(c[2] and c[3] for c in combos) and any(not c[1] and c[3] for c in combos)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_direct_eager_equals_public_flex():
    """The dynamo-free call must give exactly what torch's public eager flex_attention gives."""
    import torch.nn.attention.flex_attention as fmod

    from layerzero.backends.flex_attention.kernels import FlexAttention, direct_eager

    eager = direct_eager(fmod)
    assert eager is not None
    direct = FlexAttention(
        fmod.flex_attention, fmod.create_block_mask, fmod.BlockMask, compiled=False, eager=eager
    )
    public = FlexAttention(fmod.flex_attention, fmod.create_block_mask, fmod.BlockMask, compiled=False)
    for seed in (1, 2, 3, 5, 8):
        q, k, v, kw, what = flex_case(seed, torch.float32)
        if kw["layout"] == "BSHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        args = (q, k, v, kw["attn_mask"], kw["is_causal"], kw["scale"], 0.0)
        assert torch.equal(direct(*args), public(*args)), what


def test_causal_top_left_hand_worked():
    """Sq=2, Sk=3, causal, q = 0: query 0 sees key 0 only, query 1 keys 0 and 1 -> out = [v0, (v0 + v1) /
    2]."""
    q = torch.zeros(1, 1, 2, 8)
    k = torch.randn(1, 1, 3, 8)
    v = torch.tensor([1.0, 3.0, 100.0]).view(1, 1, 3, 1).expand(1, 1, 3, 8).contiguous()
    lz.lock("attention", KERNEL)
    out = lz.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[0, 0, :, 0], torch.tensor([1.0, 2.0]))


def test_gqa_head_mapping():
    """GQA: KV head j serves query heads j*G..(j+1)*G-1 (G = Hq/Hkv): with Hkv=2, Hq=4 and q=0, heads 0-1
    average v[0] and heads 2-3 average v[1]."""
    q = torch.zeros(1, 4, 3, 16)
    k = torch.randn(1, 2, 5, 16)
    v = torch.stack([torch.full((5, 16), 1.0), torch.full((5, 16), 7.0)]).unsqueeze(0)
    lz.lock("attention", KERNEL)
    out = lz.attention(q, k, v)
    assert torch.allclose(out[0, :2], torch.ones(2, 3, 16)) and torch.allclose(
        out[0, 2:], torch.full((2, 3, 16), 7.0)
    )


def test_mask_and_causal_fully_masked_row_is_zero():
    """Mask AND causal: query 0 sees key 0 only, which the mask removes -> row 0 is fully masked -> 0."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (
        randn((1, 2, 4, 16), gen, "cpu", torch.float32),
        randn((1, 2, 6, 16), gen, "cpu", torch.float32),
        randn((1, 2, 6, 16), gen, "cpu", torch.float32),
    )
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, 0] = False
    lz.lock("attention", KERNEL)
    out = lz.attention(q, k, v, attn_mask=mask, is_causal=True)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert mismatch(out, attention_oracle(q, k, v, mask, True), torch.float32) is None
