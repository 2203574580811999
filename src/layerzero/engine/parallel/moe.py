"""The sparse MoE block across the TP ranks (Qwen3-MoE), vLLM's two layouts:

* tensor parallel (``ParallelState.ep`` False, vLLM's default): every rank holds every expert, each expert's
  intermediate size split (``w13 [E, 2I/tp, H]`` = its gate rows then up rows, ``w2 [E, H, I/tp]``);
* expert parallel (``ep`` True): expert ``e`` lives on rank ``e * tp // E`` (contiguous blocks), whole.

The router is replicated (every rank routes every token the same way). Each rank computes its part of every
token's output through ``lz.fused_moe`` (EP: the top-k slots routed to other ranks' experts weigh 0), and
the parts are all-reduced: exact, no token dropped. An all-to-all dispatch (each token sent only to the ranks
of its experts) can replace the all-reduce for EP later.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import layerzero as lz

from ..config import MoEConfig
from ..errors import bad_config
from ..layers.moe import SparseMoE, route
from . import comm
from .layers import divide, mark_sharded, materialize
from .state import ParallelState

__all__ = ["ParallelSparseMoE", "expert_range"]


def expert_range(num_experts: int, state: ParallelState) -> tuple[int, int]:
    """[first, last) experts of this rank under EP: ``{e : e * tp // E == rank}``.

    Raises:
        ConfigurationError: fewer experts than ranks (a rank would hold none).
    """
    tp, r = state.tp_size, state.tp_rank
    if num_experts < tp:
        raise bad_config(
            f"num_experts with expert parallelism over {tp} ranks",
            f">= {tp} (every rank holds an expert)",
            num_experts,
            "Turn expert parallelism off (split each expert's intermediate size instead) or use fewer ranks.",
        )
    return -(-r * num_experts // tp), -(-(r + 1) * num_experts // tp)


class ParallelSparseMoE(SparseMoE):
    """:class:`~..layers.moe.SparseMoE` holding this rank's share (see the module docstring). ``first`` /
    ``last``: the experts held (all under TP); ``intermediate``: each held expert's intermediate rows."""

    def __init__(
        self,
        hidden: int,
        moe: MoEConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelState,
    ) -> None:
        nn.Module.__init__(self)
        e, i = moe.num_experts, moe.intermediate_size
        self.top_k, self.renormalize, self.parallel = moe.top_k, moe.norm_topk_prob, parallel
        self.num_experts, self.full_intermediate = e, i
        if parallel.ep:
            self.first, self.last = expert_range(e, parallel)
            self.intermediate = i
        else:
            self.first, self.last = 0, e
            self.intermediate = divide(i, parallel, "moe_intermediate_size")
        n, il = self.last - self.first, self.intermediate
        self.gate = nn.Parameter(torch.empty(e, hidden, device=device, dtype=dtype), requires_grad=False)
        self.w13 = nn.Parameter(
            torch.empty(n, 2 * il, hidden, device=device, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(torch.empty(n, hidden, il, device=device, dtype=dtype), requires_grad=False)
        mark_sharded(self.w13, self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, H]`` -> ``[T, H]``: the replicated router, this rank's experts (or expert slices) through
        :func:`layerzero.fused_moe`, the all-reduce."""
        weights, ids = route(F.linear(x, self.gate), self.top_k, self.renormalize)
        if self.parallel.ep:
            weights, ids = self.local_routes(weights, ids)
        return comm.all_reduce(lz.fused_moe(x, self.w13, self.w2, weights, ids), self.parallel)

    def local_routes(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """EP: the routes ``[T, K]`` (float32 weights, global expert ids) -> this rank's ``[T, K]``: local
        ids, and ``E_local`` (``lz.fused_moe``'s "no expert here") with weight 0 for a slot whose expert lives
        on another rank. Exact, and each rank computes only its own (token, expert) pairs (it computed K pairs
        per token before, the other ranks' slots as zero-weight local ones)."""
        n = self.last - self.first
        mine = (ids >= self.first) & (ids < self.last)
        return weights * mine, torch.where(mine, ids - self.first, n)

    @torch.no_grad()
    def load(self, tensor: Any, what: str, expert: int | None = None) -> None:
        """As :meth:`SparseMoE.load`, from the FULL checkpoint tensors: keeps this rank's experts (EP; the
        others' are not read) or each expert's intermediate slice (TP)."""
        i, il, r = self.full_intermediate, self.intermediate, self.parallel.tp_rank
        if what == "gate":
            self.gate.copy_(materialize(tensor))
            return
        if self.parallel.ep:
            if expert is None:  # fused [E, 2I, H] / [E, H, I]
                (self.w13 if what == "gate_up_proj" else self.w2).copy_(
                    materialize(tensor[self.first : self.last])
                )
            elif self.first <= expert < self.last:
                super().load(materialize(tensor), what, expert - self.first)
            return
        a, b = r * il, (r + 1) * il
        if expert is None:
            if what == "gate_up_proj":
                self.w13[:, :il].copy_(materialize(tensor[:, a:b]))
                self.w13[:, il:].copy_(materialize(tensor[:, i + a : i + b]))
            else:
                self.w2.copy_(materialize(tensor[:, :, a:b]))
        elif what == "down_proj":
            self.w2[expert].copy_(materialize(tensor[:, a:b]))
        else:
            self.w13[expert, (0 if what == "gate_proj" else il) :][:il].copy_(materialize(tensor[a:b]))
