"""The multi-process executor on the CPU (Gloo): ``LLM(tensor_parallel_size=2)`` gives ``LLM(tp=1)``'s tokens
and logprobs within 1e-4 (the sharded model sums in another order), and so do four ranks (Llama, its KV heads
replicated) and expert parallelism (Qwen3-MoE); seeded sampling, ``load_format="dummy"``, the KV block count
as the minimum over ranks, the flags' validation, a killed worker (a typed error within seconds, no orphans),
a worker that fails at start-up (the rank named) (``AsyncLLM`` with two ranks: ``test_serve_parallel.py``,
through the server). Every test ends the processes it started."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

import layerzero as lz
from layerzero.engine import LLM, SamplingParams
from layerzero.engine.config import EngineConfig
from layerzero.engine.core.errors import WorkerFailedError

PROMPTS = [[5, 9, 14, 3, 22, 7], [11, 4, 8], [5, 9, 14, 3, 22, 7, 30, 2, 19]]
KW = {"device": "cpu", "max_model_len": 64, "max_num_seqs": 4, "num_kv_blocks": 32, "block_size": 4}


def _run(llm: LLM, params: SamplingParams) -> list[tuple[list[int], list]]:
    outs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _children() -> list[int]:
    import psutil

    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline()):
                out.append(c.pid)  # (multiprocessing's resource tracker lives as long as this process)
        except psutil.NoSuchProcess:
            pass
    return out


def _sitecustomize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """Code the spawned workers run at interpreter start-up (not rank 0: it is this process)."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(body))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))


def _same(got: list[tuple[list[int], list]], want: list[tuple[list[int], list]]) -> None:
    """Equal tokens; each top-N logprob entry within 1e-4 (float32)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp), (_, ref) in zip(got, want, strict=True):
        for a, b in zip(lp, ref, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_tp2_matches_tp1(checkpoints) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=8, ignore_eos=True)
    ck = checkpoints["qwen3"]
    with LLM(ck, **KW) as one:
        want = _run(one, greedy), _run(one, seeded)
    with LLM(ck, tensor_parallel_size=2, **KW) as two:
        assert two.engine.executor.num_kv_blocks == 32
        got = _run(two, greedy), _run(two, seeded)
    # the sharded model sums its partial products in another order: equal tokens, logprobs within 1e-4
    _same(got[0], want[0])
    assert [t for t, _ in got[1]] == [t for t, _ in want[1]]  # seeded sampling: the same draws
    # chunked prefill (a 4-token budget) and prefix caching: the same tokens again
    kw = {**KW, "max_num_batched_tokens": 4, "enable_prefix_caching": True}
    with LLM(ck, tensor_parallel_size=2, **kw) as two:
        for _ in range(2):  # the second run hits the prefix cache
            _same(_run(two, greedy), want[0])
    assert _children() == []


@pytest.mark.parametrize(
    "family,kw",
    [
        ("llama", {"tensor_parallel_size": 4}),  # 2 KV heads over 4 ranks: each KV head on two ranks
        # attention TP, experts EP
        ("qwen3_moe", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ],
    ids=["llama-tp4", "moe-tp2-ep"],
)
def test_tp4_and_expert_parallel_match_one_rank(checkpoints, family, kw) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    with LLM(checkpoints[family], **KW) as one:
        want = _run(one, greedy)
    with LLM(checkpoints[family], **kw, **KW) as many:
        _same(_run(many, greedy), want)
    assert _children() == []


def test_preemption_under_tp2(checkpoints) -> None:
    """A pool too small for the batch (7 blocks of 4 tokens, 6 sequences of up to 19 tokens): requests are
    preempted and recomputed, and two ranks still give one rank's tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)
    kw = {**KW, "num_kv_blocks": 7, "max_num_seqs": 8, "max_model_len": 28}
    prompts = [list(p) for p in PROMPTS] * 2
    with LLM(checkpoints["qwen3"], **kw) as one:
        want = [
            (list(o.outputs[0].token_ids), o.outputs[0].logprobs)
            for o in one.generate(prompts, greedy, use_tqdm=False)
        ]
    with LLM(checkpoints["qwen3"], tensor_parallel_size=2, **kw) as two:
        got = [
            (list(o.outputs[0].token_ids), o.outputs[0].logprobs)
            for o in two.generate(prompts, greedy, use_tqdm=False)
        ]
        assert two.stats()["preemptions"] > 0  # the configuration really preempts
    _same(got, want)


def test_dummy_weights_and_kv_min(checkpoints, tmp_path, monkeypatch) -> None:
    # rank 1 can hold only 20 blocks: the engine's pool is the minimum over ranks
    _sitecustomize(
        tmp_path,
        monkeypatch,
        """
        from layerzero.engine.worker import model_runner as _mr
        _orig = _mr.ModelRunner._num_blocks
        _mr.ModelRunner._num_blocks = lambda self, *a: min(_orig(self, *a), 20)
        """,
    )
    kw = {**KW, "num_kv_blocks": None, "cpu_kv_cache_bytes": 1 << 24}
    with LLM(checkpoints["qwen3"], tensor_parallel_size=2, load_format="dummy", **kw) as llm:
        assert llm.engine.executor.num_kv_blocks == 20
        assert llm.engine.runner.num_blocks == 20
        out = _run(llm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert all(len(t) == 4 for t, _ in out)
    assert _children() == []


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size: expected an int >= 1"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size: expected an int >= 1"),
        ({"data_parallel_size": 0}, "data_parallel_size: expected an int >= 1"),
        ({"enable_expert_parallel": 1}, "enable_expert_parallel: expected True or False"),
        ({"load_format": "pt"}, "load_format: expected one of"),
    ],
)
def test_config_errors(kw, match) -> None:
    with pytest.raises(lz.ConfigurationError, match=match):
        EngineConfig("m", device="cpu", **kw)


def test_cli_flags() -> None:
    import argparse

    from layerzero.cli_engine import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(
        "--model m --tensor-parallel-size 2 --enable-expert-parallel --load-format dummy".split()
    )
    kw = engine_kwargs(ns)
    assert (kw["tensor_parallel_size"], kw["enable_expert_parallel"], kw["load_format"]) == (2, True, "dummy")
    assert kw["data_parallel_size"] == 1


def test_killed_worker_raises_typed_error(checkpoints) -> None:
    llm = LLM(checkpoints["qwen3"], tensor_parallel_size=2, **KW)
    try:
        _run(llm, SamplingParams(temperature=0.0, max_tokens=2))
        (proc,) = llm.engine.executor._procs.values()
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match="worker 1") as info:
            for _ in range(50):
                _run(llm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert info.value.rank == 1
        assert time.monotonic() - t0 < 10
    finally:
        llm.shutdown()
    assert _children() == []


def test_worker_startup_failure_names_rank(checkpoints, tmp_path, monkeypatch) -> None:
    _sitecustomize(
        tmp_path,
        monkeypatch,
        """
        import layerzero as lz
        from layerzero.engine.worker import model_runner as _mr
        def _broken(model, path):
            raise lz.ConfigurationError(f"checkpoint {path}: expected weights, got a broken file")
        _mr.load_model_weights = _broken
        """,
    )
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match="worker 1: ConfigurationError: checkpoint") as info:
        LLM(checkpoints["qwen3"], tensor_parallel_size=2, **KW)
    assert info.value.rank == 1 and info.value.remote_type == "ConfigurationError"
    assert time.monotonic() - t0 < 60
    assert _children() == []
