"""Complete tiny checkpoints for the engine's tests and the demo: a scaled-down real model
(:func:`layerzero.testing.hf_models.build_and_save`) plus a byte-level BPE tokenizer trained here with
``tokenizers`` on a built-in corpus (no network), saved with transformers' ``save_pretrained`` as a hub
checkpoint has it (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat
template).

The LM head is scaled by :data:`SHARPEN` so the top-1 logit margins are far above float32 noise: greedy tokens
of two correct implementations then agree, and a test comparing them can only fail for a real difference.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from .hf_models import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE, build_and_save

__all__ = ["CHAT_TEMPLATE", "SHARPEN", "build_checkpoint", "corpus", "train_tokenizer"]

SHARPEN = 3.0
"""Factor applied to the LM head's weights of a built checkpoint."""
SPECIAL = ("<pad>", "<s>", "</s>")
"""Special tokens, ids 0, 1, 2 (the tiny configs' pad / BOS / EOS)."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
_WORDS = (
    "the quick brown fox jumps over a lazy dog while kernels run fast on every machine and the engine "
    "serves tokens with paged attention prefix caching continuous batching hello world layer zero picks "
    "speed memory cache block table sequence prompt output stop string sample greedy temperature"
).split()


def corpus(lines: int = 400, seed: int = 0) -> list[str]:
    """A deterministic English-like corpus (``lines`` sentences of the built-in words, digits,
    punctuation)."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ",", f" {i}."]))
    return out


def train_tokenizer(vocab_size: int = VOCAB_SIZE, seed: int = 0) -> object:
    """A transformers ``PreTrainedTokenizerFast`` wrapping a byte-level BPE (GPT-2 / Qwen / Llama 3 style)
    trained on :func:`corpus`, with ``<pad>``/``<s>``/``</s>`` as ids 0/1/2, BOS prepended on encode, and
    :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_TOKEN_ID)]
    )
    for i, name in enumerate(SPECIAL):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"tokenizer: expected {name} at id {i}, got {tok.token_to_id(name)}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_checkpoint(family: str, directory: str | Path, seed: int = 0, *, tokenizer: bool = True) -> Path:
    """Build ``family``'s tiny model (``llama``, ``qwen3``, ``qwen3_moe``, ...; see
    :data:`layerzero.testing.hf_models.MODEL_FAMILIES`) with seeded weights, sharpen its LM head, save it with
    a trained tokenizer (``tokenizer=False``: weights and config only) to ``directory``; returns the
    directory.

    Raises:
        ConfigurationError: an unknown family.
    """
    from safetensors.torch import load_file, save_file

    path = build_and_save(family, directory, seed=seed)
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["lm_head.weight"] = (tensors["lm_head.weight"].double() * SHARPEN).to(torch.float32).contiguous()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    if tokenizer:
        tok = train_tokenizer(seed=seed)
        if len(tok) != VOCAB_SIZE:
            raise RuntimeError(f"tokenizer: expected {VOCAB_SIZE} tokens, got {len(tok)}")
        tok.save_pretrained(str(path))
    return path


if PAD_TOKEN_ID != 0 or EOS_TOKEN_ID != 2:  # the special-token order above relies on these ids
    raise RuntimeError("hf_models special token ids changed; update SPECIAL")
