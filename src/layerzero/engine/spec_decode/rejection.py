"""Exact speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"), batched:
the target's probabilities after the request's temperature / top-k / top-p / min-p (:func:`warped_probs`, the
semantics of ``lz.sample``), the accept / reject walk over the drafts (:func:`rejection_sample`) and the
request's random streams (:func:`counter_uniform`, :func:`counter_exponential`: counter-based for seeded rows,
so a seeded request gives the same tokens alone or in any batch)."""

from __future__ import annotations

import math

import torch

__all__ = ["GREEDY_BELOW", "counter_exponential", "counter_uniform", "rejection_sample", "warped_probs"]

GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)
"""Temperatures below this are greedy (as ``lz.sample``: the T -> 0 limit is one-hot at the argmax)."""

_M32 = 0xFFFFFFFF
UNIFORM_INDEX = _M32
"""The counter index of a position's acceptance uniform (token indices ``[0, V)`` key its Exp(1) noise)."""


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` in int64 without overflow (``c`` split into 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection on ``[0, 2**32)``), on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _hash(seed: torch.Tensor, offset: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """32 bits from (seed, offset, index): each 32-bit word folded in by one finalizer round."""
    h = torch.zeros_like(seed)
    for word in (seed & _M32, (seed >> 32) & _M32, offset & _M32, (offset >> 32) & _M32, index & _M32):
        h = _fmix32((h ^ word) + 0x9E3779B9 & _M32)
    return h


def counter_uniform(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float64, shaped like ``seeds`` / ``offsets`` (broadcast; int64): a function of
    (seed, offset) alone (``offset``: the output position the uniform decides)."""
    h = _hash(seeds.to(torch.int64), offsets.to(torch.int64), torch.full_like(seeds, UNIFORM_INDEX))
    return (h.to(torch.float64) + 0.5) * 2.0**-32


def counter_exponential(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[..., V]`` float64 for ``seeds`` / ``offsets`` ``[...]`` int64: ``-log(u)`` with ``u``
    from (seed, offset, token index)."""
    idx = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    h = _hash(seeds.to(torch.int64)[..., None], offsets.to(torch.int64)[..., None], idx)
    return -torch.log((h.to(torch.float64) + 0.5) * 2.0**-32)


def warped_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distribution ``lz.sample`` draws from, per row: ``z = (logits - rowmax) / T``; top-k (keep ``z >=``
    the k-th largest, ties kept; 0 or >= V = off); top-p on the top-k-renormalized softmax (keep tokens whose
    mass ranked above is ``< p``; the first always kept); min-p on the softmax after those cuts (keep
    ``prob >= min_p * max prob``); softmax. Rows with ``T <`` :data:`GREEDY_BELOW` are one-hot at the first
    argmax.

    Args:
        logits: ``[N, V]`` float32 or float64 (the math runs in that dtype).
        temperature: ``[N]`` float; top_k ``[N]`` int or None; top_p ``[N]`` float in (0, 1] or None; min_p
            ``[N]`` float in [0, 1] or None.

    Returns:
        ``[N, V]`` probabilities in logits' dtype, rows summing to 1."""
    dt = logits.dtype
    n, v = logits.shape
    greedy = temperature < GREEDY_BELOW
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(dt)
    z = (logits - logits.amax(dim=-1, keepdim=True)) / t[:, None]
    if top_k is not None or top_p is not None:
        sz, order = torch.sort(z, dim=-1, descending=True, stable=True)
        if top_k is not None:
            k = top_k.to(torch.int64)
            k = torch.where((k <= 0) | (k > v), v, k)
            sz = sz.masked_fill(sz < sz.gather(-1, (k - 1)[:, None]), -math.inf)
        if top_p is not None:
            pr = torch.softmax(sz, dim=-1)
            before = torch.cumsum(pr, dim=-1) - pr
            p = top_p.to(dt)[:, None]
            cut = (before >= p) & (p < 1.0)
            cut[:, 0] = False
            sz = sz.masked_fill(cut, -math.inf)
        z = torch.empty_like(z).scatter_(-1, order, sz)
    probs = torch.softmax(z, dim=-1)
    if min_p is not None:
        keep = probs >= min_p.to(dt)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``B`` rows of up to ``K`` draft tokens against the target (speculative sampling, exact: each
    emitted token has the target's distribution given the tokens before it).

    Row b walks its drafts ``x_j`` (j < ``num_drafts[b]``): accepted while ``u_j * q_j(x_j) < p_j(x_j)``
    (probability ``min(1, p/q)``); at the first rejection j the row emits the accepted drafts and one token
    from the residual ``max(p_j - q_j, 0)`` renormalized; when every draft is accepted, one more (the bonus)
    from ``p_n``. Draws use the exponential race ``argmax(log w - log E)`` with ``noise`` ``E ~ Exp(1)``.
    ``draft_probs`` None: the drafts are deterministic (n-gram lookup, greedy draft models): ``q`` is
    one-hot, so a draft is accepted with probability ``p(x)`` and the residual is ``p`` without ``x``. A
    one-hot ``p`` (greedy rows) accepts exactly the drafts equal to the target's argmax and emits the argmax.

    Args:
        target_probs: ``[B, K + 1, V]`` float (the target's :func:`warped_probs` at each verified position:
            position j predicts the token after draft j - 1; positions past ``num_drafts`` are ignored).
        draft_ids: ``[B, K]`` int64 (entries past ``num_drafts`` ignored).
        num_drafts: ``[B]`` int64 in ``[0, K]``.
        uniforms: ``[B, K]`` float in (0, 1); noise: ``[B, K + 1, V]`` float, Exp(1).
        draft_probs: ``[B, K, V]`` float (the proposer's distribution of each draft), or None (one-hot).

    Returns:
        ``(tokens, num_accepted)``: ``tokens`` ``[B, K + 1]`` int64, row b's ``num_accepted[b] + 1`` emitted
        tokens first, then -1; ``num_accepted`` ``[B]`` int64 (accepted drafts)."""
    b, k1, v = target_probs.shape
    k = k1 - 1
    dev = target_probs.device
    pos = torch.arange(k1, device=dev)
    if k:
        d = draft_ids.clamp(0, v - 1)
        p_x = target_probs[:, :k].gather(-1, d[..., None]).squeeze(-1)
        q_x = 1.0 if draft_probs is None else draft_probs.gather(-1, d[..., None]).squeeze(-1)
        ok = (uniforms * q_x < p_x) & (pos[:k][None, :] < num_drafts[:, None])
        num_acc = torch.cumprod(ok.to(torch.int64), dim=-1).sum(-1)
    else:
        num_acc = torch.zeros(b, dtype=torch.int64, device=dev)
    # residual at every position (the row's emitted one is picked after the draw)
    resid = target_probs.clone()
    if k:
        is_draft = (pos[:k][None, :] < num_drafts[:, None])[..., None]
        if draft_probs is None:
            sub = torch.zeros_like(resid[:, :k]).scatter_(-1, d[..., None], 1.0)
        else:
            sub = draft_probs.to(resid.dtype)
        r = (resid[:, :k] - sub).clamp_min(0.0)
        # p == q to rounding leaves no mass: that position is never rejected in exact arithmetic; draw from p
        r = torch.where(r.sum(-1, keepdim=True) > 0, r, resid[:, :k])
        resid[:, :k] = torch.where(is_draft, r, resid[:, :k])
    e = noise.to(resid.dtype).clamp_min(torch.finfo(resid.dtype).tiny)
    drawn = torch.argmax(torch.log(resid) - torch.log(e), dim=-1)  # [B, K + 1]
    out = torch.full((b, k1), -1, dtype=torch.int64, device=dev)
    if k:
        out[:, :k] = torch.where(pos[:k][None, :] < num_acc[:, None], draft_ids, out[:, :k])
    out.scatter_(1, num_acc[:, None], drawn.gather(1, num_acc[:, None]))
    return out, num_acc
