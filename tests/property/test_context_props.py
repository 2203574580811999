"""Properties of SelectionContext and the length bucketing the selection cache relies on.

- contexts built from random valid attention shapes are hashable, and the same cache key always builds an
  equal context (equal hash): caching by key is sound;
- ``bucket`` is monotone, ``bucket(n) >= n``, a power of two for ``n >= 2`` and ``< 2n`` (at most one
  doubling of the work a kernel is chosen for); 0 and 1 stay themselves;
- lengths in one bucket give equal contexts; lengths in different buckets do not.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerzero.core.context import SelectionContext, bucket
from layerzero.ops import OPS

pytestmark = pytest.mark.property

PREPARE, CONTEXT = OPS["attention"]  # validate + build the cache key; cache key -> SelectionContext
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@st.composite
def attention_args(draw):
    """Valid (q, k, v, kwargs) for lz.attention with tiny tensors; shapes, GQA, mask, flags and layout
    drawn."""
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 3))
    hq = hkv * draw(st.integers(1, 3))
    sq = draw(st.integers(1, 9))
    sk = draw(st.sampled_from([sq, draw(st.integers(1, 9))]))
    d = draw(st.sampled_from([1, 2, 4, 8, 6]))
    dv = draw(st.sampled_from([d, 4]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    layout = draw(st.sampled_from(["BHSD", "BSHD"]))
    if layout == "BHSD":
        shapes = ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv))
    else:
        shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv))
    q, k, v = (torch.zeros(s, dtype=dtype) for s in shapes)
    kwargs = {"layout": layout, "is_causal": draw(st.booleans())}
    mask = draw(st.sampled_from([None, "bool", "float"]))
    if mask == "bool":
        kwargs["attn_mask"] = torch.ones(sq, sk, dtype=torch.bool)
    elif mask == "float":
        kwargs["attn_mask"] = torch.zeros(1, 1, sq, sk, dtype=dtype)
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(0.01, 4.0))
    if draw(st.booleans()):
        kwargs["dropout_p"] = draw(st.floats(0.0, 0.9))
    return q, k, v, kwargs


@SETTINGS
@given(attention_args())
def test_contexts_are_hashable_and_equal_for_equal_keys(args):
    q, k, v, kwargs = args
    key1, _ = PREPARE(q, k, v, **kwargs)
    key2, _ = PREPARE(q.clone(), k.clone(), v.clone(), **kwargs)
    assert key1 == key2 and hash(key1) == hash(key2)
    c1, c2 = CONTEXT(key1), CONTEXT(key2)
    assert isinstance(c1, SelectionContext)
    assert c1 == c2 and hash(c1) == hash(c2)
    assert len({c1, c2}) == 1
    assert c1.bucket_key() == c2.bucket_key()
    # what the context records is what was passed, bucketed
    bshd = kwargs["layout"] == "BSHD"
    sq = q.shape[1] if bshd else q.shape[2]
    sk = k.shape[1] if bshd else k.shape[2]
    assert c1.seq_len_q == bucket(sq) and c1.seq_len_kv == bucket(sk)
    assert c1.seq_equal == (sq == sk)
    assert c1.head_dim == q.shape[-1] and c1.head_dim_v == v.shape[-1]
    assert c1.num_heads_q // c1.num_heads_kv == c1.gqa_ratio
    assert c1.dtype == q.dtype and c1.is_causal == kwargs["is_causal"]
    assert c1.dropout == (kwargs.get("dropout_p", 0.0) > 0.0)
    assert c1.scale_default == ("scale" not in kwargs)


@given(st.integers(0, 1 << 40))
def test_bucket_bounds_and_power_of_two(n):
    b = bucket(n)
    assert b >= n
    if n >= 2:
        assert b & (b - 1) == 0  # power of two
        assert b < 2 * n
    else:
        assert b == n


@given(st.integers(0, 1 << 40), st.integers(0, 1 << 40))
def test_bucket_is_monotone(m, n):
    lo, hi = min(m, n), max(m, n)
    assert bucket(lo) <= bucket(hi)


@given(st.integers(2, 1 << 30))
def test_bucket_is_the_smallest_power_of_two_at_least_n(n):
    b = bucket(n)
    assert b // 2 < n <= b  # brute-force-free characterization of "next power of two"
    assert bucket(b) == b  # powers of two are fixed points


def test_bucket_hand_worked():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 600, 1000, 1024, 1025, 1100)] == [
        0,
        1,
        2,
        4,
        4,
        8,
        1024,
        1024,
        1024,
        2048,
        2048,
    ]


@SETTINGS
@given(st.integers(1, 64), st.integers(1, 64))
def test_lengths_in_one_bucket_share_a_context(s1, s2):
    def ctx(s):
        t = torch.zeros(1, 1, s, 4)
        return CONTEXT(PREPARE(t, t, t)[0])

    assert (ctx(s1) == ctx(s2)) == (bucket(s1) == bucket(s2))
