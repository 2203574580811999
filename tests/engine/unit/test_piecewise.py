"""Piecewise graphs (``worker/piecewise.py``) on the CPU, their graphs replaced by an ATen-level stand-in
(``aten_graph.AtenGraph``: a replay re-runs the captured ops on the same tensors and runs none of the model's
Python): steps with prefill tokens, ragged and padded up to their bucket, replayed piece by piece with each
layer's attention run eagerly between the pieces, give transformers' greedy tokens and logprobs (1e-4) for
Qwen3 and Llama, with chunked prefill, mixed steps and prefix-cache hits (not Qwen3-MoE here: the CPU's only
``fused_moe`` kernel, the reference, is not graph-safe, a ``nonzero()`` per expert, and the stand-in's replay
refuses its data-dependent shapes as a capture would; the GPU test covers the MoE); the KV a replay writes
equals an eager forward's; the capture refuses a forward whose attention calls change between warm-up and
capture."""

from __future__ import annotations

import pytest
import torch

from ..conftest import assert_greedy_matches_hf, assert_same_greedy, prompts
from .aten_graph import AtenGraph

pytestmark = pytest.mark.integration
CPU = torch.device("cpu")
NEW = 6
OPTS = dict(device="cpu", dtype=torch.float32, max_model_len=96, num_kv_blocks=64, max_num_seqs=8)


def test_bucket_sizes():
    from layerzero.engine.worker.piecewise import piecewise_sizes

    assert piecewise_sizes(512, 8192) == [16, 32, 64, 128, 256, 512]
    assert piecewise_sizes(100, 8192) == [16, 32, 64, 100]
    assert piecewise_sizes(512, 48) == [16, 32, 48]
    assert piecewise_sizes(10, 8192) == [10]
    assert piecewise_sizes(0, 8192) == []


def test_auto_is_1024_tokens_at_any_tensor_parallel_size(monkeypatch):
    """``piecewise_max_tokens=None`` (the default): 1,024 tokens at TP 1 and 2; an explicit value, from the
    knob or the environment, wins at any TP."""
    from layerzero.engine.config import CudaGraphKnobs, EngineConfig
    from layerzero.engine.worker.piecewise import piecewise_tokens

    monkeypatch.delenv("LAYERZERO_PIECEWISE_MAX_TOKENS", raising=False)
    assert piecewise_tokens(EngineConfig("m")) == 1024
    assert piecewise_tokens(EngineConfig("m", tensor_parallel_size=2)) == 1024
    for tp in (1, 2):
        knobs = CudaGraphKnobs(piecewise_max_tokens=64)
        assert piecewise_tokens(EngineConfig("m", tensor_parallel_size=tp, cuda_graph=knobs)) == 64
        knobs = CudaGraphKnobs(piecewise_max_tokens=0)
        assert piecewise_tokens(EngineConfig("m", tensor_parallel_size=tp, cuda_graph=knobs)) == 0
    monkeypatch.setenv("LAYERZERO_PIECEWISE_MAX_TOKENS", "0")
    assert piecewise_tokens(EngineConfig("m")) == 0


def test_a_failed_capture_falls_back_on_auto_and_raises_when_asked_for(checkpoints, monkeypatch, caplog):
    """Auto (knob None) never stops the engine: any capture error is logged and the steps run eager. A value
    the user set raises anything but LayerZero's own no-graph-safe-kernel error; strict mode raises all."""
    import layerzero as lz
    from layerzero.engine import LLM
    from layerzero.engine.config import CudaGraphKnobs, EngineConfig
    from layerzero.engine.worker.piecewise import PiecewiseGraphs

    runner = LLM(checkpoints["qwen3"], **OPTS).engine.runner
    errors = [RuntimeError("operation not permitted when stream is capturing"), lz.NoKernelFoundError("none")]
    for exc in errors:

        def capture(self, exc=exc):
            raise exc

        monkeypatch.setattr(PiecewiseGraphs, "capture", capture)
        auto, set16 = EngineConfig("m"), EngineConfig("m", cuda_graph=CudaGraphKnobs(piecewise_max_tokens=16))
        with caplog.at_level("WARNING", logger="layerzero.engine"):
            assert runner._piecewise(auto, 16, 64) is None
        assert f"piecewise CUDA graphs off (steps with prefill tokens run eager): {type(exc).__name__}" in (
            caplog.text
        )
        if isinstance(exc, lz.LayerZeroError):
            assert runner._piecewise(set16, 16, 64) is None
        else:
            with pytest.raises(RuntimeError, match="stream is capturing"):
                runner._piecewise(set16, 16, 64)
        lz.configure(strict=True)
        try:
            with pytest.raises(type(exc)):
                runner._piecewise(auto, 16, 64)
        finally:
            lz.configure(strict=False)


