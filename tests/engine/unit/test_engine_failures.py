"""Issue 35: one bad request, a hang or a second caller never takes the engine down.

Each case checks the typed error (or the failed request's ``"error"`` output) and then that the same ``LLM``
holds no blocks and no requests and still generates the tokens of a clean run. Cases that used to hang run
under a deadline (SIGALRM raises in the main thread; the engine's own clean-up on an exception is part of what
is tested).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

import layerzero as lz

from ..conftest import deadline

pytestmark = pytest.mark.integration

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 10, 11, 12, 13], [1, 40, 41, 42, 43, 44, 45]]


def greedy(max_tokens: int = 6):
    from layerzero.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def sneak(params, **fields):
    """``params`` with fields set past validation: what a value that passes the checks but raises in the step
    does (the case the engine must survive even when a check is missing)."""
    params = dataclasses.replace(params)
    for k, v in fields.items():
        object.__setattr__(params, k, v)
    return params


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, checkpoints):
    from layerzero.engine import LLM

    return LLM(
        checkpoints["qwen3"],
        device="cpu",
        dtype=torch.float32,
        max_model_len=48,
        num_kv_blocks=40,
        async_scheduling=request.param,
    )


@pytest.fixture(scope="module")
def clean(llm):
    """The tokens of each of PROMPTS under ``greedy()``, from a clean run."""
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


def assert_healthy(llm, clean) -> None:
    """No request or block left, and the engine still gives the clean run's tokens."""
    assert llm.engine.requests == {}
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.usage() == 0.0
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)] == clean
    assert llm.stats()["kv_usage"] == 0.0 and llm.engine.requests == {}


# ------------------------------------------------------------------------------ 1. validate at construction
@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(seed=2**63), r"seed.*9223372036854775807"),
        (dict(top_k=2**31), r"top_k.*2147483647"),
        (dict(temperature=1e39), "float32"),
        (dict(repetition_penalty=1e39), "float32"),
        (dict(repetition_penalty=1e-50), "float32"),
        (dict(top_p=1e-60), "float32"),
        (dict(skip_special_tokens=1), "bool"),
        (dict(stop="a\ud800"), "surrogate"),
    ],
)
def test_values_the_sampler_cannot_take_are_refused_at_construction(kw, match):
    from layerzero.engine import SamplingParams

    with pytest.raises(lz.InvalidInputError, match=match):
        SamplingParams(**kw)


def test_the_largest_accepted_values_run(llm, clean):
    from layerzero.engine import SamplingParams

    sp = SamplingParams(
        max_tokens=3,
        temperature=3e38,
        top_k=2**31 - 1,
        seed=2**63 - 1,
        repetition_penalty=3e38,
        ignore_eos=True,
    )
    out = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in out] == ["length", "length"]
    assert_healthy(llm, clean)


def test_sampling_params_are_frozen_and_take_numpy_values():
    from layerzero.engine import SamplingParams

    sp = SamplingParams(
        n=np.int64(2),
        max_tokens=np.int32(5),
        temperature=np.float32(0.5),
        top_k=np.int64(3),
        stop=["x"],
        stop_token_ids=np.array([4, 5]),
        logit_bias={np.int64(3): np.float32(1.5)},
    )
    assert (sp.n, sp.max_tokens, sp.top_k, sp.stop_token_ids) == (2, 5, 3, (4, 5))
    assert type(sp.n) is int and type(sp.temperature) is float and dict(sp.logit_bias) == {3: 1.5}
    for field, value in (("n", 0), ("temperature", float("nan")), ("max_tokens", 0), ("stop", ["y"])):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(sp, field, value)
    with pytest.raises(TypeError):
        sp.logit_bias[7] = 1.0  # read-only
    assert dataclasses.replace(sp, temperature=0.0).greedy
    with pytest.raises(lz.InvalidInputError, match="max_tokens"):
        dataclasses.replace(sp, max_tokens=0)


def test_text_prompt_whose_tokens_fall_outside_the_vocabulary(llm, clean, monkeypatch):
    class Wide:
        def __call__(self, text):
            return {"input_ids": [1, 4, 100_000]}

    monkeypatch.setattr(llm.input_processor, "tokenizer", Wide())
    with pytest.raises(lz.InvalidInputError, match=r"tokenizer gave token id.*\[0, 512\).*100000"):
        llm.generate(["hello", "world"], greedy(), use_tqdm=False)
    monkeypatch.undo()
    assert_healthy(llm, clean)


