"""The "layerzero" transformers mask function under (faked) CUDA-graph capture: a plain causal mask is skipped
exactly where eager transformers skips it, so a captured forward calls lz.attention as the eager warm-up did;
every other mask (padding, sliding window, Sq != Sk) is transformers' own, unchanged."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask  # noqa: E402

from layerzero.integrations.transformers import masks, register  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture
def capturing(monkeypatch):
    monkeypatch.setattr(masks, "_capturing", lambda: True)


def _args(sq, sk, **kw):
    import inspect

    if "q_length" in inspect.signature(sdpa_mask).parameters:
        return dict(batch_size=2, q_length=sq, kv_length=sk, **kw)
    return dict(batch_size=2, cache_position=torch.arange(sk - sq, sk), kv_length=sk, **kw)


def _mask_fn():
    register()
    return AttentionMaskInterface._global_mapping["layerzero"]


@pytest.mark.parametrize(("sq", "sk"), [(7, 7), (1, 9)])
def test_plain_causal_mask_is_skipped_under_capture(capturing, sq, sk):
    assert _mask_fn()(**_args(sq, sk)) is None


def test_outside_capture_it_is_transformers_own():
    fn = _mask_fn()
    got, want = (
        fn(**_args(5, 5, allow_is_causal_skip=False)),
        sdpa_mask(**_args(5, 5, allow_is_causal_skip=False)),
    )
    assert torch.equal(got, want) and torch.equal(got[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())


def test_padding_window_and_uneven_lengths_are_transformers_own_under_capture(capturing):
    fn = _mask_fn()
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[0, :2] = False  # left padding of row 0
    for kw, sq, sk in [
        (dict(attention_mask=pad), 6, 6),
        (dict(local_size=3), 6, 6),
        ({}, 3, 6),
        (dict(allow_is_causal_skip=False), 6, 6),
    ]:
        got, want = fn(**_args(sq, sk, **kw)), sdpa_mask(**_args(sq, sk, **kw))
        assert (got is None and want is None) or torch.equal(got, want), kw
    assert fn(**_args(6, 6, attention_mask=pad)) is not None


def test_skippable_causal_hand_cases():
    base = dict(
        allow_is_causal_skip=True,
        attention_mask=None,
        mask_function=causal_mask_function,
        q_length=4,
        kv_length=4,
        q_offset=0,
        local_size=None,
        kwargs={},
    )
    assert masks.skippable_causal(base, causal_mask_function)
    for change in (
        dict(kv_length=5),
        dict(mask_function=lambda *a: True),
        dict(local_size=2),
        dict(kwargs={"or_mask_function": lambda *a: True}),
        dict(q_offset=torch.tensor(0)),
    ):
        assert not masks.skippable_causal({**base, **change}, causal_mask_function), change
