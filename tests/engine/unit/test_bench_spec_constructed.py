"""``benchmarks/engine/spec_constructed.py``: weights whose greedy continuation is a known permutation (so
speculative decoding's speed can be measured at a chosen acceptance with dummy weights). Oracles: the
permutation itself (the engine's greedy output is the walk, token for token), counting (the draft's
permutation differs on exactly the asked fraction and is still a permutation), and the speculative engine
(the target's own first layers draft the walk exactly: acceptance 1.0; n-gram lookup over the walk's copy in
the prompt is accepted)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration
BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "engine"


@pytest.fixture(scope="module")
def sc():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("spec_constructed")
    finally:
        sys.path.remove(str(BENCH))


def test_draft_permutation_differs_on_the_asked_fraction(sc):
    succ = sc.successors(1000, seed=3)
    assert sorted(succ.tolist()) == list(range(1000))
    d = sc.draft_successors(succ, 0.8)
    assert sorted(d.tolist()) == list(range(1000)) and int((d != succ).sum()) == 200
    assert torch.equal(sc.draft_successors(succ, 1.0), succ)


def test_constructed_model_walks_the_permutation(sc, checkpoints):
    from layerzero.engine import LLM, SamplingParams

    llm = LLM(checkpoints["qwen3"], device="cpu", dtype=torch.float32, max_model_len=128, num_kv_blocks=64)
    model = llm.engine.runner.model
    succ = sc.successors(model.embed_tokens.weight.shape[0], seed=4)
    sc.construct(model, succ)
    ps = sc.walk_prompts(succ, 3, 8, 30, 0.7, seed=5)
    assert all(len(p) == 46 for p in ps)
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for p, o in zip(ps, outs, strict=True):
        assert o.outputs[0].token_ids == sc.walk(succ, p[-1], 21)[1:]
    sc.check_walk(llm, succ)
    with pytest.raises(RuntimeError, match="constructed weights not in effect"):
        sc.check_walk(llm, sc.successors(succ.numel(), seed=5))  # another permutation: not this model's walk


def test_tied_embeddings_are_refused(sc):
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = self.lm_head = torch.nn.Embedding(4, 2)

    with pytest.raises(ValueError, match="tied embeddings"):
        sc.construct(Tied(), torch.arange(4))


def test_bench_tiny_constructed_run(sc):
    bench = importlib.import_module("bench_spec_decode")
    rows = bench.main(["--tiny", "--constructed", "0.9", "--configs", "ngram,layer_skip"])
    by = {(r["config"], r["batch"]): r for r in rows}
    assert by["layer_skip", 1]["acceptance_rate"] == 1.0 and by["layer_skip", 4]["acceptance_rate"] == 1.0
    assert by["ngram", 4]["num_drafts"] > 0 and by["ngram", 4]["acceptance_rate"] > 0.5
