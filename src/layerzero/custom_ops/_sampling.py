"""The sampling-step ops of :mod:`layerzero.custom_ops` as ``torch.library`` custom ops: ``lz.sample``,
``lz.sample_topk`` and ``lz.sample_topp`` (without a ``generator``: custom ops cannot take a
``torch.Generator``, so calls with one are traced as Python), ``lz.sample_greedy`` and
``lz.apply_penalties``.

Conventions (fake implementations, fresh contiguous outputs through :func:`_owned`) are those of
:mod:`layerzero.custom_ops._ops`, which imports this module and re-exports every wrapper here; it also
imports on its own (importing it registers its ops)."""

from __future__ import annotations

from typing import Optional

import torch

from ._common import NS, _owned, eager


# -------------------------------------------------------------------------------------------- sampling step
@torch.library.custom_op(f"{NS}::sample", mutates_args=())
def sample(
    logits: torch.Tensor,
    temperature: Optional[torch.Tensor],
    top_k: Optional[torch.Tensor],  # noqa: UP045
    top_p: Optional[torch.Tensor],
    min_p: Optional[torch.Tensor],  # noqa: UP045
    seeds: Optional[torch.Tensor],
    offsets: Optional[torch.Tensor],
) -> torch.Tensor:  # noqa: UP045
    """``lz.sample`` (no ``generator``: the global RNG for unseeded rows) as a custom op."""
    out = eager("sample")(
        logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds, offsets=offsets
    )
    return _owned(out, logits, temperature, top_k, top_p, min_p, seeds, offsets)


@sample.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@torch.library.custom_op(f"{NS}::sample_topk", mutates_args=())
def sample_topk(logits: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    """``lz.sample_topk`` without a ``generator`` (the global RNG) as a custom op."""
    return _owned(eager("sample_topk")(logits, k, temperature=temperature), logits)


@torch.library.custom_op(f"{NS}::sample_topp", mutates_args=())
def sample_topp(logits: torch.Tensor, p: float, temperature: float) -> torch.Tensor:
    """``lz.sample_topp`` without a ``generator`` (the global RNG) as a custom op."""
    return _owned(eager("sample_topp")(logits, p, temperature=temperature), logits)


@sample_topk.register_fake
def _(logits, k, temperature):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@sample_topp.register_fake
def _(logits, p, temperature):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@torch.library.custom_op(f"{NS}::sample_greedy", mutates_args=())
def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """``lz.sample_greedy`` as a custom op."""
    return _owned(eager("sample_greedy")(logits), logits)


@sample_greedy.register_fake
def _(logits):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@torch.library.custom_op(f"{NS}::apply_penalties", mutates_args=())
def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    repetition_penalty: Optional[torch.Tensor],
    presence_penalty: Optional[torch.Tensor],  # noqa: UP045
    frequency_penalty: Optional[torch.Tensor],
) -> torch.Tensor:  # noqa: UP045
    """``lz.apply_penalties`` as a custom op."""
    out = eager("apply_penalties")(
        logits,
        prompt_token_ids,
        output_token_ids,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
    )
    return _owned(
        out,
        logits,
        prompt_token_ids,
        output_token_ids,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
    )


@apply_penalties.register_fake
def _(logits, prompt_token_ids, output_token_ids, repetition_penalty, presence_penalty, frequency_penalty):
    return logits.new_empty(logits.shape)
