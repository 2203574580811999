"""``lz.apply_penalties``: repetition, presence and frequency penalties on a batch of logits."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import (
    INT_DTYPES,
    check_cpu_values,
    check_ids,
    check_rows,
    check_same,
    check_tensor,
    device_spec,
    fail,
    inference_only,
    scope_token,
    stream_capturing,
)

OP = "apply_penalties"
_F32 = frozenset({torch.float32})


class PenaltyKey(NamedTuple):
    """The selection-cache key of one ``lz.apply_penalties`` call (which penalties are given, whether in the
    counts form);
    ``capture``/``scope`` close every op's key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    has_repetition: bool
    has_presence: bool
    has_frequency: bool
    deterministic: bool
    counts_form: bool
    capture: bool
    scope: tuple[Any, ...]


def context(key: PenaltyKey) -> SelectionContext:
    """The :class:`SelectionContext` of an ``lz.apply_penalties`` cache key."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        vocab_size=key.vocab_size,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


def prepare(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    *,
    repetition_penalty: torch.Tensor | None = None,
    presence_penalty: torch.Tensor | None = None,
    frequency_penalty: torch.Tensor | None = None,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.apply_penalties`` inputs; return (cache key, canonical kernel args ``(logits,
    prompt_token_ids, output_token_ids, repetition_penalty, presence_penalty, frequency_penalty)``)."""
    check_tensor(OP, "logits", logits, 2)
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        raise fail(OP, "logits shape", "[B, V] with B >= 1 and V >= 1", list(logits.shape))
    if isinstance(prompt_token_ids, torch.Tensor) and prompt_token_ids.dtype == torch.bool:
        _check_counts_form(logits, prompt_token_ids, output_token_ids)
    else:
        check_ids(OP, "prompt_token_ids", prompt_token_ids, logits)
        check_ids(OP, "output_token_ids", output_token_ids, logits)
    if repetition_penalty is not None:
        check_rows(OP, "repetition_penalty", repetition_penalty, logits, _F32, "float32", "torch.float32")
        check_cpu_values(
            OP,
            "repetition_penalty",
            repetition_penalty,
            lambda r: torch.isfinite(r) & (r > 0),
            "finite values > 0 (1: off)",
            "Use 1.0 to leave a row unpenalized.",
        )
    for name, t in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if t is not None:
            check_rows(OP, name, t, logits, _F32, "float32", "torch.float32")
            check_cpu_values(
                OP, name, t, torch.isfinite, "finite values (0: off)", "Use 0.0 to leave a row unpenalized."
            )
    capture = logits.is_cuda and stream_capturing()
    key = PenaltyKey(
        OP,
        logits.device,
        logits.dtype,
        logits.shape[1],
        repetition_penalty is not None,
        presence_penalty is not None,
        frequency_penalty is not None,
        torch.are_deterministic_algorithms_enabled(),
        prompt_token_ids.dtype == torch.bool,
        capture,
        scope_token(),
    )
    return key, (
        logits,
        prompt_token_ids,
        output_token_ids,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
    )


def _check_counts_form(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: Any) -> None:
    """The counts form of ``lz.apply_penalties``: ``prompt_mask`` bool ``[B, V]`` and ``output_counts``
    int32/int64 ``[B, V]`` (values >= 0, checked on CPU tensors only), both on logits' device."""
    batch, vocab = logits.shape
    if prompt_mask.shape != logits.shape:
        raise fail(
            OP,
            "prompt_token_ids shape (counts form: a bool prompt mask)",
            f"[B, V] = {[batch, vocab]} (like logits)",
            list(prompt_mask.shape),
            "Pass a bool [B, V] mask of the tokens in each prompt, or int token ids for the ids form.",
        )
    check_same(OP, "logits", logits, "prompt_token_ids", prompt_mask, dtype=False)
    if not isinstance(output_counts, torch.Tensor):
        raise fail(
            OP, "output_token_ids", "an int32/int64 tensor [B, V] of counts", type(output_counts).__name__
        )
    if output_counts.dtype not in INT_DTYPES:
        raise fail(
            OP,
            "output_token_ids.dtype (counts form)",
            "int32 or int64",
            output_counts.dtype,
            "Cast the counts with .int().",
        )
    if output_counts.shape != logits.shape:
        raise fail(
            OP,
            "output_token_ids shape (counts form: per-token output counts)",
            f"[B, V] = {[batch, vocab]} (like logits)",
            list(output_counts.shape),
        )
    check_same(OP, "logits", logits, "output_token_ids", output_counts, dtype=False)
    check_cpu_values(
        OP, "output_token_ids", output_counts, lambda c: c >= 0, "counts >= 0", "Counts are never negative."
    )


