"""vLLM's extra sampling fields ``allowed_token_ids`` and ``bad_words`` on ``/v1/completions`` and
``/v1/chat/completions`` (the official client's ``extra_body``), against the offline ``LLM`` with the same
``SamplingParams``; out-of-vocabulary ids are a 400."""

from __future__ import annotations

import openai
import pytest

from layerzero.engine import SamplingParams

pytestmark = pytest.mark.integration


def test_allowed_token_ids_and_bad_words_fields(client, oracle):
    prompt = "the quick brown fox"
    free = oracle.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    word = oracle.tokenizer.decode(free[0].outputs[0].token_ids[:1]).strip()
    allowed = sorted(set(free[0].outputs[0].token_ids[1:4]) | {9, 11})
    for extra in ({"allowed_token_ids": allowed}, {"bad_words": [word]}):
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, **extra}
        )
        ref = oracle.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **extra), use_tqdm=False
        )[0].outputs[0]
        assert r.choices[0].text == ref.text and r.choices[0].text != free[0].outputs[0].text
        if "allowed_token_ids" in extra:
            assert set(ref.token_ids) <= set(allowed)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=6,
        temperature=0,
        extra_body={"allowed_token_ids": [9]},
    )
    assert chat.choices[0].message.content == oracle.tokenizer.decode([9] * 6)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=4, extra_body={"allowed_token_ids": [10**7]}
        )
