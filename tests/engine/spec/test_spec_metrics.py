"""Speculative decoding's metrics: the engine's counters (``LLM.stats()["spec_decode"]``, the core's
``SchedulerStats``) agree with the per-request ``spec_decode_metrics``, and ``/metrics`` exports them under
vLLM's ``spec_decode`` names with our prefix."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration


def test_engine_counters_equal_the_sum_of_the_requests(checkpoints):
    from layerzero.engine import LLM, SamplingParams

    ckpt = checkpoints["qwen3"]
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(ckpt)}
    llm = LLM(
        ckpt, device="cpu", dtype=torch.float32, max_model_len=64, num_kv_blocks=40, speculative_config=spec
    )
    outs = llm.generate(
        [[1, 5, 6, 7], [1, 8, 9]],
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        use_tqdm=False,
    )
    ms = [o.spec_decode_metrics for o in outs]
    st = llm.stats()["spec_decode"]
    assert st["num_drafts"] == sum(m.num_drafts for m in ms) > 0
    assert st["num_draft_tokens"] == sum(m.num_draft_tokens for m in ms)
    assert st["num_accepted_tokens"] == sum(m.num_accepted_tokens for m in ms)
    # 9 tokens each: one from the prefill step, the rest from verification steps of 1 + accepted tokens
    for m in ms:
        assert m.num_drafts + m.num_accepted_tokens == 8
        assert m.mean_acceptance_length == pytest.approx(8 / m.num_drafts)
    assert sum(st["accepted_per_pos"]) == st["num_accepted_tokens"]
    core = llm.engine.get_stats()
    assert (core.spec_decode_num_drafts, core.spec_decode_num_accepted_tokens) == (
        st["num_drafts"],
        st["num_accepted_tokens"],
    )


def test_metrics_endpoint_exports_vllm_spec_decode_names():
    pytest.importorskip("prometheus_client")
    from layerzero.engine.core.messages import SchedulerStats
    from layerzero.engine.entrypoints.openai.metrics import ServerMetrics

    m = ServerMetrics("tiny")
    m.update(SchedulerStats())
    assert b"spec_decode" not in m.render()  # off: nothing exported
    m.update(
        SchedulerStats(
            spec_decode_num_drafts=10,
            spec_decode_num_draft_tokens=40,
            spec_decode_num_accepted_tokens=25,
            spec_decode_num_accepted_tokens_per_pos=[9, 8, 5, 3],
        )
    )
    text = m.render().decode()
    assert 'layerzero:spec_decode_num_drafts_total{model_name="tiny"} 10.0' in text
    assert 'layerzero:spec_decode_num_draft_tokens_total{model_name="tiny"} 40.0' in text
    assert 'layerzero:spec_decode_num_accepted_tokens_total{model_name="tiny"} 25.0' in text
    assert (
        'layerzero:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="3"} 3.0' in text
    )
