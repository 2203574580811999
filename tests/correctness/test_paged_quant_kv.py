"""Quantized paged KV caches (float8_e4m3fn, int8 with per-tensor scales) against oracles written here.

- ``lz.reshape_and_cache`` writes exactly ``round_to_format(x / scale)``: fp8 compared with torch's own cast
  ``(x / s).to(torch.float8_e4m3fn)`` (and saturation at +-448), int8 with Python's ``round`` (half to even)
  and a clamp to [-127, 127], per cache kernel; -1 slots and unused slots untouched.
- ``lz.paged_attention`` over a quantized cache, every kernel that reads one locked: equal to a float64 oracle
  over the DEQUANTIZED cache (stored codes x scale, token by token, by hand) within float32 tolerance (the
  quantization error is in the oracle, so only kernel arithmetic is left).
- quantized vs unquantized: the attention output differs by at most the bound the format implies (derived in
  :func:`_fp8_bound`: e4m3's relative rounding error 2^-4 per element, 2^-10 * scale absolute in the
  subnormals).
- kernels that cannot read a quantized cache are refused with ``KV_CACHE_DTYPE_UNSUPPORTED`` in
  ``lz.explain``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

import layerzero as lz
from layerzero.core.constraints import check_constraints
from layerzero.core.reasons import ReasonCode
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.correctness

F64 = torch.float64
FP8 = torch.float8_e4m3fn
QDTYPES = (FP8, torch.int8)
ATTN_KERNELS = ("reference.paged_attention", "torch_sdpa.paged_attention")
CACHE_KERNELS = ("reference.reshape_and_cache", "torch_native.reshape_and_cache")
REFUSED = ("flex_attention.paged_attention", "flashinfer.paged_attention")
TRITON_READERS = ("triton.paged_decode", "triton.paged_prefill", "triton.reshape_and_cache")
"""Our Triton kernels read / write quantized caches (CUDA only: on CPU they are refused for the device, never
for the cache dtype)."""


@contextlib.contextmanager
def locked(op: str, kernel_id: str):
    """``lz.lock`` (process-wide) for the block only."""
    lz.lock(op, kernel_id)
    try:
        yield
    finally:
        lz.unlock(op)


def _nhd(cache: torch.Tensor, layout: str) -> torch.Tensor:
    return cache if layout == "NHD" else cache.transpose(2, 3)


def _int8_codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Hand rounding of the float32 quotient x / scale: Python's round() is half to even; clamp to [-127,
    127]."""
    quot = x.float() / torch.tensor(scale, dtype=torch.float32)
    vals = [max(-127, min(127, round(a))) for a in quot.flatten().tolist()]
    return torch.tensor(vals, dtype=torch.int8).reshape(x.shape)


