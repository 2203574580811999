"""xFormers ``memory_efficient_attention`` on a real GPU against a float64 oracle
(``pytest -m gpu tests/gpu/test_gpu_xformers.py``).

``xformers.attention`` is locked and run on seeded cases per dtype (GQA, causal with Sq == Sk and Sq != Sk,
float masks with Sk not a multiple of 8, both layouts); cases its check refuses on this GPU (e.g. fp32 or
masks on SM > 9.0, where the cutlass operator does not run) are counted out, and >= 50 must remain per dtype.
Skipped with the backend's reason when xformers is missing or its operators do not load (e.g. a wheel built
for another torch).
"""

from __future__ import annotations

import math

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.gpu

KID = "xformers.attention"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-4}


def _usable() -> None:
    RUNTIME.ensure_ready()
    backend = RUNTIME.registry.backend("xformers")
    if not backend.available:
        pytest.skip(f"xformers not usable here: {'; '.join(str(r) for r in backend.reasons)}")


def _oracle(q, k, v, mask, causal):
    """float64 BHSD attention, GQA by repeat_interleave, top-left causal, additive mask."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        s = s + mask.double()
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_xformers_matches_float64_oracle(dtype):
    _usable()
    g = torch.Generator(device="cuda").manual_seed(0)
    lz.lock("attention", KID)
    cases, refused = 0, []
    try:
        for d in (64, 128):
            for hq, hkv in ((8, 8), (8, 2)):
                for sq, sk in ((17, 17), (128, 128), (16, 77), (1, 100)):
                    for kind in ("none", "causal", "mask"):
                        for layout in ("BHSD", "BSHD"):
                            q = torch.randn(2, hq, sq, d, device="cuda", dtype=dtype, generator=g)
                            k = torch.randn(2, hkv, sk, d, device="cuda", dtype=dtype, generator=g)
                            v = torch.randn(2, hkv, sk, d, device="cuda", dtype=dtype, generator=g)
                            mask = (
                                torch.randn(1, hq, sq, sk, device="cuda", dtype=dtype, generator=g)
                                if kind == "mask"
                                else None
                            )
                            causal = kind == "causal"
                            args = (
                                (q, k, v) if layout == "BHSD" else tuple(t.transpose(1, 2) for t in (q, k, v))
                            )
                            reasons = lz.validate(
                                KID, "attention", *args, attn_mask=mask, is_causal=causal, layout=layout
                            )
                            if reasons:
                                refused.append((d, hq, hkv, sq, sk, kind, [r.code.value for r in reasons]))
                                continue
                            out = lz.attention(*args, attn_mask=mask, is_causal=causal, layout=layout)
                            if layout == "BSHD":
                                out = out.transpose(1, 2)
                            ref = _oracle(q, k, v, mask, causal)
                            err = (out.double() - ref).abs().max().item()
                            assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), (
                                f"d={d} Hq={hq} Hkv={hkv} Sq={sq} Sk={sk} {kind} {layout}: err {err}"
                            )
                            cases += 1
    finally:
        lz.unlock("attention")
    if dtype is torch.float32 and cases == 0:
        pytest.skip(f"fp32 needs xFormers' cutlass operator, refused on this GPU: {refused[:1]}")
    assert cases >= 50, f"only {cases} runnable cases; refused: {refused[:5]}"


def test_xformers_backend_reports_loaded_operators():
    _usable()
    q = k = v = torch.randn(1, 64, 8, 64, device="cuda", dtype=torch.float16)
    assert lz.validate(KID, "attention", q, k, v, layout="BSHD") == []
    out = lz.attention(q, k, v, layout="BSHD")
    ref = _oracle(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, False).transpose(1, 2)
    assert (out.double() - ref).abs().max().item() <= 2e-3 * max(1.0, ref.abs().max().item())
