"""FlashAttention 2/3/4 kernels on a real GPU against a float64 oracle (``pytest -m gpu tests/gpu``).

Each FA backend that is importable *and* whose constraints accept this GPU is locked with ``lz.lock`` and run
on seeded cases (fp16/bf16, BSHD and BHSD, causal, GQA, head dims it supports); a backend whose library is
missing is skipped with the import error as the reason. A selection test checks that the best installed FA
kernel wins over SDPA on this device when it can run.
"""

from __future__ import annotations

import math

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.gpu

KERNELS = ("flash_attn2.attention", "flash_attn3.attention", "flash_attn4.attention")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _oracle_bhsd(q, k, v, causal):
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def _usable(kernel_id: str) -> None:
    """Skip unless the kernel's backend is installed (with the import error as the reason)."""
    RUNTIME.ensure_ready()
    backend = RUNTIME.registry.backend(kernel_id.split(".")[0])
    if not backend.available:
        pytest.skip(f"{backend.backend_id} not usable here: {'; '.join(str(r) for r in backend.reasons)}")


def _head_dims(kernel_id: str) -> tuple[int, ...]:
    return (64, 128) if kernel_id != "flash_attn2.attention" else (64, 96, 128)


@pytest.mark.parametrize("kernel_id", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fa_kernel_matches_float64_oracle(kernel_id, dtype):
    _usable(kernel_id)
    g = torch.Generator(device="cuda").manual_seed(0)
    lz.lock("attention", kernel_id)
    try:
        cases = 0
        for d in _head_dims(kernel_id):
            for hq, hkv in ((8, 8), (8, 2)):
                for s in (1, 17, 128, 257):
                    for causal in (False, True):
                        for layout in ("BHSD", "BSHD"):
                            q = torch.randn(2, hq, s, d, device="cuda", dtype=dtype, generator=g)
                            k = torch.randn(2, hkv, s, d, device="cuda", dtype=dtype, generator=g)
                            v = torch.randn(2, hkv, s, d, device="cuda", dtype=dtype, generator=g)
                            reasons = lz.validate(kernel_id, "attention", q, k, v, is_causal=causal)
                            if reasons:
                                pytest.fail(f"{kernel_id} refuses d={d} s={s}: {reasons}")
                            if layout == "BSHD":
                                out = lz.attention(
                                    q.transpose(1, 2),
                                    k.transpose(1, 2),
                                    v.transpose(1, 2),
                                    is_causal=causal,
                                    layout="BSHD",
                                ).transpose(1, 2)
                            else:
                                out = lz.attention(q, k, v, is_causal=causal)
                            ref = _oracle_bhsd(q, k, v, causal)
                            err = (out.double() - ref).abs().max().item()
                            assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), (
                                f"{kernel_id} d={d} Hq={hq} Hkv={hkv} S={s} causal={causal} {layout}: err "
                                f"{err}"
                            )
                            cases += 1
        assert cases >= 64
    finally:
        lz.unlock("attention")


def test_best_installed_fa_kernel_wins_on_this_gpu():
    RUNTIME.ensure_ready()
    q = k = v = torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16)
    runnable = [kid for kid in KERNELS if not lz.validate(kid, "attention", q, k, v, layout="BSHD")]
    if not runnable:
        pytest.skip("no FlashAttention library is installed and usable on this GPU")
    best = max(runnable, key=lambda kid: RUNTIME.registry.kernel(kid).priority)
    assert lz.which("attention", q, k, v, layout="BSHD") == best


def test_causal_cross_attention_is_not_sent_to_flash_attention():
    q = torch.randn(1, 8, 16, 64, device="cuda", dtype=torch.float16)
    k = v = torch.randn(1, 8, 64, 64, device="cuda", dtype=torch.float16)
    assert lz.which("attention", q, k, v, is_causal=True) not in KERNELS
    out = lz.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.double(), _oracle_bhsd_top_left(q, k, v), atol=2e-3, rtol=2e-3)


def _oracle_bhsd_top_left(q, k, v):
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v.double()
