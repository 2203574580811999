"""Shared fixtures of the engine tests: tiny checkpoints (built once per session, real save/load path) and
Hugging Face transformers as the oracle for tokens and logprobs."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
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
    """Greedy decoding with transformers' forward (KV cache, no logits processors, EOS not special): (tokens,
    raw logprob of each chosen token). The engine's equivalent is ``temperature=0, ignore_eos=True``."""
    tokens, lps = [], []
    ids, past = torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[0, -1].double(), -1)
            t = int(out.logits[0, -1].argmax())
            tokens.append(t)
            lps.append(logp[t].item())
            ids = torch.tensor([[t]])
    return tokens, lps


def assert_same_greedy(got: list, want: list, tol: float) -> None:
    """Two engines' outputs for the same prompts (both with ``logprobs`` >= 0): the same tokens, and each
    chosen token's logprob within ``tol``."""
    for a, b in zip(got, want, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        diff = [abs(lx[t] - ly[t]) for lx, ly, t in zip(x.logprobs, y.logprobs, x.token_ids, strict=True)]
        assert max(diff, default=0.0) < tol


def assert_greedy_matches_hf(
    model: object, prompts: list[list[int]], outs: list, max_new_tokens: int
) -> None:
    """Each output's tokens equal :func:`hf_greedy`'s for its prompt and its chosen tokens' logprobs (the
    engine ran with ``logprobs=0``) are within 1e-4 of transformers' raw logprobs."""
    for p, o in zip(prompts, outs, strict=True):
        tokens, lps = hf_greedy(model, p, max_new_tokens)
        c = o.outputs[0]
        assert c.token_ids == tokens
        ours = [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(ours, lps, strict=True)) < 1e-4


def prompts(n: int = 4, seed: int = 0, lo: int = 3, hi: int = 40, vocab: int = 512) -> list[list[int]]:
    """``n`` seeded token-id prompts of ragged lengths in [lo, hi], starting with BOS (id 1)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [[1] + torch.randint(3, vocab, (k - 1,), generator=g).tolist() for k in lens]


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the main thread after ``seconds``: a hang becomes a failure, not a stuck CI (the
    engine's clean-up on an exception then runs too)."""

    def _raise(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s: the engine hangs")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
