"""``model_type`` -> model class. Llama, Qwen3 and Qwen3-MoE share one decoder implementation
(:mod:`.llama`): their differences (QK-norm, sparse MoE layers) are configuration."""

from __future__ import annotations

import torch
from torch import nn

from ..config import SUPPORTED_ARCHITECTURES, ModelConfig
from ..errors import bad_config
from ..parallel.state import SINGLE, ParallelState
from .llama import LlamaForCausalLM

__all__ = ["MODELS", "build_model"]

MODELS: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
}


def build_model(
    cfg: ModelConfig,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelState = SINGLE,
) -> nn.Module:
    """An uninitialised model for ``cfg`` (weights come from :mod:`..loader`), this rank's shard of it under
    ``parallel``.

    Raises:
        ConfigurationError: an unsupported ``model_type`` (lists the supported ones).
    """
    cls = MODELS.get(cfg.model_type)
    if cls is None:
        raise bad_config("model_type", f"one of {sorted(SUPPORTED_ARCHITECTURES)}", repr(cfg.model_type))
    return cls(cfg, max_positions, device=device, dtype=dtype, parallel=parallel)
