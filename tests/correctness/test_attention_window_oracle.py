"""Sliding-window attention and logit soft-capping against a brute-force float64 oracle.

The oracle loops over every (query i, key j) pair in plain Python floats: visibility ``(not causal or j <= i)
and i - left <= j <= i + right`` (-1 = unbounded side, top-left aligned) and the bool mask; score
``softcap * tanh(s / softcap)`` of the scaled dot product, then the float mask's bias; a row with no visible
key outputs 0. It shares no code with the library. CPU cases run the reference kernel and eager FlexAttention
(locked) on seeded shapes (Sq == Sk, Sq < Sk, Sq > Sk, GQA/MQA, every window/causal/softcap/mask combination);
``gpu`` cases (skipped without CUDA) run compiled FlexAttention and each installed FlashAttention on an H200.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import layerzero as lz
from layerzero.backends.reference.attention import attention as reference_attention
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.correctness


def brute(q, k, v, *, causal=False, window=None, softcap=None, mask=None, scale=None):
    """float64 attention by explicit loops (BHSD tensors; mask [B|1, H|1, Sq, Sk] bool or float)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    left, right = window if window is not None else (-1, -1)
    qd, kd, vd = q.double(), k.double(), v.double()
    out = torch.zeros(b, hq, sq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(sq):
                scores, values = [], []
                for j in range(sk):
                    if causal and j > i:
                        continue
                    if left >= 0 and j < i - left:
                        continue
                    if right >= 0 and j > i + right:
                        continue
                    s = float(qd[bi, h, i] @ kd[bi, g, j]) * scale
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if mask is not None:
                        m = mask[min(bi, mask.shape[0] - 1), min(h, mask.shape[1] - 1), i, j]
                        if mask.dtype == torch.bool:
                            if not bool(m):
                                continue
                        else:
                            s += float(m)
                    if s == float("-inf"):
                        continue
                    scores.append(s)
                    values.append(vd[bi, g, j])
                if scores:
                    top = max(scores)
                    w = [math.exp(s - top) for s in scores]
                    total = sum(w)
                    out[bi, h, i] = sum(wi / total * vj for wi, vj in zip(w, values, strict=True))
    return out


def _case(rng: random.Random, seed: int):
    sq, sk = rng.choice([(6, 6), (5, 9), (9, 5), (1, 7), (8, 8)])
    hq, hkv = rng.choice([(2, 2), (4, 2), (4, 1)])
    d = rng.choice([4, 8])
    window = rng.choice([(2, 1), (0, 0), (3, -1), (-1, 2), (1, 0)])
    causal = rng.random() < 0.5
    softcap = rng.choice([None, 1.5, 20.0])
    mask_kind = rng.choice([None, "bool", "float"])
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, sq, d, generator=g, dtype=torch.float64) * 2
    k = torch.randn(2, hkv, sk, d, generator=g, dtype=torch.float64) * 2
    v = torch.randn(2, hkv, sk, d, generator=g, dtype=torch.float64)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, sq, sk, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(1, hq, sq, sk, generator=g, dtype=torch.float64)
    return q, k, v, dict(causal=causal, window=window, softcap=softcap, mask=mask)


