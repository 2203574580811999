"""Quantized paged KV caches: validation (typed errors, never assert), cache keys, contexts and the hot
key."""

from __future__ import annotations

import math

import pytest
import torch

import layerzero as lz
from layerzero.core.kv_quant import dequantize_kv, quantize_kv
from layerzero.ops import paged

pytestmark = pytest.mark.unit

FP8 = torch.float8_e4m3fn
I32 = torch.int32


def _inputs(dtype=FP8, device="cpu"):
    cache = lz.allocate_kv_cache(4, 4, 2, 8, dtype, device=device)
    q = torch.randn(2, 4, 8, device=device)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=I32, device=device)
    seq = torch.tensor([5, 3], dtype=I32, device=device)
    return q, cache, bt, seq


@pytest.mark.parametrize("dtype", [FP8, torch.int8])
def test_allocate_quantized_cache_is_one_byte(dtype):
    cache = lz.allocate_kv_cache(3, 16, 2, 64, dtype)
    assert cache.dtype == dtype and cache.element_size() == 1 and cache.shape == (3, 2, 16, 2, 64)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e5m2, torch.int32, torch.bool])
def test_other_cache_dtypes_refused(dtype):
    with pytest.raises(lz.InvalidInputError, match="float8_e4m3fn/int8"):
        lz.allocate_kv_cache(1, 4, 1, 8, dtype)
    q, cache, bt, seq = _inputs(torch.float32)
    bad = torch.zeros(cache.shape, dtype=dtype)
    with pytest.raises(lz.InvalidInputError, match="kv_cache.dtype"):
        lz.paged_attention(q, bad, bt, seq)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, True, "1", [1.0]])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_bad_scale_values(bad, which):
    q, cache, bt, seq = _inputs()
    with pytest.raises(lz.InvalidInputError, match=which):
        lz.paged_attention(q, cache, bt, seq, **{which: bad})
    k = torch.randn(2, 2, 8)
    with pytest.raises(lz.InvalidInputError, match=which):
        lz.reshape_and_cache(k, k, cache, torch.tensor([0, 1]), **{which: bad})


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.tensor(1.0, dtype=torch.float64), "float32"),
        (torch.tensor([1.0, 2.0]), "float32"),
        (torch.ones(1, 1), "float32"),
        (torch.tensor(-2.0), "value"),
        (torch.tensor(float("nan")), "value"),
        (torch.tensor(1.0, device="meta"), "device"),
    ],
)
def test_bad_scale_tensors(bad, match):
    q, cache, bt, seq = _inputs()
    with pytest.raises(lz.InvalidInputError, match=match):
        lz.paged_attention(q, cache, bt, seq, k_scale=bad)


def test_scale_tensor_forms_accepted():
    q, cache, bt, seq = _inputs()
    for s in (torch.tensor(0.5), torch.tensor([0.5]), 2, 0.5):
        assert lz.paged_attention(q, cache, bt, seq, k_scale=s, v_scale=s).shape == q.shape


def test_scales_with_unquantized_cache_refused():
    q, cache, bt, seq = _inputs(torch.float32)
    with pytest.raises(lz.InvalidInputError, match="unquantized"):
        lz.paged_attention(q, cache, bt, seq, k_scale=1.0)
    with pytest.raises(lz.InvalidInputError, match="unquantized"):
        lz.reshape_and_cache(q[:, :2], q[:, :2], cache, torch.tensor([0, 1]), v_scale=1.0)


def test_q_and_kv_must_be_float():
    q, cache, bt, seq = _inputs()
    with pytest.raises(lz.InvalidInputError, match="q.dtype"):
        lz.paged_attention(q.to(torch.int8), cache, bt, seq)
    k = torch.randn(2, 2, 8)
    with pytest.raises(lz.InvalidInputError, match="k.dtype"):
        lz.reshape_and_cache(k.to(FP8), k, cache, torch.tensor([0, 1]))
    with pytest.raises(lz.InvalidInputError, match="v.dtype"):
        lz.reshape_and_cache(k, k.half(), cache, torch.tensor([0, 1]))


def test_unquantized_dtype_mismatch_still_refused():
    q, cache, bt, seq = _inputs(torch.float16)
    with pytest.raises(lz.InvalidInputError, match="dtype"):
        lz.paged_attention(q, cache, bt, seq)


def test_default_scale_is_one():
    q, cache, bt, seq = _inputs()
    k = torch.randn(2, 2, 8)
    lz.reshape_and_cache(k, k, cache, torch.tensor([0, 5]))
    assert torch.equal(cache[0, 0, 0].view(torch.uint8), k[0].to(FP8).view(torch.uint8))
    a = lz.paged_attention(q, cache, bt, seq)
    b = lz.paged_attention(q, cache, bt, seq, k_scale=1.0, v_scale=torch.tensor(1.0))
    assert torch.equal(a, b)


