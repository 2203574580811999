"""The bad-call catalogue: one test (or table) per class of defect it found.

1. non-string ids and non-path arguments, malformed ``lz.tune`` / ``lz.warmup`` cases -> typed errors naming the
   argument (never a bare TypeError);
2. a positive temperature so small that ``logits / T`` overflows -> greedy argmax (not a KernelExecutionError);
3. masks of rank < 4 -> served by every mask-accepting kernel, equal to a float64 oracle, no health charged;
4. policies naming unknown ops / kernels / backends -> PolicyValidationError (files) or ConfigurationError
   (environment, like ``lz.prefer``), malformed ``config:`` and duplicate ``<<`` merge keys rejected, a bad
   ``LAYERZERO_CAPABILITIES`` file raises on ``lz.reload()``;
5. ``register_kernel``: unknown device types rejected, ``mask_kinds=None`` means every mask kind.

Runs under ``python -O`` too (no assert-based validation in src/).
"""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.specs import MaskKind

pytestmark = pytest.mark.unit


def _attn_kernel(q, k, v, attn_mask, is_causal, scale, dropout_p):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)


# ------------------------------------------------------------------------------ 5. register_kernel constraints
@pytest.mark.parametrize(("device_types", "match"), [
    ({"gpu"}, r"device_types: expected torch device types such as \['cpu', 'cuda', 'mps', 'xpu'\].*got 'gpu'.*'cuda'"),
    ({"cda"}, r"got 'cda'.*Did you mean 'cuda'"),
    ({"cuda:0"}, r"got 'cuda:0'"),
    ({"cpu", 3}, r"got 3"),
    (None, r"device_types: expected a set.*got None"),
    (set(), r"got an empty set"),
])
def test_register_kernel_rejects_unknown_device_types(device_types, match):
    with pytest.raises(lz.ConfigurationError, match=match):
        lz.register_kernel("attention", "mylib.cat5", _attn_kernel, device_types=device_types)
    assert "mylib.cat5" not in {k["kernel_id"] for k in lz.list_kernels("attention")}


def test_register_kernel_device_types_known_and_other_torch_types():
    spec = lz.register_kernel("attention", "mylib.cat5", _attn_kernel, device_types=["CUDA", "cpu", "hpu"])
    assert spec.device_types == frozenset({"cuda", "cpu", "hpu"})
    lz.unregister_kernel("mylib.cat5")


def test_register_kernel_mask_kinds_none_means_every_kind():
    spec = lz.register_kernel("attention", "mylib.cat5", _attn_kernel, device_types={"cpu"}, mask_kinds=None)
    assert spec.mask_kinds == frozenset(MaskKind) == frozenset({MaskKind.NONE, MaskKind.BOOL, MaskKind.FLOAT})
    q = torch.randn(1, 2, 4, 8)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    assert lz.validate("mylib.cat5", "attention", q, q, q, attn_mask=mask) == []
    lz.unregister_kernel("mylib.cat5")
    with pytest.raises(lz.ConfigurationError, match=r"mask_kinds: expected values from \['bool', 'float', 'none'\], "
                                                   r"got None"):
        lz.register_kernel("attention", "mylib.cat5", _attn_kernel, mask_kinds={"bool", None})
    with pytest.raises(lz.ConfigurationError, match="dtypes: expected a set"):
        lz.register_kernel("attention", "mylib.cat5", _attn_kernel, dtypes=None)


# ------------------------------------------------------------------------------ 3. masks of rank < 4
def _mask_cases(dtype):
    """(name, mask) of every rank < 4 (plus an expanded, stride-0 view and an Sk = 1 broadcast) for q
    [B=2, Hq=4, Sq=5, D=8], k/v [2, 2, Sk=7, 8] (GQA)."""
    g = torch.Generator().manual_seed(3)
    m1 = torch.rand(7, generator=g) > 0.3
    m1[0] = True  # every row keeps a key
    m2 = torch.rand(5, 7, generator=g) > 0.3
    m2[:, 0] = True
    m3 = torch.rand(4, 5, 7, generator=g) > 0.3
    m3[..., 0] = True
    return [("bool[Sk]", m1), ("bool[Sq,Sk]", m2), ("bool[Hq,Sq,Sk]", m3), ("bool[Sk].expand(Sq,Sk)", m1.expand(5, 7)),
            ("bool[1]", torch.ones(1, dtype=torch.bool)),
            ("float[Sk]", torch.where(m1, 0.0, -1e4).to(dtype)), ("float[Sq,Sk]", torch.randn(5, 7, generator=g).to(dtype)),
            ("float[Hq,1,Sk]", torch.randn(4, 1, 7, generator=g).to(dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_low_rank_masks_served_by_every_kernel_without_fallback_or_health_charge(dtype):
    import sys
    from pathlib import Path

    from layerzero.core.runtime import RUNTIME

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
    from _shapes import attention_oracle

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 5, 8, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 7, 8, generator=g).to(dtype) for _ in range(2))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    served = set()
    RUNTIME.health.reset()
    for kid in [info["kernel_id"] for info in lz.list_kernels("attention")]:
        for name, mask in _mask_cases(dtype):
            if lz.validate(kid, "attention", q, k, v, attn_mask=mask):
                continue
            lz.lock("attention", kid)
            try:
                with lz.trace() as tr:
                    out = lz.attention(q, k, v, attn_mask=mask)
            finally:
                lz.unlock("attention")
            assert tr.fallbacks == [] and tr.kernels_for("attention") == [kid], (kid, name, tr.fallbacks)
            ref = attention_oracle(q, k, v, attn_mask=mask)
            torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=f"{kid} {name}")
            served.add(kid)
    assert RUNTIME.health.snapshot() == {}, "a valid mask charged a backend's health"
    assert {"reference.attention", "torch_sdpa.math"} <= served
    if dtype == torch.float32:
        assert "torch_sdpa.flash" in served  # the kernel that raised IndexError on a 1-D mask
    # unlocked calls too: the default choice serves a 1-D key-padding mask without a fallback
    with lz.trace() as tr:
        out = lz.attention(q, k, v, attn_mask=_mask_cases(dtype)[0][1])
    assert tr.fallbacks == []
    torch.testing.assert_close(out.double(), attention_oracle(q, k, v, attn_mask=_mask_cases(dtype)[0][1]),
                               rtol=tol, atol=tol)


def test_low_rank_mask_reaches_kernels_as_a_4d_view():
    seen = []

    def spy(q, k, v, attn_mask, is_causal, scale, dropout_p):
        seen.append((tuple(attn_mask.shape), attn_mask.data_ptr()))
        return _attn_kernel(q, k, v, attn_mask, is_causal, scale, dropout_p)

    lz.register_kernel("attention", "mylib.spy", spy, priority=1000, device_types={"cpu"})
    try:
        q = torch.randn(1, 2, 3, 8)
        mask = torch.tensor([True, False, True])
        lz.attention(q, q, q, attn_mask=mask)
        lz.attention(q, q, q, attn_mask=mask[None].expand(3, 3))
    finally:
        lz.unregister_kernel("mylib.spy")
    assert seen == [((1, 1, 1, 3), mask.data_ptr()), ((1, 1, 3, 3), mask.data_ptr())]  # views, no copy
