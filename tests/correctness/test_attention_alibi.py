"""ALiBi (``lz.attention(alibi_slopes=...)``) against a float64 oracle built by hand from flash-attn's
formula.

flash-attn (``flash_attn_func`` docstring): "alibi_slopes: (nheads,) or (batch_size, nheads), fp32. A bias of
(-alibi_slope * |i + seqlen_k - seqlen_q - j|) is added to the attention score of query i and key j." The
oracle writes that bias matrix out element by element in Python, adds it to the scaled float64 scores, applies
the top-left causal mask of lz.attention and a plain softmax; it shares no code with the library. Every kernel
that declares ``supports_alibi`` and runs here is locked and compared (CPU: reference, eager FlexAttention,
SDPA math and the CPU flash kernel through an explicit float32 bias; GPU cases for compiled flex and FA2 are
skipped without CUDA); the others must be refused with ``ALIBI_UNSUPPORTED``.
"""

from __future__ import annotations

import math

import pytest
import torch

import layerzero as lz
from layerzero.core.reasons import ReasonCode
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.correctness

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def alibi_bias(slopes: torch.Tensor, b: int, hq: int, sq: int, sk: int) -> torch.Tensor:
    """The explicit bias ``[B, Hq, Sq, Sk]``: ``-slope[b, h] * |i + Sk - Sq - j|`` (float64, element by
    element)."""
    bias = torch.zeros(b, hq, sq, sk, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            slope = float(slopes[h] if slopes.dim() == 1 else slopes[bi, h])
            for i in range(sq):
                for j in range(sk):
                    bias[bi, h, i, j] = -slope * abs(i + sk - sq - j)
    return bias


def oracle(q, k, v, slopes, causal):
    """float64 attention with the explicit ALiBi bias; causal is lz.attention's top-left ``j <= i``."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    qd = q.double()
    kd = k.double().repeat_interleave(hq // hkv, 1)
    vd = v.double().repeat_interleave(hq // hkv, 1)
    s = qd @ kd.transpose(-1, -2) / math.sqrt(d) + alibi_bias(slopes, b, hq, sq, sk)
    if causal:
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ vd


def slopes_for(hq: int) -> torch.Tensor:
    """Press et al. 2022's geometric slopes ``2**(-8 (h + 1) / Hq)`` (float32, as flash-attn takes them)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)], dtype=torch.float32)


def make(seed, b, hq, hkv, sq, sk, d, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g, dtype=torch.float64) * 2
    k = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64) * 2
    v = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# (b, hq, hkv, sq, sk, d, slopes per batch row, causal)
CASES = [
    (2, 4, 4, 6, 6, 8, False, False),
    (2, 4, 4, 6, 6, 8, False, True),
    (2, 4, 2, 5, 9, 8, True, False),  # Sq < Sk, GQA, [B, Hq] slopes
    (2, 4, 2, 5, 9, 8, False, True),
    (1, 4, 1, 9, 5, 4, True, False),  # Sq > Sk, MQA
    (1, 4, 1, 9, 5, 4, True, True),
    (3, 6, 3, 1, 7, 8, False, False),  # decode-like Sq = 1, odd head count
    (2, 2, 2, 7, 7, 5, True, True),  # odd head dim
]


def _case(idx, dtype=torch.float64):
    b, hq, hkv, sq, sk, d, per_batch, causal = CASES[idx]
    q, k, v = make(idx, b, hq, hkv, sq, sk, d, dtype)
    slopes = slopes_for(hq)
    if per_batch:
        slopes = torch.stack([slopes * (r + 1) for r in range(b)])  # [B, Hq], distinct per row
    return q, k, v, slopes, causal


