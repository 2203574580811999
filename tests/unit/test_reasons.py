"""Reason codes: enough of them, each with a category, unique and stable wire strings, and a lossless JSON
round trip for :class:`Reason`."""

from __future__ import annotations

import json

import pytest

from layerzero.core.reasons import Reason, ReasonCategory, ReasonCode, reason

pytestmark = pytest.mark.unit

# Wire strings that reports, logs and policies already use: renaming one breaks users (stability check).
RELEASED = {
    "DEVICE_TYPE_UNSUPPORTED",
    "SM_TOO_OLD",
    "SM_TOO_NEW",
    "DTYPE_UNSUPPORTED",
    "HEAD_DIM_TOO_LARGE",
    "HEAD_DIM_INVALID",
    "HEAD_DIM_NOT_ALIGNED",
    "HEAD_DIM_MISMATCH",
    "GQA_UNSUPPORTED",
    "MASK_UNSUPPORTED",
    "MASK_WITH_CAUSAL",
    "CAUSAL_SEQ_MISMATCH",
    "DROPOUT_UNSUPPORTED",
    "STRIDE_LAST_DIM_NOT_1",
    "LAYOUT_UNSUPPORTED",
    "NON_DETERMINISTIC",
    "CUDA_GRAPH_UNSAFE",
    "BACKWARD_UNSUPPORTED",
    "POLICY_DENIED",
    "POLICY_NOT_ALLOWED",
    "POLICY_LOCKED_OTHER",
    "BACKEND_NOT_INSTALLED",
    "BACKEND_UNHEALTHY",
    "SEQ_LEN_TOO_LONG",
    "TORCH_TOO_OLD",
    "GPU_GENERATION_UNSUPPORTED",
}


def test_every_code_is_emitted_somewhere():
    """No dead codes: each is used by a check in the source (outside reasons.py) or in a capability
    descriptor."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = "\n".join(
        p.read_text(encoding="utf-8")
        for p in (root / "src" / "layerzero").rglob("*.py")
        if p.name != "reasons.py"
    )
    text += "\n".join(p.read_text(encoding="utf-8") for p in (root / "capabilities").rglob("*.yaml"))
    dead = [c.name for c in ReasonCode if c.name not in text]
    assert not dead, f"reason codes no check emits: {dead}"


def test_every_code_has_a_category():
    for code in ReasonCode:
        assert isinstance(code.category, ReasonCategory), code


def test_every_category_is_used():
    used = {code.category for code in ReasonCode}
    assert used == set(ReasonCategory)


def test_codes_are_unique_stable_strings():
    values = [code.value for code in ReasonCode]
    assert len(values) == len(set(values))
    for code in ReasonCode:
        assert code.value == code.name  # the wire string is the name: grep-able, never translated
        assert code.value.isupper() and code.value.replace("_", "").isalnum()
        assert ReasonCode(code.value) is code
        assert isinstance(code, str) and code == code.value
    assert RELEASED <= set(values)


@pytest.mark.parametrize(
    ("code", "category"),
    [
        (ReasonCode.DEVICE_TYPE_UNSUPPORTED, ReasonCategory.HARDWARE),
        (ReasonCode.DTYPE_UNSUPPORTED, ReasonCategory.DTYPE),
        (ReasonCode.MASK_WITH_CAUSAL, ReasonCategory.MASK),
        (ReasonCode.STRIDE_LAST_DIM_NOT_1, ReasonCategory.STRIDE),
        (ReasonCode.POLICY_DENIED, ReasonCategory.POLICY),
        (ReasonCode.BACKEND_UNHEALTHY, ReasonCategory.BACKEND),
        (ReasonCode.HEAD_DIM_MISMATCH, ReasonCategory.HEAD_DIM),
        (ReasonCode.CUDA_GRAPH_UNSAFE, ReasonCategory.CUDA_GRAPH),
    ],
)
def test_categories_hand_checked(code, category):
    assert code.category is category
    assert Reason(code, "m").category is category


@pytest.mark.parametrize("code", list(ReasonCode))
def test_reason_json_round_trip(code):
    r = Reason(code, f"message for {code.value} with 'quotes', unicode µs and \"escapes\"")
    text = r.to_json()
    assert json.loads(text) == {"code": code.value, "category": code.category.value, "message": r.message}
    assert Reason.from_json(text) == r
    assert Reason.from_dict(r.to_dict()) == r


def test_reason_str_and_shorthand():
    r = reason(ReasonCode.SM_TOO_OLD, "needs SM >= 8.0, device is SM 7.5")
    assert r == Reason(ReasonCode.SM_TOO_OLD, "needs SM >= 8.0, device is SM 7.5")
    assert str(r) == "SM_TOO_OLD: needs SM >= 8.0, device is SM 7.5"
    assert hash(r) == hash(Reason(ReasonCode.SM_TOO_OLD, "needs SM >= 8.0, device is SM 7.5"))


def test_reason_is_frozen():
    r = Reason(ReasonCode.SM_TOO_OLD, "x")
    with pytest.raises(AttributeError):
        r.message = "y"  # type: ignore[misc]


def test_unknown_code_in_json_is_rejected():
    with pytest.raises(ValueError, match="NOT_A_CODE"):
        Reason.from_json('{"code": "NOT_A_CODE", "message": "x"}')
