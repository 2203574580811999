"""``torch_dist``: the collectives of ``torch.distributed`` in their fused single-tensor forms
(``all_reduce`` of a copy, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``) on
the group's own transport: NCCL on CUDA, Gloo on CPU.

Graph-safe only on NCCL (a check refuses them under CUDA-graph capture on any other transport, with
``CUDA_GRAPH_UNSAFE``). Priority 50: above the reference (list forms), below the symmetric-memory all-reduces
where those may run (``layerzero.backends.symm_mem``).
"""

from __future__ import annotations

from typing import Any

import torch

from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec, KernelSpec

from .._collectives import COMM_DTYPES, graph_reasons

_REDUCE = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def all_reduce(x: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``dist.all_reduce`` of a copy of x (x is never written); avg is ReduceOp.AVG on NCCL, a sum then a
    division elsewhere."""
    dist = _dist()
    out = x.clone()
    if op == "avg" and dist.get_backend(group) == "nccl":
        dist.all_reduce(out, op=dist.ReduceOp.AVG, group=group)
        return out
    dist.all_reduce(out, op=getattr(dist.ReduceOp, _REDUCE[op]), group=group)
    if op == "avg":
        out.div_(dist.get_world_size(group))
    return out


def _gather0(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    dist = _dist()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def _scatter0(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    dist = _dist()
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, op=dist.ReduceOp.SUM, group=group)


def all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """One ``all_gather_into_tensor`` along dim 0 (x moved so that ``dim`` leads, then moved back)."""
    world = _dist().get_world_size(group)
    xt = x if dim == 0 else x.movedim(dim, 0).contiguous()
    out = xt.new_empty((world * xt.shape[0], *xt.shape[1:]))
    _gather0(out, xt, group)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """One ``reduce_scatter_tensor`` (sum) along dim 0 (x moved so that ``dim`` leads, then moved back)."""
    world = _dist().get_world_size(group)
    xt = x if dim == 0 else x.movedim(dim, 0).contiguous()
    out = xt.new_empty((xt.shape[0] // world, *xt.shape[1:]))
    _scatter0(out, xt, group)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def all_to_all(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group: Any):
    """``dist.all_to_all_single`` into a new ``[sum(output_split_sizes), ...]`` tensor."""
    out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
    _dist().all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=group)
    return out


def _check(ctx) -> list[Reason]:
    return graph_reasons(ctx)


def register(registry: KernelRegistry) -> None:
    """Add the torch_dist backend (unavailable, with a reason, where torch.distributed is not built in) and
    its four kernels."""
    ok = torch.distributed.is_available()
    registry.add_backend(
        BackendSpec(
            "torch_dist",
            "torch.distributed",
            torch.__version__,
            ok,
            ()
            if ok
            else (Reason(ReasonCode.BACKEND_NOT_INSTALLED, "this torch build has no torch.distributed"),),
            description="torch.distributed collectives (NCCL on CUDA, Gloo on CPU)",
        )
    )
    for op, fn in (
        ("all_reduce", all_reduce),
        ("all_gather", all_gather),
        ("reduce_scatter", reduce_scatter),
        ("all_to_all", all_to_all),
    ):
        registry.add_kernel(
            KernelSpec(
                f"torch_dist.{op}",
                op,
                fn,
                priority=50,
                device_types=frozenset({"cpu", "cuda"}),
                dtypes=COMM_DTYPES,
                graph_safe=True,  # on NCCL only: _check refuses a capture on any other transport
                supports_backward=False,
                check=_check,
                description=f"torch.distributed {op} (fused single-tensor form; graph-safe on NCCL)",
            )
        )