# ------------------------------------------------------------------------------ 1. a step that raises
@pytest.mark.parametrize(
    "bad",
    [dict(top_k=2**31), dict(seed=2**63), dict(temperature=1e39), dict(repetition_penalty=1e39)],
    ids=lambda d: next(iter(d)),
)
def test_a_request_failing_in_the_sampler_fails_alone(llm, clean, bad):
    from layerzero.engine import SamplingParams

    poisoned = sneak(SamplingParams(max_tokens=6, temperature=0.7, ignore_eos=True), **bad)
    params = [greedy(), poisoned, greedy(), greedy()]
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert out[1].outputs[0].finish_reason == "error" and out[1].finished
    assert out[1].error and ("Error" in out[1].error)
    for i in (0, 2, 3):
        assert out[i].error is None and out[i].outputs[0].finish_reason == "length"
        assert out[i].outputs[0].token_ids == clean[i]
    assert_healthy(llm, clean)


def test_a_forward_failure_fails_the_step_requests_only(llm, clean, monkeypatch):
    runner = llm.engine.runner
    real, calls = runner.execute, []

    def fail_first(out, *args, **kwargs):
        calls.append(list(out.req_ids))
        if len(calls) == 1:
            raise RuntimeError("injected forward failure")
        return real(out, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", fail_first)
    monkeypatch.setattr(
        llm.engine.scheduler, "max_num_seqs", 1
    )  # one request per step: the first fails alone
    out = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    monkeypatch.undo()
    assert out[0].outputs[0].finish_reason == "error" and "injected forward failure" in out[0].error
    assert [o.outputs[0].token_ids for o in out[1:]] == clean[1:]
    assert_healthy(llm, clean)


def test_a_detokenizer_failure_fails_its_request_only(checkpoints):
    from layerzero.engine import LLM

    llm = LLM(checkpoints["qwen3"], device="cpu", dtype=torch.float32, max_model_len=48, num_kv_blocks=40)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    boxes = llm._add_all(PROMPTS, greedy(), None, "final_only")

    def broken(tok, may_stop):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    llm.output_processor.requests[boxes[2].request_id].comps[0].detok.add = broken
    while not all(b.finished for b in boxes):
        llm._step()
    out = [llm._collect(b) for b in boxes]
    assert out[2].outputs[0].finish_reason == "error" and "injected" in out[2].error
    assert [o.outputs[0].token_ids for i, o in enumerate(out) if i != 2] == want[:2] + want[3:]
    assert_healthy(llm, want)


@pytest.mark.parametrize("at_call", [1, 3])
def test_keyboard_interrupt_mid_generate_aborts_its_requests(llm, clean, monkeypatch, at_call):
    runner = llm.engine.runner
    real, calls = runner.execute, [0]

    def interrupt(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    stream = llm.stream(PROMPTS[3], greedy(8))  # someone else's request, open across the interrupt
    first = next(stream)
    monkeypatch.setattr(runner, "execute", interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:3], greedy(), use_tqdm=False)
    monkeypatch.undo()
    assert list(llm.engine.requests) == [first.request_id]  # only the stream's request is left
    rest = [t for d in stream for t in d.outputs[0].token_ids]
    assert first.outputs[0].token_ids + rest == greedy_tokens(llm, PROMPTS[3], 8)
    assert_healthy(llm, clean)


def greedy_tokens(llm, prompt, n):
    return llm.generate([prompt], greedy(n), use_tqdm=False)[0].outputs[0].token_ids


# ------------------------------------------------------------------------------ 2. admission never spins
def test_a_prompt_filling_the_whole_pool_is_admitted_on_an_idle_engine(checkpoints):
    from layerzero.engine import LLM

    llm = LLM(
        checkpoints["qwen3"],
        device="cpu",
        dtype=torch.float32,
        block_size=1,
        max_model_len=256,
        max_num_seqs=1,
    )
    assert llm.engine.kv.watermark_blocks > 0
    assert llm.engine.runner.num_blocks - llm.engine.kv.watermark_blocks < 256
    with deadline(60):
        out = llm.generate([[1] + [5] * 255, [1, 2, 3], [1] + [7] * 250], greedy(3), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in out] == ["length"] * 3
    assert [len(o.outputs[0].token_ids) for o in out] == [1, 3, 3]
    assert llm.engine.kv.usage() == 0.0 and llm.engine.requests == {}


def test_an_engine_that_cannot_admit_fails_the_requests_instead_of_spinning(llm, clean, monkeypatch):
    from layerzero.engine.core.sched.scheduler import SchedulerOutput

    monkeypatch.setattr(
        llm.engine.scheduler, "schedule", lambda: SchedulerOutput()
    )  # a defect: admits nothing
    with deadline(20):
        out = llm.generate(PROMPTS[:2], greedy(), use_tqdm=False)
    monkeypatch.undo()
    assert [o.outputs[0].finish_reason for o in out] == ["error", "error"]
    assert "admitted none" in out[0].error
    assert_healthy(llm, clean)


# ------------------------------------------------------------------------------ 3. outputs reach their owner
def test_zipped_streams_each_get_their_own_tokens(llm, clean):
    a = llm.stream(PROMPTS[0], greedy(2))
    b = llm.stream(PROMPTS[1], greedy(6))
    got: dict[str, list[int]] = {"a": [], "b": []}
    with deadline(30):
        for x, y in zip(a, b, strict=False):
            got["a"] += x.outputs[0].token_ids
            got["b"] += y.outputs[0].token_ids
        got["b"] += [t for d in b for t in d.outputs[0].token_ids]
    assert got == {"a": clean[0][:2], "b": clean[1]}
    assert_healthy(llm, clean)


def test_generate_while_a_stream_is_open(llm, clean):
    stream = llm.stream(PROMPTS[0], greedy(3))
    first = next(stream)
    with deadline(30):
        out = llm.generate(PROMPTS[1:], greedy(), use_tqdm=False)  # finishes the stream's request too
        rest = [t for d in stream for t in d.outputs[0].token_ids]
    assert [o.outputs[0].token_ids for o in out] == clean[1:]
    assert first.outputs[0].token_ids + rest == clean[0][:3]
    assert_healthy(llm, clean)


def test_an_abandoned_stream_frees_its_request_when_collected(llm, clean):
    stream = llm.stream(PROMPTS[2], greedy(20))
    next(stream)
    assert llm.engine.requests
    del stream  # the generator's finally runs at collection: the request is aborted
    assert_healthy(llm, clean)


# ------------------------------------------------------------------------------ 4. several threads
def test_threads_calling_generate_get_correct_tokens(llm, clean):
    results: list[list[list[int]]] = []
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(3):
                order = PROMPTS[k % 4 :] + PROMPTS[: k % 4]
                out = llm.generate(order, greedy(), use_tqdm=False)
                results.append([o.outputs[0].token_ids for o in out])
                results[-1] = results[-1][-(k % 4) :] + results[-1][: -(k % 4)] if k % 4 else results[-1]
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    assert errors == [] and len(results) == 12
    assert all(r == clean for r in results)
    assert_healthy(llm, clean)


def test_abort_from_another_thread_ends_a_running_generate(llm, clean, monkeypatch):
    """The other thread is inside a step (holding the engine's lock) when abort is called: abort does not wait
    for it, and the step's end applies it."""
    runner = llm.engine.runner
    real, calls, inside, go = runner.execute, [0], threading.Event(), threading.Event()

    def held(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            inside.set()
            go.wait(timeout=30)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", held)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=llm.generate(PROMPTS[:2], greedy(40), use_tqdm=False)))
    t.start()
    assert inside.wait(timeout=30)
    ids = list(llm.engine.requests)
    with deadline(10):  # abort does not wait for the step the other thread is in (that step waits for `go`)
        assert llm.abort(ids) == ids
    go.set()
    t.join(timeout=30)
    monkeypatch.undo()
    assert not t.is_alive()
    assert [o.outputs[0].finish_reason for o in box["out"]] == ["abort", "abort"]
    assert [o.request_id for o in box["out"]] == ids
    assert all(len(o.outputs[0].token_ids) < 40 for o in box["out"])
    assert llm.abort("no-such-request") == []
    assert_healthy(llm, clean)


# ------------------------------------------------------------------------------ 7. prompt and chat shapes
def test_prompt_shapes(llm, clean):
    one = [o.outputs[0].token_ids for o in llm.generate(tuple(PROMPTS[0]), greedy(), use_tqdm=False)]
    assert one == clean[:1]
    arr = llm.generate(np.array(PROMPTS[1]), greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in arr] == clean[1:2]
    many = llm.generate([[np.int64(t) for t in p] for p in PROMPTS], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in many] == clean
    with pytest.raises(lz.InvalidInputError, match="priority"):
        llm.generate(PROMPTS[0], greedy(), priority="high", use_tqdm=False)
    assert_healthy(llm, clean)


@pytest.mark.parametrize("prompt", ["caf\ud800e", "\udfff"])
def test_a_lone_surrogate_in_a_text_prompt(checkpoints, prompt):
    from layerzero.engine import LLM

    llm = LLM(checkpoints["qwen3"], device="cpu", dtype=torch.float32, max_model_len=48, num_kv_blocks=8)
    with pytest.raises(lz.InvalidInputError, match="surrogate"):
        llm.generate(["fine", prompt], greedy(), use_tqdm=False)
    assert llm.engine.requests == {}


@pytest.mark.parametrize(
    "messages,match",
    [
        (["hi"], "conversation"),
        (None, "conversation"),
        ([], "conversation"),
        ([{"role": "user"}], "conversation"),
        ([[{"role": "user", "content": "hi"}], "x"], "conversation"),
    ],
)
def test_chat_with_malformed_messages(checkpoints, messages, match):
    from layerzero.engine import LLM

    llm = LLM(checkpoints["qwen3"], device="cpu", dtype=torch.float32, max_model_len=48, num_kv_blocks=8)
    if not getattr(llm.tokenizer, "chat_template", None):
        llm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(lz.InvalidInputError, match=match):
        llm.chat(messages, greedy(), use_tqdm=False)
    assert llm.engine.requests == {}
