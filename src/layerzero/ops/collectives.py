"""Collectives as LayerZero ops: ``lz.all_reduce``, ``lz.all_gather``, ``lz.reduce_scatter`` and
``lz.all_to_all`` over a ``torch.distributed`` process group (issue 38).

Each is an op with several kernels (``reference.*`` and ``torch_dist.*``: torch.distributed, NCCL on CUDA and
Gloo on CPU; for all_reduce on CUDA also ``symm_mem.one_shot_push`` (LayerZero's) and ``symm_mem.one_shot`` /
``symm_mem.two_shot``, PyTorch symmetric
memory over NVLink P2P), chosen by dtype, message bytes (bucketed), world size and the group's transport, with
reasons, like every other op (``lz.explain("all_reduce", x)``). Every rank must make the same calls in the
same order (SPMD) and reach the same choice: with heterogeneous ranks, wrap the calls in
``lz.distributed.sync_selection()``. See docs/distributed.md, "Collectives".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from layerzero.core.context import SelectionContext, bucket
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec

from ._common import device_spec, fail, scope_token, stream_capturing

COMM_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64}
)
"""The dtypes every collective kernel moves (integer dtypes: sum/max/min/product, never avg)."""
REDUCE_OPS = ("sum", "avg", "max", "min", "product")
_TENSOR = torch.Tensor


class CollectiveKey(NamedTuple):
    """The selection-cache key of one collective call: the op, the tensor's device and dtype, the group's
    size, transport (``"nccl"``, ``"gloo"``) and name, this rank's message size in bytes (bucketed to a power
    of two), the reduce op (None for all_gather / all_to_all); ``capture``/``scope`` close every op's key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    world_size: int
    comm_backend: str
    comm_group: str
    message_bytes: int
    reduction: str | None
    capture: bool
    scope: tuple[Any, ...]


