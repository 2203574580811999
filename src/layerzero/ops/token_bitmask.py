"""``lz.apply_token_bitmask``: structured outputs' packed token bitmask applied to logits in place (every
token a row's grammar does not allow gets -inf), in xgrammar's / llguidance's bit layout."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from layerzero.core.context import SelectionContext, bucket
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec

from ._common import (
    INT_DTYPES,
    check_same,
    check_tensor,
    device_spec,
    fail,
    scope_token,
    stream_capturing,
)

OP = "apply_token_bitmask"


class BitmaskKey(NamedTuple):
    """The selection-cache key of one ``lz.apply_token_bitmask`` call (masked rows bucketed; ``indices_dtype``
    None without indices; ``stride_last_1``: logits and bitmask rows are contiguous); ``capture``/``scope``
    close every op's key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    rows: int
    indices_dtype: torch.dtype | None
    stride_last_1: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def context(key: BitmaskKey) -> SelectionContext:
    """The :class:`SelectionContext` of an ``lz.apply_token_bitmask`` key (``batch`` = masked rows,
    bucketed)."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.rows,
        vocab_size=key.vocab_size,
        stride_last_1=key.stride_last_1,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


def prepare(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> tuple[BitmaskKey, tuple[Any, ...]]:
    """Validate ``lz.apply_token_bitmask`` inputs; return (cache key, canonical kernel args ``(logits,
    bitmask, indices)``).

    Raises:
        InvalidInputError: see :func:`apply_token_bitmask`.
    """
    check_tensor(OP, "logits", logits, 2)
    n_all, vocab = logits.shape
    if vocab == 0:
        raise fail(OP, "logits shape", "[R_all, V] with V >= 1", list(logits.shape))
    if logits.requires_grad and torch.is_grad_enabled():
        raise fail(
            OP,
            "logits.requires_grad",
            False,
            True,
            "The mask is written in place: pass logits.detach() or run under torch.no_grad().",
        )
    if not isinstance(bitmask, torch.Tensor):
        raise fail(OP, "bitmask", "an int32 tensor [R, W]", type(bitmask).__name__)
    if bitmask.dtype != torch.int32:
        raise fail(
            OP,
            "bitmask.dtype",
            "int32 (bit j of word w = token 32 w + j allowed)",
            bitmask.dtype,
            "Cast it with bitmask.to(torch.int32) (xgrammar.allocate_token_bitmask gives int32).",
        )
    if bitmask.dim() != 2 or bitmask.shape[1] == 0:
        raise fail(
            OP,
            "bitmask shape",
            f"[R, W] with W >= 1 words per row (W = ceil(V / 32) = {-(-vocab // 32)} covers the vocabulary)",
            list(bitmask.shape),
        )
    check_same(OP, "logits", logits, "bitmask", bitmask, dtype=False)
    rows = bitmask.shape[0]
    if indices is None:
        if rows != n_all:
            raise fail(
                OP,
                "bitmask rows",
                f"{n_all} (one per logits row, indices=None)",
                rows,
                "Pass indices (the logits rows the bitmask rows belong to) to mask only some rows.",
            )
    else:
        _check_indices(indices, logits, rows)
    stride = logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    capture = logits.is_cuda and stream_capturing()
    key = BitmaskKey(
        OP,
        logits.device,
        logits.dtype,
        vocab,
        bucket(rows),
        None if indices is None else indices.dtype,
        stride,
        torch.are_deterministic_algorithms_enabled(),
        capture,
        scope_token(),
    )
    return key, (logits, bitmask, indices)


def _check_indices(indices: Any, logits: torch.Tensor, rows: int) -> None:
    """``indices``: int64/int32 ``[R]`` on logits' device; on CPU, distinct values in ``[0, R_all)``."""
    n_all = logits.shape[0]
    if not isinstance(indices, torch.Tensor):
        raise fail(
            OP,
            "indices",
            "an int64/int32 tensor [R] or None",
            type(indices).__name__,
            "Pass torch.tensor(rows, device=logits.device).",
        )
    if indices.dtype not in INT_DTYPES:
        raise fail(OP, "indices.dtype", "int64 or int32", indices.dtype, "Cast it with indices.long().")
    if indices.dim() != 1 or indices.shape[0] != rows:
        raise fail(OP, "indices shape", f"[R] = [{rows}] (one per bitmask row)", list(indices.shape))
    check_same(OP, "logits", logits, "indices", indices, dtype=False)
    if indices.device.type != "cpu" or rows == 0:
        return  # reading device values would synchronize: the caller's responsibility there
    bad = (indices < 0) | (indices >= n_all)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise fail(OP, f"indices[{i}]", f"a logits row in [0, {n_all})", int(indices[i]))
    if int(indices.unique().numel()) != rows:
        raise fail(OP, "indices values", "distinct rows", indices.tolist(), "Each row is masked once.")


SPEC = OperationSpec(
    OP,
    "a packed token bitmask applied to logits in place (disallowed tokens -> -inf)",
    ("logits", "bitmask", "indices"),
    "reference.apply_token_bitmask",
)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Ban the tokens a packed bitmask does not allow: their logits become -inf, IN PLACE (structured outputs:
    xgrammar's ``apply_token_bitmask_inplace``, vLLM's grammar bitmask step).

    Shapes: logits ``[R_all, V]`` (rows, vocabulary) float32/bfloat16/float16/float64; bitmask ``[R, W]``
    int32 on logits' device: bit ``j`` (least significant first) of word ``w`` set = token ``32 w + j``
    allowed (xgrammar's and llguidance's layout; ``W = ceil(V / 32)`` covers the vocabulary, extra words are
    ignored, and ids ``>= 32 W`` are banned); indices ``[R]`` int64/int32, distinct: bitmask row ``i`` masks
    logits row ``indices[i]`` (None: ``R == R_all`` and row ``i`` masks row ``i``). Other rows and allowed
    tokens are left bit for bit. Returns None.

    Index values are checked on CPU tensors only (on CUDA a check would synchronize; a wrong index there is
    the caller's responsibility). Not a ``torch.library`` custom op:
    ``torch.compile`` runs it as Python (correct, with graph breaks).

    Raises:
        InvalidInputError: logits not a 2-D float tensor with V >= 1, or requiring grad; bitmask not int32
            ``[R, W]`` (W >= 1) on logits' device; without indices, R != R_all; indices not int64/int32
            ``[R]`` on logits' device; on CPU, an index outside ``[0, R_all)`` or repeated.

    >>> import torch, layerzero as lz
    >>> logits = torch.zeros(2, 5)
    >>> lz.apply_token_bitmask(logits, torch.tensor([[0b10110]], dtype=torch.int32), torch.tensor([1]))
    >>> logits
    tensor([[0., 0., 0., 0., 0.],
            [-inf, 0., 0., -inf, 0.]])
    """
    key, args = prepare(logits, bitmask, indices)
    if bitmask.shape[0] == 0:
        return
    RUNTIME.run(key, context, args)


# the op of this module, defined once (layerzero.core.opdef): every list of ops is derived from it
OPDEFS = define(
    OpDef(SPEC, apply_token_bitmask, prepare, context, kernel_args=("logits", "bitmask", "indices")),
)