def test_no_bucket_is_refused():
    from layerzero import InvalidInputError
    from layerzero.engine.worker.piecewise import PiecewiseGraphs

    for sizes in ([], [0, 16]):
        with pytest.raises(InvalidInputError, match="expected token buckets >= 1"):
            PiecewiseGraphs(torch.nn.Identity(), [], sizes, 4, 16, CPU, AtenGraph)


def _install(runner, sizes, max_rows=8):
    """Piecewise graphs of ``runner``'s model with the ATen stand-in, captured (an int8 pool's scales then
    re-armed: the runner captures before it arms them, so a capture's dummy step calibrates nothing)."""
    from layerzero.engine.layers.attention import KVScales
    from layerzero.engine.worker.piecewise import PiecewiseGraphs

    pieces = PiecewiseGraphs(
        runner.model, runner.kv_caches, sizes, max_rows, runner.block_size, CPU, AtenGraph
    )
    scales = [m for m in runner.model.modules() if isinstance(m, KVScales) and m.calibrate]
    for m in scales:
        m.calibrate = False
    pieces.capture()
    for m in scales:
        m.calibrate = True
    runner.pieces = pieces
    return pieces


ENGINE_CONFIGS = {
    "async-chunked-7": (dict(async_scheduling=True, max_num_batched_tokens=7), [4, 7]),
    "tiny-pool": (dict(num_kv_blocks=7, max_model_len=64), [16, 32]),
    "fp8-kv": (dict(kv_cache_dtype="fp8", max_num_batched_tokens=32), [16, 32]),
    "int8-kv": (dict(kv_cache_dtype="int8", max_num_batched_tokens=32), [16, 32]),
}


@pytest.mark.parametrize("name", sorted(ENGINE_CONFIGS))
def test_same_output_as_the_engine_without_pieces(name, checkpoints):
    """Async scheduling with a 7-token budget, a pool so small that requests are preempted, fp8 and int8 KV
    pools (int8: the scales calibrate on the first real step, inside an eager attention call): the same
    greedy tokens and logprobs (1e-5) as the same engine without piecewise graphs, and pieces ran."""
    from layerzero.engine import LLM, SamplingParams

    opts, sizes = ENGINE_CONFIGS[name]
    kw = {**OPTS, **opts}
    ps = prompts(6, seed=31, lo=3, hi=40)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    want = LLM(checkpoints["qwen3"], **kw).generate(ps, sp, use_tqdm=False)
    llm = LLM(checkpoints["qwen3"], **kw)
    pieces = _install(llm.engine.runner, sizes)
    before = AtenGraph.replays
    got = llm.generate(ps, sp, use_tqdm=False)
    assert AtenGraph.replays > before and pieces.graphs
    if name == "tiny-pool":
        assert llm.stats()["preemptions"] > 0
    assert_same_greedy(got, want, 1e-5)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_equals_transformers_with_prefill_steps_in_pieces(family, checkpoints, hf_models):
    from layerzero.engine import LLM, SamplingParams

    shared = prompts(1, seed=21, lo=20, hi=20)[0]
    ps = prompts(4, seed=22, lo=5, hi=45) + [shared + [7, 8, 9], shared + [10, 11]]
    # prompts over 40 tokens are chunked; later steps mix decode rows in
    llm = LLM(checkpoints[family], max_num_batched_tokens=40, block_size=4, **OPTS)
    runner = llm.engine.runner
    pieces = _install(runner, [16, 32, 40])
    layers = len(runner.model.layers)
    assert all(len(g) == layers + 1 for g in pieces.graphs.values()) and len(pieces.attention) == layers
    ran = []
    run = pieces.run
    pieces.run = lambda batch: ran.append(batch.input_ids.shape[0]) or run(batch)
    before = AtenGraph.replays
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate(ps, sp, use_tqdm=False)
    assert ran and all(t <= 40 for t in ran) and any(t % 16 for t in ran)  # ragged steps, padded
    assert AtenGraph.replays - before == len(ran) * (layers + 1)
    assert_greedy_matches_hf(hf_models[family], ps, outs, NEW)


