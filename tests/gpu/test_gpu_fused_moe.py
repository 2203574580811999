"""``lz.fused_moe`` on a real GPU (``pytest -m gpu tests/gpu/test_gpu_fused_moe.py``; not yet run on a GPU).

- ``triton.fused_moe`` vs ``reference.fused_moe`` (float32 math, the oracle) in bfloat16 on CUDA: tiny odd
  shapes (H, I not multiples of the block sizes), Mixtral-like (H 4096, I 14336 scaled down to fit: E 8, K 2)
  and Qwen3-30B-A3B-like (H 2048, I 768, E 128, K 8) with T in {1, 16, 512}; float16 and float32 on a small
  case.
- ``lz.fused_moe`` picks ``triton.fused_moe`` on CUDA; the Triton kernel replays inside a CUDA graph (no host
  sync: the expert layout is built with torch ops whose sizes follow from the shapes) and equals its eager
  result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from _shapes import F64, mismatch  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("triton_usable"),
]

DEV = "cuda"


def make(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=DEV, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEV, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=DEV, generator=g) / inter**0.5).to(dtype)
    probs = torch.softmax(torch.randn(tokens, experts, device=DEV, generator=g) * 2, -1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, -1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def triton_vs_reference(args, dtype):
    from layerzero.backends.reference.moe import fused_moe as reference
    from layerzero.backends.triton.moe import fused_moe as triton_moe

    out = triton_moe(*args)
    torch.cuda.synchronize()
    ref = reference(*args)
    # the reference rounds once; the kernel also rounds h = silu(gate) * up to x's dtype (as vLLM does)
    return mismatch(out, ref.to(F64), dtype, floor=1e-3)


SHAPES = [  # (T, H, I, E, K)
    (1, 33, 17, 4, 2),
    (7, 100, 70, 8, 3),
    (300, 129, 65, 5, 5),  # odd sizes, partial tiles
    (16, 512, 1792, 8, 2),  # Mixtral-like, scaled down (H 4096, I 14336)
    *[(t, 2048, 768, 128, 8) for t in (1, 16, 512)],  # Qwen3-30B-A3B
]


@pytest.mark.parametrize(("tokens", "hidden", "inter", "experts", "top_k"), SHAPES)
def test_triton_matches_reference_bfloat16(tokens, hidden, inter, experts, top_k):
    msg = triton_vs_reference(make(tokens, hidden, inter, experts, top_k), torch.bfloat16)
    assert msg is None, msg


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_triton_matches_reference_other_dtypes(dtype):
    msg = triton_vs_reference(make(40, 96, 48, 6, 2, dtype=dtype, seed=3), dtype)
    assert msg is None, msg


def test_lz_picks_triton_and_empty_input():
    args = make(16, 64, 32, 8, 2)
    assert lz.which("fused_moe", *args) == "triton.fused_moe"
    out = lz.fused_moe(*args)
    assert out.shape == (16, 64) and out.dtype == torch.bfloat16 and out.is_cuda
    empty = make(0, 64, 32, 8, 2)
    assert lz.fused_moe(*empty).shape == (0, 64)


def test_triton_replays_in_a_cuda_graph():
    from layerzero.backends.triton.moe import fused_moe as triton_moe

    args = make(16, 256, 128, 16, 4, seed=5)
    eager = triton_moe(*args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_moe(*args)  # warm-up on a side stream, as torch's recipe asks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = triton_moe(*args)
    new = make(16, 256, 128, 16, 4, seed=6)
    for dst, src in zip(args, new, strict=True):
        dst.copy_(src)  # new tokens, weights and routing in place
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, triton_moe(*new))
    assert not torch.equal(static, eager)