def _codes(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.int8:
        return _int8_codes(x.float(), scale)
    return (x.float() / scale).to(FP8)


def _scale_arg(s: float, as_tensor: bool):
    return torch.tensor(s, dtype=torch.float32) if as_tensor else s


# ------------------------------------------------------------------------------------ reshape_and_cache
@pytest.mark.parametrize("kernel", CACHE_KERNELS)
@pytest.mark.parametrize("dtype", QDTYPES, ids=["fp8", "int8"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("tensor_scale", [False, True])
def test_write_is_round_to_format(kernel, dtype, layout, tensor_scale):
    g = torch.Generator().manual_seed(7)
    n, p, hkv, d = 6, 4, 2, 16
    ks, vs = (2.0**-4, 2.0**-5) if dtype == torch.int8 else (0.5, 2.0)  # powers of two: exact ties
    k = torch.randn(n, hkv, d, generator=g) * 2
    v = torch.randn(n, hkv, d, generator=g) * 2
    if dtype == torch.int8:  # exact ties: x / s = m + 0.5 must round to even
        k[0, 0, :6] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 200.0]) * ks
    else:  # saturation: |x / s| > 448 stores +-448 (e4m3fn has no inf)
        k[0, 0, :3] = torch.tensor([1000.0, -5000.0, 448.0]) * ks
    cache = lz.allocate_kv_cache(3, p, hkv, d, dtype, layout)
    sentinel = torch.full_like(cache, 3, dtype=torch.float32).to(dtype)  # 3 is exact in both formats
    cache.copy_(sentinel)
    slots = torch.tensor([5, -1, 0, 11, 2, -1])
    with locked("reshape_and_cache", kernel):
        lz.reshape_and_cache(
            k,
            v,
            cache,
            slots,
            layout,
            k_scale=_scale_arg(ks, tensor_scale),
            v_scale=_scale_arg(vs, tensor_scale),
        )
    view = _nhd(cache, layout)
    written = set()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written.add(slot)
        b, o = divmod(slot, p)
        for which, x, s in ((0, k, ks), (1, v, vs)):
            want = _codes(x[t], s, dtype)
            got = view[b, which, o]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (t, which)
    if dtype == torch.int8:
        assert view[1, 0, 1, 0, :6].tolist() == [0, 2, 2, 0, -2, 127]
    else:
        assert view[1, 0, 1, 0, :3].float().tolist() == [448.0, -448.0, 448.0]
    for slot in set(range(3 * p)) - written:  # untouched
        b, o = divmod(slot, p)
        assert (view[b, :, o].float() == 3).all()


# ------------------------------------------------------------------------------------------ attention
def _fill(layout, dtype, page, hkv, d, lens, seed, ks, vs, nblocks=None):
    """A cache of ``dtype`` holding every sequence's K/V (written through lz.reshape_and_cache, reference
    kernel), unused slots left as NaN (float caches) / garbage codes; returns cache, block_tables, the raw
    float K/V."""
    g = torch.Generator().manual_seed(seed)
    need = [(kv + page - 1) // page for _, kv in lens]
    nblocks = nblocks or sum(need) + 3
    perm = torch.randperm(nblocks, generator=g).tolist()
    cols = max(need) + 1
    bt = torch.full((len(lens), cols), -1, dtype=torch.int32)
    ks_raw, vs_raw, slots = [], [], []
    for s, (_, kv) in enumerate(lens):
        ids = [perm.pop() for _ in range(need[s])]
        bt[s, : need[s]] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[t // page] * page + t % page for t in range(kv)]
        ks_raw.append(torch.randn(kv, hkv, d, generator=g) * 1.5)
        vs_raw.append(torch.randn(kv, hkv, d, generator=g) * 1.5)
    cache = lz.allocate_kv_cache(nblocks, page, hkv, d, dtype, layout)
    if dtype.is_floating_point and dtype != FP8:
        cache.fill_(float("nan"))
    else:  # garbage codes (fp8 NaN pattern 0x7f / int8 -128) in every unused slot
        cache.view(torch.uint8).fill_(0x7F if dtype == FP8 else 0x80)
    k_all, v_all = torch.cat(ks_raw), torch.cat(vs_raw)
    kw = {} if dtype not in QDTYPES else {"k_scale": ks, "v_scale": vs}
    with locked("reshape_and_cache", "reference.reshape_and_cache"):
        lz.reshape_and_cache(
            k_all.to(torch.float32),
            v_all.to(torch.float32),
            cache,
            torch.tensor(slots, dtype=torch.int64),
            layout,
            **kw,
        )
    return cache, bt, ks_raw, vs_raw


def _oracle(q, cache, bt, lens, layout, ks, vs, causal, decode):
    """float64 attention over the dequantized cache: each token's stored codes read back by slot arithmetic
    (by hand) and multiplied by the scale."""
    view = _nhd(cache, layout)
    page = view.shape[2]
    quant = cache.dtype in QDTYPES
    hq, d = q.shape[1], q.shape[2]
    out = torch.zeros(q.shape, dtype=F64)
    t0 = 0
    for s, (ql, kv) in enumerate(lens):
        if decode:
            ql = 1
        if ql == 0:
            continue
        keys, vals = [], []
        for t in range(kv):
            b = int(bt[s, t // page])
            keys.append(view[b, 0, t % page].to(F64) * (ks if quant else 1.0))
            vals.append(view[b, 1, t % page].to(F64) * (vs if quant else 1.0))
        k, v = torch.stack(keys), torch.stack(vals)  # [kv, Hkv, D]
        grp = hq // k.shape[1]
        k, v = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
        qs = q[t0 : t0 + ql].to(F64)
        sc = torch.einsum("qhd,khd->hqk", qs, k) / math.sqrt(d)
        if causal:
            i = torch.arange(ql)[:, None]
            sc = sc.masked_fill(torch.arange(kv)[None] > kv - ql + i, float("-inf"))
        out[t0 : t0 + ql] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), v)
        t0 += ql
    return out


CASES = [  # (layout, page, hkv, ratio, d, lens, decode)
    ("NHD", 4, 2, 2, 16, ((1, 9), (1, 1), (1, 16)), True),
    ("HND", 8, 1, 4, 32, ((1, 30), (1, 7)), True),
    ("NHD", 5, 2, 1, 8, ((4, 11), (0, 0), (3, 3), (1, 6)), False),
    ("HND", 16, 4, 2, 64, ((17, 40), (5, 5)), False),
    ("NHD", 1, 1, 8, 16, ((2, 4), (1, 3)), False),
]


@pytest.mark.parametrize("kernel", ATTN_KERNELS)
@pytest.mark.parametrize("dtype", QDTYPES, ids=["fp8", "int8"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("tensor_scale", [False, True])
def test_attention_matches_dequantized_oracle(kernel, dtype, case, tensor_scale):
    layout, page, hkv, ratio, d, lens, decode = CASES[case]
    ks, vs = (0.04, 0.03) if dtype == torch.int8 else (0.25, 0.5)
    cache, bt, _, _ = _fill(layout, dtype, page, hkv, d, lens, seed=case, ks=ks, vs=vs)
    g = torch.Generator().manual_seed(100 + case)
    nq = len(lens) if decode else sum(ql for ql, _ in lens)
    q = torch.randn(nq, hkv * ratio, d, generator=g)
    seq = torch.tensor([kv for _, kv in lens], dtype=torch.int32)
    cu = (
        None
        if decode
        else torch.tensor([0] + list(torch.tensor([ql for ql, _ in lens]).cumsum(0)), dtype=torch.int32)
    )
    with locked("paged_attention", kernel):
        out = lz.paged_attention(
            q,
            cache,
            bt,
            seq,
            cu_seqlens_q=cu,
            kv_layout=layout,
            k_scale=_scale_arg(ks, tensor_scale),
            v_scale=_scale_arg(vs, tensor_scale),
        )
    ref = _oracle(q, cache, bt, lens, layout, ks, vs, True, decode)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.to(F64), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16, torch.float64])
def test_attention_q_dtypes(qdtype):
    """q in any float dtype over an fp8 cache; output in q's dtype, within q's precision of the oracle."""
    lens = ((3, 10), (1, 4))
    cache, bt, _, _ = _fill("NHD", FP8, 4, 2, 16, lens, seed=3, ks=0.5, vs=0.5)
    q = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(1)).to(qdtype)
    seq, cu = torch.tensor([10, 4], dtype=torch.int32), torch.tensor([0, 3, 4], dtype=torch.int32)
    ref = _oracle(q, cache, bt, lens, "NHD", 0.5, 0.5, True, False)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float64: 1e-12}[qdtype]
    ran = []
    for kernel in ATTN_KERNELS:
        kw = dict(cu_seqlens_q=cu, k_scale=0.5, v_scale=0.5)
        codes = {r.code for r in lz.validate(kernel, "paged_attention", q, cache, bt, seq, **kw)}
        if codes == {
            ReasonCode.PLATFORM_UNSUPPORTED
        }:  # bf16 SDPA on an AMX CPU forced below AVX-512 (torch_sdpa)
            continue
        with locked("paged_attention", kernel):
            out = lz.paged_attention(q, cache, bt, seq, **kw)
        assert out.dtype == qdtype
        torch.testing.assert_close(out.to(F64), ref, atol=tol, rtol=tol)
        ran.append(kernel)
    assert "reference.paged_attention" in ran, ran  # the reference kernel runs on every CPU


def _fp8_bound(q, k, v, ks, vs, scale):
    """Bound on |attn(q, K', V') - attn(q, K, V)| per output element for e4m3 storage of K, V (one sequence,
    decode, GQA-repeated K/V ``[kv, Hq, D]``). Each stored element x' = s * round(x / s): |x' - x| <= 2^-4 |x|
    (3 mantissa bits, round to nearest) for normals and <= 2^-10 s in the subnormal range (step 2^-9 s),
    so |dx| <= 2^-4 |x| + 2^-10 s. Scores move by at most eps_j = scale * sum_d |q_d| |dk_jd|; with eps =
    max_j eps_j every softmax weight moves by at most p_j (e^{2 eps} - 1), hence |o' - o| <= max_j |dv_j| +
    (e^{2 eps} - 1) * max_j |v'_j| (per head and dim)."""
    dk = k.abs() * 2**-4 + 2**-10 * ks  # [kv, Hq, D]
    dv = v.abs() * 2**-4 + 2**-10 * vs
    eps = (scale * torch.einsum("hd,khd->kh", q.abs(), dk)).amax(0)  # [Hq]
    vmax = (v.abs() + dv).amax(0)  # [Hq, D]
    return dv.amax(0) + (torch.exp(2 * eps) - 1)[:, None] * vmax


def test_fp8_vs_unquantized_within_format_bound():
    """An fp8 cache vs a float32 cache with the same K/V: every output element within :func:`_fp8_bound`; the
    measured error is also printed (pytest -s)."""
    page, hkv, ratio, d = 8, 2, 2, 64
    lens = tuple((1, n) for n in (1, 7, 33, 64, 100))
    ks = vs = 0.25
    qc, bt, k_raw, v_raw = _fill("NHD", FP8, page, hkv, d, lens, seed=11, ks=ks, vs=vs)
    fc, _, _, _ = _fill("NHD", torch.float32, page, hkv, d, lens, seed=11, ks=ks, vs=vs)
    q = torch.randn(len(lens), hkv * ratio, d, generator=torch.Generator().manual_seed(5))
    seq = torch.tensor([kv for _, kv in lens], dtype=torch.int32)
    worst_rel = 0.0
    for kernel in ATTN_KERNELS:
        with locked("paged_attention", kernel):
            out_q = lz.paged_attention(q, qc, bt, seq, k_scale=ks, v_scale=vs).to(F64)
            out_f = lz.paged_attention(q, fc, bt, seq).to(F64)
        for s in range(len(lens)):
            k = k_raw[s].to(F64).repeat_interleave(ratio, 1)
            v = v_raw[s].to(F64).repeat_interleave(ratio, 1)
            bound = _fp8_bound(q[s].to(F64), k, v, ks, vs, 1 / math.sqrt(d))
            err = (out_q[s] - out_f[s]).abs()
            assert (err <= bound + 1e-6).all(), (kernel, s, float((err - bound).max()))
            worst_rel = max(worst_rel, float(err.max() / out_f[s].abs().max()))
    print(f"fp8 vs fp32 cache: worst max|diff| / max|out| = {worst_rel:.4f}")
    assert worst_rel < 0.1


def test_int8_vs_unquantized_within_half_step():
    """int8 with scale s: each stored value within s/2 of the original (V), so with K unquantized-equivalent
    the output error is bounded by the same argument as fp8 with |dx| <= s/2."""
    lens = ((1, 40), (1, 9))
    k_amax = 1.5 * 5
    ks = vs = k_amax / 127
    qc, bt, k_raw, v_raw = _fill("NHD", torch.int8, 8, 2, 32, lens, seed=2, ks=ks, vs=vs)
    fc, _, _, _ = _fill("NHD", torch.float32, 8, 2, 32, lens, seed=2, ks=ks, vs=vs)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(9))
    seq = torch.tensor([40, 9], dtype=torch.int32)
    out_q = lz.paged_attention(q, qc, bt, seq, k_scale=ks, v_scale=vs).to(F64)
    out_f = lz.paged_attention(q, fc, bt, seq).to(F64)
    for s in range(2):
        eps = (1 / math.sqrt(32)) * q[s].abs().to(F64).sum(-1) * ks / 2  # [Hq]
        vmax = v_raw[s].abs().amax((0, 1)).to(F64).max() + vs / 2
        bound = vs / 2 + (torch.exp(2 * eps) - 1)[:, None] * vmax
        assert ((out_q[s] - out_f[s]).abs() <= bound + 1e-6).all()


