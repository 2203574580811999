"""``triton.reshape_and_cache`` compiled on a real GPU: exact against the token-by-token oracle of the
interpreter tests (seeded ragged cases, both layouts, -1 slots, strided K/V), picked by
``lz.reshape_and_cache`` on CUDA, and replayed in a CUDA graph with new slots and values written in place."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.backends.triton import cache as tc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from test_triton_cache_interpret import _case, _oracle  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("triton_usable"),
]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", range(6))
def test_exact_against_oracle(layout, dtype, seed):
    k, v, cache, slots, page = _case(100 + seed, layout, dtype)
    want = _oracle(k, v, cache, slots, page, layout)
    k, v, cache, slots = k.cuda(), v.cuda(), cache.cuda(), slots.cuda()
    with lz.trace() as tr:
        lz.reshape_and_cache(k, v, cache, slots, kv_layout=layout)
    assert tr.kernels_for("reshape_and_cache") == [tc.KERNEL_ID] and not tr.fallbacks
    torch.testing.assert_close(cache.cpu(), want, rtol=0, atol=0, equal_nan=True)


def test_replays_in_a_cuda_graph():
    k, v, cache, slots, page = (
        t.cuda() if isinstance(t, torch.Tensor) else t for t in _case(7, "NHD", torch.bfloat16)
    )
    tc.reshape_and_cache(k, v, cache, slots, "NHD")  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tc.reshape_and_cache(k, v, cache, slots, "NHD")
    k2, v2, cache2, slots2, _ = _case(7, "NHD", torch.bfloat16)
    k.copy_(k2.cuda().add_(1)), v.copy_(v2.cuda().add_(1)), slots.copy_(slots2.flip(0).cuda())
    want = _oracle(k.cpu(), v.cpu(), cache.cpu(), slots.cpu(), page, "NHD")
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(cache.cpu(), want, rtol=0, atol=0, equal_nan=True)
