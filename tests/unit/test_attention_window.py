"""``lz.attention(window=, softcap=)``: validation, normalization, cache key, constraints and routing on CPU,
and the transformers integration's mapping of ``sliding_window`` / ``softcap``.

Numerical agreement of every implementation with a brute-force float64 oracle is in
``tests/correctness/test_attention_window_oracle.py``; FlashAttention routing with fake libraries is in
``tests/unit/test_flash_attn_backend.py`` (section 5).
"""

from __future__ import annotations

import importlib
import math
import types
from dataclasses import replace

import pytest
import torch

import layerzero as lz
from layerzero.core.constraints import check_constraints
from layerzero.core.errors import InvalidInputError
from layerzero.core.reasons import ReasonCategory, ReasonCode
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import KernelSpec
from layerzero.integrations.transformers.attention import layerzero_attention_forward

pytestmark = pytest.mark.unit

A = importlib.import_module("layerzero.ops.attention")  # the module (the package re-exports the function)

R = ReasonCode


def qkv(b=1, hq=4, hkv=2, sq=6, sk=6, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, sq, d, generator=g, dtype=dtype),
        torch.randn(b, hkv, sk, d, generator=g, dtype=dtype),
        torch.randn(b, hkv, sk, d, generator=g, dtype=dtype),
    )


def hand_oracle(q, k, v, *, causal=False, window=None, softcap=None, mask=None):
    """float64, written independently of the library: explicit (i, j) visibility, GQA by repeat_interleave."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = s.shape[-2:]
    ok = torch.tensor(
        [
            [
                (not causal or j <= i)
                and (window is None or window[0] < 0 or j >= i - window[0])
                and (window is None or window[1] < 0 or j <= i + window[1])
                for j in range(sk)
            ]
            for i in range(sq)
        ]
    )
    if mask is not None:
        ok = ok & mask
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


# ----------------------------------------------------------------------------- reasons and spec data


def test_new_reason_codes_are_mask_category_and_default_specs_refuse():
    assert R.SLIDING_WINDOW_UNSUPPORTED.category is ReasonCategory.MASK
    assert R.SOFTCAP_UNSUPPORTED.category is ReasonCategory.MASK
    spec = KernelSpec("x.attention", "attention", lambda *a: None)
    assert spec.supports_window is False and spec.supports_softcap is False
    assert spec.constraints()["supports_window"] is False and spec.constraints()["supports_softcap"] is False


def _ctx(**kw):
    key, _ = A.prepare(*qkv(), **kw)
    return A.context(key)


def test_constraints_report_window_and_softcap_independently():
    spec = KernelSpec("x.attention", "attention", lambda *a: None)
    assert {r.code for r in check_constraints(spec, _ctx(window=(1, 1)))} == {R.SLIDING_WINDOW_UNSUPPORTED}
    assert {r.code for r in check_constraints(spec, _ctx(softcap=3.0))} == {R.SOFTCAP_UNSUPPORTED}
    both = {r.code for r in check_constraints(spec, _ctx(window=(1, 1), softcap=3.0))}
    assert both == {R.SLIDING_WINDOW_UNSUPPORTED, R.SOFTCAP_UNSUPPORTED}
    ok = replace(spec, supports_window=True, supports_softcap=True)
    assert check_constraints(ok, _ctx(window=(1, 1), softcap=3.0)) == []
    assert check_constraints(spec, _ctx()) == []


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "window", [(1,), (1, 2, 3), 3, "1,0", (1.0, 0), (True, 0), (-2, 0), (0, -5), (None, "a"), (None,)]
)
def test_bad_window_raises(window):
    with pytest.raises(InvalidInputError, match="window"):
        lz.attention(*qkv(), window=window)


@pytest.mark.parametrize("softcap", [0, 0.0, -1.0, float("inf"), float("nan"), True, "50"])
def test_bad_softcap_raises(softcap):
    with pytest.raises(InvalidInputError, match="softcap"):
        lz.attention(*qkv(), softcap=softcap)


# ----------------------------------------------------------------------------- normalization and key


@pytest.mark.parametrize(
    ("window", "causal", "sq", "sk", "expected"),
    [
        ((2, 1), False, 6, 6, (2, 1)),
        ((2, 1), True, 6, 6, (2, 0)),  # causal bounds the right side at 0
        ((-1, 3), True, 6, 6, None),  # causal + unbounded left: plain causal
        ((5, 5), False, 6, 6, None),  # covers every (i, j) of a 6 x 6 call
        ((5, 0), False, 6, 6, (-1, 0)),  # left >= Sq - 1 never restricts
        ((4, 8), False, 6, 9, (4, -1)),  # right >= Sk - 1 never restricts
        ((0, 0), False, 1, 9, (-1, 0)),  # one query: left never restricts
        ((-1, -1), False, 6, 6, None),
        ((None, 3), True, 6, 6, None),  # None = unbounded, as -1 (FlashAttention's spelling)
        ((2, None), False, 6, 9, (2, -1)),
        ((None, None), False, 6, 6, None),
    ],
)
def test_window_normalization_hand_worked(window, causal, sq, sk, expected):
    assert A._window(window, causal, sq, sk) == expected


def test_trivial_window_serves_like_no_window():
    q, k, v = qkv(dtype=torch.float32)
    assert lz.which("attention", q, k, v, window=(10, 10)) == lz.which("attention", q, k, v)
    key_plain, args_plain = A.prepare(q, k, v, is_causal=True)
    key_win, args_win = A.prepare(q, k, v, is_causal=True, window=(-1, 7))
    assert key_plain[:-1] == key_win[:-1] and len(args_win) == len(args_plain) == 7


def test_softcap_value_is_not_in_the_key_but_window_sizes_are():
    q, k, v = qkv()
    k1, a1 = A.prepare(q, k, v, softcap=30.0)
    k2, a2 = A.prepare(q, k, v, softcap=50.0)
    assert k1 == k2 and a1[-1] == 30.0 and a2[-1] == 50.0
    w1, _ = A.prepare(q, k, v, window=(1, 0))
    w2, _ = A.prepare(q, k, v, window=(2, 0))
    assert w1 != w2
    ctx = A.context(w1)
    assert (ctx.window_left, ctx.window_right, ctx.has_softcap) == (1, 0, None)
    assert A.context(k1).has_softcap is True and A.context(k1).window_left is None


def test_plain_context_bucket_key_does_not_mention_window_or_softcap():
    key = _ctx().bucket_key()
    assert "window" not in key and "softcap" not in key


def test_fast_and_slow_paths_build_the_same_key():
    """A Parameter (a Tensor subclass) takes the full validation; its key must equal the fast path's."""
    q, k, v = qkv(dtype=torch.float32)
    fast, _ = A._prepare(q, k, v, None, True, None, 0.0, "BHSD")
    slow, _ = A._prepare(torch.nn.Parameter(q, requires_grad=False), k, v, None, True, None, 0.0, "BHSD")
    assert fast == slow  # plain tuples of the AttentionKey fields
    named = A.AttentionKey(*fast)
    assert named == fast and hash(named) == hash(fast) and named.is_causal and named.num_heads_q == q.shape[1]


