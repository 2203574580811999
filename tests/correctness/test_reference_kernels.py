"""Reference kernels against independent oracles: explicit float64 loops, torch SDPA (math) in float64,
torch.nn.functional norms, transformers' Llama RoPE, Meta's complex-number RoPE, and sampling statistics."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from layerzero.backends.reference.kernels import (
    attention,
    layer_norm,
    rms_norm,
    rope,
    sample_topk,
    sample_topp,
)
from layerzero.core.errors import InvalidInputError

pytestmark = pytest.mark.correctness

F64 = torch.float64


# =============================================================================================
# attention


def loop_attention(q, k, v, bool_mask=None, float_mask=None, causal=False, scale=None):
    """Per-head float64 einsum oracle, BHSD. A row with no visible key (or only -inf scores) outputs 0."""
    b_, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    bm = None if bool_mask is None else bool_mask.expand(b_, hq, sq, sk)
    fm = None if float_mask is None else float_mask.to(F64).expand(b_, hq, sq, sk)
    out = torch.zeros(b_, hq, sq, dv, dtype=F64)
    for b in range(b_):
        for h in range(hq):
            kh, vh = k[b, h // group].to(F64), v[b, h // group].to(F64)
            scores = torch.einsum("id,jd->ij", q[b, h].to(F64), kh) * scale
            if fm is not None:
                scores = scores + fm[b, h]
            vis = torch.ones(sq, sk, dtype=torch.bool)
            if causal:  # top-left: key j visible to query i iff j <= i
                vis &= torch.arange(sk)[None, :] <= torch.arange(sq)[:, None]
            if bm is not None:
                vis &= bm[b, h]
            scores = scores.masked_fill(~vis, float("-inf"))
            dead = torch.isneginf(scores).all(-1, keepdim=True)  # nothing visible -> output row 0
            w = torch.exp(scores - torch.where(dead, 0.0, scores.max(-1, keepdim=True).values))
            rows = (w / torch.where(dead, 1.0, w.sum(-1, keepdim=True))) @ vh
            out[b, h] = torch.where(dead, 0.0, rows)
    return out


def _make_case(seed: int):
    rng = random.Random(seed)
    big = seed % 40 == 0
    batch = 1 if big else rng.randint(1, 3)
    hkv = rng.randint(1, 2 if big else 3)
    hq = hkv * rng.choice([1, 1, 2, 3, 4])
    d = rng.choice([8, 16, 21, 32, 64, 72, 80, 96, 128, 203, 256])
    dv = d if rng.random() < 0.8 else rng.choice([8, 21, 72])
    sq = rng.randint(100, 587) if big else rng.choice([1, 1, 2, rng.randint(1, 40)])
    sk = rng.randint(100, 587) if big else rng.randint(1, 48)
    mask_kind = rng.choice(["none", "bool", "float", "causal", "causal+bool", "bool3d"])
    layout = rng.choice(["BHSD", "BSHD"])
    dtype = rng.choice([F64, F64, torch.float32])
    scale = rng.choice([None, None, 0.3])
    return batch, hq, hkv, sq, sk, d, dv, mask_kind, layout, dtype, scale


ATTN_SEEDS = list(range(220))


@pytest.mark.parametrize("seed", ATTN_SEEDS)
def test_attention_random_vs_loop_and_sdpa(seed):
    batch, hq, hkv, sq, sk, d, dv, mask_kind, layout, dtype, scale = _make_case(seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, sq, d, generator=g, dtype=F64)
    k = torch.randn(batch, hkv, sk, d, generator=g, dtype=F64)
    v = torch.randn(batch, hkv, sk, dv, generator=g, dtype=F64)
    bool_mask = float_mask = None
    causal = mask_kind.startswith("causal")
    if "bool" in mask_kind:
        shape = (batch, hq, sq, sk) if mask_kind == "bool3d" else (sq, sk)
        bool_mask = torch.rand(shape, generator=g) < 0.7
        bool_mask[..., 0] = True  # every row keeps key 0 (dead rows have their own test)
    if mask_kind == "float":
        float_mask = torch.randn(1, hq, sq, sk, generator=g, dtype=F64)
    expected = loop_attention(q, k, v, bool_mask, float_mask, causal, scale)

    mask = bool_mask if bool_mask is not None else float_mask
    qi, ki, vi = (t.to(dtype) for t in (q, k, v))
    if layout == "BSHD":
        qi, ki, vi = (t.transpose(1, 2).contiguous() for t in (qi, ki, vi))
    got = attention(qi, ki, vi, attn_mask=mask, is_causal=causal, scale=scale, layout=layout)
    assert got.dtype == dtype
    if layout == "BSHD":
        got = got.transpose(1, 2)
    tol = 1e-10 if dtype == F64 else 2e-5
    torch.testing.assert_close(got.to(F64), expected, atol=tol, rtol=tol)

    # torch SDPA (math) in float64: it cannot take a mask and is_causal together, so fold causal in.
    sdpa_mask = mask
    if causal:
        tri = torch.ones(sq, sk, dtype=torch.bool).tril()
        sdpa_mask = tri if bool_mask is None else (tri & bool_mask)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=scale, enable_gqa=hq != hkv)
    torch.testing.assert_close(got.to(F64), ref, atol=tol, rtol=tol)


def test_attention_hand_worked_2x2():
    e = math.e
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=F64)
    k = q.clone()
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]], dtype=F64)
    # row 0 scores [1, 0] -> weights [e, 1]/(e+1); row 1 scores [0, 1] -> [1, e]/(e+1)
    expected = torch.tensor([[(e + 3) / (e + 1), (2 * e + 4) / (e + 1)],
                             [(1 + 3 * e) / (1 + e), (2 + 4 * e) / (1 + e)]], dtype=F64)  # fmt: skip
    torch.testing.assert_close(attention(q, k, v, scale=1.0)[0, 0], expected, atol=1e-14, rtol=0)
    causal = attention(q, k, v, scale=1.0, is_causal=True)[0, 0]
    torch.testing.assert_close(causal, torch.stack([v[0, 0, 0], expected[1]]), atol=1e-14, rtol=0)


def test_attention_causal_is_top_left_when_sq_ne_sk():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, s, 8, generator=g, dtype=F64) for s in (3, 5, 5))
    out = attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[0, :, 0], v[0, :, 0])  # query 0 sees key 0 only
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref)
    # more queries than keys: rows >= Sk see every key
    q2 = torch.randn(1, 2, 7, 8, generator=g, dtype=F64)
    out2 = attention(q2, k[:, :, :4], v[:, :, :4], is_causal=True)
    torch.testing.assert_close(out2[:, :, 3:], attention(q2[:, :, 3:], k[:, :, :4], v[:, :, :4]))


def test_attention_fully_masked_rows_are_zero():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g, dtype=F64) for _ in range(3))
    bmask = torch.ones(4, 4, dtype=torch.bool)
    bmask[1] = False
    fmask = torch.zeros(4, 4, dtype=F64)
    fmask[2] = float("-inf")
    for kwargs, dead in (({"attn_mask": bmask}, 1), ({"attn_mask": fmask}, 2)):
        out = attention(q, k, v, **kwargs)
        assert torch.isfinite(out).all()
        assert torch.equal(out[:, :, dead], torch.zeros(2, 2, 8, dtype=F64))
        live = [i for i in range(4) if i != dead]
        torch.testing.assert_close(out[:, :, live], attention(q[:, :, live], k, v))
    # causal + mask hiding key 0 leaves query 0 with nothing
    hide0 = torch.ones(4, 4, dtype=torch.bool)
    hide0[:, 0] = False
    out = attention(q, k, v, attn_mask=hide0, is_causal=True)
    assert torch.equal(out[:, :, 0], torch.zeros(2, 2, 8, dtype=F64))
    torch.testing.assert_close(out, loop_attention(q, k, v, bool_mask=hide0, causal=True), atol=1e-12, rtol=0)


def test_attention_low_precision_returns_input_dtype():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 9, 72, generator=g).to(torch.bfloat16) for _ in range(3))
    out = attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    expected = loop_attention(q, k, v, causal=True)  # from the same bf16 values, in float64
    torch.testing.assert_close(out.to(F64), expected, atol=1e-2, rtol=1e-2)


def test_attention_dropout_matches_explicit_keep_mask():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=F64) for _ in range(3))
    p = 0.4
    out = attention(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(7))
    keep = torch.rand((1, 2, 5, 5), generator=torch.Generator().manual_seed(7), dtype=F64) >= p
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1)
    torch.testing.assert_close(out, (probs * keep / (1 - p)) @ v)
    again = attention(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(7))
    assert torch.equal(out, again)
    assert not torch.equal(out, attention(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(8)))
    assert torch.equal(attention(q, k, v, dropout_p=1.0), torch.zeros_like(out))


def test_attention_bad_layout():
    x = torch.randn(1, 1, 2, 4)
    with pytest.raises(InvalidInputError, match=r"layout: expected one of \['BHSD', 'BSHD'\], got 'NHD'"):
        attention(x, x, x, layout="NHD")


# =============================================================================================
# norms

NORM_SHAPES = [(1, 5), (3, 123), (2, 7, 64), (4, 4097)]
LOW = [torch.float32, torch.bfloat16, torch.float16]


def rms_f64(x, w, eps):
    x = x.to(F64)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.to(F64)


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("dtype", [F64, *LOW])
def test_rms_norm_vs_float64_formula(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g, dtype=F64) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g, dtype=F64).to(dtype)
    y = rms_norm(x, w, eps=1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    tol = {F64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.to(F64), rms_f64(x, w, 1e-6), atol=tol, rtol=tol)
    if dtype == torch.float32:
        torch.testing.assert_close(y, F.rms_norm(x, (shape[-1],), w, eps=1e-6))


@pytest.mark.parametrize("dtype", LOW)
def test_rms_norm_matches_hf_llama(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 11, 96, generator=g).to(dtype)
    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=g))
        expected = hf(x)
    assert torch.equal(rms_norm(x, hf.weight.detach(), eps=1e-5, cast_before_weight=True), expected)
    if dtype == torch.float32:  # both orders are bitwise HF in float32
        assert torch.equal(rms_norm(x, hf.weight.detach(), eps=1e-5), expected)


def test_rms_norm_hand_worked_and_fused_residual():
    y = rms_norm(torch.tensor([[3.0, 4.0]], dtype=F64), torch.tensor([1.0, 2.0], dtype=F64), eps=0.0)
    r = math.sqrt(12.5)  # sqrt((9 + 16) / 2)
    torch.testing.assert_close(y, torch.tensor([[3 / r, 8 / r]], dtype=F64), atol=1e-15, rtol=0)
    g = torch.Generator().manual_seed(6)
    x, res = (torch.randn(2, 5, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(32, generator=g).to(torch.bfloat16)
    y, h = rms_norm(x, w, eps=1e-6, residual=res)
    assert h.dtype == torch.bfloat16 and torch.equal(h, x + res)  # sum rounded to the input dtype
    assert torch.equal(y, rms_norm(x + res, w, eps=1e-6))


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("dtype", [F64, *LOW])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_vs_float64_and_torch(shape, dtype, with_bias):
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (torch.randn(shape, generator=g, dtype=F64) * 2 + 1).to(dtype)
    w = torch.randn(shape[-1], generator=g, dtype=F64).to(dtype)
    b = torch.randn(shape[-1], generator=g, dtype=F64).to(dtype) if with_bias else None
    y = layer_norm(x, w, b, eps=1e-5)
    assert y.dtype == dtype
    x64 = x.to(F64)
    mu = x64.mean(-1, keepdim=True)
    var = ((x64 - mu) ** 2).mean(-1, keepdim=True)  # biased, like nn.LayerNorm
    expected = (x64 - mu) / torch.sqrt(var + 1e-5) * w.to(F64) + (0 if b is None else b.to(F64))
    tol = {F64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(y.to(F64), expected, atol=tol, rtol=tol)
    ref = F.layer_norm(x64, (shape[-1],), w.to(F64), None if b is None else b.to(F64), eps=1e-5)
    torch.testing.assert_close(y.to(F64), ref, atol=tol, rtol=tol)


def test_layer_norm_hand_worked():
    y = layer_norm(torch.tensor([[1.0, 3.0]], dtype=F64), torch.tensor([2.0, 2.0], dtype=F64),
                   torch.tensor([0.5, 0.5], dtype=F64), eps=0.0)  # fmt: skip
    assert torch.equal(y, torch.tensor([[-1.5, 2.5]], dtype=F64))  # mean 2, var 1 -> [-1, 1] * 2 + 0.5


# =============================================================================================
# rope


def hf_rotary(head_dim, max_pos=64):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_pos)  # fmt: skip
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_matches_transformers_llama(layout, head_dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(head_dim)
    b, s = 2, 13
    q = torch.randn(b, 4, s, head_dim, generator=g)
    k = torch.randn(b, 2, s, head_dim, generator=g)  # GQA: fewer kv heads
    pos = torch.randint(0, 64, (b, s), generator=g)
    emb = hf_rotary(head_dim)
    cos, sin = emb(q, pos)  # [B, S, D], HF layout cat(f, f)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    table_cos, table_sin = (t[0] for t in emb(q, torch.arange(64)[None]))  # [max_pos, D]
    if layout == "BSHD":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        hf_q, hf_k = hf_q.transpose(1, 2), hf_k.transpose(1, 2)
    for kwargs in ({"cos": cos, "sin": sin}, {"cos": table_cos, "sin": table_sin, "position_ids": pos}):
        got_q, got_k = rope(q, k, layout=layout, **kwargs)
        assert torch.equal(got_q, hf_q) and torch.equal(got_k, hf_k)  # bit-exact in float32
    # [S, R] table with position_ids=None means positions 0..S-1
    got_q, _ = rope(q, k, table_cos[:s], table_sin[:s], layout=layout)
    ar = torch.arange(s)[None].expand(b, s)
    ref_q, _ = rope(q, k, table_cos, table_sin, position_ids=ar, layout=layout)
    assert torch.equal(got_q, ref_q)


def test_rope_hand_worked_90_degrees():
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=F64)  # one head, 2 positions, one pair
    cos, sin = torch.zeros(2, 2, dtype=F64), torch.ones(2, 2, dtype=F64)  # angle pi/2 at every position
    out, _ = rope(q, q, cos, sin)
    assert torch.equal(out, torch.tensor([[[[0.0, 1.0], [-1.0, 0.0]]]], dtype=F64))
    out_i, _ = rope(q, q, cos, sin, interleaved=True)  # with one pair both layouts agree
    assert torch.equal(out_i, out)


def meta_complex_rope(x_bshd, positions, inv_freq):
    """Meta Llama's ``apply_rotary_emb``: rotate consecutive pairs as complex numbers."""
    freqs = torch.outer(positions.to(F64), inv_freq.to(F64))  # [S, R/2]
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    xc = torch.view_as_complex(x_bshd.to(F64).reshape(*x_bshd.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)


@pytest.mark.parametrize("rot_dim", [8, 32])
def test_rope_interleaved_vs_complex_oracle_and_partial(rot_dim):
    g = torch.Generator().manual_seed(rot_dim)
    b, s, h, d = 2, 9, 3, 32
    q = torch.randn(b, s, h, d, generator=g, dtype=F64)
    k = torch.randn(b, s, 1, d, generator=g, dtype=F64)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=F64) / rot_dim))
    pos = torch.arange(s, dtype=F64)
    ang = torch.outer(pos, inv_freq)
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)  # [S, R]
    got_q, got_k = rope(q, k, cos, sin, interleaved=True, layout="BSHD")
    for x, got in ((q, got_q), (k, got_k)):
        torch.testing.assert_close(got[..., :rot_dim], meta_complex_rope(x[..., :rot_dim], pos, inv_freq),
                                   atol=1e-12, rtol=0)  # fmt: skip
        assert torch.equal(got[..., rot_dim:], x[..., rot_dim:])  # partial rotary: pass-through
    # half-rotation partial rotary == full rotation of the first R dims (GPT-NeoX rotary_pct)
    cos_h, sin_h = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    half_q, _ = rope(q, k, cos_h, sin_h, layout="BSHD")
    full_q, _ = rope(
        q[..., :rot_dim].contiguous(), k[..., :rot_dim].contiguous(), cos_h, sin_h, layout="BSHD"
    )
    assert torch.equal(half_q[..., :rot_dim], full_q) and torch.equal(half_q[..., rot_dim:], q[..., rot_dim:])


