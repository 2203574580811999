"""``lz.sample_topk``, ``lz.sample_topp``, ``lz.sample`` and ``lz.sample_greedy``: next-token sampling from
logits."""

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
    INT_DTYPES,
    check_cpu_values,
    check_rows,
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


# ------------------------------------------------------------------------------------------- lz.sample
SAMPLE_OP = "sample"
_F32 = frozenset({torch.float32})
_I64 = frozenset({torch.int64})


class BatchSamplingKey(NamedTuple):
    """The selection-cache key of one ``lz.sample`` call: which per-row parameters are given (``has_*``),
    whether counter-based ``seeds`` and a ``generator`` are; ``capture``/``scope`` close every op's key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    has_temperature: bool
    has_top_k: bool
    has_top_p: bool
    has_min_p: bool
    has_seeds: bool
    has_generator: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def context_batch(key: BatchSamplingKey) -> SelectionContext:
    """The :class:`SelectionContext` of an ``lz.sample`` cache key."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        vocab_size=key.vocab_size,
        has_generator=key.has_generator,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


def prepare_sample(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.sample`` inputs; return (cache key, canonical kernel args ``(logits, temperature, top_k,
    top_p, min_p, seeds, offsets, generator)``). Values are checked on CPU tensors only (see
    :func:`sample`)."""
    op = SAMPLE_OP
    _check_logits(op, logits, generator)
    if temperature is not None:
        check_rows(op, "temperature", temperature, logits, _F32, "float32", "torch.float32")
        check_cpu_values(
            op,
            "temperature",
            temperature,
            lambda t: torch.isfinite(t) & (t >= 0),
            "finite values >= 0 (0 means greedy)",
            "Use 0.0 for greedy rows.",
        )
    if top_k is not None:
        check_rows(op, "top_k", top_k, logits, INT_DTYPES, "int64 or int32", "torch.int64")
        check_cpu_values(
            op,
            "top_k",
            top_k,
            lambda k: k >= 0,
            "values >= 0 (0 or >= V: no cut)",
            "Use 0 to turn the cut off for a row.",
        )
    if top_p is not None:
        check_rows(op, "top_p", top_p, logits, _F32, "float32", "torch.float32")
        check_cpu_values(
            op,
            "top_p",
            top_p,
            lambda p: (p > 0) & (p <= 1),
            "values in (0, 1] (1: no cut)",
            "Use 1.0 to turn the cut off for a row.",
        )
    if min_p is not None:
        check_rows(op, "min_p", min_p, logits, _F32, "float32", "torch.float32")
        check_cpu_values(
            op,
            "min_p",
            min_p,
            lambda p: (p >= 0) & (p <= 1),
            "values in [0, 1] (0: no cut)",
            "Use 0.0 to turn the cut off for a row.",
        )
    if seeds is not None:
        check_rows(op, "seeds", seeds, logits, _I64, "int64", "torch.int64")
    if offsets is not None:
        if seeds is None:
            raise fail(
                op,
                "offsets",
                "None when seeds is None (offsets only move seeded rows' counters)",
                "a tensor",
                "Pass seeds= as well, or drop offsets=.",
            )
        check_rows(op, "offsets", offsets, logits, _I64, "int64", "torch.int64")
    capture = logits.is_cuda and stream_capturing()
    key = BatchSamplingKey(
        op,
        logits.device,
        logits.dtype,
        logits.shape[1],
        temperature is not None,
        top_k is not None,
        top_p is not None,
        min_p is not None,
        seeds is not None,
        generator is not None,
        torch.are_deterministic_algorithms_enabled(),
        capture,
        scope_token(),
    )
    return key, (logits, temperature, top_k, top_p, min_p, seeds, offsets, generator)


SAMPLE_SPEC = OperationSpec(
    "sample",
    "batched per-row sampling: temperature, top-k, top-p, min-p, seeds",
    ("logits",),
    "reference.sample",
)


def sample(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row, each row with its own parameters: the sampling step of a serving engine
    (vLLM v1 ``Sampler`` semantics; warpers in Hugging Face ``generate``'s order).

    Shapes: logits ``[B, V]`` (B rows, V vocabulary), any float dtype (computed in float32, float64 for
    float64) -> token ids ``[B]`` int64. Every parameter is a ``[B]`` tensor on logits' device, or None (off
    for every row):

    - ``temperature`` float32 >= 0: ``(logits - rowmax) / T``; ``T == 0``, or below :data:`GREEDY_BELOW`,
      makes that row greedy (argmax, first index on ties).
    - ``top_k`` int32/int64 >= 0: keep the k largest (ties at the k-th kept); 0 or ``>= V`` = no cut
      (Fan et al. 2018).
    - ``top_p`` float32 in (0, 1]: nucleus of the top-k-renormalized distribution (Holtzman et al. 2019), the
      tokens whose mass ranked above them is ``< p``; 1 = no cut.
    - ``min_p`` float32 in [0, 1]: keep tokens with ``prob >= min_p * max prob`` after the cuts above
      (Nguyen et al. 2024, HF ``MinPLogitsWarper``); 0 = no cut.

    Order: temperature -> top-k -> top-p -> min-p; the most likely token is always kept. The draw is the
    exponential race ``argmax(probs / E)``, ``E ~ Exp(1)`` per token (a draw from ``probs``). Noise per row:
    with ``seeds`` (int64), rows with ``seed >= 0`` use counter-based noise hashed from (seed, offset, token
    index), ``offsets`` (int64, default 0: e.g. the tokens the request has generated so far) -- the same
    request draws the same token whatever batch it is in and on any device (up to float32 rounding of its
    logits). Other rows use ``torch.empty(B, V).exponential_(generator=generator)`` (the global RNG when
    None): drawn once per call for all rows, so the generator advances whatever the seeds and temperatures.

    Values are checked on CPU tensors only (temperature finite >= 0, top_k >= 0, top_p in (0, 1], min_p in
    [0, 1]); on CUDA that would synchronize, so out-of-range values there are the caller's responsibility.

    Raises:
        InvalidInputError: logits not a 2-D float tensor or empty, or (CPU tensors) with NaN / +inf or a
            row of -inf only; a parameter not a ``[B]`` tensor of its
            dtype on logits' device; a CPU parameter value out of range; ``offsets`` without ``seeds``;
            generator of another device type.

    >>> import torch, layerzero as lz
    >>> logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 2.0]])
    >>> lz.sample(logits, temperature=torch.tensor([0.0, 0.0]))
    tensor([1, 0])
    >>> lz.sample(logits, top_k=torch.tensor([1, 1]), seeds=torch.tensor([7, -1]))
    tensor([1, 0])
    """
    if (is_dynamo_compiling() or is_exporting()) and generator is None:  # torch.compile, torch.export
        return traced("sample")(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    key, args = prepare_sample(
        logits,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=seeds,
        offsets=offsets,
        generator=generator,
    )
    return RUNTIME.run(key, context_batch, args)


# ------------------------------------------------------------------------------------------- lz.sample_greedy
GREEDY_OP = "sample_greedy"


class GreedyKey(NamedTuple):
    """The selection-cache key of one ``lz.sample_greedy`` call (the row count is left out: every kernel takes
    any); ``capture``/``scope`` close every op's key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def context_greedy(key: GreedyKey) -> SelectionContext:
    """The :class:`SelectionContext` of an ``lz.sample_greedy`` cache key."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        vocab_size=key.vocab_size,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


def prepare_greedy(logits: torch.Tensor) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.sample_greedy`` inputs; return (cache key, canonical kernel args ``(logits,)``).

    Raises:
        InvalidInputError: see :func:`sample_greedy`.
    """
    op = GREEDY_OP
    check_tensor(op, "logits", logits)
    if logits.dim() != 2:
        raise fail(
            op,
            "logits rank",
            "2 dims [S, V] (rows, vocabulary)",
            f"{logits.dim()} dims (shape {tuple(logits.shape)})",
            "Flatten the leading dims: logits.reshape(-1, logits.shape[-1]) (a 1-D row: logits[None]).",
        )
    if logits.shape[1] == 0:
        raise fail(
            op,
            "logits shape",
            "[S, V] with V >= 1 (S = 0 rows is allowed)",
            list(logits.shape),
            "An empty vocabulary has no token to pick.",
        )
    key = GreedyKey(
        op,
        logits.device,
        logits.dtype,
        logits.shape[1],
        torch.are_deterministic_algorithms_enabled(),
        logits.is_cuda and stream_capturing(),
        scope_token(),
    )
    return key, (logits,)


GREEDY_SPEC = OperationSpec(
    GREEDY_OP,
    "greedy decoding: the first argmax of each row of logits (NaN rule explicit)",
    ("logits",),
    "reference.sample_greedy",
    key_type=GreedyKey,
)


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy decoding: per row, the index of the first maximum of the logits.

    Shapes: logits ``[S, V]`` (S >= 0 rows, V >= 1 vocabulary; any strides), float16 / bfloat16 / float32
    (float64 is compared in float64) -> token ids ``[S]`` int64. Per row:

    - the first index holding the row's maximum (ties -> the lowest index), ``+inf`` counting as a maximum;
    - a row holding NaN returns the index of its first NaN (what ``torch.argmax`` returns for such a row);
    - an all ``-inf`` row returns 0.

    The result equals ``torch.argmax(logits.float(), dim=-1)`` on NaN-free rows (the cast of float16 /
    bfloat16 to float32 is exact) and never depends on a kernel's or a torch build's NaN handling. Values are
    not checked (NaN is a defined input here, unlike :func:`sample_topk`'s): no device synchronization, so the
    call can be captured in a CUDA graph. On CUDA (SM >= 8.0) ``triton.sample_greedy`` reads the
    half-precision logits directly, split over vocabulary chunks (no float32 copy); elsewhere
    ``reference.sample_greedy``.

    Raises:
        InvalidInputError: logits not a tensor, not 2-D, not a float dtype, or with V == 0.
        KernelExecutionError: the kernel failed and no fallback was allowed (lock or strict mode).

    >>> import torch, layerzero as lz
    >>> lz.sample_greedy(torch.tensor([[0.0, 5.0, 5.0], [2.0, float("nan"), 9.0]]))
    tensor([1, 1])
    """
    if is_dynamo_compiling() or is_exporting():  # one custom-op node (custom_ops/_ops.py)
        return traced("sample_greedy")(logits)
    key, args = prepare_greedy(logits)
    return RUNTIME.run(key, context_greedy, args)


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
    OpDef(
        SAMPLE_SPEC,
        sample,
        prepare_sample,
        context_batch,
        kernel_args=("logits", "temperature", "top_k", "top_p", "min_p", "seeds", "offsets", "generator"),
        custom_ops=("sample",),
    ),
    OpDef(GREEDY_SPEC, sample_greedy, prepare_greedy, context_greedy, custom_ops=("sample_greedy",)),
)
