"""``lz.sample_topk`` and ``lz.sample_topp``: next-token sampling from logits with one temperature and cut for
every row, and what the sampling ops share (:data:`GREEDY_BELOW`, the logits check :func:`_check_logits`).

The batched per-row ``lz.sample`` is :mod:`layerzero.ops.sampling_batch`, greedy decoding
(``lz.sample_greedy``) :mod:`layerzero.ops.sampling_greedy`: one module per op family."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import (
    check_cpu_values,
    check_temperature,
    check_tensor,
    device_spec,
    fail,
    scope_token,
    stream_capturing,
)

GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)
"""Temperatures in ``(0, GREEDY_BELOW)`` (float32's smallest normal number, about 1.18e-38) are sampled as
``temperature == 0``: greedy argmax, first index on ties, no random draw. At such a temperature ``1 / T`` does
not fit in float32 and ``softmax(logits / T)`` is one-hot at the maximum anyway (the limit T -> 0+); the
kernels compute ``(logits - max) / T`` for every larger T, so ``logits / T`` overflowing float32 cannot
produce NaN."""


def _temperature(op: str, temperature: Any) -> float:
    """:func:`check_temperature`, then temperatures below :data:`GREEDY_BELOW` become 0.0 (greedy)."""
    t = check_temperature(op, temperature)
    return 0.0 if t < GREEDY_BELOW else t


def _check_logits(op: str, logits: Any, generator: Any) -> None:
    check_tensor(op, "logits", logits, 2)
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        raise fail(op, "logits shape", "[B, V] with B >= 1 and V >= 1", list(logits.shape))
    if (
        logits.device.type == "cpu" and logits.is_floating_point()
    ):  # values on CPU only: a GPU check would sync
        check_cpu_values(
            op,
            "logits",
            logits,
            lambda t: ~torch.isnan(t) & (t != math.inf),
            "no NaN and no +inf (-inf masks a token)",
            "Check the model's output for overflow.",
        )
        check_cpu_values(
            op,
            "logits row maximum",
            logits.amax(dim=-1),
            torch.isfinite,
            "a finite logit in every row (a row of -inf has nothing to sample)",
        )
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise fail(op, "generator", "a torch.Generator or None", type(generator).__name__)
        if generator.device.type != logits.device.type:
            raise fail(
                op,
                "generator.device",
                f"a {logits.device.type} generator (like logits)",
                generator.device,
                f"Create it with torch.Generator(device={str(logits.device)!r}).",
            )


class SamplingKey(NamedTuple):
    """The selection-cache key of one ``lz.sample_topk`` / ``lz.sample_topp`` call (``greedy``: temperature 0,
    kept apart from sampled calls); ``capture``/``scope`` close every op's key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    greedy: bool
    has_generator: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def _key(op: str, logits: torch.Tensor, temperature: float, generator: Any) -> SamplingKey:
    capture = logits.is_cuda and stream_capturing()
    return SamplingKey(
        op,
        logits.device,
        logits.dtype,
        logits.shape[1],
        temperature == 0.0,
        generator is not None,
        torch.are_deterministic_algorithms_enabled(),
        capture,
        scope_token(),
    )


def context(key: SamplingKey) -> SelectionContext:
    """The :class:`SelectionContext` of a sampling cache key."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        vocab_size=key.vocab_size,
        has_generator=key.has_generator,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


def prepare_topk(
    logits: torch.Tensor, k: int, *, temperature: float = 1.0, generator: torch.Generator | None = None
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.sample_topk`` inputs; return (cache key, canonical kernel args)."""
    op = "sample_topk"
    _check_logits(op, logits, generator)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise fail(op, "k", "an int >= 1", repr(k), "k = 1 is greedy; k >= V disables the top-k cut.")
    temperature = _temperature(op, temperature)
    return _key(op, logits, temperature, generator), (logits, k, temperature, generator)


def prepare_topp(
    logits: torch.Tensor, p: float, *, temperature: float = 1.0, generator: torch.Generator | None = None
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.sample_topp`` inputs; return (cache key, canonical kernel args)."""
    op = "sample_topp"
    _check_logits(op, logits, generator)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0.0 < p <= 1.0:
        raise fail(op, "p", "a float in (0, 1]", repr(p), "p = 1.0 disables the nucleus cut.")
    temperature = _temperature(op, temperature)
    return _key(op, logits, temperature, generator), (logits, float(p), temperature, generator)


TOPK_SPEC = OperationSpec(
    "sample_topk", "top-k sampling (temperature, torch.Generator)", ("logits",), "reference.sample_topk"
)
TOPP_SPEC = OperationSpec(
    "sample_topp",
    "nucleus (top-p) sampling (temperature, torch.Generator)",
    ("logits",),
    "reference.sample_topp",
)


def sample_topk(
    logits: torch.Tensor, k: int, *, temperature: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Sample one token per row from the ``k`` most likely tokens (Fan et al. 2018).

    Shapes: logits ``[B, V]`` (B rows, V vocabulary), any float dtype -> token ids ``[B]`` int64.
    ``softmax(logits / temperature)`` restricted to the top k, renormalized, sampled with ``generator``
    (``torch.Generator`` on logits' device; same seed -> same tokens). ``temperature``: a finite float >= 0;
    ``temperature == 0``, and any positive temperature below :data:`GREEDY_BELOW` (~1.18e-38, where ``1 / T``
    overflows float32), is greedy: argmax, first index on ties, no draw (the T -> 0+ limit). Larger
    temperatures are computed as ``softmax((logits - max) / T)``, so a tiny T gives the argmax token (ties at
    the maximum are drawn uniformly, as the softmax says) rather than an overflow. ``k >= V`` means no cut.

    Raises:
        InvalidInputError: logits not a 2-D float tensor or empty, or (CPU tensors) with NaN / +inf or a
            row of -inf only; k not an int >= 1; temperature negative or
            not finite; generator of another device type.

    >>> import torch, layerzero as lz
    >>> lz.sample_topk(torch.tensor([[0.0, 5.0, 1.0]]), k=1)
    tensor([1])
    """
    if (
        (is_dynamo_compiling() or is_exporting())
        and generator is None
        and isinstance(k, int)
        and _scalars(k, temperature)
    ):
        return traced("sample_topk")(logits, k, float(temperature))
    key, args = prepare_topk(logits, k, temperature=temperature, generator=generator)
    return RUNTIME.run(key, context, args)


def _scalars(*values: Any) -> bool:
    """Plain Python numbers (not bools): the arguments a sampling custom op can take; anything else takes the
    eager path, whose validation raises the typed error."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def sample_topp(
    logits: torch.Tensor, p: float, *, temperature: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2019): sample from the smallest set of most likely tokens whose
    probability sums to at least ``p`` (always at least one token).

    Shapes: logits ``[B, V]``, any float dtype -> token ids ``[B]`` int64. ``p`` in (0, 1] (1.0 = no cut);
    ``temperature`` as in :func:`sample_topk` (0, or below :data:`GREEDY_BELOW`, is greedy argmax);
    ``generator`` as in :func:`sample_topk`.

    Raises:
        InvalidInputError: logits not a 2-D float tensor or empty, or (CPU tensors) with NaN / +inf or a
            row of -inf only; p outside (0, 1]; bad temperature or
            generator.

    >>> import torch, layerzero as lz
    >>> lz.sample_topp(torch.tensor([[0.0, 9.0, 1.0]]), p=0.5)
    tensor([1])
    """
    if (is_dynamo_compiling() or is_exporting()) and generator is None and _scalars(p, temperature):
        return traced("sample_topp")(logits, float(p), float(temperature))
    key, args = prepare_topp(logits, p, temperature=temperature, generator=generator)
    return RUNTIME.run(key, context, args)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        TOPK_SPEC,
        sample_topk,
        prepare_topk,
        context,
        kernel_args=("logits", "k", "temperature", "generator"),
        custom_ops=("sample_topk",),
    ),
    OpDef(
        TOPP_SPEC,
        sample_topp,
        prepare_topp,
        context,
        kernel_args=("logits", "p", "temperature", "generator"),
        custom_ops=("sample_topp",),
    ),
)