def test_hand_worked_1x1x3x3():
    """q = k = 0 (scores 0), v = [[1], [2], [4]], slope 1, Sq = Sk = 3: bias row i is -|i - j|.

    Non-causal row 1: weights ∝ (e^-1, 1, e^-1) -> (e^-1 + 2 + 4e^-1) / (1 + 2e^-1) = (2 + 5/e) / (1 + 2/e).
    Causal row 2: keys 0..2 with bias (-2, -1, 0) -> (e^-2 + 2e^-1 + 4) / (e^-2 + e^-1 + 1); causal row 0 is
    v[0] = 1.
    """
    q = k = torch.zeros(1, 1, 3, 1, dtype=torch.float64)
    v = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64).view(1, 1, 3, 1)
    slopes = torch.tensor([1.0])
    e = math.e
    full = lz.attention(q, k, v, alibi_slopes=slopes)
    assert full[0, 0, 1, 0].item() == pytest.approx((2 + 5 / e) / (1 + 2 / e), abs=1e-12)
    assert full[0, 0, 0, 0].item() == pytest.approx(
        (1 + 2 / e + 4 / e**2) / (1 + 1 / e + 1 / e**2), abs=1e-12
    )
    causal = lz.attention(q, k, v, alibi_slopes=slopes, is_causal=True)
    assert causal[0, 0, 0, 0].item() == pytest.approx(1.0, abs=1e-12)
    assert causal[0, 0, 2, 0].item() == pytest.approx((e**-2 + 2 / e + 4) / (e**-2 + 1 / e + 1), abs=1e-12)


def test_oracle_bias_is_flash_attn_formula():
    """The bias matrix by hand for Sq = 2, Sk = 4, slope 0.5: query i at position i + 2."""
    bias = alibi_bias(torch.tensor([0.5]), 1, 1, 2, 4)[0, 0]
    assert bias.tolist() == [[-1.0, -0.5, 0.0, -0.5], [-1.5, -1.0, -0.5, 0.0]]


def _usable(kernel_id):
    RUNTIME.ensure_ready()
    backend = RUNTIME.registry.backend(kernel_id.split(".")[0])
    if not backend.available:
        pytest.skip(f"{kernel_id} unavailable here")


@pytest.mark.parametrize(
    "kernel_id", ["reference.attention", "flex_attention.attention", "torch_sdpa.math", "torch_sdpa.flash"]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("idx", range(len(CASES)))
def test_locked_cpu_kernel_matches_oracle(kernel_id, dtype, idx):
    _usable(kernel_id)
    q, k, v, slopes, causal = _case(idx, dtype)
    lz.lock("attention", kernel_id)
    try:
        out = lz.attention(q, k, v, is_causal=causal, alibi_slopes=slopes)
        assert lz.which("attention", q, k, v, is_causal=causal, alibi_slopes=slopes) == kernel_id
    finally:
        lz.unlock("attention")
    ref = oracle(q, k, v, slopes, causal)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_bshd_layout_and_combination_with_window_softcap_mask():
    q, k, v, slopes, _ = _case(0)
    out = lz.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="BSHD", alibi_slopes=slopes
    )
    torch.testing.assert_close(out.transpose(1, 2), oracle(q, k, v, slopes, False), atol=1e-10, rtol=1e-10)
    # with a float mask, a window and a softcap: reference vs flex (both declare all four features)
    mask = torch.randn(1, 4, 6, 6, dtype=torch.float64)
    outs = []
    for kernel_id in ("reference.attention", "flex_attention.attention"):
        _usable(kernel_id)
        lz.lock("attention", kernel_id)
        try:
            outs.append(
                lz.attention(q, k, v, attn_mask=mask, window=(2, 1), softcap=3.0, alibi_slopes=slopes)
            )
        finally:
            lz.unlock("attention")
    torch.testing.assert_close(outs[0], outs[1], atol=1e-10, rtol=1e-10)


def test_alibi_changes_the_answer_and_default_selection():
    """Guard against kernels that ignore the slopes; the default pick serves ALiBi and the cache keeps the two
    apart."""
    q, k, v, slopes, causal = _case(2, torch.float32)
    plain = lz.attention(q, k, v, is_causal=causal)
    biased = lz.attention(q, k, v, is_causal=causal, alibi_slopes=slopes)
    plain_again = lz.attention(q, k, v, is_causal=causal)
    assert (biased - plain).abs().max() > 1e-3
    torch.testing.assert_close(plain_again, plain)
    torch.testing.assert_close(biased.double(), oracle(q, k, v, slopes, causal), atol=2e-5, rtol=2e-5)


