"""``lz.apply_token_bitmask`` on CUDA: ``triton.apply_token_bitmask`` and ``xgrammar.apply_token_bitmask``
equal ``torch_native`` bit for bit (float32 / bfloat16 / float16, odd vocabularies, indices, words covering
fewer or more ids than V), default selection picks the fused triton kernel, and it replays in a CUDA graph
with new bitmask values."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import layerzero as lz

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
OP = "apply_token_bitmask"
KERNELS = ["triton.apply_token_bitmask", "xgrammar.apply_token_bitmask"]
CASES = [(3, 70, 3, None), (64, 151_643, 4_739, None), (9, 151_936, 4_748, [8, 0, 3]), (5, 1000, 20, [4, 1])]


def _locked(kernel_id, logits, bits, idx):
    lz.lock(OP, kernel_id)
    try:
        lz.apply_token_bitmask(logits, bits, idx)
    finally:
        lz.unlock(OP)


@pytest.mark.parametrize("kernel_id", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equals_torch_native(kernel_id, dtype):
    if kernel_id.startswith("xgrammar") and importlib.util.find_spec("xgrammar") is None:
        pytest.skip("xgrammar is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    for n_all, vocab, width, rows in CASES:
        r = n_all if rows is None else len(rows)
        logits = torch.randn(n_all, vocab, device="cuda", generator=g).to(dtype)
        bits = torch.randint(-(2**31), 2**31, (r, width), device="cuda", generator=g, dtype=torch.int64)
        bits = bits.to(torch.int32)
        for index_dtype in (torch.int64, torch.int32):
            idx = None if rows is None else torch.tensor(rows, device="cuda", dtype=index_dtype)
            want, got = logits.clone(), logits.clone()
            _locked("torch_native.apply_token_bitmask", want, bits, idx)
            _locked(kernel_id, got, bits, idx)
            assert torch.equal(
                got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                want.view(torch.int16 if dtype != torch.float32 else torch.int32),
            ), (kernel_id, dtype, n_all, vocab, width, rows)


@pytest.mark.parametrize("kernel_id", KERNELS)
def test_row_strided_bitmask(kernel_id):
    """Words of a row-strided view (a slice of wider rows): only the first W of each row are read."""
    if kernel_id.startswith("xgrammar") and importlib.util.find_spec("xgrammar") is None:
        pytest.skip("xgrammar is not installed")
    wide = torch.zeros(3, 40, dtype=torch.int32, device="cuda")
    wide[:, 1] = 1  # token 32 allowed
    logits = torch.zeros(3, 80, device="cuda")
    _locked(kernel_id, logits, wide[:, :2], torch.tensor([2, 0, 1], device="cuda"))
    assert (torch.isfinite(logits).nonzero()[:, 1] == 32).all() and int(torch.isfinite(logits).sum()) == 3


def test_default_selection_is_the_fused_kernel():
    logits = torch.zeros(4, 1000, device="cuda")
    bits = torch.zeros(2, 32, dtype=torch.int32, device="cuda")
    assert lz.which(OP, logits, bits, torch.tensor([3, 1], device="cuda")) == "triton.apply_token_bitmask"


def test_replays_in_a_cuda_graph():
    logits = torch.zeros(4, 100, device="cuda")
    bits = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    idx = torch.tensor([3, 1], device="cuda")
    lz.apply_token_bitmask(logits, bits, idx)  # eager first: compiles, prepares the capture choice
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lz.apply_token_bitmask(logits, bits, idx)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lz.apply_token_bitmask(logits, bits, idx)
    logits.zero_()
    bits.copy_(torch.tensor([[0b1, 0, 0, 0], [0, 0, 0, 1 << 3]], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [0]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [99]
    assert (logits[0] == 0).all() and (logits[2] == 0).all()
