"""lm-evaluation-harness against the live server: its ``local-completions`` model (token-id prompts,
``echo`` + ``logprobs`` + ``max_tokens``, the way it scores any loglikelihood task) on a small local
multiple-choice task (``data/lz_tiny_mc.yaml``: 20 hand-written items, 80 continuations; no network) gives
the same accuracy, the same greedy flags and the same per-continuation loglikelihoods (within :data:`TOL`) as
lm-eval's own ``hf`` model on the same checkpoint directory (the independent oracle: transformers, no
LayerZero code). The server runs the real ``AsyncLLM``, so the prompt logprobs are the engine's
(``SamplingParams.prompt_logprobs``) and this checks them end to end through the HTTP path (token-id
prompts, batches of prompts, echo, the logprobs' alignment and shape).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from .conftest import LiveServer, server_args

pytestmark = pytest.mark.integration

lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).parent / "data"
TOL = 1e-3  # nats per continuation: fp32 engine vs fp32 transformers
# lm-eval's two models differ in their default (hf: the tokenizer's, which prepends <s>; the API models: no
# BOS), so both are told: the same token ids reach both models
BOS = {"add_bos_token": True}


@pytest.fixture
def offline(monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")


def task_config() -> dict:
    import yaml

    cfg = yaml.safe_load((DATA / "lz_tiny_mc.yaml").read_text())
    cfg["dataset_kwargs"]["data_files"]["test"] = str(DATA / "lz_tiny_mc.jsonl")  # not relative to the cwd
    return cfg


def evaluate(model: str, model_args: dict, batch_size: int) -> tuple[dict, list[list[float]], list]:
    """lm-eval's ``simple_evaluate`` on the task: (metrics, per-item loglikelihoods, greedy flags)."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task_config()],
        batch_size=batch_size,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    res = out["results"]["lz_tiny_mc"]
    samples = sorted(out["samples"]["lz_tiny_mc"], key=lambda s: s["doc_id"])
    lls = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    greedy = [[bool(r[0][1]) for r in s["resps"]] for s in samples]
    return {k: res[k] for k in ("acc,none", "acc_norm,none")}, lls, greedy


def test_lm_eval_local_completions_matches_hf(engine, model_dir, offline):
    from layerzero.engine.entrypoints.openai.api_server import build_app

    ref, ref_ll, ref_greedy = evaluate(
        "hf", {"pretrained": model_dir, "dtype": "float32", "device": "cpu", **BOS}, batch_size=8
    )
    live = LiveServer(build_app(engine, server_args(model_dir, served_model_name=["tiny"])))
    try:
        ours, ll, greedy = evaluate(
            "local-completions",
            {
                "model": "tiny",
                "base_url": live.url + "/v1/completions",
                "tokenizer": model_dir,
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "num_concurrent": 2,
                "max_retries": 1,
                "timeout": 60,
                **BOS,
            },
            batch_size=4,  # several token-id prompts per request
        )
    finally:
        live.close()
    assert len(ll) == len(ref_ll) == 20 and all(len(x) == 4 for x in ll)
    worst = max(abs(a - b) for xs, ys in zip(ll, ref_ll, strict=True) for a, b in zip(xs, ys, strict=True))
    assert worst < TOL, worst
    assert all(math.isfinite(x) and x < 0 for xs in ll for x in xs)
    assert ours == ref, (ours, ref)
    assert greedy == ref_greedy