def test_cuda_flash_refuses_alibi_by_its_device_rule():
    """``torch_sdpa.flash`` declares ALiBi for its CPU kernel (an explicit bias mask); CUDA flash takes no
    mask, so its device rule refuses ALiBi there with the ALiBi reason (a hand-built CUDA context: no GPU
    needed)."""
    from layerzero.backends.torch_sdpa.kernels import _flash_device_check
    from layerzero.core.context import SelectionContext
    from layerzero.testing.devices import fake_cuda_device

    ctx = SelectionContext(
        op="attention", device=fake_cuda_device((9, 0)), dtype=torch.bfloat16, head_dim=64, has_alibi=True
    )
    assert ReasonCode.ALIBI_UNSUPPORTED in {r.code for r in _flash_device_check(ctx)}
    assert ReasonCode.ALIBI_UNSUPPORTED not in {
        r.code
        for r in _flash_device_check(
            SelectionContext(
                op="attention", device=fake_cuda_device((9, 0)), dtype=torch.bfloat16, head_dim=64
            )
        )
    }


def test_non_supporting_kernels_are_refused_with_alibi_unsupported():
    q, k, v, slopes, _ = _case(0, torch.float32)
    report = lz.explain("attention", q, k, v, alibi_slopes=slopes)
    # the CPU flash kernel with the bias (priority 80): 1.7-2.3x faster than SDPA math with it on the AVX2 CI
    # CPU (benchmarks/results/alibi_cpu_avx2.md)
    assert report.chosen == "torch_sdpa.flash"
    rows = {c.kernel_id: c for c in report.candidates}
    for kernel_id in (
        "torch_sdpa.efficient",
        "torch_sdpa.cpu_fp32_upcast",
        "flash_attn3.attention",
        "flash_attn4.attention",
    ):
        assert ReasonCode.ALIBI_UNSUPPORTED in {r.code for r in rows[kernel_id].reasons}, kernel_id
    for kernel_id in (
        "reference.attention",
        "flex_attention.attention",
        "flash_attn2.attention",
        "torch_sdpa.math",
        "torch_sdpa.flash",
    ):
        assert ReasonCode.ALIBI_UNSUPPORTED not in {r.code for r in rows[kernel_id].reasons}, kernel_id
    lz.lock("attention", "torch_sdpa.efficient")
    try:
        with pytest.raises(lz.NoKernelFoundError, match="ALIBI_UNSUPPORTED"):
            lz.attention(q, k, v, alibi_slopes=slopes)
    finally:
        lz.unlock("attention")


