"""``lz.qk_norm_rope_cache`` (per-head q/k RMSNorm, RoPE, and the new K/V written into a paged cache) against
a float64 oracle written out here: every CPU kernel (reference, composite, the default), the Triton kernel
through the interpreter (compiled on a GPU by tests/gpu/test_gpu_triton_gemv.py), both KV layouts, skipped
slots, odd head counts; plus its typed errors and the Triton kernel's routing."""

from __future__ import annotations

import pytest
import torch
from _triton_interp import needs_interpreter

import layerzero as lz
from layerzero.backends.triton import rope as tr
from layerzero.core.context import SelectionContext
from layerzero.core.policy import Policy
from layerzero.core.selection import SelectionInputs, select
from layerzero.testing.devices import fake_cuda_device
from layerzero.testing.registries import routing_registry

pytestmark = pytest.mark.correctness
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def oracle(q, k, qw, kw, cos, sin, pos, eps):
    """float64 per-head RMSNorm then NeoX half rotation at each token's position: ``(q, k)`` ``[T, H, D]``."""

    def norm_rope(x, w):
        x = x.double()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()
        c, s = cos.double()[pos][:, None, :], sin.double()[pos][:, None, :]
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * c + rot * s

    return norm_rope(q, qw), norm_rope(k, kw)


def case(dtype, t, hq, hkv, d, seed, layout="NHD", blocks=6, page=4):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)  # views of one packed projection
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    qw, kw = (torch.rand(d, generator=g) + 0.5).to(dtype), (torch.rand(d, generator=g) + 0.5).to(dtype)
    cos, sin = torch.randn(64, d, generator=g).to(dtype), torch.randn(64, d, generator=g).to(dtype)
    pos = torch.randperm(64, generator=g)[:t]
    slots = torch.randperm(blocks * page, generator=g)[:t]
    slots[t // 2] = -1  # a padded token: skipped
    cache = lz.allocate_kv_cache(blocks, page, hkv, d, dtype, layout)
    cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    return q, k, v, qw, kw, cos, sin, pos, slots, cache


def check(out, args, layout, before, tol=None):
    q, k, v, qw, kw, cos, sin, pos, slots, cache = args
    qo, ko = out
    want_q, want_k = oracle(q, k, qw, kw, cos, sin, pos, 1e-6)
    tol = tol or TOL[q.dtype]
    for got, want in ((qo, want_q), (ko, want_k)):
        assert got.shape == want.shape and got.dtype == q.dtype
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= tol
    nhd = cache if layout == "NHD" else cache.transpose(2, 3)  # [N, 2, P, Hkv, D] view
    old = before if layout == "NHD" else before.transpose(2, 3)
    page = nhd.shape[2]
    written = torch.zeros(nhd.shape[0], page, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, page)
        written[b, o] = True
        assert torch.equal(nhd[b, 0, o], ko[i]), "the cache holds exactly the returned k"
        assert torch.equal(nhd[b, 1, o], v[i])
    keep = (~written)[:, None, :].expand(-1, 2, -1)  # [N, 2, P]
    assert torch.equal(nhd[keep], old[keep]), "no other slot changes (-1 skips)"


@pytest.mark.parametrize(
    "kernel",
    ["reference.qk_norm_rope_cache", "composite.qk_norm_rope_cache", None],
    ids=["reference", "composite", "default"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(5, 4, 2, 16), (7, 6, 3, 32), (1, 2, 1, 8)], ids=str)
def test_cpu_kernels_match_float64(kernel, dtype, layout, t, hq, hkv, d):
    args = case(dtype, t, hq, hkv, d, seed=t * 7 + d, layout=layout)
    q, k, v, qw, kw, cos, sin, pos, slots, cache = args
    before = cache.clone()
    if kernel is not None:
        lz.lock("qk_norm_rope_cache", kernel)
    try:
        out = lz.qk_norm_rope_cache(
            q, k, v, qw, kw, cos, sin, cache, slots, position_ids=pos, kv_layout=layout
        )
    finally:
        if kernel is not None:
            lz.unlock("qk_norm_rope_cache")
    check(out, args, layout, before)


interpreted = needs_interpreter("tests/gpu/test_gpu_triton_gemv.py")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(5, 4, 2, 16), (3, 6, 3, 40), (1, 16, 8, 64)], ids=str)
def test_triton_kernel_matches_float64(dtype, layout, t, hq, hkv, d):
    args = case(dtype, t, hq, hkv, d, seed=t + hq + d, layout=layout)
    q, k, v, qw, kw, cos, sin, pos, slots, cache = args
    before = cache.clone()
    out = tr.qk_norm_rope_cache(q, k, v, qw, kw, cos, sin, cache, slots, pos, False, layout, 1e-6)
    # the interpreter rounds float32 -> bfloat16 toward zero (see test_fused_projections.py): a wider bf16
    # bound
    check(out, args, layout, before, 3e-2 if dtype == torch.bfloat16 else None)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda a: {**a, "kv_cache": a["kv_cache"].to(torch.float8_e4m3fn)},
            r"kv_cache\.dtype: expected .*unquantized",
        ),
        (
            lambda a: {**a, "position_ids": a["position_ids"][:2]},
            r"position_ids shape: expected \[num_tokens\] = \[5\]",
        ),
        (lambda a: {**a, "q": a["q"][None]}, r"lz\.qk_norm_rope_cache: q rank: expected 3 dims"),
        (lambda a: {**a, "v": a["v"][:, :1]}, r"lz\.qk_norm_rope_cache: k/v shape"),
        (
            lambda a: {**a, "slot_mapping": a["slot_mapping"][:3]},
            r"lz\.qk_norm_rope_cache: slot_mapping shape",
        ),
        (lambda a: {**a, "q_weight": a["q_weight"][:4]}, r"q_weight shape"),
    ],
)
def test_bad_inputs_raise_typed_errors(change, match):
    q, k, v, qw, kw, cos, sin, pos, slots, cache = case(torch.float32, 5, 4, 2, 16, seed=1)
    a = change(
        dict(
            q=q,
            k=k,
            v=v,
            q_weight=qw,
            k_weight=kw,
            cos=cos,
            sin=sin,
            kv_cache=cache,
            slot_mapping=slots,
            position_ids=pos,
        )
    )
    before = cache.clone()
    with pytest.raises(lz.InvalidInputError, match=match):
        lz.qk_norm_rope_cache(
            a.pop("q"),
            a.pop("k"),
            a.pop("v"),
            a.pop("q_weight"),
            a.pop("k_weight"),
            a.pop("cos"),
            a.pop("sin"),
            a.pop("kv_cache"),
            a.pop("slot_mapping"),
            **a,
        )
    assert torch.equal(cache, before), "nothing is written before the checks pass"


