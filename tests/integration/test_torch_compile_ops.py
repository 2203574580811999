"""lz ops inside ``torch.compile`` (TorchDynamo traces their Python; CPU, backend "eager"): the compiled function
matches eager over calls with new data and a new shape. (On CUDA under ``mode="reduce-overhead"`` TorchDynamo
mis-traced ``tuple.__new__`` of the NamedTuple keys; tests/gpu/test_gpu_graph_recipe.py covers that case.)"""

from __future__ import annotations

import pytest
import torch

import layerzero as lz

pytestmark = pytest.mark.integration


def block(x, w, gate, up, q, k, v):
    h = lz.rms_norm(x, w)
    h2, res = lz.rms_norm(x, w, residual=h)
    return h2 + res, lz.swiglu(gate, up), lz.attention(q, k, v, is_causal=True)


def test_compiled_block_matches_eager():
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="eager")
    gen = torch.Generator().manual_seed(0)
    for rows, s in ((4, 16), (4, 16), (6, 9)):
        args = (torch.randn(rows, 64, generator=gen), torch.rand(64, generator=gen) + 0.5,
                torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen),
                torch.randn(2, 4, s, 32, generator=gen), torch.randn(2, 2, s, 32, generator=gen),
                torch.randn(2, 2, s, 32, generator=gen))
        for got, want in zip(compiled(*args), block(*args), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
