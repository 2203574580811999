"""``triton.attention`` (FlashAttention-2 forward with in-kernel ALiBi) compiled on a CUDA GPU
(``pytest -m gpu``; skipped on CPU with a reason): bfloat16 / float16 (and a float32 case) against the float64
oracle of ``tests/correctness/test_triton_attention.py`` (computed on the GPU in float64) at serving shapes
(B2 H16/Hkv4 S1024 D128 causal, decode-like Sq = 1 over 4096 keys, Sq != Sk both ways, odd and large head
dims, D != Dv, window + soft-cap), split-K against no split and its determinism,
``lz.attention(..., alibi_slopes=...)`` selecting it by default (FlashAttention 2 first when it is installed
and eligible) and never for a plain call, BSHD inputs, autograd calls falling back with their gradients, and a
CUDA-graph capture/replay (the spec says graph-safe).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from test_triton_attention import Case, oracle  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("triton_usable"),
]

KID = "triton.attention"
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
SERVING = [
    Case(2, 16, 4, 1024, 1024, 128, 128, causal=True),  # prefill, GQA 4
    Case(4, 32, 8, 1, 4096, 128, 128, per_batch=True),  # decode-like: split-K
    Case(2, 8, 2, 77, 1000, 128, 128, per_batch=True),  # Sq < Sk, not causal
    Case(2, 8, 2, 1000, 77, 64, 64, causal=True),  # Sq > Sk, causal (top-left)
    Case(1, 12, 12, 300, 300, 80, 80, causal=True),  # odd head dim, MHA
    Case(1, 8, 1, 129, 257, 256, 256, causal=True),  # D = 256, MQA
    Case(1, 4, 4, 200, 300, 96, 64),  # D != Dv
    Case(1, 8, 2, 500, 700, 128, 128, causal=True, window=(127, 0), softcap=30.0),
    Case(3, 6, 3, 31, 63, 72, 8, scale=0.0633),  # Dv 8 padded to 16: the sweep's seed 15036 (was wrong)
    Case(3, 6, 3, 31, 63, 72, 24),  # Dv 24 padded to 32 (was wrong too, before the row-mask-only V load)
]


def aligned(case: Case) -> bool:
    """Head dims triton.attention runs: powers of two >= 16 (others are refused with HEAD_DIM_NOT_ALIGNED
    since padded tiles miscompiled on the H200 under Triton 3.6; gpu_suite/README.md, 2026-11-29)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (case.d, case.dv))


def tensors(case: Case, seed: int, dtype: torch.dtype):
    q, k, v, slopes = case.tensors(seed, torch.float32)
    return q.to("cuda", dtype), k.to("cuda", dtype), v.to("cuda", dtype), slopes.cuda()


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """``out`` within ``TOL[dtype]`` of the float64 ``ref`` relative to ref's scale (plus each element's
    own)."""
    assert out.dtype == dtype and out.shape == ref.shape, (what, out.dtype, out.shape, ref.shape)
    tol = TOL[dtype]
    err = (out.double() - ref).abs()
    bad = err > tol * float(ref.abs().max()) + tol * ref.abs()
    assert not bool(bad.any()), f"{what}: {int(bad.sum())}/{bad.numel()} off, worst {float(err.max()):.3g}"


@contextlib.contextmanager
def locked(kernel_id: str):
    lz.lock("attention", kernel_id)
    try:
        yield
    finally:
        lz.unlock("attention")


def call(case: Case, q, k, v, slopes, **kw):
    return lz.attention(
        q,
        k,
        v,
        is_causal=case.causal,
        scale=case.scale,
        window=case.window,
        softcap=case.softcap,
        alibi_slopes=slopes,
        **kw,
    )


