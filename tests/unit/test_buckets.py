"""Sequence-length buckets: a cached choice is valid for every length in its bucket."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.backends.torch_sdpa.kernels import kernel_specs
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import BackendSpec, KernelSpec

pytestmark = pytest.mark.unit


@pytest.fixture
def short_kernel():
    """A fast attention kernel that only supports up to 700 tokens (plain SDPA math underneath)."""
    RUNTIME.ensure_ready()
    math = next(s for s in kernel_specs() if s.kernel_id == "torch_sdpa.math")
    RUNTIME.registry.add_backend(BackendSpec("short", None, "0", True), replace=True)
    spec = KernelSpec("short.attention", "attention", math.fn, priority=99, max_seq_len=700)
    RUNTIME.registry.add_kernel(spec)
    yield spec
    RUNTIME.registry.remove_kernel("short.attention")
    # and the backend: a later multi-process engine's ranks (fresh processes) would not have it, and
    # lz.distributed.sync_selection refuses ranks whose backend lists differ
    RUNTIME.registry.backends.remove("short")


def test_max_seq_len_is_checked_against_the_bucket_upper_bound(short_kernel):
    small = torch.randn(1, 1, 500, 8)  # bucket 512 <= 700: eligible
    mid = torch.randn(1, 1, 600, 8)  # bucket 1024 > 700: rejected although 600 <= 700
    assert lz.which("attention", small, small, small) == "short.attention"
    assert lz.which("attention", mid, mid, mid) != "short.attention"
    reasons = lz.validate("short.attention", "attention", mid, mid, mid)
    assert [r.code for r in reasons] == [lz.ReasonCode.SEQ_LEN_TOO_LONG]
    assert "1024" in reasons[0].message
    # 800 tokens share 600's bucket: the cached (rejecting) choice stays correct for them too
    big = torch.randn(1, 1, 800, 8)
    assert lz.which("attention", big, big, big) == lz.which("attention", mid, mid, mid)


def test_bucket_boundaries_share_and_split_cache_entries():
    RUNTIME.ensure_ready()
    before = RUNTIME.cache.stats().size
    for s in (513, 700, 1024):
        x = torch.randn(1, 1, s, 8)
        lz.attention(x, x, x)
    assert RUNTIME.cache.stats().size - before == 1
    x = torch.randn(1, 1, 1025, 8)
    lz.attention(x, x, x)
    assert RUNTIME.cache.stats().size - before == 2


def test_attention_key_buckets_equal_core_bucket():
    """lz.attention inlines the power-of-two bucketing on its hot path; it must equal core.context.bucket for
    the batch and both lengths, odd sizes included, on the fast path and the validating path (a float
    mask)."""
    import importlib

    from layerzero.core.context import bucket

    att = importlib.import_module("layerzero.ops.attention")
    for b, sq, sk in [(1, 1, 1), (2, 3, 5), (3, 17, 33), (5, 64, 65), (7, 1, 1000)]:
        q = torch.randn(b, 2, sq, 8)
        k = v = torch.randn(b, 2, sk, 8)
        for mask in (None, torch.zeros(sq, sk)):
            key, _ = att.prepare(q, k, v, attn_mask=mask)
            assert (key.batch, key.seq_len_q, key.seq_len_kv) == (bucket(b), bucket(sq), bucket(sk)), (
                b,
                sq,
                sk,
            )