SPEC = OperationSpec(
    OP,
    "repetition, presence and frequency penalties on logits",
    ("logits", "prompt_token_ids", "output_token_ids"),
    "reference.apply_penalties",
)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    *,
    repetition_penalty: torch.Tensor | None = None,
    presence_penalty: torch.Tensor | None = None,
    frequency_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """Penalize tokens a request has already seen (the logits processors of a serving engine, vLLM's order).

    Shapes: logits ``[B, V]`` (B rows, V vocabulary), any float dtype; ``prompt_token_ids`` ``[B, Lp]`` and
    ``output_token_ids`` ``[B, Lo]`` int64/int32, ragged rows right-padded with V (ignored), Lp or Lo may be
    0; penalties ``[B]`` float32 on logits' device, or None (off for every row) -> a new ``[B, V]`` tensor in
    logits' dtype (computed in float32, float64 for float64; logits are not modified).

    1. ``repetition_penalty`` r > 0 (CTRL, Keskar et al. 2019; Hugging Face
       ``RepetitionPenaltyLogitsProcessor``): for every token in the prompt *or* the output,
       ``logit > 0 -> logit / r``, else ``logit * r``; r = 1 is off.
    2. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI API semantics, as vLLM): over *output*
       tokens only, ``logit -= f * count + p * (count > 0)``; 0 is off. OpenAI documents [-2, 2]; any finite
       value is accepted here.

    Counts form (what a serving engine keeps on the device, so a step reads no token lists from the host):
    ``prompt_token_ids`` a bool ``[B, V]`` mask (True: the token is in the row's prompt) and
    ``output_token_ids`` an int32/int64 ``[B, V]`` count of each token in the row's output so far; the result
    equals the ids form's for the same tokens (the bool dtype selects the form; token ids are never bool).

    Values are checked on CPU tensors only (token ids in ``[0, V]``, counts >= 0, repetition finite > 0,
    presence and frequency finite); on CUDA that would synchronize, so out-of-range values there are the
    caller's responsibility (an id outside ``[0, V]`` fails inside the kernel).

    Raises:
        InvalidInputError: logits not a 2-D float tensor or empty; token ids not int64/int32 ``[B, L]`` on
            logits' device (counts form: the mask or the counts not ``[B, V]`` on logits' device, counts not
            int32/int64); a penalty not a float32 ``[B]`` tensor on logits' device; a CPU value out of
            range.

    >>> import torch, layerzero as lz
    >>> logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    >>> lz.apply_penalties(logits, torch.tensor([[0, 4]]), torch.tensor([[1, 3, 3]]),
    ...                    repetition_penalty=torch.tensor([2.0]), frequency_penalty=torch.tensor([0.1]))
    tensor([[ 1.0000, -2.1000,  3.0000,  0.0500]])
    """
    if (is_dynamo_compiling() or is_exporting()) and inference_only(logits):  # torch.compile, torch.export
        return traced("apply_penalties")(
            logits,
            prompt_token_ids,
            output_token_ids,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
        )
    key, args = prepare(
        logits,
        prompt_token_ids,
        output_token_ids,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
    )
    return RUNTIME.run(key, context, args)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        apply_penalties,
        prepare,
        context,
        kernel_args=(
            "logits",
            "prompt_token_ids",
            "output_token_ids",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ),
        custom_ops=("apply_penalties",),
    ),
)
