"""Reference collectives: ``torch.distributed``'s plainest calls (list all_gather, all_reduce of a copy), the
last fallback of ``lz.all_reduce`` / ``all_gather`` / ``reduce_scatter`` / ``all_to_all`` on any transport.

They run the group's own transport (NCCL, Gloo, ...), so they are exact where it is; the float64
single-process oracle lives in the tests (tests/distributed/test_collectives.py). Not marked graph-safe: the
list forms allocate per call and are not verified under CUDA-graph capture (``torch_dist.*`` are, on NCCL).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather", "all_reduce", "all_to_all", "reduce_scatter"]

_OPS = {
    "sum": "SUM",
    "avg": "SUM",  # divided by the world size after the sum (Gloo has no AVG)
    "max": "MAX",
    "min": "MIN",
    "product": "PRODUCT",
}


def all_reduce(x: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``op`` of ``x`` over ``group`` into a new tensor (x is not written)."""
    out = x.clone()
    dist.all_reduce(out, op=getattr(dist.ReduceOp, _OPS[op]), group=group)
    if op == "avg":
        out = out / dist.get_world_size(group)
    return out


def all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's chunk along ``dim`` of the sum over ``group`` (an all_reduce, then a slice)."""
    total = all_reduce(x, "sum", group)
    return total.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


def all_to_all(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group: Any):
    """Rows ``input_split_sizes[r]`` of x to rank r; the received rows in rank order. One point-to-point
    send and receive per peer (any transport, uneven splits included; Gloo's list all_to_all needs equal
    sizes)."""
    me = dist.get_rank(group)
    sends = [s.contiguous() for s in x.split(input_split_sizes, 0)]
    recvs = [x.new_empty((n, *x.shape[1:])) for n in output_split_sizes]
    recvs[me].copy_(sends[me])
    ops = []
    for r in range(dist.get_world_size(group)):
        if r == me:
            continue
        peer = dist.get_global_rank(group, r)
        ops.append(dist.P2POp(dist.isend, sends[r], peer, group))
        ops.append(dist.P2POp(dist.irecv, recvs[r], peer, group))
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    return torch.cat(recvs, 0)