# ---------------------------------------------------------------------------------------------- routing
@pytest.mark.parametrize("dtype", QDTYPES, ids=["fp8", "int8"])
def test_kernels_without_quantized_reads_are_refused(dtype):
    cache = lz.allocate_kv_cache(4, 4, 2, 16, dtype)
    q = torch.randn(2, 4, 16)
    bt = torch.tensor([[0], [1]], dtype=torch.int32)
    seq = torch.tensor([3, 4], dtype=torch.int32)
    report = lz.explain("paged_attention", q, cache, bt, seq, k_scale=1.0, v_scale=1.0)
    assert report.context.kv_dtype == dtype
    assert report.chosen in ATTN_KERNELS
    ids = {c.kernel_id for c in report.candidates}
    for kid in REFUSED:
        if kid in ids:
            assert ReasonCode.KV_CACHE_DTYPE_UNSUPPORTED in {r.code for r in report.candidate(kid).reasons}, (
                kid
            )
    # the constraint alone (a CUDA-only kernel's other reasons aside), on every registered paged kernel
    ctx = report.context
    for spec in RUNTIME.registry.for_op("paged_attention"):
        codes = {r.code for r in check_constraints(spec, ctx)}
        assert (ReasonCode.KV_CACHE_DTYPE_UNSUPPORTED in codes) == (dtype not in spec.kv_cache_dtypes)
    unq = dataclasses.replace(ctx, kv_dtype=None)
    for spec in RUNTIME.registry.for_op("paged_attention"):
        assert ReasonCode.KV_CACHE_DTYPE_UNSUPPORTED not in {r.code for r in check_constraints(spec, unq)}
    # cache writes: on CPU the reference / torch_native writers; the Triton writer is refused for the device
    # only
    k = torch.randn(2, 2, 16)
    rep = lz.explain("reshape_and_cache", k, k, cache, torch.tensor([0, 1]))
    assert rep.chosen in CACHE_KERNELS
    for r in (report, rep):
        for kid in TRITON_READERS:
            if kid in {c.kernel_id for c in r.candidates}:
                codes = {x.code for x in r.candidate(kid).reasons}
                assert ReasonCode.KV_CACHE_DTYPE_UNSUPPORTED not in codes, kid


def test_lock_on_refusing_kernel_raises():
    cache = lz.allocate_kv_cache(2, 4, 1, 16, FP8)
    q = torch.randn(1, 1, 16)
    with (
        locked("paged_attention", "flex_attention.paged_attention"),
        pytest.raises(lz.NoKernelFoundError, match="KV_CACHE_DTYPE_UNSUPPORTED"),
    ):
        lz.paged_attention(
            q, cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
        )
