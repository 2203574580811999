"""``lz.sample``: batched next-token sampling, each row with its own temperature, top-k, top-p, min-p and
seed (a serving engine's sampling step). Its own module (one per op family of sampling): the single-parameter
``lz.sample_topk`` / ``lz.sample_topp`` and the logits check they share with this op are
:mod:`layerzero.ops.sampling`."""

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
    check_rows,
    device_spec,
    fail,
    scope_token,
    stream_capturing,
)
from .sampling import _check_logits

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

    How (the CPU and Triton kernels): no sort of the vocabulary. Top-k / top-p by pivot rejection (as
    FlashInfer's sampling kernels): race among the tokens ranked above a pivot (at first all), accept the
    winner if fewer than k tokens have a larger logit and the mass ranked above it is ``< p`` of the top-k
    mass, else it becomes the pivot; exact, and with one noise for all rounds the accepted token is the race's
    argmax over the kept set (the sort-and-cut reference's token, up to float32 rounding at a cut's boundary).
    A row with both top-k and top-p needs the k-th value first (``torch.topk`` on CPU, a radix select over the
    float keys in Triton). The tokens a given seed draws may change when the algorithm changes (the
    distribution does not; LayerZero keeps them stable within a version).

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


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SAMPLE_SPEC,
        sample,
        prepare_sample,
        context_batch,
        kernel_args=("logits", "temperature", "top_k", "top_p", "min_p", "seeds", "offsets", "generator"),
        custom_ops=("sample",),
    ),
)
