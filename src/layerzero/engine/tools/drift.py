"""Measuring what an engine option changes in the model's numbers (quantization's logprob drift): the model's
teacher-forced log-softmax over a fixed token sequence, and its weight bytes. Used by
``benchmarks/engine/bench_quantization.py`` and the engine's tests; not on the serving path."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import bad_input
from ..layers.quantized_linear import module_bytes
from ..worker.input_batch import ScheduledChunk, build_forward_batch

__all__ = ["teacher_forced_logprobs", "weight_bytes"]


def weight_bytes(llm: Any) -> int:
    """Bytes of the model's parameters and buffers (codes, scales and zero points of quantized layers)."""
    return module_bytes(llm.engine.runner.model)


@torch.no_grad()
def teacher_forced_logprobs(llm: Any, token_ids: list[int]) -> torch.Tensor:
    """float64 log-softmax ``[T, V]`` of the next token at every position of ``token_ids`` (one prefill of the
    whole sequence through the engine's model into a scratch KV cache of its own, so the engine's pool and
    prefix cache are untouched; row t predicts token t + 1).

    Raises:
        InvalidInputError: an empty sequence.
    """
    runner, n = llm.engine.runner, len(token_ids)
    if n == 0:
        raise bad_input("teacher_forced_logprobs token_ids", "at least one token", 0)
    bs = runner.block_size
    blocks = -(-n // bs)
    scratch = [torch.zeros((blocks, *c.shape[1:]), dtype=c.dtype, device=c.device) for c in runner.kv_caches]
    batch = build_forward_batch(
        [ScheduledChunk(list(token_ids), 0, n, list(range(blocks)), True)], bs, runner.device
    )
    batch.logits_indices = torch.arange(n, device=runner.device)
    batch.logits_all = True
    return torch.log_softmax(runner.model(batch, scratch).double(), dim=-1)
