"""``/v1/completions`` through the official ``openai`` client (sync and async) against a live server; the
offline ``LLM`` on the same checkpoint is the oracle for tokens, text, logprobs and usage."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from layerzero.engine import SamplingParams
from layerzero.engine.entrypoints.openai.logprobs import TokenStrings

from .conftest import API_KEY, has_prompt_logprobs, needs_prompt_logprobs

pytestmark = pytest.mark.integration

PROMPTS = ["hello world", "the quick brown fox jumps"]


def _offline(oracle, prompt, **kw):
    return oracle.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def test_greedy_completions_equal_the_offline_engine(client, oracle):
    r = client.completions.create(
        model="tiny",
        prompt=PROMPTS,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny"
    assert [c.index for c in r.choices] == [0, 1]
    strings = TokenStrings(oracle.tokenizer)
    prompt_tokens = 0
    for p, c in zip(PROMPTS, r.choices, strict=True):
        ref = _offline(oracle, p, temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
        out = ref.outputs[0]
        prompt_tokens += len(ref.prompt_token_ids)
        assert c.text == out.text and c.finish_reason == "length"
        assert c.logprobs.tokens == [strings.text(t) for t in out.token_ids]
        ours = c.logprobs.token_logprobs
        theirs = [d[t] for d, t in zip(out.logprobs, out.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-5
        assert [list(d.values())[0] for d in c.logprobs.top_logprobs] == ours
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == prompt_tokens + 24


def test_token_id_prompts(client, oracle):
    ids = oracle.tokenizer("hello world")["input_ids"]
    one = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    two = client.completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=6, temperature=0)
    ref = _offline(oracle, ids, temperature=0, max_tokens=6)
    assert one.choices[0].text == two.choices[0].text == ref.outputs[0].text
    assert one.usage.prompt_tokens == len(ids) and two.usage.prompt_tokens == len(ids) + 2


def test_seeded_n_choices_indexed_and_equal_to_offline(client, oracle):
    kw = dict(n=2, temperature=0.9, seed=7, max_tokens=10)
    r = client.completions.create(model="tiny", prompt=PROMPTS, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt index x n + completion index
    for i, p in enumerate(PROMPTS):
        ref = _offline(oracle, p, **kw)
        assert [r.choices[i * 2 + j].text for j in range(2)] == [o.text for o in ref.outputs]
    assert r.usage.completion_tokens == sum(
        len(o.token_ids) for p in PROMPTS for o in _offline(oracle, p, **kw).outputs
    )


def test_streamed_equals_non_streamed(client):
    kw = dict(model="tiny", prompt=PROMPTS, n=2, temperature=0.8, seed=3, max_tokens=14, logprobs=1)
    whole = client.completions.create(**kw)
    texts, tokens, fins, usage, last = {}, {}, {}, None, None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        last = chunk
        if not chunk.choices:
            usage = chunk.usage
            continue
        assert chunk.usage is None and chunk.id == whole.id.replace(whole.id, chunk.id)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens if c.logprobs else [])
            if c.finish_reason:
                fins[c.index] = c.finish_reason
    assert last.choices == [] and usage == whole.usage
    for c in whole.choices:
        assert texts[c.index] == c.text and fins[c.index] == c.finish_reason
        assert tokens[c.index] == c.logprobs.tokens


@pytest.mark.skipif(has_prompt_logprobs(), reason="the engine has prompt logprobs")
def test_echo_with_logprobs_is_a_clean_400_until_the_engine_has_prompt_logprobs(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt="hello", max_tokens=2, echo=True, logprobs=1)
    assert ei.value.status_code == 400 and ei.value.body["param"] == "echo"
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith("hello")  # echo alone needs no prompt logprobs


@needs_prompt_logprobs
def test_echo_with_logprobs_includes_the_prompts(client, oracle):
    ids = oracle.tokenizer("hello world again")["input_ids"]
    r = client.completions.create(
        model="tiny", prompt="hello world again", max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    c, ref = r.choices[0], _offline(oracle, "hello world again", temperature=0, max_tokens=4)
    assert c.text == "hello world again" + ref.outputs[0].text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert all(2 <= len(d) <= 3 for d in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    only = client.completions.create(
        model="tiny", prompt="hello world again", max_tokens=0, echo=True, logprobs=1
    )
    o = only.choices[0]
    assert o.text == "hello world again" and o.finish_reason == "length"
    assert o.logprobs.tokens == lp.tokens[: len(ids)] and o.logprobs.token_logprobs[0] is None
    assert (
        max(
            abs(a - b)
            for a, b in zip(o.logprobs.token_logprobs[1:], lp.token_logprobs[1 : len(ids)], strict=True)
        )
        < 1e-9
    )
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids)


def test_stop_strings_and_every_sampling_field(client, oracle):
    base = _offline(oracle, PROMPTS[1], temperature=0, max_tokens=16, ignore_eos=True).outputs[0].text
    stop = base[4:7]
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop])
    ref = _offline(oracle, PROMPTS[1], temperature=0, max_tokens=16, stop=[stop])
    assert r.choices[0].text == ref.outputs[0].text and stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    fields = dict(
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={"5": 3.0},
        seed=11,
    )
    extras = dict(
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.2,
        min_tokens=3,
        stop_token_ids=[7],
        skip_special_tokens=False,
    )
    r = client.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=12,
        user="u1",
        extra_body={**extras, "priority": 0},
        **fields,
    )
    ref = _offline(oracle, PROMPTS[0], max_tokens=12, **{**fields, "logit_bias": {5: 3.0}}, **extras)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_async_client_concurrent_seeded_requests_are_reproducible(server, client):
    kw = dict(model="tiny", temperature=1.0, max_tokens=12)
    alone = [
        client.completions.create(prompt=p, seed=s, **kw).choices[0].text
        for p, s in zip(PROMPTS * 2, range(4), strict=True)
    ]

    async def together():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as ac:
            rs = await asyncio.gather(
                *(
                    ac.completions.create(prompt=p, seed=s, **kw)
                    for p, s in zip(PROMPTS * 2, range(4), strict=True)
                )
            )
            chunks = [
                c async for c in await ac.completions.create(prompt=PROMPTS[0], seed=0, stream=True, **kw)
            ]
        return [r.choices[0].text for r in rs], "".join(c.choices[0].text for c in chunks if c.choices)

    concurrent, streamed = asyncio.run(together())
    assert concurrent == alone and streamed == alone[0]


def test_a_model_without_tokenizer_streams_a_chunk_per_step(model_dir, tmp_path):
    """A checkpoint without tokenizer files (token-id prompts; every text is "") streams as steps finish:
    chunks carry no text but arrive one per step, not all at the end (found by bench-serve: TTFT == E2EL)."""
    import shutil

    import httpx

    from layerzero.engine.entrypoints.openai.api_server import build_app

    from .conftest import LiveServer, server_args, start_engine, stop_engine

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in Path(model_dir).iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors":
            shutil.copy(f, bare / f.name)
    eng = start_engine(str(bare))
    live = LiveServer(build_app(eng, server_args(str(bare), served_model_name=["bare"])))
    try:
        body = {"model": "bare", "prompt": [5, 6, 7], "max_tokens": 16, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        chunks = [e for e in events if e["choices"]]
        assert events[-1]["usage"]["completion_tokens"] == 16
        assert all(c["choices"][0]["text"] == "" for c in chunks)
        assert len(chunks) >= 2 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        live.close()
        stop_engine(eng)
