"""Chunked ``linear_cross_entropy`` in plain PyTorch: the logits of ``chunk`` rows at a time, so peak memory
is O(chunk x V) instead of O(N x V); differentiable (first order).

The approach of Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024, "Liger Kernel: Efficient Triton
Kernels for LLM Training") and of Wijmans et al. 2024 ("Cut Your Losses in Large-Vocabulary Language Models"),
with autograd done by recomputation: forward keeps the per-row log-sum-exp ``[N]`` (not the logits); backward
recomputes each chunk's logits, turns them into ``d loss / d logits = g_i (softmax - (1 - ε) onehot - ε /
V)`` (times ``1 - tanh^2`` under a softcap) and accumulates ``d hidden = dz @ W``, ``d W += dz^T @ h``, ``d
bias += sum dz``. So any ``grad_output`` works (``reduction="none"`` with per-row weights included), at the
price of a second matmul pass. The projection runs in the input dtype (fp32 accumulation inside the GEMM on
GPUs), the softmax / loss math in float32 (float64 for float64). The chunk size comes from the
:class:`LinearCEKnobs` in force (``"torch_native.linear_ce"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from layerzero.core import knobs
from layerzero.core.knobs import check_types, require

__all__ = ["KNOBS", "LinearCEKnobs", "chunk_rows_for", "linear_cross_entropy"]

KNOBS = "torch_native.linear_ce"
"""The name :class:`LinearCEKnobs` is registered under (``layerzero.core.knobs``)."""


@dataclass(frozen=True, slots=True)
class LinearCEKnobs:
    """The chunking of the chunked ``linear_cross_entropy``, registered as ``"torch_native.linear_ce"``; read
    once per call (:func:`chunk_rows_for`). Written, not measured: no run has varied it
    (``benchmarks/results/knobs/torch_native_linear_ce.md``). Peak memory against launches: every value gives
    the same loss up to float rounding. Raises ``ConfigurationError`` for a field of the wrong type or out of
    range."""

    chunk_elements: int = 1 << 22
    """Logit elements per chunk (4 Mi: 16 MiB of float32): ``chunk = clamp(chunk_elements // V, 1, N)``
    rows."""

    def __post_init__(self) -> None:
        check_types(self)
        require(self.chunk_elements >= 1, self, "chunk_elements", "an int >= 1")


knobs.register(KNOBS, LinearCEKnobs())


def chunk_rows_for(n: int, v: int, kn: LinearCEKnobs | None = None) -> int:
    """Rows per chunk for N rows and a V-class vocabulary (``kn``, default the knobs in force)."""
    return max(1, min(n, (kn or knobs.get(KNOBS)).chunk_elements // max(v, 1)))


def _logits(h, weight, bias, softcap, acc):
    z = (h @ weight.T).to(acc)
    if bias is not None:
        z = z + bias.to(acc)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, reduction, smoothing, softcap, chunk):
        n = hidden.shape[0]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        valid = target != ignore_index
        safe = torch.where(valid, target, torch.zeros_like(target))
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        rows = torch.empty(n, dtype=acc, device=hidden.device)
        for s in range(0, n, chunk):
            z = _logits(hidden[s : s + chunk], weight, bias, softcap, acc)
            m = torch.logsumexp(z, dim=-1)
            nll = m - z.gather(1, safe[s : s + chunk, None]).squeeze(1)
            loss = nll if smoothing == 0.0 else (1.0 - smoothing) * nll + smoothing * (m - z.mean(dim=-1))
            lse[s : s + chunk], rows[s : s + chunk] = m, loss
        rows = torch.where(valid, rows, torch.zeros_like(rows))
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse, count)
        ctx.args = (reduction, smoothing, softcap, chunk, acc)
        if reduction == "none":
            return rows
        total = rows.sum()
        return total / count if reduction == "mean" else total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, bias, safe, valid, lse, count = ctx.saved_tensors
        reduction, smoothing, softcap, chunk, acc = ctx.args
        n, v = hidden.shape[0], weight.shape[0]
        g = grad_out.to(acc)
        if reduction == "mean":
            g = g / count
        per_row = (g.expand(n) if g.dim() == 0 else g) * valid.to(acc)
        gh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        gb = (
            torch.zeros(v, dtype=acc, device=weight.device)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        for s in range(0, n, chunk):
            h = hidden[s : s + chunk]
            z = _logits(h, weight, bias, softcap, acc)
            dz = torch.exp(z - lse[s : s + chunk, None])
            dz[torch.arange(h.shape[0], device=dz.device), safe[s : s + chunk]] += smoothing - 1.0
            if smoothing:
                dz -= smoothing / v
            dz *= per_row[s : s + chunk, None]
            if softcap is not None:
                dz *= 1.0 - (z / softcap) ** 2
            if gh is not None:
                gh[s : s + chunk] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if gw is not None:
                gw += dz.T @ h.to(acc)
            if gb is not None:
                gb += dz.sum(0)
        return (
            gh,
            None if gw is None else gw.to(weight.dtype),
            None if gb is None else gb.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: float | None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Canonical ``linear_cross_entropy`` kernel: hidden ``[N, H]``, weight ``[V, H]``, target ``[N]`` int64,
    bias ``[V]`` or None -> 0-dim loss or ``[N]`` (reduction "none"), float32 (float64 for float64 inputs).
    ``chunk_rows`` overrides :func:`chunk_rows_for` (tests use it to force many chunks)."""
    n, v = hidden.shape[0], weight.shape[0]
    chunk = chunk_rows if chunk_rows is not None else chunk_rows_for(n, v)
    return _ChunkedLinearCE.apply(
        hidden, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, max(1, chunk)
    )
