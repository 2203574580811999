"""Exact speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"), batched:
the accept / reject walk over the drafts (:func:`rejection_sample`). Its inputs come from LayerZero's own
definitions, shared with ``lz.sample``: the target's probabilities after the request's temperature / top-k /
top-p / min-p (``lz.sampling_probs``) and, for seeded rows, the counter-based streams (``lz.seeded_uniform``,
``lz.seeded_exponential``), so a seeded request gives the same tokens alone or in any batch."""

from __future__ import annotations

import torch

__all__ = ["rejection_sample"]


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
        target_probs: ``[B, K + 1, V]`` float (the target's ``lz.sampling_probs`` at each verified position:
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
