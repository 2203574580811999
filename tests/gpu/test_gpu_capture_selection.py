"""``lz.capture_selection()`` on a real GPU (``pytest -m gpu``): inside the block an eager call picks the
kernel a CUDA-graph capture of it picks (``triton.rms_norm`` / ``triton.swiglu`` by ``capture_priority``;
torch's kernels outside), and its output equals the captured graph's replay bit for bit; selection inside the
block needs no warm-up (no ``CudaGraphUnsafeError``)."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_usable")]
DEV = "cuda"


def test_eager_inside_equals_graph_and_picks_capture_kernels():
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(3, 1024, device=DEV, dtype=torch.bfloat16, generator=g)
    r = torch.randn(3, 1024, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.rand(1024, device=DEV, dtype=torch.bfloat16, generator=g) + 0.5
    gate, up = torch.randn(2, 3, 3072, device=DEV, dtype=torch.bfloat16, generator=g)

    def step():
        y, h = lz.rms_norm(x, w, 1e-6, residual=r)
        return y, h, lz.swiglu(gate, up)

    assert lz.which("rms_norm", x, w, 1e-6, residual=r) == "torch_native.rms_norm"
    with lz.capture_selection():
        assert lz.which("rms_norm", x, w, 1e-6, residual=r) == "triton.rms_norm"
        assert lz.which("swiglu", gate, up) == "triton.swiglu"
        eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured, strict=True):
        assert torch.equal(a, b)