def _group_facts(op: str, group: Any) -> tuple[Any, int, str, str]:
    """``(group, world size, transport, group name)`` of ``group`` (None: the default group).

    Raises:
        InvalidInputError: torch.distributed unavailable or not initialised, ``group`` not a process group,
            or this process not a member of it.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise fail(
            op,
            "process group",
            "an initialised torch.distributed process group",
            "none (torch.distributed is not initialised)",
            "Call torch.distributed.init_process_group('nccl' on CUDA, 'gloo' on CPU) on every rank first.",
        )
    pg = dist.group.WORLD if group is None else group
    if not isinstance(pg, dist.ProcessGroup):
        raise fail(op, "group", "None (the default group) or a torch.distributed.ProcessGroup", type(group))
    if dist.get_rank(pg) < 0:
        raise fail(
            op,
            "group",
            "a process group this rank belongs to",
            "a group without this rank",
            "Call the collective only on the ranks of the group (dist.new_group(ranks)).",
        )
    return pg, dist.get_world_size(pg), str(dist.get_backend(pg)), str(pg.group_name)


def _common(op: str, x: Any, group: Any, reduction: str | None, min_dim: int) -> tuple[Any, int, Any]:
    """Check the tensor and group shared by every collective; return ``(group, world size, key)`` (the key
    with the input's own byte count: each op swaps in a contiguous copy first, where needed)."""
    if not isinstance(x, _TENSOR):
        raise fail(op, "x", "a torch.Tensor", type(x).__name__)
    if x.dtype not in COMM_DTYPES:
        raise fail(
            op,
            "x.dtype",
            "one of float32/float64/float16/bfloat16/int32/int64",
            x.dtype,
            "Cast x first (e.g. x.float()); bool/uint8/float8 tensors are not reduced by every transport.",
        )
    if x.dim() < min_dim:
        raise fail(op, "x rank", f">= {min_dim} dims", f"{x.dim()} dims (shape {tuple(x.shape)})")
    if x.requires_grad and torch.is_grad_enabled():
        raise fail(
            op,
            "x.requires_grad",
            "False (collectives here do not record autograd)",
            True,
            "Call under torch.no_grad() or pass x.detach(); torch.distributed.nn.functional has "
            "differentiable collectives.",
        )
    if reduction is not None and reduction not in REDUCE_OPS:
        raise fail(op, "op", f"one of {list(REDUCE_OPS)}", repr(reduction))
    if reduction == "avg" and not x.is_floating_point():
        raise fail(
            op, "op", "'sum'/'max'/'min'/'product' for an integer tensor", "'avg'", "Use a float tensor."
        )
    pg, world, backend, name = _group_facts(op, group)
    if backend == "nccl" and not x.is_cuda:
        raise fail(
            op,
            "x.device",
            "a CUDA tensor (the group's transport is NCCL)",
            x.device,
            "Move x to this rank's GPU (x.cuda()), or use a Gloo group for CPU tensors.",
        )
    key = CollectiveKey(
        op,
        x.device,
        x.dtype,
        world,
        backend,
        name,
        bucket(x.numel() * x.element_size()),
        reduction,
        x.is_cuda and stream_capturing(),
        scope_token(),
    )
    return pg, world, key


def _dim(op: str, x: torch.Tensor, dim: Any) -> int:
    if dim.__class__ is not int or not -x.dim() <= dim < x.dim():
        raise fail(op, "dim", f"an int in [{-x.dim()}, {x.dim() - 1}] (x has shape {tuple(x.shape)})", dim)
    return dim % x.dim()


def prepare_all_reduce(x: torch.Tensor, *, op: str = "sum", group: Any = None) -> tuple[Any, tuple[Any, ...]]:
    """Validate ``lz.all_reduce`` inputs; return (cache key, canonical kernel args ``(x, op, group)``)."""
    pg, _world, key = _common("all_reduce", x, group, op, 0)
    return key, (x.contiguous(), op, pg)


def prepare_all_gather(x: torch.Tensor, *, dim: int = 0, group: Any = None) -> tuple[Any, tuple[Any, ...]]:
    """Validate ``lz.all_gather`` inputs; return (cache key, canonical kernel args ``(x, dim, group)``)."""
    pg, _world, key = _common("all_gather", x, group, None, 1)
    return key, (x.contiguous(), _dim("all_gather", x, dim), pg)


def prepare_reduce_scatter(
    x: torch.Tensor, *, dim: int = 0, group: Any = None
) -> tuple[Any, tuple[Any, ...]]:
    """Validate ``lz.reduce_scatter`` inputs; return (cache key, canonical kernel args
    ``(x, dim, group)``)."""
    pg, world, key = _common("reduce_scatter", x, group, "sum", 1)
    d = _dim("reduce_scatter", x, dim)
    if x.shape[d] % world:
        raise fail(
            "reduce_scatter",
            f"x.shape[{d}]",
            f"a multiple of the world size {world} (each rank gets x.shape[{d}] / {world})",
            x.shape[d],
            f"Pad dim {d} to a multiple of {world}, or use lz.all_reduce and slice.",
        )
    return key, (x.contiguous(), d, pg)


def _splits(name: str, sizes: Any, world: int) -> list[int] | None:
    if sizes is None:
        return None
    if isinstance(sizes, _TENSOR):
        sizes = sizes.tolist()
    ok = isinstance(sizes, (list, tuple)) and len(sizes) == world
    ok = ok and all(s.__class__ is int and s >= 0 for s in sizes)
    if not ok:
        raise fail("all_to_all", name, f"None or {world} ints >= 0 (one per rank)", repr(sizes))
    return list(sizes)


def prepare_all_to_all(
    x: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    *,
    group: Any = None,
) -> tuple[Any, tuple[Any, ...]]:
    """Validate ``lz.all_to_all`` inputs; return (cache key, canonical kernel args ``(x, output_split_sizes,
    input_split_sizes, group)``) with both split lists filled in (equal splits where None was given)."""
    pg, world, key = _common("all_to_all", x, group, None, 1)
    rows = x.shape[0]
    ins = _splits("input_split_sizes", input_split_sizes, world)
    outs = _splits("output_split_sizes", output_split_sizes, world)
    if ins is None:
        if rows % world:
            raise fail(
                "all_to_all",
                "x.shape[0]",
                f"a multiple of the world size {world} when input_split_sizes is None",
                rows,
                "Pass input_split_sizes (rows sent to each rank, summing to x.shape[0]).",
            )
        ins = [rows // world] * world
    elif sum(ins) != rows:
        raise fail("all_to_all", "sum(input_split_sizes)", f"x.shape[0] = {rows}", sum(ins))
    if outs is None:
        if rows % world:
            raise fail(
                "all_to_all",
                "output_split_sizes",
                "a list (rows received from each rank) when x.shape[0] is not a multiple of the world size",
                None,
                "Exchange the split sizes first (e.g. lz.all_to_all of a [world] int64 tensor of counts).",
            )
        outs = [rows // world] * world
    return key, (x.contiguous(), outs, ins, pg)


def context(key: CollectiveKey) -> SelectionContext:
    """The :class:`SelectionContext` of a collective's cache key."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        reduction=key.reduction,
        world_size=key.world_size,
        comm_backend=key.comm_backend,
        comm_group=key.comm_group,
        message_bytes=key.message_bytes,
        graph_capture=key.capture,
    )


def all_reduce(x: torch.Tensor, *, op: str = "sum", group: Any = None) -> torch.Tensor:
    """Reduce ``x`` over every rank of ``group`` (``torch.distributed.all_reduce`` semantics, out of place).

    Shapes: x any shape ``[...]`` (the same on every rank); returns a new tensor of x's shape, dtype and
    device holding ``op`` over the group's ranks of x. ``x`` is never written (kernels reduce a copy or a
    symmetric buffer): the return value is the result. dtype: float32/float64/float16/bfloat16/int32/int64
    (Gloo reduces half precision on CPU too). ``op``: ``"sum"`` (default), ``"avg"`` (floats), ``"max"``,
    ``"min"``, ``"product"``. ``group``: a ``torch.distributed.ProcessGroup`` (None: the default group).
    Kernels: ``torch_dist.all_reduce`` (NCCL / Gloo), ``symm_mem.one_shot_push`` / ``symm_mem.one_shot`` /
    ``symm_mem.two_shot`` (CUDA, sum, NVLink P2P, after ``lz.distributed.enable_symm_mem``),
    ``reference.all_reduce``. A collective: every rank of the group must call it with the same shape, dtype
    and op.

    Raises:
        InvalidInputError: no initialised process group, a rank outside ``group``, a non-tensor, an
            unsupported dtype, an unknown op (or ``"avg"`` on integers), a CPU tensor on an NCCL group, or
            ``x.requires_grad`` under grad mode. A non-contiguous x is copied, not refused.

    >>> y = lz.all_reduce(torch.ones(4))  # doctest: +SKIP  (world size 2: tensor([2., 2., 2., 2.]))
    """
    key, args = prepare_all_reduce(x, op=op, group=group)
    return RUNTIME.run(key, context, args)


def all_gather(x: torch.Tensor, *, dim: int = 0, group: Any = None) -> torch.Tensor:
    """Gather ``x`` from every rank of ``group`` and concatenate along ``dim`` in rank order
    (``torch.distributed.all_gather_into_tensor`` for ``dim=0``).

    Shapes: x ``[..., N, ...]`` (N at ``dim``; the same shape on every rank) -> ``[..., W * N, ...]``
    (W = world size), rows ``r * N:(r + 1) * N`` from rank r; a new tensor in x's dtype (any of
    :data:`COMM_DTYPES`).

    Raises:
        InvalidInputError: what :func:`all_reduce` raises, a 0-dim x, or ``dim`` out of range.

    >>> lz.all_gather(torch.full((1, 3), float(rank)))  # doctest: +SKIP  (W = 2: [[0, 0, 0], [1, 1, 1]])
    """
    key, args = prepare_all_gather(x, dim=dim, group=group)
    return RUNTIME.run(key, context, args)


def reduce_scatter(x: torch.Tensor, *, dim: int = 0, group: Any = None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` and return this rank's chunk along ``dim``
    (``torch.distributed.reduce_scatter_tensor`` for ``dim=0``, op sum).

    Shapes: x ``[..., W * C, ...]`` (the same on every rank; ``x.shape[dim]`` divisible by the world size W)
    -> ``[..., C, ...]``: rows ``rank * C:(rank + 1) * C`` of the sum; a new tensor in x's dtype.

    Raises:
        InvalidInputError: what :func:`all_gather` raises, and ``x.shape[dim]`` not divisible by W (expected
            vs got, and how to pad).
    """
    key, args = prepare_reduce_scatter(x, dim=dim, group=group)
    return RUNTIME.run(key, context, args)


def all_to_all(
    x: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    *,
    group: Any = None,
) -> torch.Tensor:
    """Exchange rows of ``x`` between every pair of ranks (``torch.distributed.all_to_all_single``).

    Shapes: x ``[N, ...]``; rows ``input_split_sizes[r]`` (in order) go to rank r (None: N / W each, N
    divisible by the world size W); returns ``[sum(output_split_sizes), ...]``: the rows from rank 0, then
    rank 1, ...
    (``output_split_sizes[r]`` from rank r; None: N / W each). A new tensor in x's dtype. With uneven splits,
    each rank must know what it receives: exchange the counts first (an all_to_all of a ``[W]`` int64 tensor).

    Raises:
        InvalidInputError: what :func:`all_gather` raises, split lists that are not W ints >= 0, input splits
            not summing to N, or N not divisible by W where a split list is None.
    """
    key, args = prepare_all_to_all(x, output_split_sizes, input_split_sizes, group=group)
    return RUNTIME.run(key, context, args)


def _spec(op: str, what: str, inputs: tuple[str, ...]) -> OperationSpec:
    return OperationSpec(op, what, inputs, f"reference.{op}", key_type=CollectiveKey)


OPDEFS = define(
    OpDef(
        _spec("all_reduce", "all-reduce over a process group (out of place)", ("x",)),
        all_reduce,
        prepare_all_reduce,
        context,
        kernel_args=("x", "op", "group"),
    ),
    OpDef(
        _spec("all_gather", "all-gather along a dim, in rank order", ("x",)),
        all_gather,
        prepare_all_gather,
        context,
        kernel_args=("x", "dim", "group"),
    ),
    OpDef(
        _spec("reduce_scatter", "sum over the group, this rank's chunk along a dim", ("x",)),
        reduce_scatter,
        prepare_reduce_scatter,
        context,
        kernel_args=("x", "dim", "group"),
    ),
    OpDef(
        _spec("all_to_all", "row exchange between ranks (all_to_all_single)", ("x",)),
        all_to_all,
        prepare_all_to_all,
        context,
        kernel_args=("x", "output_split_sizes", "input_split_sizes", "group"),
    ),
)