def test_replay_writes_the_kv_an_eager_forward_writes(checkpoints):
    """One mixed step (a 9-token prefill, a 3-token chunk at position 5, a decode row at position 12) replayed
    in pieces against the same step run eagerly on a copy of the pools: the same logits (1e-5) and the same
    KV in every layer, the padded rows (bucket 16) writing none."""
    from layerzero.engine import LLM
    from layerzero.engine.worker.input_batch import ScheduledChunk, build_forward_batch

    llm = LLM(checkpoints["qwen3"], device="cpu", dtype=torch.float32, max_model_len=64, num_kv_blocks=32)
    runner = llm.engine.runner
    pieces = _install(runner, [16, 32])
    g = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    chunks = [
        ScheduledChunk(list(range(3, 12)), 0, 9, [4], True),
        ScheduledChunk(list(range(20, 28)), 5, 3, [7, 9], True),
        ScheduledChunk(list(range(40, 53)), 12, 1, [11, 12], True),
    ]
    batch = build_forward_batch(chunks, runner.block_size, CPU)
    eager_caches = [c.clone() for c in runner.kv_caches]
    want = runner.model(batch, eager_caches)
    got = pieces.run(batch)
    assert got.shape == want.shape == (3, want.shape[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(runner.kv_caches, eager_caches, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert pieces.can_run(batch) and not pieces.can_run(
        build_forward_batch(chunks[2:], runner.block_size, CPU)
    )


def test_capture_refuses_a_forward_whose_attention_calls_change(checkpoints):
    from layerzero.engine import LLM
    from layerzero.engine.worker.piecewise import PiecewiseGraphs

    llm = LLM(checkpoints["qwen3"], device="cpu", dtype=torch.float32, max_model_len=64, num_kv_blocks=32)
    runner = llm.engine.runner
    pieces = PiecewiseGraphs(runner.model, runner.kv_caches, [16], 4, runner.block_size, CPU, AtenGraph)
    forward, calls = runner.model.forward, []

    def skips_a_layer_when_captured(batch, caches):
        calls.append(1)
        layers = runner.model.layers
        if len(calls) == 3:  # the capture: one layer fewer
            runner.model.layers = layers[:-1]
        try:
            return forward(batch, caches[: len(runner.model.layers)])
        finally:
            runner.model.layers = layers

    runner.model.forward = skips_a_layer_when_captured
    with pytest.raises(RuntimeError, match="attention calls"):
        pieces.capture()
    assert not pieces.graphs


def test_kernel_report_selects_a_prefill_as_its_pieces_do(checkpoints, monkeypatch):
    """``kernel_report`` (the server's /v1/layerzero/kernels) dry-runs a prefill that piecewise graphs hold
    the way their replay selects it: through the pieces' attention hand-off, each attention call eager; a
    prefill longer than the largest bucket, and decode, the plain way. Nothing is replayed."""
    from layerzero.engine import LLM

    runner = LLM(checkpoints["qwen3"], **OPTS).engine.runner
    pieces = _install(runner, [16, 32])
    modes, attend = [], pieces.attend
    monkeypatch.setattr(pieces, "attend", lambda *a: modes.append(pieces._mode) or attend(*a))
    before = AtenGraph.replays
    report = runner.kernel_report([("prefill", 20), ("prefill", 64), ("decode", 2)])
    assert modes == ["as-replayed"] * len(runner.model.layers) and pieces._mode is None
    assert AtenGraph.replays == before
    assert {"prefill/20", "prefill/64", "decode/2"} <= set(report["paged_attention"])