def fa2_takes(case: Case, q, k, v, slopes) -> bool:
    """Whether flash_attn2 (installed, ALiBi natively, priority 90) can run this call: then it is the
    default."""
    return not lz.validate(
        "flash_attn2.attention",
        "attention",
        q,
        k,
        v,
        is_causal=case.causal,
        scale=case.scale,
        window=case.window,
        softcap=case.softcap,
        alibi_slopes=slopes,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("idx", range(len(SERVING)))
def test_serving_shapes_match_float64(dtype, idx):
    case = SERVING[idx]
    q, k, v, slopes = tensors(case, idx, dtype)
    want = oracle(q, k, v, slopes, case.causal, case.scale, case.window, case.softcap)
    if not aligned(case):  # refused, with the reason; lz.attention serves the call with another kernel
        reasons = lz.validate(
            KID,
            "attention",
            q,
            k,
            v,
            is_causal=case.causal,
            scale=case.scale,
            window=case.window,
            softcap=case.softcap,
            alibi_slopes=slopes,
        )
        assert "HEAD_DIM_NOT_ALIGNED" in str(reasons), reasons
        with lz.trace() as tr:
            out = call(case, q, k, v, slopes)
        assert KID not in tr.kernels_for("attention")
        check(out, want, dtype, str(case))
        return
    with locked(KID), lz.trace() as tr:
        out = call(case, q, k, v, slopes)
    assert tr.kernels_for("attention") == [KID] and not tr.fallbacks
    check(out, want, dtype, str(case))
    expected = "flash_attn2.attention" if fa2_takes(case, q, k, v, slopes) else KID
    assert (
        lz.which(
            "attention",
            q,
            k,
            v,
            is_causal=case.causal,
            scale=case.scale,
            window=case.window,
            softcap=case.softcap,
            alibi_slopes=slopes,
        )
        == expected
    )


def test_float32_matches_float64():
    case = Case(2, 8, 2, 130, 170, 64, 64, causal=True, per_batch=True)
    q, k, v, slopes = tensors(case, 3, torch.float32)
    with locked(KID):
        out = call(case, q, k, v, slopes)
    check(out, oracle(q, k, v, slopes, True), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_split_k_against_no_split_and_deterministic(dtype):
    from layerzero.backends.triton.attention import attention

    case = Case(2, 16, 4, 1, 3000, 128, 128, per_batch=True)
    q, k, v, slopes = tensors(case, 4, dtype)
    want = oracle(q, k, v, slopes)
    outs = {
        s: attention(q, k, v, None, False, None, 0.0, None, None, slopes, num_splits=s) for s in (1, 7, 16)
    }
    outs[None] = attention(q, k, v, None, False, None, 0.0, None, None, slopes)
    for s, out in outs.items():
        check(out, want, dtype, f"splits={s}")
    again = attention(q, k, v, None, False, None, 0.0, None, None, slopes)
    assert torch.equal(again, outs[None])


def test_default_selection_plain_calls_and_autograd():
    """ALiBi calls default to it (unless FA2 takes them); plain calls never; a call needing gradients falls
    back to a kernel with a backward (BACKWARD_UNSUPPORTED here) and its gradients match the float64
    oracle's."""
    case = Case(2, 8, 2, 256, 256, 64, 64, causal=True)
    q, k, v, slopes = tensors(case, 5, torch.bfloat16)
    if not fa2_takes(case, q, k, v, slopes):
        assert lz.which("attention", q, k, v, is_causal=True, alibi_slopes=slopes) == KID
    assert lz.which("attention", q, k, v, is_causal=True) != KID
    report = lz.explain("attention", q, k, v, is_causal=True)
    assert "ALIBI_REQUIRED" in {r.code.value for r in report.candidate(KID).reasons}
    qg = q.float().requires_grad_()
    out = lz.attention(qg, k.float(), v.float(), is_causal=True, alibi_slopes=slopes)
    assert lz.which("attention", qg, k.float(), v.float(), is_causal=True, alibi_slopes=slopes) != KID
    out.sum().backward()
    q64 = q.double().requires_grad_()
    oracle(q64, k, v, slopes, True).sum().backward()
    torch.testing.assert_close(qg.grad.double(), q64.grad, rtol=1e-4, atol=1e-4)


def test_bshd_inputs():
    case = Case(2, 16, 4, 333, 333, 128, 128, causal=True, per_batch=True)
    q, k, v, slopes = tensors(case, 6, torch.bfloat16)
    want = oracle(q, k, v, slopes, True)
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    with locked(KID), lz.trace() as tr:
        out = lz.attention(qb, kb, vb, is_causal=True, alibi_slopes=slopes, layout="BSHD")
    assert tr.kernels_for("attention") == [KID]
    assert out.is_contiguous()
    check(out.transpose(1, 2), want, torch.bfloat16)


@pytest.mark.parametrize(
    "case",
    [Case(2, 16, 4, 512, 512, 128, 128, causal=True), Case(4, 32, 8, 1, 4096, 128, 128)],
    ids=["prefill", "decode"],
)
def test_replays_in_a_cuda_graph(case):
    """PyTorch's recipe (an eager call, a side-stream warm-up, the capture) with
    lz.attention(alibi_slopes=...): the capture-time choice is this kernel (graph-safe), and a replay with new
    q values equals an eager call."""
    q, k, v, slopes = tensors(case, 7, torch.bfloat16)
    if fa2_takes(case, q, k, v, slopes):
        pytest.skip("flash_attn2 is installed and takes these calls")
    call(case, q, k, v, slopes)
    with lz.capture_selection():
        assert lz.which("attention", q, k, v, is_causal=case.causal, alibi_slopes=slopes) == KID
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(case, q, k, v, slopes)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(case, q, k, v, slopes)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    eager = call(case, q, k, v, slopes)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    check(out, oracle(q, k, v, slopes, case.causal), torch.bfloat16)
