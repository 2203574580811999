"""``triton.reshape_and_cache`` on CPU through the Triton interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py when no CUDA device is visible), against a token-by-token oracle written by hand: seeded
ragged cases (NHD and HND, page sizes 1..32, Hkv 1..8, odd head dims, -1 padding slots, K/V as strided views
of a packed QKV projection). The write is a copy, so the comparison is exact: every written slot bit-equal to
its token, every other slot (NaN-filled) untouched. Plus its KernelSpec's routing on hand-built contexts."""

from __future__ import annotations

import random

import pytest
import torch
from _triton_interp import needs_interpreter

from layerzero.backends.triton import cache as tc
from layerzero.core.context import SelectionContext
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.selection import SelectionInputs, select
from layerzero.testing.devices import fake_cuda_device
from layerzero.testing.registries import routing_registry

pytestmark = pytest.mark.correctness

interpreted = needs_interpreter("tests/gpu/test_gpu_triton_cache.py")


def _case(seed: int, layout: str, dtype: torch.dtype):
    """(k, v, cache, slots): T new tokens of Hkv heads, K/V cut out of a packed [T, (Hq + 2 Hkv) * D]
    projection (row stride > Hkv * D), unique slots in a NaN-filled cache, about a fifth of them -1."""
    rnd = random.Random(seed)
    t, hkv, d, page = (
        rnd.randint(1, 40),
        rnd.choice([1, 2, 3, 8]),
        rnd.choice([8, 20, 64, 128]),
        rnd.choice([1, 5, 16, 32]),
    )
    blocks = (t + page - 1) // page + rnd.randint(1, 3)
    g = torch.Generator().manual_seed(seed)
    hq = 2 * hkv
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    slots = torch.tensor(rnd.sample(range(blocks * page), t), dtype=rnd.choice([torch.int32, torch.int64]))
    slots[torch.rand(t, generator=g) < 0.2] = -1
    shape = (blocks, 2, page, hkv, d) if layout == "NHD" else (blocks, 2, hkv, page, d)
    cache = torch.full(shape, float("nan"), dtype=dtype)
    return k, v, cache, slots, page


def _oracle(k, v, cache, slots, page, layout):
    out = cache.clone()
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, page)
        for which, src in ((0, k), (1, v)):
            if layout == "NHD":
                out[b, which, o] = src[i]
            else:
                out[b, which, :, o] = src[i]
    return out


@interpreted
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_matches_token_by_token_oracle_exactly(layout, dtype, seed):
    k, v, cache, slots, page = _case(seed * 7 + len(layout), layout, dtype)
    want = _oracle(k, v, cache, slots, page, layout)
    k_before, v_before = k.clone(), v.clone()
    tc.reshape_and_cache(k, v, cache, slots, layout)
    torch.testing.assert_close(cache, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


@interpreted
def test_hand_worked_page_boundaries_and_skips():
    """Page 4, one head, D 2: slots 3 (block 0, last offset), 4 (block 1, first), -1 (skipped), 9 (block 2,
    offset 1): exactly those three rows change."""
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]], [[7.0, 8.0]]])
    v = -k
    cache = torch.zeros(3, 2, 4, 1, 2)
    tc.reshape_and_cache(k, v, cache, torch.tensor([3, 4, -1, 9]), "NHD")
    nz = {tuple(i) for i in (cache[:, 0, :, 0, 0] != 0).nonzero().tolist()}
    assert nz == {(0, 3), (1, 0), (2, 1)}
    assert cache[0, 0, 3, 0].tolist() == [1.0, 2.0] and cache[1, 1, 0, 0].tolist() == [-3.0, -4.0]
    assert cache[2, 0, 1, 0].tolist() == [7.0, 8.0]


@interpreted
def test_all_slots_skipped_and_empty_batch_write_nothing():
    cache = torch.full((2, 2, 4, 1, 8), float("nan"))
    k = torch.randn(3, 1, 8)
    tc.reshape_and_cache(k, k, cache, torch.full((3,), -1), "NHD")
    tc.reshape_and_cache(k[:0], k[:0], cache, torch.zeros(0, dtype=torch.int64), "NHD")
    assert torch.isnan(cache).all()


# ------------------------------------------------------------------------------------------------ routing
@pytest.fixture
def registry():
    """The reshape_and_cache op with the reference, torch_native and (fake-installed) triton kernels."""
    return routing_registry("reshape_and_cache", [tc.kernel_spec(True, "")])


def _ctx(device, dtype=torch.bfloat16, capture=False, stride=True):
    return SelectionContext(
        op="reshape_and_cache",
        device=device,
        dtype=dtype,
        batch=8,
        num_heads_kv=8,
        head_dim=128,
        page_size=16,
        kv_layout="NHD",
        graph_capture=capture,
        stride_last_1=stride,
    )


def _select(reg, ctx):
    return select(
        reg,
        ctx,
        SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False),
    )


@pytest.mark.unit
@pytest.mark.parametrize("capture", [False, True])
def test_chosen_on_cuda_eager_and_under_capture(registry, capture):
    plan, _ = _select(registry, _ctx(fake_cuda_device((9, 0)), capture=capture))
    assert plan.kernel_id == tc.KERNEL_ID


@pytest.mark.unit
def test_refused_on_cpu_old_gpus_and_strided_rows(registry):
    from layerzero.core.device import DeviceSpec

    for ctx, code in (
        (_ctx(DeviceSpec.detect("cpu")), R.DEVICE_TYPE_UNSUPPORTED),
        (_ctx(fake_cuda_device((7, 5))), R.SM_TOO_OLD),
        (_ctx(fake_cuda_device((9, 0)), dtype=torch.float64), R.DTYPE_UNSUPPORTED),
    ):
        plan, report = _select(registry, ctx)
        assert code in {r.code for r in report.candidate(tc.KERNEL_ID).reasons}
        assert plan.kernel_id != tc.KERNEL_ID
    plan, report = _select(registry, _ctx(fake_cuda_device((9, 0)), stride=False))
    assert plan.kernel_id != tc.KERNEL_ID and report.candidate(tc.KERNEL_ID).reasons