def test_rope_low_precision_and_errors():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 5, 16, generator=g)
    ang = torch.outer(torch.arange(5.0), 1.0 / (10000.0 ** (torch.arange(0, 16, 2) / 16)))
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    out_bf, _ = rope(q.bfloat16(), q.bfloat16(), cos, sin)
    assert out_bf.dtype == torch.bfloat16
    ref, _ = rope(q.bfloat16().double(), q.double(), cos.double(), sin.double())
    torch.testing.assert_close(out_bf.double(), ref, atol=2e-2, rtol=1e-2)
    gathered = cos[None].expand(1, 5, 16)
    with pytest.raises(
        InvalidInputError, match=r"position_ids with an already gathered cos.*expected position_ids=None"
    ):
        rope(q, q, gathered, gathered, position_ids=torch.zeros(1, 5, dtype=torch.int64))
    with pytest.raises(InvalidInputError, match="layout: expected one of"):
        rope(q, q, cos, sin, layout="SBHD")


# =============================================================================================
# sampling

CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32, 9: 27.88}  # 99.9% quantiles


def chi2(tokens, probs):
    """Pearson chi-square of drawn ``tokens`` against ``probs`` [V] (zero-probability tokens must not
    occur)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).to(F64)
    n = tokens.numel()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the support was drawn"
    exp = probs[support] * n
    return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1


LOGITS = torch.tensor([2.0, 1.5, 0.2, -0.3, 1.0, -1.0, 0.7, 0.0, -2.0, 0.4], dtype=F64)  # no ties


def test_topk_k1_and_temperature0_are_argmax():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(64, 1000, generator=g)
    best = logits.argmax(-1)
    assert torch.equal(sample_topk(logits, 1, generator=g), best)
    assert torch.equal(sample_topk(logits, 50, temperature=0.0), best)
    assert torch.equal(sample_topp(logits, 0.9, temperature=0.0), best)
    assert sample_topk(logits.bfloat16(), 5, generator=g).dtype == torch.int64


@pytest.mark.parametrize(("k", "temperature"), [(3, 1.0), (5, 0.7), (10, 2.0), (50, 1.0)])
def test_topk_distribution_chi_square(k, temperature):
    n = 20_000
    draws = sample_topk(
        LOGITS.expand(n, -1), k, temperature=temperature, generator=torch.Generator().manual_seed(k)
    )
    assert draws.shape == (n,) and draws.dtype == torch.int64
    p = torch.softmax(LOGITS / temperature, -1)
    top = torch.topk(p, min(k, 10)).indices
    target = torch.zeros_like(p)
    target[top] = p[top] / p[top].sum()  # renormalized top-k distribution, k >= V -> the full softmax
    stat, dof = chi2(draws, target)
    assert stat < CHI2_999[dof], (stat, dof)
    if k < 10:  # the statistic does detect a wrong distribution (the untruncated one)
        assert set(draws.unique().tolist()) <= set(top.tolist())


@pytest.mark.parametrize(("p", "kept"), [(0.3, 1), (0.5, 2), (0.65, 3), (0.85, 6), (0.96, 8), (1.0, 10)])
def test_topp_nucleus_and_chi_square(p, kept):
    n = 20_000
    probs = torch.softmax(LOGITS, -1)
    order = torch.argsort(probs, descending=True)
    cum = torch.cumsum(probs[order], 0)
    # brute force: smallest prefix whose mass reaches p
    size = next(i + 1 for i in range(10) if cum[i] >= p) if p < 1.0 else 10
    assert size == kept  # the parametrization really exercises 1, 2, 3, 6, 8 and all tokens
    nucleus = order[:size]
    target = torch.zeros_like(probs)
    target[nucleus] = probs[nucleus] / probs[nucleus].sum()
    draws = sample_topp(LOGITS.expand(n, -1), p, generator=torch.Generator().manual_seed(int(p * 100)))
    stat, dof = chi2(draws, target)
    if size == 1:
        assert torch.equal(draws, torch.full((n,), int(order[0])))
    else:
        assert stat < CHI2_999[dof], (stat, dof)
        uniform = torch.zeros_like(probs)
        uniform[nucleus] = 1.0 / size  # right support, wrong weights: the statistic must reject it
        assert chi2(draws, uniform)[0] > 10 * CHI2_999[dof]


def test_chi_square_detects_untruncated_sampling():
    # Guard against a statistic that cannot fail: full-softmax draws are rejected against top-3.
    n = 20_000
    full = torch.multinomial(
        torch.softmax(LOGITS, -1).expand(n, -1), 1, generator=torch.Generator().manual_seed(0)
    )
    p = torch.softmax(LOGITS, -1)
    top3 = torch.topk(p, 3).indices
    target = torch.zeros_like(p)
    target[top3] = p[top3] / p[top3].sum()
    with pytest.raises(AssertionError, match="outside the support"):
        chi2(full.squeeze(-1), target)


def test_sampling_same_seed_same_tokens():
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(11))
    for fn, arg in ((sample_topk, 40), (sample_topp, 0.9)):
        a = fn(logits, arg, temperature=0.8, generator=torch.Generator().manual_seed(123))
        b = fn(logits, arg, temperature=0.8, generator=torch.Generator().manual_seed(123))
        c = fn(logits, arg, temperature=0.8, generator=torch.Generator().manual_seed(124))
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_topp_never_draws_outside_nucleus_many_rows():
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(8, 300, generator=g) * 3
    p = 0.7
    probs = torch.softmax(logits, -1)
    sp, si = torch.sort(probs, -1, descending=True)
    before = torch.cumsum(sp, -1) - sp
    for _ in range(20):
        draws = sample_topp(logits, p, generator=g)
        for row in range(8):
            rank = int((si[row] == draws[row]).nonzero())
            assert rank == 0 or before[row, rank] < p + 1e-6