def test_keys_and_contexts_carry_the_cache_dtype_not_scale_values():
    q, cache, bt, seq = _inputs()
    k1, a1 = paged.prepare(q, cache, bt, seq, k_scale=0.5, v_scale=2.0)
    k2, a2 = paged.prepare(q, cache, bt, seq, k_scale=0.25)
    assert k1 == k2 and k1.kv_dtype == FP8 and paged.context(k1).kv_dtype == FP8
    assert a1[-2:] == (0.5, 2.0) and a2[-2:] == (0.25, 1.0)
    qu, cu, _, _ = _inputs(torch.float32)
    ku, au = paged.prepare(qu, cu, bt, seq)
    assert ku.kv_dtype is None and paged.context(ku).kv_dtype is None and len(au) == 8
    ki, _ = paged.prepare(q, lz.allocate_kv_cache(4, 4, 2, 8, torch.int8), bt, seq)
    assert ki.kv_dtype == torch.int8 and ki != k1
    kc, ac = paged.prepare_cache(q[:, :2], q[:, :2], cache, torch.tensor([0, 1]), v_scale=3.0)
    assert kc.kv_dtype == FP8 and paged.context_cache(kc).kv_dtype == FP8 and ac[-2:] == (1.0, 3.0)
    assert "kv_dtype=float8_e4m3fn" in paged.context(k1).bucket_key()
    assert "kv_dtype" not in paged.context(ku).bucket_key()


def test_hot_key_has_cache_dtype_and_scale_presence_not_values():
    q, cache, bt, seq = (t.to("meta") for t in _inputs())
    hk = paged._hot_key
    base = hk(q, cache, bt, seq, None, None, True, "NHD")
    assert base is not None and base[-1] == (FP8, "none", "none")
    assert hk(q, cache, bt, seq, None, None, True, "NHD", 0.5, 2.0) == hk(
        q, cache, bt, seq, None, None, True, "NHD", 4.0, 0.125
    )
    assert hk(q, cache, bt, seq, None, None, True, "NHD", 0.5) != base
    ts = torch.tensor(1.0, device="meta")
    assert hk(q, cache, bt, seq, None, None, True, "NHD", ts, ts)[-1] == (FP8, "tensor", "tensor")
    # invalid scales or a foreign scale tensor: no hot key (the full checks run and raise)
    for bad in (
        -1.0,
        math.nan,
        math.inf,
        torch.tensor(1.0),
        torch.tensor(1.0, dtype=torch.float64, device="meta"),
    ):
        assert hk(q, cache, bt, seq, None, None, True, "NHD", bad) is None
    i8 = cache.to(torch.int8)
    assert hk(q, i8, bt, seq, None, None, True, "NHD")[-1] == (torch.int8, "none", "none")
    unq = cache.to(torch.float32)
    assert hk(q, unq, bt, seq, None, None, True, "NHD")[-1] is None
    assert hk(q, unq, bt, seq, None, None, True, "NHD", 1.0) is None
    assert hk(q, cache.to(torch.float16), bt, seq, None, None, True, "NHD") is None


def test_quantize_helpers_round_trip():
    x = torch.tensor([0.1, -3.0, 1000.0, -0.0])
    assert quantize_kv(x, 1.0, FP8).float().tolist()[2] == 448.0
    codes = quantize_kv(x, 0.5, torch.int8)
    assert codes.tolist() == [0, -6, 127, 0]
    assert dequantize_kv(codes, 0.5).tolist() == [0.0, -3.0, 63.5, 0.0]
    assert dequantize_kv(codes, torch.tensor(0.5), torch.float64).dtype == torch.float64


def test_custom_kernel_declaring_quantized_caches_gets_the_scales():
    seen = []

    def mine(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        is_causal,
        layout,
        k_scale=None,
        v_scale=None,
    ):
        seen.append((k_scale, v_scale))
        return torch.zeros_like(q)

    lz.register_kernel(
        "paged_attention",
        "mylib.fp8_paged",
        mine,
        kv_cache_dtypes={"float8_e4m3fn"},
        priority=99,
        device_types={"cpu"},
        graph_safe=False,
    )
    try:
        q, cache, bt, seq = _inputs()
        assert lz.explain("paged_attention", q, cache, bt, seq).chosen == "mylib.fp8_paged"
        lz.paged_attention(q, cache, bt, seq, v_scale=0.5)
        assert seen == [(1.0, 0.5)]
        qi, ci, _, _ = _inputs(torch.int8)
        assert lz.explain("paged_attention", qi, ci, bt, seq).chosen != "mylib.fp8_paged"

        def bad(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, layout):
            return q

        with pytest.raises(lz.ConfigurationError, match="k_scale=None, v_scale=None"):
            lz.register_kernel("paged_attention", "mylib.bad", bad, kv_cache_dtypes={"int8"})
    finally:
        lz.unregister_kernel("mylib.fp8_paged")