# ----------------------------------------------------------------------------- routing on CPU


def test_sdpa_refuses_with_the_new_reasons_and_reference_serves():
    q, k, v = qkv(dtype=torch.float32)
    report = lz.explain("attention", q, k, v, is_causal=True, window=(2, 0), softcap=5.0)
    assert report.chosen == "reference.attention"
    sdpa = [c for c in report.candidates if c.kernel_id.startswith("torch_sdpa.")]
    assert sdpa
    for cand in sdpa:
        got = {r.code for r in cand.reasons}
        assert {R.SLIDING_WINDOW_UNSUPPORTED, R.SOFTCAP_UNSUPPORTED} <= got, cand.kernel_id
    flex = report.candidate("flex_attention.attention")
    if flex is not None:
        assert not {r.code for r in flex.reasons} & {R.SLIDING_WINDOW_UNSUPPORTED, R.SOFTCAP_UNSUPPORTED}


@pytest.mark.parametrize("kernel_id", ["reference.attention", "flex_attention.attention"])
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_locked_kernels_serve_window_softcap_in_both_layouts(kernel_id, layout):
    RUNTIME.ensure_ready()
    if not RUNTIME.registry.backend(kernel_id.split(".")[0]).available:
        pytest.skip(f"{kernel_id} unavailable here")
    q, k, v = qkv(sq=5, sk=7, hq=4, hkv=1, seed=3)
    want = hand_oracle(q, k, v, causal=True, window=(1, 0), softcap=2.0)
    lz.lock("attention", kernel_id)
    try:
        if layout == "BSHD":
            out = lz.attention(
                *(t.transpose(1, 2) for t in (q, k, v)),
                is_causal=True,
                window=(1, 0),
                softcap=2.0,
                layout="BSHD",
            ).transpose(1, 2)
        else:
            out = lz.attention(q, k, v, is_causal=True, window=(1, 0), softcap=2.0)
    finally:
        lz.unlock("attention")
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)


