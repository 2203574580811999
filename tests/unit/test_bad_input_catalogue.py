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