CASES = [_case(random.Random(s), s) for s in range(24)]


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_reference_matches_brute_force(idx):
    q, k, v, kw = CASES[idx]
    out = reference_attention(
        q, k, v, kw["mask"], kw["causal"], None, 0.0, window=kw["window"], softcap=kw["softcap"]
    )
    torch.testing.assert_close(out, brute(q, k, v, **kw), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kernel_id", ["reference.attention", "flex_attention.attention"])
def test_locked_kernel_through_lz_attention_matches_brute_force(kernel_id):
    RUNTIME.ensure_ready()
    if not RUNTIME.registry.backend(kernel_id.split(".")[0]).available:
        pytest.skip(f"{kernel_id} unavailable here")
    lz.lock("attention", kernel_id)
    try:
        for q, k, v, kw in CASES:
            out = lz.attention(
                q,
                k,
                v,
                attn_mask=kw["mask"],
                is_causal=kw["causal"],
                window=kw["window"],
                softcap=kw["softcap"],
            )
            torch.testing.assert_close(
                out, brute(q, k, v, **kw), atol=1e-10, rtol=1e-10, msg=lambda m, kw=kw: f"{kw}: {m}"
            )
    finally:
        lz.unlock("attention")


def test_default_selection_float32_matches_brute_force():
    q, k, v, kw = CASES[0]
    q, k, v = q.float(), k.float(), v.float()
    out = lz.attention(q, k, v, is_causal=True, window=(2, 0), softcap=20.0)
    torch.testing.assert_close(
        out.double(), brute(q, k, v, causal=True, window=(2, 0), softcap=20.0), atol=2e-5, rtol=2e-5
    )


def test_window_changes_the_answer():
    """Guard against an oracle and kernels that both ignore the window: a narrow window must differ from
    none."""
    q, k, v, _ = CASES[0]
    narrow = lz.attention(q, k, v, window=(0, 0))
    full = lz.attention(q, k, v)
    assert (narrow - full).abs().max() > 1e-3
    torch.testing.assert_close(narrow, brute(q, k, v, window=(0, 0)), atol=1e-10, rtol=1e-10)


# ----------------------------------------------------------------------------- GPU (H200)

GPU_TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _gpu_usable(kernel_id: str) -> None:
    RUNTIME.ensure_ready()
    backend = RUNTIME.registry.backend(kernel_id.split(".")[0])
    if not backend.available:
        pytest.skip(f"{backend.backend_id} not usable here: {'; '.join(str(r) for r in backend.reasons)}")


def _gpu_oracle(q, k, v, causal, window, softcap):
    """Vectorized float64 oracle on the GPU (the brute-force loops are too slow for these sizes)."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    rel = (
        torch.arange(s.shape[-1], device=s.device)[None] - torch.arange(s.shape[-2], device=s.device)[:, None]
    )
    ok = torch.ones_like(rel, dtype=torch.bool)
    if causal:
        ok &= rel <= 0
    if window is not None and window[0] >= 0:
        ok &= rel >= -window[0]
    if window is not None and window[1] >= 0:
        ok &= rel <= window[1]
    return torch.softmax(s.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0) @ v


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kernel_id",
    ["flash_attn2.attention", "flash_attn3.attention", "flash_attn4.attention", "flex_attention.compiled"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_kernels_window_softcap_match_oracle(kernel_id, dtype):
    _gpu_usable(kernel_id)
    g = torch.Generator(device="cuda").manual_seed(0)
    lz.lock("attention", kernel_id)
    try:
        for s, hq, hkv in ((128, 8, 2), (257, 8, 8)):
            for causal, window in ((True, (63, 0)), (False, (32, 16)), (False, (-1, 7))):
                for softcap in (None, 30.0):
                    q = torch.randn(2, hq, s, 64, device="cuda", dtype=dtype, generator=g)
                    k = torch.randn(2, hkv, s, 64, device="cuda", dtype=dtype, generator=g)
                    v = torch.randn(2, hkv, s, 64, device="cuda", dtype=dtype, generator=g)
                    reasons = lz.validate(
                        kernel_id, "attention", q, k, v, is_causal=causal, window=window, softcap=softcap
                    )
                    if reasons:
                        pytest.skip(f"{kernel_id} refuses on this GPU: {reasons}")
                    out = lz.attention(q, k, v, is_causal=causal, window=window, softcap=softcap)
                    ref = _gpu_oracle(q, k, v, causal, window, softcap)
                    err = (out.double() - ref).abs().max().item()
                    assert err <= GPU_TOL[dtype] * max(1.0, ref.abs().max().item()), (
                        f"{kernel_id} S={s} causal={causal} window={window} softcap={softcap}: err {err}"
                    )
    finally:
        lz.unlock("attention")


@pytest.mark.gpu
def test_gpu_default_selection_refuses_sdpa_for_window():
    q = k = v = torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.float16)
    report = lz.explain("attention", q, k, v, is_causal=True, window=(31, 0))
    assert not report.chosen.startswith("torch_sdpa.")
    out = lz.attention(q, k, v, is_causal=True, window=(31, 0))
    ref = _gpu_oracle(q, k, v, True, (31, 0), None)
    assert (out.double() - ref).abs().max().item() <= GPU_TOL[torch.float16] * max(
        1.0, ref.abs().max().item()
    )
