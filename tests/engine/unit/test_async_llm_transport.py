"""AsyncLLM's process boundary with a fake engine core (tests/engine/unit/fake_core.py: deterministic tokens,
no model): streaming deltas, continuous batching, routing under concurrency, aborts (explicit, cancelled,
abandoned, in storms), utility calls. One engine for the module (its core process starts once)."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

import layerzero as lz
from layerzero.engine import SamplingParams

from . import fake_core
from .fake_core import fake_engine, fake_token

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def engine(checkpoints):
    eng = fake_engine(checkpoints["qwen3"], max_model_len=200, num_kv_blocks=64, max_num_seqs=8)
    yield eng
    eng.shutdown()
    assert not eng.is_running and not eng.errored


def run(loop, coro, timeout: float = 60.0):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


async def collect(engine, prompt, params, rid, **kw):
    return [out async for out in engine.generate(prompt, params, rid, **kw)]


async def idle(engine, timeout: float = 10.0):
    """Wait until the core runs and holds nothing; its stats then."""
    for _ in range(int(timeout / 0.02)):
        s = await engine.get_stats()
        if s.num_running_reqs == 0 and s.num_waiting_reqs == 0 and s.kv_cache_usage == 0:
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"the core is not idle: {s}")


def tokens(outs, index=0):
    return [t for o in outs for c in o.outputs if c.index == index for t in c.token_ids]


def test_attributes(engine, checkpoints):
    assert engine.is_running and not engine.errored
    assert engine.max_model_len == 200 and engine.num_kv_blocks == 64
    assert engine.tokenizer is not None and engine.model_config.vocab_size == fake_core.VOCAB
    assert engine.validate([1, 2, 3], SamplingParams()) == (None, [1, 2, 3])
    text, ids = engine.validate("hello world", SamplingParams())
    assert text == "hello world" and ids == list(engine.tokenizer("hello world")["input_ids"])


def test_generate_streams_deltas(engine, loop):
    prompt = [1, 5, 9]
    outs = run(loop, collect(engine, prompt, SamplingParams(max_tokens=7, logprobs=0), "deltas"))
    assert tokens(outs) == [fake_token(prompt, 0, t) for t in range(7)]
    assert all(o.outputs and o.outputs[0].token_ids for o in outs)  # each delta holds only new tokens
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    last = outs[-1].outputs[0]
    assert last.finish_reason == "length" and outs[-1].request_id == "deltas"
    assert sum(len(o.outputs[0].logprobs) for o in outs) == 7
    assert outs[0].prompt_token_ids == prompt


def test_text_prompt_and_n(engine, loop):
    ids = list(engine.tokenizer("the quick brown fox")["input_ids"])
    outs = run(loop, collect(engine, "the quick brown fox", SamplingParams(n=3, max_tokens=5), "n3"))
    assert outs[0].prompt == "the quick brown fox" and outs[-1].finished
    for i in range(3):
        assert tokens(outs, i) == [fake_token(ids, i, t) for t in range(5)]


def test_stop_token_ids(engine, loop):
    prompt = [1, 2]
    stop = fake_token(prompt, 0, 3)
    outs = run(loop, collect(engine, prompt, SamplingParams(max_tokens=50, stop_token_ids=[stop]), "stop"))
    assert tokens(outs) == [fake_token(prompt, 0, t) for t in range(4)]
    assert outs[-1].outputs[-1].finish_reason == "stop" and outs[-1].outputs[-1].stop_reason == stop


def test_concurrent_requests_are_routed(engine, loop):
    rng = random.Random(0)
    reqs = {
        f"c{i}": ([1] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))], rng.randint(1, 40))
        for i in range(40)
    }

    async def main():
        return await asyncio.gather(
            *(collect(engine, p, SamplingParams(max_tokens=m), rid) for rid, (p, m) in reqs.items())
        )

    results = run(loop, main())
    for (rid, (p, m)), outs in zip(reqs.items(), results, strict=True):
        assert {o.request_id for o in outs} == {rid}
        assert tokens(outs) == [fake_token(p, 0, t) for t in range(m)]
        assert outs[-1].finished
    run(loop, idle(engine))


def test_requests_join_the_running_batch(engine, loop):
    async def main():
        long = engine.generate([1, 7], SamplingParams(max_tokens=150), "long")
        first = await long.__anext__()
        short = await collect(engine, [1, 8], SamplingParams(max_tokens=3), "short")
        rest = [o async for o in long]
        return first, short, rest

    first, short, rest = run(loop, main())
    assert short[-1].finished and tokens(short) == [fake_token([1, 8], 0, t) for t in range(3)]
    assert not rest[0].finished  # the long one was still running when the short one finished
    assert tokens([first, *rest]) == [fake_token([1, 7], 0, t) for t in range(150)]


def test_bad_input_raises_before_anything_is_queued(engine, loop):
    async def main():
        for prompt, kw, match in [
            ([], {}, "at least one token"),
            ([1, fake_core.VOCAB], {}, "token id"),
            ([1] * 201, {}, "max_model_len"),
            ([1], {"priority": "high"}, "priority"),
            ([1], {"request_id": ""}, "request_id"),
        ]:
            rid = kw.pop("request_id", "bad")
            with pytest.raises(lz.InvalidInputError, match=match):
                await collect(engine, prompt, SamplingParams(), rid, **kw)
            assert "bad" not in engine._streams
        with pytest.raises(lz.InvalidInputError, match="vocab"):
            await collect(engine, [1], SamplingParams(stop_token_ids=[10**6]), "bad")
        return await idle(engine)

    assert run(loop, main()).num_running_reqs == 0


def test_duplicate_request_id_is_refused(engine, loop):
    async def main():
        gen = engine.generate([1, 3], SamplingParams(max_tokens=20), "dup")
        first = await gen.__anext__()
        with pytest.raises(lz.InvalidInputError, match="not in flight"):
            await collect(engine, [1, 4], SamplingParams(), "dup")
        rest = [o async for o in gen]
        return [first, *rest]

    outs = run(loop, main())
    assert tokens(outs) == [fake_token([1, 3], 0, t) for t in range(20)]  # the first one is untouched


def test_abort_ends_the_stream_and_frees_kv(engine, loop):
    async def main():
        outs = []
        async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=5000, n=2), "ab"):
            outs.append(out)
            if len(outs) == 3:
                busy = await engine.get_stats()
                await engine.abort("ab")
        return busy, outs, await idle(engine)

    busy, outs, after = run(loop, main())
    assert busy.kv_cache_usage > 0 and busy.num_running_reqs == 1
    assert outs[-1].finished and {c.finish_reason for c in outs[-1].outputs} == {"abort"}
    assert after.kv_cache_usage == 0
    run(loop, engine.abort(["ab", "never-seen"]))  # unknown and finished ids are ignored


def test_cancelled_and_abandoned_streams_abort(engine, loop):
    async def consume(rid):
        async for _ in engine.generate([1, 4], SamplingParams(max_tokens=5000), rid):
            pass

    async def main():
        task = asyncio.create_task(consume("cancelled"))
        await asyncio.sleep(0.1)
        assert (await engine.get_stats()).num_running_reqs == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await idle(engine)
        gen = engine.generate([1, 5], SamplingParams(max_tokens=5000), "closed")
        await gen.__anext__()
        await gen.aclose()
        await idle(engine)
        async for _ in engine.generate([1, 6], SamplingParams(max_tokens=5000), "broken"):
            break  # the generator is finalized (aclose scheduled by the loop) once dropped
        return await idle(engine)

    run(loop, main())
    assert not engine._streams


def test_abort_storm(engine, loop):
    rng = random.Random(1)
    n = 120

    async def one(i):
        rid, p, m = f"s{i}", [1, 10 + i], rng.randint(1, 60)
        mode = rng.choice(["finish", "abort", "cancel", "break"])
        gen = engine.generate(p, SamplingParams(max_tokens=m), rid)
        outs = []
        try:
            async for out in gen:
                outs.append(out)
                if mode == "abort" and rng.random() < 0.3:
                    await engine.abort(rid)
                elif mode == "cancel" and rng.random() < 0.3:
                    raise asyncio.CancelledError
                elif mode == "break" and rng.random() < 0.3:
                    break
        except asyncio.CancelledError:
            return rid, "cancel", outs
        finally:
            await gen.aclose()
        return rid, mode, outs

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(n)))
        return results, await idle(engine)

    results, after = run(loop, main(), timeout=120)
    done = 0
    for rid, mode, outs in results:
        if outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "length":
            i = int(rid[1:])
            assert tokens(outs) == [fake_token([1, 10 + i], 0, t) for t in range(len(tokens(outs)))]
            done += 1
        elif outs and outs[-1].finished:
            assert outs[-1].outputs[0].finish_reason == "abort" and mode == "abort"
    assert done >= n // 4
    assert after.kv_cache_usage == 0 and not engine._streams
    assert not engine.output_processor.has_unfinished_requests()


def test_stats_and_utility_calls(engine, loop):
    async def main():
        gen = engine.generate([1, 9], SamplingParams(max_tokens=5000), "stats")
        await gen.__anext__()
        await asyncio.sleep(0.05)
        running = engine.num_running, engine.num_waiting
        report = await engine.kernel_report()
        reset = await engine.reset_prefix_cache()
        await gen.aclose()
        return running, report, reset, await idle(engine)

    running, report, reset, after = run(loop, main())
    assert running == (1, 0)
    assert report["fake.op"]["1"]["kernel"] == "fake.kernel" and report["pid"] != os.getpid()
    assert reset is True and after.generation_tokens > 0 and engine.num_running == 0
    with pytest.raises(lz.InvalidInputError, match="utility method"):
        run(loop, engine._client.call_utility("shutdown"))


def test_engine_moves_to_a_new_loop(engine):
    outs = asyncio.run(collect(engine, [1, 2], SamplingParams(max_tokens=4), "other-loop"))
    assert tokens(outs) == [fake_token([1, 2], 0, t) for t in range(4)]
    outs = asyncio.run(collect(engine, [1, 3], SamplingParams(max_tokens=4), "third-loop"))
    assert tokens(outs) == [fake_token([1, 3], 0, t) for t in range(4)]


def test_async_llm_takes_every_llm_option():
    import dataclasses
    import inspect

    from layerzero.engine import LLM, EngineConfig

    options = {n for n, p in inspect.signature(LLM).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert options and options <= {f.name for f in dataclasses.fields(EngineConfig)}


def test_importing_the_engine_imports_no_transport():
    import subprocess
    import sys

    code = (
        "import sys, layerzero.engine\n"
        "from layerzero.engine import AsyncLLM, EngineDeadError\n"
        "print(sorted(m for m in ('zmq', 'msgpack') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
