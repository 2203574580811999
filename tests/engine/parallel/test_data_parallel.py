"""Data parallelism on the CPU: ``AsyncLLM(data_parallel_size=2)`` runs two engine cores behind one front end;
every request's tokens equal ``LLM``'s (one replica), both replicas serve, a shared prompt prefix follows its
replica, stats are summed, one replica killed marks the engine errored (new requests raise EngineDeadError),
and ``LLM`` refuses ``data_parallel_size > 1`` with a typed error. Every test ends the processes it
started."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import layerzero as lz
from layerzero.engine import LLM, AsyncLLM, SamplingParams
from layerzero.engine.core.errors import EngineDeadError

KW = {"device": "cpu", "max_model_len": 64, "max_num_seqs": 4, "num_kv_blocks": 32, "block_size": 4}
SHARED = [5, 9, 14, 3, 22, 7, 30, 2]  # two full blocks of 4
PROMPTS = [SHARED + [1], [11, 4, 8, 40, 41], SHARED + [19, 6], [17, 3, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


async def _collect(engine: AsyncLLM, prompt: list[int], rid: str) -> list[int]:
    toks: list[int] = []
    async for out in engine.generate(prompt, GREEDY, rid):
        toks += out.outputs[0].token_ids
    return toks


def test_two_replicas_serve_llm_tokens(checkpoints) -> None:
    ck = checkpoints["qwen3"]
    with LLM(ck, **KW) as one:
        want = [list(o.outputs[0].token_ids) for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]

    async def main() -> tuple[list[list[int]], list[int], int, int]:
        with AsyncLLM(ck, data_parallel_size=2, **KW) as engine:
            pids = [c.proc.pid for c in engine._clients]
            got = [await _collect(engine, PROMPTS[0], "first")]  # alone: replica 0 (both idle)
            got += await asyncio.gather(*(_collect(engine, p, f"r{i}") for i, p in enumerate(PROMPTS[1:])))
            stats = await engine.get_stats()
            return got, pids, engine.router.prefix_routed, stats.generation_tokens

    got, pids, prefix_routed, generated = asyncio.run(main())
    assert got == want
    assert len(set(pids)) == 2
    assert prefix_routed >= 1  # PROMPTS[2] shares two blocks with PROMPTS[0]
    assert generated == 6 * len(PROMPTS)  # summed over the replicas
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_dead_replica_errors_the_engine(checkpoints) -> None:
    async def main() -> None:
        with AsyncLLM(checkpoints["qwen3"], data_parallel_size=2, **KW) as engine:
            assert engine.is_running and not engine.errored
            os.kill(engine._clients[1].proc.pid, signal.SIGKILL)
            engine._clients[1].proc.join(10)
            for _ in range(100):  # the client notices the sentinel on the loop
                if engine.errored:
                    break
                await asyncio.sleep(0.05)
            assert engine.errored and not engine.is_running
            assert isinstance(engine.dead_error, EngineDeadError)
            with pytest.raises(EngineDeadError):  # a new request: the engine is errored
                await _collect(engine, PROMPTS[1], "late")

    asyncio.run(asyncio.wait_for(main(), 60))


def test_llm_refuses_data_parallel(checkpoints) -> None:
    with pytest.raises(lz.ConfigurationError, match=r"data_parallel_size.*AsyncLLM"):
        LLM(checkpoints["qwen3"], data_parallel_size=2, **KW)
