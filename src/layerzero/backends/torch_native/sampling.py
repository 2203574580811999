"""``torch_native.sample``: ``lz.sample`` on CPU without sorting the vocabulary: top-k / top-p by pivot
rejection sampling (FlashInfer's sampling kernels' idea), min-p as a threshold, the draw by inverse CDF for
unseeded rows (one uniform per row and round) and by the counter-based exponential race for seeded rows.

The algorithm (one vectorized pass over ``[B, V]`` per round, every row in step; the same as
``triton.sample``'s kernel, ``backends/triton/_sampling_reject_kernels.py``). Ranking is the cuts' order:
larger ``z`` first, equal ``z`` by lower token id. The kept set K of a row (top-k, then top-p on the
top-k-renormalized distribution, then min-p) is tested token by token without a sort:

- token j passes top-k iff fewer than k tokens have ``z > z_j`` (ties at the k-th kept);
- j passes top-p iff the mass ``sum(exp z)`` of the tokens ranked above it is ``< p * Z``, Z the mass of
  the top-k set (the whole row without top-k; with both cuts, ``torch.topk`` of k values gives the k-th
  value: :func:`~layerzero.backends._sampling_common.kth_mass`);
- j passes min-p iff ``exp(z_j) >= min_p`` (``z = (x - max) / T``, so ``exp z`` is ``prob / max prob``).

A round draws j from the row restricted to the candidates C (tokens passing min-p and ranked above the
pivot; at first every token); j in K is the answer, else j becomes the pivot. Every token ranked at or below
a rejected j fails the same test, so C always contains K: the accepted draw is an exact draw from K
(rejection sampling), and C shrinks every round (the most likely token is always in K, so a round always
ends it). Unseeded rows draw each round with a fresh uniform; seeded rows keep one noise ``E`` for all rounds
and take ``argmax(z - log E)`` over C: with the same noise the argmax over C, given the earlier rounds, is
still a draw from C (the argmax and the maximum of a Gumbel race over a set are independent, and the earlier
rounds only see maxima), and the accepted token is the argmax over K itself -- the reference's token, so a
seeded request draws the same tokens as with ``reference.sample``'s sort (up to float32 rounding at a cut's
boundary: the masses here are summed in another order than the sorted cumulative sum).
"""

from __future__ import annotations

import math

import torch

from layerzero.backends._sampling_common import kth_mass, ranked_above, scaled_cut, seeded_exponential

__all__ = ["sample"]


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Batched per-row sampling with ``reference.sample``'s semantics (vLLM v1 ``Sampler``, Hugging Face
    warper order: temperature, top-k, top-p, min-p; see its docstring), without sorting the vocabulary (the
    module docstring gives the algorithm and why it is exact).

    Args:
        logits: ``[B, V]`` float tensor on CPU (float32 math; float64 for float64 logits).
        temperature, top_k, top_p, min_p, seeds, offsets: ``[B]`` per-row tensors or None, as ``lz.sample``.
        generator: CPU ``torch.Generator`` or None (the global one): one uniform per unseeded row and round.

    Returns:
        Token ids ``[B]``, int64. Unseeded rows: a draw from the kept set (inverse CDF over the candidates in
        vocabulary order; a rounding-edge draw on a zero-probability token takes the top candidate). Seeded
        rows: the reference's counter-based exponential race over the kept set (its tokens). Greedy rows: the
        first argmax of the logits.

    Raises:
        Nothing of its own (``lz.sample`` validates).
    """
    b, v = logits.shape
    x, z, greedy = scaled_cut(logits, temperature, None, None)  # temperature only: the cuts come below
    cdt = z.dtype
    e = torch.exp(z)  # prob / max prob (z <= 0)
    allowed = None if min_p is None else e >= min_p.to(cdt)[:, None]
    k = None
    if top_k is not None:
        k = top_k.to(torch.int64)
        k = torch.where((k <= 0) | (k > v), v, k)
    p = None if top_p is None else top_p.to(cdt)
    mass = None
    if p is not None:
        mass = kth_mass(z, e, k) if k is not None else e.sum(dim=-1)
    seeded = None
    score = None
    if seeds is not None and bool((seeds >= 0).any()):
        seeded = seeds >= 0
        noise = seeded_exponential(seeds, offsets, v).to(cdt)
        score = z - noise.clamp_min(torch.finfo(cdt).tiny).log()
    done = torch.zeros(b, dtype=torch.bool) if greedy is None else greedy.clone()
    tokens = torch.zeros(b, dtype=torch.int64)
    pz = torch.full((b,), -math.inf, dtype=cdt)
    pi = torch.full((b,), v, dtype=torch.int64)
    while not bool(done.all()):
        cand = ranked_above(z, pz, pi)
        if allowed is not None:
            cand &= allowed
        j = _draw(e, cand, b, generator)
        if seeded is not None:
            j = torch.where(seeded, score.masked_fill(~cand, -math.inf).argmax(dim=-1), j)
        zj = z.gather(1, j[:, None]).squeeze(1)
        ok = torch.ones(b, dtype=torch.bool)
        if k is not None:
            ok &= (z > zj[:, None]).sum(dim=-1) < k
        if p is not None:
            above = torch.where(ranked_above(z, zj, j), e, torch.zeros_like(e)).sum(dim=-1)
            ok &= (above < p * mass) | (p >= 1.0)
        take = ~done & ok
        tokens = torch.where(take, j, tokens)
        move = ~done & ~ok
        pz, pi = torch.where(move, zj, pz), torch.where(move, j, pi)
        done |= ok
    if greedy is not None:
        tokens = torch.where(greedy, torch.argmax(x, dim=-1), tokens)
    return tokens


def _draw(e: torch.Tensor, cand: torch.Tensor, b: int, generator: torch.Generator | None) -> torch.Tensor:
    """One inverse-CDF draw per row from ``e`` restricted to ``cand`` (``[B, V]``): the first candidate whose
    running mass exceeds ``u * total``, ``u ~ U[0, 1)`` from ``generator``; a rounding-edge pick of a token
    without mass (or a row without any) takes the top candidate (``argmax`` of the masked ``e``)."""
    w = torch.where(cand, e, torch.zeros_like(e))
    cum = w.cumsum(dim=-1)
    total = cum[:, -1:]
    u = torch.rand(b, 1, dtype=e.dtype, generator=generator)
    j = torch.searchsorted(cum, u * total, right=True).clamp_max(e.shape[1] - 1)
    ok = w.gather(1, j) > 0
    return torch.where(ok, j, w.argmax(dim=-1, keepdim=True)).squeeze(1)
