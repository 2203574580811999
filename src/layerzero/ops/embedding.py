"""``lz.embedding``: token-embedding lookup ``weight[input_ids]`` (``torch.nn.functional.embedding``
semantics), dispatched to the best kernel for these inputs."""

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
    FLOAT_DTYPES,
    deterministic_enabled,
    device_spec,
    fail,
    is_grad_enabled,
    scope_layers,
    scope_token_of,
    stream_capturing,
)
from .kv_cache import check_values

OP = "embedding"
INDEX_DTYPES = frozenset({torch.int32, torch.int64})


class EmbeddingKey(NamedTuple):
    """The selection-cache key of one ``lz.embedding`` call: ``batch`` is the number of ids N (bucketed to a
    power of two), ``vocab_size`` V and ``hidden_size`` H exact, ``dtype`` the weight's; the ids' dtype
    (int32/int64) and ``padding_idx`` are left out (every kernel takes both). ``capture``/``scope`` close
    every op's key (see ``ops.attention.AttentionKey``)."""

    op: str
    device: torch.device
    dtype: torch.dtype
    batch: int
    vocab_size: int
    hidden_size: int
    stride_last_1: bool
    contiguous: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def _validate(input_ids: Any, weight: Any, padding_idx: Any) -> int | None:
    """Every check of :func:`embedding`; returns ``padding_idx`` normalized to ``[0, V)`` (or None).

    Raises:
        InvalidInputError: see :func:`embedding`.
    """
    if not isinstance(input_ids, torch.Tensor):
        raise fail(OP, "input_ids", "a torch.Tensor of token ids", type(input_ids).__name__)
    if input_ids.dtype not in INDEX_DTYPES:
        raise fail(
            OP,
            "input_ids.dtype",
            "torch.int32 or torch.int64",
            input_ids.dtype,
            "Token ids are integers: input_ids.long() (a tokenizer's output already is).",
        )
    if not isinstance(weight, torch.Tensor):
        raise fail(OP, "weight", "a torch.Tensor [V, H]", type(weight).__name__)
    if weight.dim() != 2:
        raise fail(
            OP,
            "weight rank",
            "2 dims [V, H] (vocabulary size, hidden size)",
            list(weight.shape),
            "Pass the embedding table, e.g. model.embed_tokens.weight.",
        )
    if weight.dtype not in FLOAT_DTYPES:
        raise fail(
            OP,
            "weight.dtype",
            "one of float32/float64/float16/bfloat16",
            weight.dtype,
            "Dequantize a quantized table first (lz.dequantize).",
        )
    v, h = weight.shape
    if v == 0 or h == 0:
        raise fail(OP, "weight shape", "[V, H] with V >= 1 and H >= 1", list(weight.shape))
    if input_ids.device != weight.device:
        raise fail(
            OP,
            "input_ids.device",
            f"{weight.device} (like weight)",
            input_ids.device,
            "Move them with input_ids.to(weight.device).",
        )
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or not -v <= padding_idx < v:
            raise fail(
                OP,
                "padding_idx",
                f"None or an int in [-V, V) = [{-v}, {v})",
                repr(padding_idx),
                "As torch.nn.Embedding: a negative index counts from the end.",
            )
        padding_idx = padding_idx + v if padding_idx < 0 else padding_idx
    if input_ids.numel() and check_values(input_ids):
        lo, hi = (
            int(t) for t in torch.aminmax(input_ids)
        )  # one pass over the ids (min() and max() took two)
        if lo < 0 or hi >= v:
            bad = lo if lo < 0 else hi
            where = (input_ids == bad).nonzero()[0].tolist()
            raise fail(
                OP,
                "input_ids values",
                f"token ids in [0, V) = [0, {v})",
                f"{bad} at index {where} (min {lo}, max {hi})",
                "Check the tokenizer's vocabulary against the embedding table (padding ids included).",
            )
    return padding_idx