@pytest.mark.unit
def test_triton_is_the_default_on_cuda_above_the_composite_form():
    """On a CUDA context the Triton kernel is eligible and ranked above the composite form
    (``rope.CACHE_PRIORITY``: one launch where the composite makes two), which a policy can still prefer."""
    reg = routing_registry(
        "qk_norm_rope_cache",
        [s for s in tr.kernel_specs(True, "") if s.op == "qk_norm_rope_cache"],
        base=("reference", "composite"),
    )
    ctx = SelectionContext(
        op="qk_norm_rope_cache",
        device=fake_cuda_device((9, 0)),
        dtype=torch.bfloat16,
        batch=1,
        num_heads_q=16,
        num_heads_kv=8,
        head_dim=128,
        rotary_dim=128,
        kv_layout="NHD",
        page_size=16,
    )

    def pick(policy):
        return select(
            reg, ctx, SelectionInputs(policy, lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False)
        )

    plan, report = pick(Policy.empty())
    assert plan.kernel_id == tr.QK_NORM_CACHE_KERNEL_ID
    assert report.candidate("composite.qk_norm_rope_cache").status.name == "ELIGIBLE"
    assert (
        pick(Policy.prefer(["composite.qk_norm_rope_cache"]))[0].kernel_id == "composite.qk_norm_rope_cache"
    )