# ----------------------------------------------------------------------------- transformers integration


def _module(is_causal=True):
    return types.SimpleNamespace(is_causal=is_causal)


def test_hf_softcap_is_applied():
    q, k, v = qkv(seed=5)
    out, weights = layerzero_attention_forward(_module(), q, k, v, None, softcap=1.5)
    assert weights is None
    torch.testing.assert_close(
        out, hand_oracle(q, k, v, causal=True, softcap=1.5).transpose(1, 2), atol=1e-10, rtol=1e-10
    )
    zero, _ = layerzero_attention_forward(
        _module(), q, k, v, None, softcap=0.0
    )  # 0 = off, as in FlashAttention
    torch.testing.assert_close(
        zero, hand_oracle(q, k, v, causal=True).transpose(1, 2), atol=1e-10, rtol=1e-10
    )


def test_hf_sliding_window_without_mask_maps_to_window():
    q, k, v = qkv(sq=7, sk=7, seed=6)
    out, _ = layerzero_attention_forward(_module(), q, k, v, None, sliding_window=3)
    # transformers: key j visible to query i iff j <= i and j > i - 3, i.e. window=(2, 0)
    torch.testing.assert_close(
        out, hand_oracle(q, k, v, causal=True, window=(2, 0)).transpose(1, 2), atol=1e-10, rtol=1e-10
    )


def test_hf_sliding_window_with_mask_is_not_applied_twice():
    q, k, v = qkv(sq=7, sk=7, seed=7)
    i, j = torch.arange(7)[:, None], torch.arange(7)[None]
    mask = ((j <= i) & (i - j < 3))[None, None]
    # a window applied on top of the mask would differ from the mask alone only if doubled (W=2 < 3)
    out, _ = layerzero_attention_forward(_module(), q, k, v, mask, sliding_window=2)
    torch.testing.assert_close(
        out, hand_oracle(q, k, v, mask=mask[0, 0]).transpose(1, 2), atol=1e-10, rtol=1e-10
    )


def test_hf_sliding_window_without_mask_and_unequal_lengths_is_refused():
    q, k, v = qkv(sq=1, sk=9)
    with pytest.raises(InvalidInputError, match="sliding window without a mask"):
        layerzero_attention_forward(_module(), q, k, v, None, sliding_window=4)


def test_capture_key_keeps_the_window_and_flips_only_the_capture_flag():
    from layerzero.core.dispatch import capture_key

    key, _ = A.prepare(*qkv(), is_causal=True, window=(2, 0), softcap=3.0)
    cap = capture_key(key)
    assert (
        cap is not None
        and cap.capture is True
        and key.capture is False
        and cap._replace(capture=False) == key
    )
    ctx = A.context(cap)
    assert ctx.graph_capture and (ctx.window_left, ctx.window_right, ctx.has_softcap) == (2, 0, True)


def test_window_and_softcap_fast_path_builds_the_validating_path_key():
    """A tuple window and a float softcap stay on prepare's fast path; its key and args must equal what the
    full validation builds for the same call (a list window / int softcap take that path), and bad values
    still get the typed error."""
    att = importlib.import_module("layerzero.ops.attention")

    q = torch.randn(1, 4, 9, 16)
    k = v = torch.randn(1, 2, 9, 16)
    for causal, window, softcap in [
        (True, (3, 0), None),
        (False, (2, 5), 30.0),
        (True, None, 50.0),
        (False, (20, 20), None),
        (True, (8, 0), 7.0),
    ]:
        fast = att.prepare(q, k, v, is_causal=causal, window=window, softcap=softcap)
        slow = att.prepare(
            q,
            k,
            v,
            is_causal=causal,
            window=None if window is None else list(window),
            softcap=None if softcap is None else int(softcap),
        )
        assert fast[0] == slow[0], (causal, window, softcap)
        assert len(fast[1]) == len(slow[1]) and fast[1][7:] == slow[1][7:]
    with pytest.raises(InvalidInputError, match="window"):
        att.prepare(q, k, v, window=(-2, 0))
    with pytest.raises(InvalidInputError, match="softcap"):
        att.prepare(q, k, v, softcap=float("nan"))
