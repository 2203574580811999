"""``lz.embedding``: equals ``weight[ids]`` exactly (a hand oracle: the rows copied by a Python loop), for odd
shapes, int32/int64 ids and 0-D..3-D ids; typed errors for bad inputs and out-of-range ids (CPU); each kernel
reachable through a policy lock; ``padding_idx`` gets no gradient, as ``torch.nn.Embedding``."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.custom import CANONICAL_ARGS
from layerzero.ops import OPS

pytestmark = pytest.mark.unit

KERNELS = ("reference.embedding", "torch_native.embedding")


def hand_lookup(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]`` by a Python loop over the flattened ids (no indexing op shared with the kernels)."""
    flat = ids.reshape(-1).tolist()
    rows = [weight[i] for i in flat]
    out = torch.stack(rows) if rows else weight.new_empty(0, weight.shape[1])
    return out.reshape(*ids.shape, weight.shape[1])


SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 5), (1, 1, 1)]


@pytest.mark.parametrize("kernel_id", KERNELS)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    "wdtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=["f32", "bf16", "f16", "f64"]
)
def test_locked_kernel_equals_hand_lookup(kernel_id, id_dtype, shape, wdtype):
    g = torch.Generator().manual_seed(len(shape))
    v, h = 123, 37  # odd vocabulary and hidden sizes
    weight = torch.randn(v, h, generator=g).to(wdtype)
    ids = torch.randint(0, v, shape, generator=g, dtype=torch.int64).to(id_dtype)
    lz.lock("embedding", kernel_id)
    try:
        out = lz.embedding(ids, weight)
        assert lz.which("embedding", ids, weight) == kernel_id
    finally:
        lz.unlock("embedding")
    assert out.shape == (*shape, h) and out.dtype == wdtype
    assert torch.equal(out, hand_lookup(ids, weight))


def test_extreme_ids_and_non_contiguous_inputs():
    weight = torch.randn(50, 64)[:, ::2]  # non-contiguous table [50, 32]
    ids = torch.tensor([[0, 49, 0], [49, 1, 2]]).t()  # transposed ids [3, 2]
    for kernel_id in KERNELS:
        lz.lock("embedding", kernel_id)
        try:
            assert torch.equal(lz.embedding(ids, weight), hand_lookup(ids, weight))
        finally:
            lz.unlock("embedding")


def test_default_selection_and_empty_ids():
    weight = torch.randn(10, 4)
    ids = torch.tensor([[3, 1, 4], [1, 5, 9]])
    assert lz.which("embedding", ids, weight) in KERNELS
    assert torch.equal(lz.embedding(ids, weight), weight[ids])
    empty = torch.zeros(2, 0, dtype=torch.int64)
    assert lz.embedding(empty, weight).shape == (2, 0, 4)


@pytest.mark.parametrize("kernel_id", KERNELS)
def test_padding_idx_gets_no_gradient(kernel_id):
    weight = torch.randn(6, 3, requires_grad=True)
    ids = torch.tensor([0, 2, 2, 5])
    lz.lock("embedding", kernel_id)
    try:
        out = lz.embedding(ids, weight, padding_idx=-4)  # -4 + 6 = 2, as torch.nn.Embedding
    finally:
        lz.unlock("embedding")
    assert torch.equal(out, weight.detach()[ids])  # the forward is the plain lookup
    out.sum().backward()
    expected = torch.zeros(6, 3)
    expected[0] = 1.0
    expected[5] = 1.0
    assert torch.equal(weight.grad, expected)


@pytest.mark.parametrize("bad", [-1, 10, 1000])
@pytest.mark.parametrize("kernel_id", KERNELS)
def test_out_of_range_ids_raise_on_cpu(bad, kernel_id):
    weight = torch.randn(10, 4)
    ids = torch.tensor([[1, 2], [bad, 3]], dtype=torch.int32)
    lz.lock("embedding", kernel_id)
    try:
        with pytest.raises(
            lz.InvalidInputError, match=rf"token ids in \[0, V\) = \[0, 10\), got {bad} at index \[1, 0\]"
        ):
            lz.embedding(ids, weight)
    finally:
        lz.unlock("embedding")


@pytest.mark.parametrize(
    ("ids", "weight", "kwargs", "match"),
    [
        (torch.tensor([1.0]), torch.randn(4, 2), {}, "input_ids.dtype: expected torch.int32 or torch.int64"),
        (torch.tensor([True]), torch.randn(4, 2), {}, "input_ids.dtype"),
        ([1, 2], torch.randn(4, 2), {}, "input_ids: expected a torch.Tensor"),
        (torch.tensor([1]), torch.randn(4), {}, r"weight rank: expected 2 dims \[V, H\]"),
        (torch.tensor([1]), torch.randn(4, 2, 1), {}, "weight rank"),
        (torch.tensor([1]), torch.ones(4, 2, dtype=torch.int64), {}, "weight.dtype"),
        (torch.tensor([1]), torch.randn(4, 0), {}, "V >= 1 and H >= 1"),
        (torch.tensor([1]), "w", {}, "weight: expected a torch.Tensor"),
        (torch.tensor([1], device="meta"), torch.randn(4, 2), {}, "input_ids.device"),
        (
            torch.tensor([1]),
            torch.randn(4, 2),
            {"padding_idx": 4},
            r"padding_idx: expected None or an int in \[-V, V\)",
        ),
        (torch.tensor([1]), torch.randn(4, 2), {"padding_idx": -5}, "padding_idx"),
        (torch.tensor([1]), torch.randn(4, 2), {"padding_idx": True}, "padding_idx"),
    ],
)
def test_bad_inputs_raise_typed_errors(ids, weight, kwargs, match):
    with pytest.raises(lz.InvalidInputError, match=match) as info:
        lz.embedding(ids, weight, **kwargs)
    assert isinstance(info.value, ValueError)


def test_registered_everywhere():
    assert CANONICAL_ARGS["embedding"] == ("input_ids", "weight", "padding_idx")
    assert "embedding" in OPS and "embedding" in lz.__all__
    ids = {
        k["kernel_id"] if isinstance(k, dict) else getattr(k, "kernel_id", k)
        for k in lz.list_kernels("embedding")
    }
    assert set(KERNELS) <= ids
    report = lz.explain("embedding", torch.tensor([1]), torch.randn(4, 2))
    assert report.chosen in KERNELS
