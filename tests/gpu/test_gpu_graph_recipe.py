"""The PyTorch CUDA-graph recipe with no ``lz.warmup`` (``pytest -m gpu tests/gpu/test_gpu_graph_recipe.py``).

The recipe of the PyTorch "CUDA Graphs" notes: eager calls, a warm-up on a side stream, ``torch.cuda.graph``
capture, then new data copied into the static inputs and ``replay()``; the replayed output must equal an eager
call on the new data (per-dtype tolerance of ``lz.graphs.GRAPH_TOLERANCES``). LayerZero's part: the first
eager call of a CUDA key prepares the capture-time kernel choice (``Runtime.prepare_capture``), so nothing
else is needed. Covered: lz.attention, lz.paged_attention (decode), lz.rms_norm (+ fused residual), lz.rope,
lz.swiglu, a tiny Llama patched with ``lz.patch_model`` (its forward), and
``torch.compile(mode= "reduce-overhead")`` of a function calling lz ops.
"""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME
from layerzero.graphs import _compare

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _recipe(
    fn,
    static: list[torch.Tensor],
    fresh: list[torch.Tensor],
    *,
    eager_calls: int = 1,
    rtol: float | None = None,
    atol: float | None = None,
):
    """Run the recipe on ``fn(*static)``; returns (kernels served under capture, error message or None)."""
    for _ in range(eager_calls):
        fn(*static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with lz.trace() as tr, torch.cuda.graph(graph):
        out = fn(*static)
    for dst, src in zip(static, fresh, strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    want = fn(*static)
    _, problem = _compare(out, want, rtol, atol)
    return tr.counts, problem


def _graph_safe(counts) -> None:
    assert counts, "nothing was dispatched under capture"
    for op, kid in counts:
        assert RUNTIME.registry.kernel(kid, op).graph_safe, (op, kid)


def _rand(*shape, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=DEV, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize(
    "shape",
    [(2, 8, 2, 128, 64, True), (1, 16, 4, 1, 128, False), (3, 4, 4, 77, 128, True)],
    ids=["prefill-gqa", "decode", "odd-len"],
)
def test_attention(shape):
    b, hq, hkv, s, d, causal = shape
    sk = 300 if s == 1 else s
    static = [_rand(b, hq, s, d, seed=1), _rand(b, hkv, sk, d, seed=2), _rand(b, hkv, sk, d, seed=3)]
    fresh = [_rand(b, hq, s, d, seed=4), _rand(b, hkv, sk, d, seed=5), _rand(b, hkv, sk, d, seed=6)]
    counts, problem = _recipe(lambda q, k, v: lz.attention(q, k, v, is_causal=causal), static, fresh)
    assert problem is None, problem
    _graph_safe(counts)


def test_rms_norm_plain_and_fused():
    x, r, w = _rand(5, 37, 1024, seed=1), _rand(5, 37, 1024, seed=2), _rand(1024, seed=3) + 1
    fresh = [_rand(5, 37, 1024, seed=4), _rand(5, 37, 1024, seed=5), w.clone()]
    counts, problem = _recipe(
        lambda x, r, w: (lz.rms_norm(x, w), *lz.rms_norm(x, w, residual=r)), [x, r, w], fresh
    )
    assert problem is None, problem
    _graph_safe(counts)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope(interleaved):
    b, h, hkv, s, d = 2, 8, 2, 19, 128
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    f = torch.outer(torch.arange(s, device=DEV).float(), inv)
    f = f.repeat_interleave(2, -1) if interleaved else torch.cat([f, f], -1)
    cos, sin = f.cos()[None].to(torch.bfloat16), f.sin()[None].to(torch.bfloat16)
    static = [_rand(b, h, s, d, seed=1), _rand(b, hkv, s, d, seed=2)]
    fresh = [_rand(b, h, s, d, seed=3), _rand(b, hkv, s, d, seed=4)]
    counts, problem = _recipe(lambda q, k: lz.rope(q, k, cos, sin, interleaved=interleaved), static, fresh)
    assert problem is None, problem
    _graph_safe(counts)


def test_swiglu():
    static = [_rand(7, 3000, seed=1), _rand(7, 3000, seed=2)]
    fresh = [_rand(7, 3000, seed=3), _rand(7, 3000, seed=4)]
    counts, problem = _recipe(lambda g, u: lz.swiglu(g, u), static, fresh)
    assert problem is None, problem
    _graph_safe(counts)


def test_paged_decode():
    """Decode over a ragged paged batch; seq_lens and block tables are static inputs updated in place."""
    torch.manual_seed(0)
    b, hq, hkv, d, page, blocks = 6, 32, 8, 128, 16, 64
    lens = torch.tensor([5, 130, 64, 700, 1, 333], dtype=torch.int32, device=DEV)
    cache = lz.allocate_kv_cache(blocks * b, page, hkv, d, dtype=torch.bfloat16, device=DEV)
    cache.normal_()
    tables = torch.randperm(blocks * b, device=DEV, dtype=torch.int32).view(b, blocks)
    q = _rand(b, hq, d, seed=1)
    fresh = [_rand(b, hq, d, seed=2), tables.roll(1, 0).contiguous(), lens + 1]
    counts, problem = _recipe(lambda q, t, n: lz.paged_attention(q, cache, t, n), [q, tables, lens], fresh)
    assert problem is None, problem
    _graph_safe(counts)


def test_patched_hf_model_forward(tmp_path):
    pytest.importorskip("transformers")
    from layerzero.testing import hf_models

    path = hf_models.build_and_save("llama", tmp_path / "llama")
    # float32: under capture transformers (< ~5.20) materializes the causal mask, so attention runs a masked
    # kernel (SDPA efficient) where the eager calls ran is_causal; in bf16 the two differ by up to ~0.05 in
    # the logits after a few layers (measured on the H200), in float32 by rounding only
    model = hf_models.load("llama", path).to(DEV, torch.float32)
    handle = lz.patch_model(model)
    seen: list = []  # the attention keys dispatched, to say which field differs under capture if it fails
    run = RUNTIME.run

    def recording(key, build_ctx, args, hot_key=None):
        named = RUNTIME.named_key(key) if type(key) is tuple else key  # the ops pass the plain-tuple form
        if getattr(named, "op", None) == "attention":
            seen.append(named)
        return run(key, build_ctx, args, hot_key)

    RUNTIME.run = recording
    try:
        ids = torch.randint(0, hf_models.VOCAB_SIZE, (2, 24), device=DEV)
        fresh = [torch.randint(0, hf_models.VOCAB_SIZE, (2, 24), device=DEV)]
        with torch.no_grad():
            try:
                counts, problem = _recipe(
                    lambda i: model(input_ids=i, use_cache=False).logits, [ids], fresh, rtol=1e-4, atol=1e-4
                )
            except lz.CudaGraphUnsafeError:
                cap = next(k for k in reversed(seen) if k.capture)
                eager = [k for k in seen if not k.capture]
                diff = {
                    f: (getattr(eager[0], f), getattr(cap, f))
                    for f in cap._fields
                    if eager and getattr(eager[0], f) != getattr(cap, f)
                }
                pytest.fail(f"capture-time attention key differs from the eager one in {diff}")
    finally:
        RUNTIME.run = run
        handle.undo()
    assert problem is None, problem
    _graph_safe(counts)
    assert {op for op, _ in counts} >= {"attention", "rms_norm"}


def test_torch_compile_reduce_overhead():
    """``torch.compile(mode="reduce-overhead")`` (CUDA graphs through Inductor's cudagraph trees) of a block
    that calls lz ops: compiled output == eager output on new data after the warm-up calls."""

    def block(x, w, q, k, v):
        h = lz.rms_norm(x, w)
        return h, lz.attention(q, k, v, is_causal=True)

    compiled = torch.compile(block, mode="reduce-overhead")
    w = _rand(512, seed=9) + 1
    for step in range(4):
        args = [
            _rand(4, 64, 512, seed=step),
            w,
            _rand(2, 8, 64, 64, seed=10 + step),
            _rand(2, 2, 64, 64, seed=20 + step),
            _rand(2, 2, 64, 64, seed=30 + step),
        ]
        got = compiled(*args)
        got = tuple(t.clone() for t in got)
        _, problem = _compare(got, block(*args), None, None)
        assert problem is None, f"step {step}: {problem}"
