"""CUDA graphs and FlexAttention on a GPU (``pytest -m gpu tests/gpu/test_gpu_graphs.py``; skipped on CPU).

- lz.warmup then capture lz.attention + lz.rms_norm in one CUDA graph: replay == eager
  (validate_graph_capture), graph-safe kernels only in the capture trace;
- a capture without warm-up raises CudaGraphUnsafeError (the capture-time cache miss);
- flex_attention.compiled against a float64 oracle (causal Sq != Sk, bool/float masks, mask + causal, GQA).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from _shapes import attention_oracle, make_mask, mismatch, randn  # noqa: E402

pytestmark = pytest.mark.gpu


def _inputs(dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = randn((2, 8, 128, 64), gen, "cuda", dtype)
    k = randn((2, 2, 128, 64), gen, "cuda", dtype)
    v = randn((2, 2, 128, 64), gen, "cuda", dtype)
    x = randn((2, 128, 512), gen, "cuda", dtype)
    w = randn((512,), gen, "cuda", dtype)
    return q, k, v, x, w


def _step(q, k, v, x, w):
    out = lz.attention(q, k, v, is_causal=True)
    return out, lz.rms_norm(x, w)


def test_capture_attention_and_rms_norm_after_warmup():
    q, k, v, x, w = _inputs()
    lz.warmup("attention", [((q, k, v), {"is_causal": True})])
    lz.warmup("rms_norm", [((x, w), {})])
    check = lz.validate_graph_capture(_step, q, k, v, x, w)
    assert check.ok, str(check)
    assert (
        check.replays == 2
    )  # max_error is bounded by validate_graph_capture's per-dtype tolerance (check.ok)
    for entry in check.kernels:
        op, kid = entry.split(":")
        assert RUNTIME.registry.kernel(kid, op).graph_safe, entry
    assert any(e.startswith("attention:") for e in check.kernels)
    assert any(e.startswith("rms_norm:") for e in check.kernels)


def test_capture_without_warmup_raises():
    """A call under capture whose capture-time cache entry is missing raises before any selection work."""
    q, k, v, x, w = _inputs(seed=1)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    caught = None
    with torch.cuda.stream(side):
        g.capture_begin()
        try:
            lz.attention(q, k, v, is_causal=True)
        except lz.CudaGraphUnsafeError as exc:
            caught = exc
        finally:
            try:
                g.capture_end()
            except RuntimeError:
                pass
    torch.cuda.synchronize()
    assert caught is not None and "lz.warmup" in str(caught)


def test_strict_mode_validate_raises_on_capture_error():
    q, k, v, x, w = _inputs(seed=2)
    lz.configure(strict=True)
    with pytest.raises(lz.CudaGraphUnsafeError):
        lz.validate_graph_capture(lambda a: a.cpu(), q)  # a device->host copy cannot be captured


def test_is_graph_safe_on_cuda():
    q, k, v, x, w = _inputs()
    assert lz.is_graph_safe("attention", q, k, v, is_causal=True)
    assert not lz.is_graph_safe("sample_topk", torch.randn(2, 100, device="cuda"), 5)


@pytest.mark.xfail(
    raises=lz.KernelExecutionError,
    strict=False,
    reason=(
        "KNOWN: on the H200 image (torch 2.11.0+cu130, Triton 3.6) Inductor fails to lower compiled "
        "flex_attention for this shape (NoValidChoicesError); flex_attention.compiled is opt-in (priority "
        "-1) until understood"
    ),
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_flex_compiled_matches_oracle(dtype):
    gen = torch.Generator().manual_seed(0)
    failures = []
    lz.lock("attention", "flex_attention.compiled")
    try:
        for i, (hq, hkv, sq, sk, d, mask_kind, causal) in enumerate(
            [
                (4, 4, 128, 128, 64, "none", True),
                (8, 2, 100, 300, 64, "none", True),
                (4, 1, 1, 257, 128, "none", False),
                (4, 2, 64, 64, 32, "bool", False),
                (4, 2, 77, 130, 64, "float", False),
                (4, 4, 96, 96, 64, "bool", True),
                (8, 2, 50, 70, 128, "float", True),
                (2, 2, 256, 256, 16, "bool", True),
            ]
        ):
            q = randn((2, hq, sq, d), gen, "cuda", dtype)
            k, v = randn((2, hkv, sk, d), gen, "cuda", dtype), randn((2, hkv, sk, d), gen, "cuda", dtype)
            mask = make_mask(mask_kind, "B1SS", i % 3 == 0, 2, hq, sq, sk, gen, "cuda", dtype)
            out = lz.attention(q, k, v, attn_mask=mask, is_causal=causal)
            msg = mismatch(out, attention_oracle(q, k, v, mask, causal), dtype, f"case {i}")
            if msg:
                failures.append(msg)
    finally:
        lz.unlock("attention")
    assert not failures, "\n".join(failures)


def test_flex_compiled_is_warmed_by_lz_warmup():
    """lz.warmup compiles flex (the compile counts as warm-up); a second call of the same shape compiles
    nothing (no new frame reaches TorchDynamo)."""
    from torch._dynamo.utils import counters

    q, k, v, x, w = _inputs(torch.float32, seed=3)
    mask = torch.rand(128, 128, device="cuda") < 0.7
    with lz.prefer("flex_attention.compiled"):
        assert lz.warmup("attention", [((q, k, v), {"attn_mask": mask, "is_causal": True})]) == [
            "flex_attention.compiled"
        ]
        frames = sum(counters["frames"].values())
        lz.attention(q, k, v, attn_mask=mask, is_causal=True)
        torch.cuda.synchronize()
        assert sum(counters["frames"].values()) == frames, "a warmed-up flex call must not compile again"
