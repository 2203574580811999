"""``/v1/chat/completions`` and the other routes (models, health, version, tokenize, detokenize, metrics,
kernels) through the official ``openai`` client and ``httpx`` against a live server."""

from __future__ import annotations

import httpx
import pytest

from layerzero.engine import SamplingParams

from .conftest import API_KEY, MAX_MODEL_LEN

pytestmark = pytest.mark.integration

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


def _template_ids(tok, messages):
    return list(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def test_chat_uses_the_template_and_equals_the_offline_engine(client, oracle):
    ids = _template_ids(oracle.tokenizer, MESSAGES)
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    ref = oracle.generate([ids], SamplingParams(temperature=0, max_tokens=10, logprobs=3), use_tqdm=False)[0]
    out = ref.outputs[0]
    c = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and c.index == 0
    assert c.message.role == "assistant" and c.message.content == out.text
    assert c.finish_reason == out.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(out.token_ids)
    assert r.usage.total_tokens == len(ids) + len(out.token_ids)
    assert len(c.logprobs.content) == len(out.token_ids)
    for e, d, t in zip(c.logprobs.content, out.logprobs, out.token_ids, strict=True):
        assert abs(e.logprob - d[t]) < 1e-5 and len(e.top_logprobs) == 3
        assert [x.logprob for x in e.top_logprobs] == sorted(
            (x.logprob for x in e.top_logprobs), reverse=True
        )
        assert abs(e.top_logprobs[0].logprob - max(d.values())) < 1e-5
    tok = httpx.post(
        client.base_url.join("/tokenize").__str__().replace("/v1", ""),
        json={"messages": MESSAGES},
        headers=AUTH,
        timeout=60,
    )
    assert tok.json()["tokens"] == ids


def test_content_parts_equal_a_string_and_max_tokens_alias(client):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    a = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=6, temperature=0
    )
    b = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello\nworld"}],
        max_completion_tokens=6,
        temperature=0,
    )
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage == b.usage


def test_chat_stream_role_first_equals_non_streamed_with_usage_chunk(client):
    kw = dict(model="tiny", messages=MESSAGES, n=2, temperature=0.9, seed=5, max_tokens=12)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    firsts = {}
    texts = {0: "", 1: ""}
    for ch in chunks[:-1]:
        assert ch.usage is None
        for c in ch.choices:
            firsts.setdefault(c.index, c.delta)
            texts[c.index] += c.delta.content or ""
    assert all(d.role == "assistant" and d.content == "" for d in firsts.values())
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert [texts[c.index] for c in whole.choices] == [c.message.content for c in whole.choices]


def test_default_max_tokens_fill_the_context_up_to_the_limit(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 64  # --max-tokens-limit 64 (the context would allow more)


def test_models_health_version_tokenize_detokenize(server, client, oracle, model_dir):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].object == "model"
    raw = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=60).json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert raw["data"][0]["root"] == model_dir
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200  # no key needed
    v = httpx.get(server.url + "/version", headers=AUTH, timeout=60).json()
    import layerzero

    assert v == {"version": layerzero.__version__}
    ids = oracle.tokenizer("hello world")["input_ids"]
    t = httpx.post(
        server.url + "/tokenize",
        json={"prompt": "hello world", "return_token_strs": True},
        headers=AUTH,
        timeout=60,
    )
    assert (
        t.json()["tokens"] == ids
        and t.json()["count"] == len(ids)
        and t.json()["max_model_len"] == MAX_MODEL_LEN
    )
    assert len(t.json()["token_strs"]) == len(ids)
    d = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=AUTH, timeout=60)
    assert d.json() == {"prompt": oracle.tokenizer.decode(ids)}


def test_metrics_and_kernels(server, client):
    client.completions.create(
        model="tiny", prompt="hello", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=60).text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "num_preemptions_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket",
    ):
        assert f"layerzero:{name}" in text, name
    assert 'layerzero:request_success_total{finished_reason="length",model_name="tiny"}' in text
    queued = [x for x in text.splitlines() if x.startswith("layerzero:request_queue_time_seconds_count{")]
    assert queued and float(queued[0].rsplit(" ", 1)[1]) >= 1  # fed by RequestOutput.queue_time
    # LayerZero's dispatch counters, from the engine core's process (build_app turned them on there)
    calls = [x for x in text.splitlines() if x.startswith("layerzero_kernel_calls_total{")]
    assert any('op="rms_norm"' in x or 'op="linear"' in x for x in calls), calls
    assert all(float(x.rsplit(" ", 1)[1]) > 0 for x in calls)
    for name in ("selections_total", "cache_hits_total", "cache_misses_total", "kernel_call_seconds_bucket"):
        assert f"layerzero_{name}" in text, name
    k = httpx.get(server.url + "/v1/layerzero/kernels", headers=AUTH, timeout=120)  # a dry run per bucket
    assert k.status_code == 200 and isinstance(k.json(), dict)