def prepare(
    input_ids: torch.Tensor, weight: torch.Tensor, *, padding_idx: int | None = None
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.embedding`` inputs; return (cache key, canonical kernel args ``(input_ids, weight,
    padding_idx)``, ``padding_idx`` normalized to ``[0, V)`` or None).

    Raises:
        InvalidInputError: see :func:`embedding`.
    """
    padding_idx = _validate(input_ids, weight, padding_idx)
    n = input_ids.numel()
    contiguous = input_ids.is_contiguous() and weight.is_contiguous()
    layers = scope_layers()
    key = EmbeddingKey(
        OP,
        weight.device,
        weight.dtype,
        n if n <= 1 else 1 << (n - 1).bit_length(),
        weight.shape[0],
        weight.shape[1],
        contiguous or weight.stride(-1) == 1,
        contiguous,
        is_grad_enabled() and weight.requires_grad,
        deterministic_enabled(),
        weight.is_cuda and stream_capturing(),
        scope_token_of(layers) if layers else (),
    )
    return key, (input_ids, weight, padding_idx)


def context(key: EmbeddingKey) -> SelectionContext:
    """The :class:`SelectionContext` of an embedding cache key (``batch`` = number of ids, bucketed)."""
    return SelectionContext(
        op=OP,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.batch,
        vocab_size=key.vocab_size,
        hidden_size=key.hidden_size,
        stride_last_1=key.stride_last_1,
        contiguous=key.contiguous,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


SPEC = OperationSpec(
    OP,
    "token-embedding lookup weight[input_ids] (F.embedding semantics)",
    ("input_ids", "weight"),
    "reference.embedding",
    key_type=EmbeddingKey,
)


def embedding(
    input_ids: torch.Tensor, weight: torch.Tensor, *, padding_idx: int | None = None
) -> torch.Tensor:
    """Token-embedding lookup: ``out[..., :] = weight[input_ids[...], :]``, as
    ``torch.nn.functional.embedding`` (the first layer of every transformer LM, e.g. Llama's
    ``embed_tokens``).

    Shapes (V vocabulary size, H hidden size): ``input_ids`` any shape ``[...]`` (0-D, ``[N]``, ``[B, S]``,
    ...), ``weight`` ``[V, H]`` -> out ``[..., H]`` (a new tensor, exact copies of the rows: no arithmetic).
    dtype: ``input_ids`` int32 or int64 (values in ``[0, V)``); ``weight`` float32/float64/float16/bfloat16,
    the output's dtype. ``padding_idx`` (torch.nn.Embedding's): the row whose gradient stays 0 (the forward is
    the plain lookup); negative counts from the end; None: none. Under ``torch.compile`` / ``torch.export``
    the call is one ``torch.ops.layerzero.embedding`` node, also when ``weight`` requires grad (backward:
    PyTorch's ``embedding_dense_backward``, ``layerzero/custom_ops/_grad.py``).

    Raises:
        InvalidInputError: ``input_ids`` not an int32/int64 tensor, ``weight`` not a 2-D float tensor with V,
            H >= 1, the two on different devices, ``padding_idx`` not None or an int in ``[-V, V)``, an id
            outside ``[0, V)`` (checked on CPU tensors always; on other devices only in strict mode,
            ``lz.get_config().strict``, since it costs a device sync: outside it a bad id on CUDA is the
            kernel's device-side assert).
        KernelExecutionError: the kernel failed and no fallback was allowed (lock or strict mode).

    >>> import torch, layerzero as lz
    >>> w = torch.randn(10, 4)
    >>> lz.embedding(torch.tensor([[1, 2, 3]]), w).shape
    torch.Size([1, 3, 4])
    """
    if (
        is_dynamo_compiling() or is_exporting()
    ):  # one custom-op node (custom_ops/_ops.py; backward formula: custom_ops/_grad.py)
        return traced("embedding")(input_ids, weight, padding_idx)
    key, args = prepare(input_ids, weight, padding_idx=padding_idx)
    return RUNTIME.run(key, context, args)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        embedding,
        prepare,
        context,
        kernel_args=("input_ids", "weight", "padding_idx"),
        custom_ops=("embedding",),
    ),
)
