"""Speculative decoding on a GPU (run by hand on the H200): in float32 greedy speculative output equals plain
greedy (CUDA-graph decode) token for token for every method, with async scheduling on (the CUDA default); in
bf16 a draft equal to the target is accepted (nearly) always and seeded sampled requests are reproducible."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[1, *([5, 6, 7, 8, 9] * 4)], [1, 20, 21, 22, 20, 21, 22, 20, 21], [1, 90, 91, 92, 93, 94, 95]]


def _run(ckpt, spec=None, dtype=torch.float32, params=None, as_decode=None, **kw):
    from layerzero.engine import LLM, SamplingParams

    llm = LLM(
        ckpt,
        device="cuda",
        dtype=dtype,
        max_model_len=128,
        num_kv_blocks=64,
        max_num_seqs=8,
        speculative_config=spec,
        **kw,
    )
    runner = llm.engine.runner
    runner.verify_as_decode = as_decode  # None: verification replays the decode graphs; False: eager chunks
    execute, graphed = runner.execute, []

    def spy(out, *args, **kwargs):
        res = execute(out, *args, **kwargs)
        if any(out.spec_token_ids):
            graphed.append(runner.last_batch.is_decode and runner.graphs_for(runner.last_batch) is not None)
        return res

    runner.execute = spy
    sp = params or SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    if spec is not None:
        assert any(graphed) if as_decode is None else not any(graphed)
    stats = llm.stats().get("spec_decode")
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_greedy_speculative_equals_plain_greedy_float32(checkpoints, family):
    ckpt = checkpoints[family]
    want, _ = _run(ckpt)
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"method": "draft_model", "num_speculative_tokens": 4, "model": str(ckpt)},
        {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 1},
    ):
        for as_decode in (None, False):  # graphed decode rows, eager chunks
            got, st = _run(ckpt, spec, as_decode=as_decode)
            assert got == want, (spec["method"], as_decode)
            assert st["num_accepted_tokens"] > 0, st


def test_bf16_draft_equal_to_target_and_seeded_sampling(checkpoints):
    from layerzero.engine import SamplingParams

    ckpt = checkpoints["qwen3"]
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(ckpt)}
    _, st = _run(ckpt, spec, dtype=torch.bfloat16)
    assert st["acceptance_rate"] > 0.9, st
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=30, ignore_eos=True)
    a, _ = _run(ckpt, spec, dtype=torch.bfloat16, params=sp)
    b, _ = _run(ckpt, spec, dtype=torch.bfloat16, params=sp)
    assert a == b
