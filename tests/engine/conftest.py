"""Shared fixtures of the engine tests: tiny checkpoints (built once per session, real save/load path) and
Hugging Face transformers as the oracle for tokens and logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FAMILIES = ("qwen3", "llama", "qwen3_moe")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> checkpoint directory (weights + trained tokenizer), built lazily."""
    from layerzero.testing.checkpoints import build_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    cache: dict[str, Path] = {}

    class Lazy(dict):
        def __missing__(self, family: str) -> Path:
            cache[family] = build_checkpoint(family, root / family, seed=0)
            self[family] = cache[family]
            return cache[family]

    return Lazy()


@pytest.fixture(scope="session")
def hf_models(checkpoints: dict[str, Path]) -> dict[str, object]:
    """family -> the transformers model of that checkpoint (float32, CPU, eval)."""
    from layerzero.testing.hf_models import load

    class Lazy(dict):
        def __missing__(self, family: str) -> object:
            self[family] = load(family, checkpoints[family])
            return self[family]

    return Lazy()


def hf_greedy(model: object, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy ``generate`` of one prompt: (tokens, raw logprob of each chosen token)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(lg[0].double(), -1)[t].item() for lg, t in zip(out.logits, tokens, strict=True)]
    return tokens, lps


def prompts(n: int = 4, seed: int = 0, lo: int = 3, hi: int = 40, vocab: int = 512) -> list[list[int]]:
    """``n`` seeded token-id prompts of ragged lengths in [lo, hi], starting with BOS (id 1)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [[1] + torch.randint(3, vocab, (k - 1,), generator=g).tolist() for k in lens]