@pytest.mark.parametrize(
    ("slopes", "match"),
    [
        (torch.ones(4, dtype=torch.float16), "Pass float32 slopes as flash-attn requires"),
        (torch.ones(4, dtype=torch.float64), "float32"),
        (torch.ones(3), r"\[Hq\] = \[4\]"),
        (torch.ones(2, 4, 1), "alibi_slopes shape"),
        (torch.ones(3, 4), r"\[B, Hq\] = \[2, 4\]"),
        ([0.5] * 4, "a float32 torch.Tensor"),
        (torch.ones(4, device="meta"), "alibi_slopes.device"),
    ],
)
def test_bad_slopes_raise_typed_errors(slopes, match):
    q, k, v, _, _ = _case(0, torch.float32)
    with pytest.raises(lz.InvalidInputError, match=match):
        lz.attention(q, k, v, alibi_slopes=slopes)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_id", ["flash_attn2.attention"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_kernels_match_oracle(kernel_id, dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    _usable(kernel_id)
    for causal, (sq, sk), per_batch in (
        (False, (64, 64), False),
        (True, (64, 64), True),
        (False, (33, 96), True),
    ):
        q, k, v = (t.cuda() for t in make(0, 2, 8, 2, sq, sk, 64, dtype))
        slopes = slopes_for(8)
        slopes = torch.stack([slopes, slopes * 2]) if per_batch else slopes
        reasons = lz.validate(kernel_id, "attention", q, k, v, is_causal=causal, alibi_slopes=slopes.cuda())
        if reasons:
            pytest.skip(f"{kernel_id} refuses here: {reasons}")
        lz.lock("attention", kernel_id)
        try:
            out = lz.attention(q, k, v, is_causal=causal, alibi_slopes=slopes.cuda())
        finally:
            lz.unlock("attention")
        ref = oracle(q.cpu(), k.cpu(), v.cpu(), slopes, causal)
        torch.testing.assert_close(out.cpu().double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_compiled_flex_refuses_alibi():
    """flex_attention.compiled does not claim ALiBi (Inductor failed to lower its score_mod on the H200)."""
    from layerzero.core.runtime import RUNTIME

    RUNTIME.ensure_ready()
    assert not RUNTIME.registry.kernel("flex_attention.compiled").supports_alibi
    assert RUNTIME.registry.kernel("flex_attention.attention").supports_alibi


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_sdpa_math_alibi_with_a_mask_and_bshd(mask_kind, layout):
    """torch_sdpa.math's explicit-bias path adds the caller's mask (bool: -inf where False; float: added) to
    the ALiBi bias; the float64 oracle adds the same mask by hand. BSHD inputs go through the layout
    adapter."""
    q, k, v, slopes, _ = _case(2, torch.float64)  # Sq < Sk, GQA, [B, Hq] slopes
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    g = torch.Generator().manual_seed(7)
    if mask_kind == "bool":
        mask = torch.rand(b, 1, sq, sk, generator=g) > 0.3
        mask[..., 0] = True  # every row keeps a key
        add = torch.zeros(b, 1, sq, sk, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    else:
        mask = torch.randn(b, 1, sq, sk, generator=g, dtype=torch.float64)
        add = mask
    s = (q @ k.repeat_interleave(hq // k.shape[1], 1).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    ref = torch.softmax(s + alibi_bias(slopes, b, hq, sq, sk) + add, -1) @ v.repeat_interleave(
        hq // k.shape[1], 1
    )
    args = (q, k, v) if layout == "BHSD" else tuple(t.transpose(1, 2) for t in (q, k, v))
    lz.lock("attention", "torch_sdpa.math")
    try:
        out = lz.attention(*args, attn_mask=mask, alibi_slopes=slopes, layout=layout)
    finally:
        lz.unlock("attention")
    out = out if layout == "BHSD" else out.transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_the_locked_kernel_sweep_draws_alibi_for_kernels_that_require_it(monkeypatch):
    """``run_kernel`` (the locked-kernel sweeps, CPU and GPU) runs a kernel that serves ALiBi calls only
    (``ALIBI_REQUIRED``, e.g. ``triton.attention``) on the drawn cases with slopes added, against an oracle
    that adds the ALiBi bias itself; checked here with the reference kernel standing in for such a kernel (its
    validation refuses every call without slopes), and that oracle checked against this file's own oracle."""
    import sys
    from pathlib import Path

    from layerzero.core.reasons import Reason

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _shapes import attention_call, run_kernel, with_alibi

    real = lz.validate

    def alibi_only(kernel_id, op, *args, **kwargs):
        reasons = list(real(kernel_id, op, *args, **kwargs))
        if kwargs.get("alibi_slopes") is None:
            reasons.append(Reason(ReasonCode.ALIBI_REQUIRED, "serves ALiBi calls only"))
        return reasons

    monkeypatch.setattr(lz, "validate", alibi_only)
    run = run_kernel("attention", "reference.attention", torch.float32, target=40)
    assert run.ran >= 40 and not run.failures, run.report()
    assert (
        run.rejected.get("ALIBI_REQUIRED", 0) == 0
    )  # every case was redrawn with slopes, none skipped for it
    compared = 0
    for seed in range(200):  # the sweep's oracle is flash-attn's bias, as this file's hand-written one
        call = with_alibi(attention_call(seed, torch.float64))
        c = call.case
        if call.kwargs["attn_mask"] is not None or c.layout != "BHSD" or c.scale is not None or c.sq > 64:
            continue
        q, k, v = call.args
        torch.testing.assert_close(
            call.oracle(), oracle(q, k, v, call.kwargs["alibi_slopes"], c.causal), atol=1e-10, rtol=1e-10
        )
        compared += 1
        if compared == 8:
            break
    assert compared == 8
