"""``lz.sample_greedy``: greedy decoding, the first argmax of each row of logits with an explicit NaN rule.
Its own module (one per op family of sampling; the sampled ops are :mod:`layerzero.ops.sampling` and
:mod:`layerzero.ops.sampling_batch`): it shares no check with them (NaN is a defined input here)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import check_tensor, device_spec, fail, scope_token, stream_capturing

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
    OpDef(GREEDY_SPEC, sample_greedy, prepare_greedy, context_greedy, custom_ops=("sample_greedy",)),
)
