"""Quantized paged KV caches on a CUDA GPU (``pytest -m gpu``; skipped on CPU): the default kernels
(``triton.paged_decode`` for decode, ``triton.paged_prefill`` for prefill/append, ``triton.reshape_and_cache``
for writes; the Triton kernels also checked bit-equal / close to the torch ones) on fp8 / int8 caches against
the float64 oracle of ``tests/correctness/test_paged_quant_kv.py`` (its CPU helpers, run on CUDA tensors),
repeated calls through the hot path with float and tensor scales, and the kernels that cannot read a quantized
cache refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.core.reasons import ReasonCode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from test_paged_quant_kv import _fill, _oracle  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("decode", [True, False])
def test_cuda_quantized_cache(dtype, qdtype, decode):
    lens = ((1, 37), (1, 5), (1, 64)) if decode else ((9, 37), (5, 5), (1, 64))
    ks, vs = (0.04, 0.03) if dtype == torch.int8 else (0.25, 0.5)
    cache, bt, _, _ = _fill(
        "NHD", dtype, 16, 2, 128, lens, seed=1, ks=ks, vs=vs
    )  # written on CPU (reference)
    g = torch.Generator().manual_seed(2)
    nq = len(lens) if decode else sum(ql for ql, _ in lens)
    q = torch.randn(nq, 8, 128, generator=g)
    ref = _oracle(q, cache, bt, lens, "NHD", ks, vs, True, decode)
    seq = torch.tensor([kv for _, kv in lens], dtype=torch.int32)
    cu = None if decode else torch.tensor([0, 9, 14, 15], dtype=torch.int32)
    dev = "cuda"
    qc, cc, btc, sc = q.to(dev, qdtype), cache.to(dev), bt.to(dev), seq.to(dev)
    cuc = None if cu is None else cu.to(dev)
    tol = 2e-5 if qdtype == torch.float32 else 3e-2
    for scales in ((ks, vs), (torch.tensor(ks, device=dev), torch.tensor([vs], device=dev))):
        for _ in range(3):  # the first call selects, the next ones take the hot path
            out = lz.paged_attention(qc, cc, btc, sc, cu_seqlens_q=cuc, k_scale=scales[0], v_scale=scales[1])
            assert out.dtype == qdtype
            torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)
    report = lz.explain("paged_attention", qc, cc, btc, sc, cu_seqlens_q=cuc, k_scale=ks, v_scale=vs)
    assert report.chosen == ("triton.paged_decode" if decode else "triton.paged_prefill")
    if "flashinfer.paged_attention" in {c.kernel_id for c in report.candidates}:
        reasons = report.candidate("flashinfer.paged_attention").reasons
        assert ReasonCode.KV_CACHE_DTYPE_UNSUPPORTED in {r.code for r in reasons}
    lz.lock("paged_attention", "torch_sdpa.paged_attention")  # the torch kernel agrees with the Triton one
    try:
        out_t = lz.paged_attention(qc, cc, btc, sc, cu_seqlens_q=cuc, k_scale=ks, v_scale=vs)
    finally:
        lz.unlock("paged_attention")
    torch.testing.assert_close(out_t.double().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_cuda_write_equals_cpu_write(dtype):
    k = torch.randn(40, 4, 64) * 3
    v = torch.randn(40, 4, 64) * 3
    slots = torch.randperm(64)[:40]
    slots[::7] = -1
    s = 0.05 if dtype == torch.int8 else 0.5
    cpu = lz.allocate_kv_cache(4, 16, 4, 64, dtype)
    lz.reshape_and_cache(k, v, cpu, slots, k_scale=s, v_scale=s)
    gpu = lz.allocate_kv_cache(4, 16, 4, 64, dtype, device="cuda")
    for _ in range(2):
        lz.reshape_and_cache(
            k.cuda().bfloat16().float(),
            v.cuda().bfloat16().float(),
            gpu,
            slots.cuda(),
            k_scale=torch.tensor(s, device="cuda"),
            v_scale=s,
        )
    ref = lz.allocate_kv_cache(4, 16, 4, 64, dtype)
    lz.reshape_and_cache(k.bfloat16().float(), v.bfloat16().float(), ref, slots, k_scale=s, v_scale=s)
    assert torch.equal(gpu.cpu().view(torch.uint8), ref.view(torch.uint8))
    rep = lz.explain("reshape_and_cache", k.cuda(), v.cuda(), gpu, slots.cuda(), k_scale=s, v_scale=s)
    assert rep.chosen == "triton.reshape_and_cache"
    lz.lock("reshape_and_cache", "torch_native.reshape_and_cache")
    try:
        torch_w = lz.allocate_kv_cache(4, 16, 4, 64, dtype, device="cuda")
        lz.reshape_and_cache(
            k.cuda().bfloat16().float(),
            v.cuda().bfloat16().float(),
            torch_w,
            slots.cuda(),
            k_scale=s,
            v_scale=s,
        )
    finally:
        lz.unlock("reshape_and_cache")
    assert torch.equal(torch_w.view(torch.uint8), gpu.view(torch.uint8))
