"""Tiny, real Hugging Face causal LMs for parity tests and the demo (no network, seconds on a CPU).

Each family is the real transformers model class built from its real config class, scaled down:
2 layers, hidden 128, 8 query heads / 2 KV heads (GQA 4:1), head_dim 16, vocab 512; Mistral uses a sliding
window of 8 tokens on every layer, Qwen2 on its second layer (hybrid full/sliding cache), Qwen3 has its
q/k RMSNorms, Qwen3-MoE 4 experts with top-2 routing. Weights are seeded (``torch.manual_seed``) and drawn
with ``initializer_range=0.1`` (5x transformers' default) plus RMSNorm weights of 1 + N(0, 0.1), so logits
have a real spread (greedy decoding is not decided by float noise) and a kernel that ignored the norm
weight would be caught. Models are round-tripped through ``save_pretrained`` (safetensors) and
``from_pretrained`` like a downloaded checkpoint. ``transformers`` is imported only when a function runs.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import torch

from layerzero.core.errors import ConfigurationError, InvalidInputError, did_you_mean, expected_got

#: Families (= ``config.model_type``) this module can build.
MODEL_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

# family -> (config class, causal-LM class), names in the top-level transformers namespace
_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}

#: Sliding window (tokens) of the families that use one; the default prompts (11 tokens + 32 generated) exceed
#: it.
SLIDING_WINDOW = 8
VOCAB_SIZE = 512
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "pad_token_id": PAD_TOKEN_ID,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}
_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": SLIDING_WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": SLIDING_WINDOW, "max_window_layers": 1},
    "qwen3": {},
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}


def _check_family(family: str) -> str:
    if family not in _CLASSES:
        raise ConfigurationError(
            expected_got(
                "model family",
                f"one of {list(MODEL_FAMILIES)}",
                repr(family),
                "Pick a supported family." + did_you_mean(str(family), MODEL_FAMILIES),
            )
        )
    return family


def _transformers_class(name: str) -> Any:
    return getattr(importlib.import_module("transformers"), name)


def tiny_config(family: str) -> Any:
    """The scaled-down real config of ``family`` (e.g. a ``transformers.LlamaConfig``).

    Raises:
        ConfigurationError: unknown family (lists :data:`MODEL_FAMILIES`).
    """
    config_cls = _transformers_class(_CLASSES[_check_family(family)][0])
    return config_cls(**_COMMON, **_EXTRA[family])


def build_and_save(family: str, directory: str | Path, seed: int = 0) -> Path:
    """Build ``family``'s tiny model with seeded random weights and save it as safetensors.

    Args:
        family: one of :data:`MODEL_FAMILIES`.
        directory: where to write ``config.json`` + ``model.safetensors`` (created if missing).
        seed: ``torch.manual_seed`` value; the same seed gives bit-identical weights.

    Returns:
        ``Path(directory)``, loadable with :func:`load`.

    Raises:
        ConfigurationError: unknown family, or no ``model.safetensors`` was written.
    """
    model_cls = _transformers_class(_CLASSES[_check_family(family)][1])
    config = tiny_config(family)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:  # RMSNorm weights: not all ones, so they matter
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    path = Path(directory)
    kwargs: dict[str, Any] = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:  # transformers 4.x
        kwargs["safe_serialization"] = True
    model.save_pretrained(path, **kwargs)
    if not any(path.glob("*.safetensors")):
        raise ConfigurationError(
            expected_got(
                f"save_pretrained({path})",
                "a model.safetensors file",
                sorted(p.name for p in path.iterdir()),
                "Check the installed transformers/safetensors versions.",
            )
        )
    return path


def load(family: str, path: str | Path, attn_implementation: str = "sdpa") -> Any:
    """Load a model saved by :func:`build_and_save`, float32, eval mode, CPU.

    Args:
        family: one of :data:`MODEL_FAMILIES` (must match what was saved).
        path: the directory :func:`build_and_save` returned.
        attn_implementation: ``"sdpa"``, ``"eager"`` or ``"layerzero"`` (registered first when asked for).

    Returns:
        The ``*ForCausalLM`` model.

    Raises:
        ConfigurationError: unknown family, or the saved ``model_type`` differs from ``family``.
    """
    model_cls = _transformers_class(_CLASSES[_check_family(family)][1])
    if attn_implementation == "layerzero":
        from layerzero.integrations.transformers import register

        register()
    model = model_cls.from_pretrained(
        Path(path), attn_implementation=attn_implementation, dtype=torch.float32
    )
    if model.config.model_type != family:
        raise ConfigurationError(
            expected_got(
                f"model_type saved in {path}",
                repr(family),
                repr(model.config.model_type),
                "Load with the family it was built as.",
            )
        )
    return model.float().eval()


def padded_batch(
    lengths: tuple[int, ...] = (11, 6), *, vocab_size: int = VOCAB_SIZE, seed: int = 1234
) -> dict[str, torch.Tensor]:
    """Deterministic prompts of different lengths, LEFT padded (the generation convention), no tokenizer.

    Args:
        lengths: number of real tokens per prompt (each >= 1).
        vocab_size: token ids are drawn from [3, vocab_size) so they are never pad (0), bos (1) or eos (2).
        seed: seed of the private ``torch.Generator`` (global RNG untouched).

    Returns:
        ``{"input_ids": [B, L] int64, "attention_mask": [B, L] int64}`` with B = len(lengths),
        L = max(lengths); padding (id 0, mask 0) on the left. Pass as ``model.generate(**batch)``.

    Raises:
        InvalidInputError: an empty ``lengths``, a length < 1, or ``vocab_size`` <= 3.
    """
    if not lengths or min(lengths) < 1 or vocab_size <= 3:
        raise InvalidInputError(
            expected_got(
                "padded_batch(lengths, vocab_size)",
                "non-empty lengths >= 1 and vocab_size > 3",
                f"lengths={lengths}, vocab_size={vocab_size}",
                "Fix the arguments.",
            )
        )
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD_TOKEN_ID, dtype=torch.int64)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.int64)
    for row, n in enumerate(lengths):
        input_ids[row, width - n :] = torch.randint(3, vocab_size, (n,), generator=gen)
        attention_mask[row, width - n :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def left_padded_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a left-padded batch, as ``generate`` computes them: [B, L] int64, the first real token
    of each row at position 0, padding positions set to 1 (their value is irrelevant: they are masked)."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 1)


def masked_rel_error(reference: torch.Tensor, candidate: torch.Tensor, attention_mask: torch.Tensor) -> float:
    """``max|candidate - reference| / max|reference|`` over the non-padded positions, computed in float64.

    Args:
        reference, candidate: [B, L, V] logits (any float dtype).
        attention_mask: [B, L], nonzero at real tokens.

    Raises:
        InvalidInputError: the shapes differ or no position is unmasked.
    """
    if reference.shape != candidate.shape or tuple(attention_mask.shape) != tuple(reference.shape[:2]):
        raise InvalidInputError(
            expected_got(
                "masked_rel_error shapes",
                "reference == candidate [B, L, V], mask [B, L]",
                f"{tuple(reference.shape)}, {tuple(candidate.shape)}, {tuple(attention_mask.shape)}",
                "Pass matching tensors.",
            )
        )
    keep = attention_mask.bool()
    if not bool(keep.any()):
        raise InvalidInputError(
            expected_got(
                "masked_rel_error mask",
                "at least one real token",
                "all padding",
                "Pass the batch's attention_mask.",
            )
        )
    ref, cand = reference[keep].double(), candidate[keep].double()
    return float((cand - ref).abs().max() / ref.abs().max().clamp_min(torch.finfo(torch.float64).tiny))
