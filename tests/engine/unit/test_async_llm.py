"""AsyncLLM on a real (tiny) checkpoint, its engine core in a child process, against ``LLM.generate`` in this
process as the oracle: the same greedy tokens and text, the same seeded samples and logprobs, stop strings
found by the front end, concurrent requests, and aborts that free the KV cache."""

from __future__ import annotations

import asyncio

import pytest
import torch

from layerzero.engine import SamplingParams

from ..conftest import prompts

pytestmark = pytest.mark.integration
OPTIONS = dict(device="cpu", dtype=torch.float32, max_model_len=96, num_kv_blocks=48, max_num_seqs=8)


@pytest.fixture(scope="module")
def llm(checkpoints):
    from layerzero.engine import LLM

    return LLM(checkpoints["qwen3"], **OPTIONS)


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def engine(checkpoints):
    from layerzero.engine import AsyncLLM

    eng = AsyncLLM(checkpoints["qwen3"], **OPTIONS)
    yield eng
    eng.shutdown()


def run(loop, coro, timeout: float = 120.0):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


async def generate(engine, prompt, params, rid):
    """The deltas of one request joined: (text, token ids, logprobs, finish reason, stop reason) per
    completion index, and the deltas."""
    outs = [o async for o in engine.generate(prompt, params, rid)]
    joined = {}
    for o in outs:
        for c in o.outputs:
            text, ids, lps, _, _ = joined.get(c.index, ("", [], [], None, None))
            joined[c.index] = (
                text + c.text,
                ids + c.token_ids,
                lps + (c.logprobs or []),
                c.finish_reason,
                c.stop_reason,
            )
    assert outs[-1].finished
    return [joined[i] for i in sorted(joined)], outs


def oracle(llm, prompt, params):
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return [(c.text, c.token_ids, c.logprobs or [], c.finish_reason, c.stop_reason) for c in out.outputs]


def test_greedy_equals_llm(engine, llm, loop):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    for i, p in enumerate(prompts(4, seed=3)):
        got, outs = run(loop, generate(engine, p, params, f"greedy{i}"))
        want = oracle(llm, p, params)
        assert [g[:2] + g[3:] for g in got] == [w[:2] + w[3:] for w in want]
        for a, b in zip(got[0][2], want[0][2], strict=True):
            assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) < 1e-5
        assert len(outs) > 1  # streamed as deltas, not as one output


def test_text_prompt_and_stop_string_equal_llm(engine, llm, loop):
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (free,) = oracle(llm, "the quick brown fox", base)
    stop = free[0][len(free[0]) // 2 : len(free[0]) // 2 + 2]  # a string the greedy text is sure to hold
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    got, _ = run(loop, generate(engine, "the quick brown fox", params, "stop"))
    want = oracle(llm, "the quick brown fox", params)
    assert got[0][0] == want[0][0] and got[0][3:] == want[0][3:] == ("stop", stop)
    assert run(loop, engine.get_stats()).num_running_reqs == 0  # the front end's stop ended it in the core


def test_seeded_sampling_is_reproducible(engine, llm, loop):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, n=2, max_tokens=10, ignore_eos=True)
    p = prompts(1, seed=5)[0]
    first, _ = run(loop, generate(engine, p, params, "seed-a"))
    second, _ = run(loop, generate(engine, p, params, "seed-b"))
    assert first == second
    assert [f[:2] for f in first] == [w[:2] for w in oracle(llm, p, params)]


def test_concurrent_requests_equal_llm(engine, llm, loop):
    ps = prompts(8, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True) for i in range(8)]
    want = llm.generate(ps, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(
            *(generate(engine, p, sp, f"conc{i}") for i, (p, sp) in enumerate(zip(ps, params, strict=True)))
        )

    got = run(loop, main())
    for (g, _), w in zip(got, want, strict=True):
        assert g[0][:2] == (w.outputs[0].text, w.outputs[0].token_ids)


def test_abort_frees_kv(engine, loop):
    async def main():
        outs = []
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        async for out in engine.generate(prompts(1, seed=7, lo=20, hi=20)[0], params, "abort-me"):
            outs.append(out)
            if len(outs) == 2:
                held = (await engine.get_stats()).kv_cache_usage
                await engine.abort("abort-me")
        for _ in range(200):
            stats = await engine.get_stats()
            if stats.kv_cache_usage == 0 and stats.num_running_reqs == 0:
                break
            await asyncio.sleep(0.02)
        return held, outs, stats

    held, outs, stats = run(loop, main())
    assert held > 0 and outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert stats.kv_cache_usage == 0 and stats.num_running_reqs == stats.num_waiting_reqs == 0
    # the core's own last output for the aborted request (finish_reason "abort") changed nothing here
    assert not engine.output_processor.has_unfinished_requests() and not engine._streams


def test_leaving_early_aborts_in_the_core(engine, loop):
    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True, n=2)
        agen = engine.generate(prompts(1, seed=9, lo=30, hi=30)[0], params, "leave-me")
        async for _ in agen:
            break
        await agen.aclose()
        for _ in range(200):
            stats = await engine.get_stats()
            if stats.kv_cache_usage == 0 and stats.num_running_reqs == 0:
                return stats
            await asyncio.sleep(0.02)
        return stats

    stats = run(loop, main())
    assert stats.kv_cache_usage == 0 and stats.num_running_reqs == stats.num_waiting_reqs == 0
    assert "leave-me" not in engine.output_processor.requests and not engine._streams
    # the id is free again once the request left
    got, _ = run(loop, generate(engine, [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), "leave-me"))
    assert len(got[0][1]) == 2


def test_dispatch_counters_come_from_the_core(engine, loop):
    import os

    import layerzero.telemetry as lzt

    engine.enable_dispatch_counters()
    run(loop, generate(engine, [3, 4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True), "counted"))
    snap = run(loop, engine.dispatch_counters())
    assert snap["enabled"] and snap["calls"], snap
    assert all(isinstance(op, str) and n > 0 for op, n in snap["calls"].values())
    assert engine._client.info["pid"] != os.getpid() and not lzt.is_enabled()  # counted there, not here


def test_kernel_report_comes_from_the_core(engine, loop):
    report = run(loop, engine.kernel_report())
    assert isinstance(report, dict) and report
