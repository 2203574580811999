"""``layerzero.ops.awq``: lz.quantize's int4 layout to and from AutoAWQ's GEMM packing (qweight ``[K, N/8]``
int32, nibble i of a word = column ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``; qzeros packed the same way; scales
``[K/g, N]``). Oracles: words built by hand from that rule, and AutoAWQ's dequantization written out here
(shift out the eight nibbles, undo the order with the index list (0, 4, 1, 5, 2, 6, 3, 7),
``(q - zero) * scale``) compared with ``lz.dequantize``."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero import InvalidInputError
from layerzero.core.quant_format import QuantFormat, QuantizedTensor
from layerzero.ops.awq import AWQ_ORDER, from_awq, to_awq

pytestmark = pytest.mark.unit


def _awq_dequantize(qweight, qzeros, scales, group_size):
    """AutoAWQ's ``dequantize_gemm`` semantics, derived from its published layout: -> ``[K, N]`` float64."""
    shifts = torch.arange(0, 32, 4)
    w = ((qweight.to(torch.int64)[:, :, None] >> shifts) & 15).reshape(qweight.shape[0], -1)
    z = ((qzeros.to(torch.int64)[:, :, None] >> shifts) & 15).reshape(qzeros.shape[0], -1)
    undo = torch.arange(w.shape[1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    w, z = w[:, undo], z[:, undo]
    z = z.repeat_interleave(group_size, dim=0)
    s = scales.to(torch.float64).repeat_interleave(group_size, dim=0)
    return (w - z).to(torch.float64) * s


def test_awq_bit_layout_by_hand():
    """q[n, k] = (3n + k) % 16: qweight[k, c] nibble i = q[8c + ORDER[i], k]; qzeros likewise with zero[n,
    group]."""
    n, k, g = 16, 8, 4
    q = (3 * torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16  # [N, K]
    zeros = ((torch.arange(n)[:, None] * 5 + torch.arange(k // g)[None, :] * 7) % 16).to(
        torch.uint8
    )  # [N, K/g]
    data = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    qt = QuantizedTensor(
        data,
        torch.rand(n, k // g) + 0.5,
        zeros,
        None,
        QuantFormat.INT4,
        torch.Size((n, k)),
        torch.float32,
        None,
        g,
    )
    w = to_awq(qt, scale_dtype=torch.float32)
    assert w.qweight.shape == (8, 2) and w.qzeros.shape == (2, 2) and w.scales.shape == (2, 16)
    assert w.qweight.dtype == torch.int32 and w.qzeros.dtype == torch.int32
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    word = sum(int(q[8 + AWQ_ORDER[i], 5]) << (4 * i) for i in range(8))  # qweight[5, 1]
    assert int(w.qweight[5, 1]) & 0xFFFFFFFF == word
    zword = sum(int(zeros[AWQ_ORDER[i], 1]) << (4 * i) for i in range(8))  # qzeros[1, 0]
    assert int(w.qzeros[1, 0]) & 0xFFFFFFFF == zword
    assert torch.equal(w.scales, qt.scale.t())


@pytest.mark.parametrize(("n", "k", "g"), [(24, 256, 64), (8, 128, 128), (40, 96, 32)])
def test_awq_dequantization_matches_autoawq_semantics(n, k, g):
    torch.manual_seed(n + k)
    qt = lz.quantize(torch.randn(n, k) * 0.1, "int4", group_size=g)
    w = to_awq(qt, scale_dtype=torch.float32)
    want = _awq_dequantize(w.qweight, w.qzeros, w.scales, g)  # [K, N]
    torch.testing.assert_close(lz.dequantize(qt).double().t(), want, rtol=1e-6, atol=1e-7)
    # checkpoints keep float16 scales: the dequantized weight differs by their rounding only
    w16 = to_awq(qt)
    assert w16.scales.dtype == torch.float16
    torch.testing.assert_close(
        lz.dequantize(from_awq(w16, group_size=g, dtype=torch.float32)).double().t(),
        _awq_dequantize(w16.qweight, w16.qzeros, w16.scales, g),
        rtol=1e-6,
        atol=1e-7,
    )


def test_awq_round_trip_is_lossless():
    torch.manual_seed(1)
    qt = lz.quantize(torch.randn(32, 512), "int4", group_size=128)
    back = from_awq(to_awq(qt, scale_dtype=torch.float32), group_size=128, dtype=torch.float32)
    for a, b in zip(qt, back, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert torch.equal(lz.dequantize(back), lz.dequantize(qt))


def test_awq_errors():
    qt = lz.quantize(torch.rand(8, 128) - 0.5, "int4")
    with pytest.raises(InvalidInputError, match=r"to_awq: qt: expected an int4 QuantizedTensor"):
        to_awq(lz.quantize(torch.rand(8, 128), "int8"))
    with pytest.raises(InvalidInputError, match=r"\[N, K\] with N a multiple of 8"):
        to_awq(lz.quantize(torch.rand(6, 128), "int4"))
    w = to_awq(qt)
    with pytest.raises(InvalidInputError, match=r"group_size: expected an even int >= 2 dividing K = 128"):
        from_awq(w, group_size=48)
    with pytest.raises(InvalidInputError, match=r"qweight: expected a 2-D int32 tensor"):
        from_awq((w.qweight.to(torch.int64), w.qzeros, w.scales), group_size=128)
    with pytest.raises(InvalidInputError, match=r"qzeros / scales shapes: expected \[1, 1\] / \[1, 8\]"):
        from_awq((w.qweight, w.qzeros, w.scales[:, :4]), group_size=128)
