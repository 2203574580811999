"""A verification step's draw (:func:`verify_step`): the plain rows through the engine's
:class:`~layerzero.engine.worker.sampler.Sampler`, the speculating rows through exact rejection sampling
(:func:`~.rejection.rejection_sample`) with each request's own random stream."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..core.sched.output import SamplingMetadata, SchedulerOutput
from ..worker.sampler import SamplerOutput, SamplingError
from .rejection import counter_exponential, counter_uniform, rejection_sample, warped_probs

__all__ = ["spec_layout", "verify_rows", "verify_step"]


def spec_layout(out: SchedulerOutput) -> tuple[list[int], list[int]]:
    """Per sampled row of ``out`` (chunk order): its first logits row and its draft count (0: a plain row);
    a verification step's logits hold ``1 + drafts`` rows per sampled chunk."""
    starts, counts, r = [], [], 0
    spec = out.spec_token_ids or [[]] * len(out.sample)
    for sampled, drafts in zip(out.sample, spec, strict=True):
        if sampled:
            starts.append(r)
            counts.append(len(drafts))
            r += 1 + len(drafts)
    return starts, counts


def _subset(rows: SamplingMetadata, idx: list[int]) -> SamplingMetadata:
    return SamplingMetadata(
        [rows.params[i] for i in idx],
        [rows.seeds[i] for i in idx],
        [rows.num_output_tokens[i] for i in idx],
        [rows.prompt_token_ids[i] for i in idx],
        [rows.output_token_ids[i] for i in idx],
    )


def verify_rows(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: list[int],
    rows: SamplingMetadata,
    generator: torch.Generator,
) -> tuple[list[list[int]], list[int]]:
    """Verify ``R`` speculating rows: ``logits`` ``[R, K + 1, V]`` (row r's positions past ``num_drafts[r]``
    ignored), ``drafts`` ``[R, K]`` int64 on the logits' device, ``rows`` their sampling parameters. Greedy
    rows accept drafts equal to the target's argmax and emit the argmax (plain greedy's tokens); sampled rows
    go through :func:`~.rejection.rejection_sample` over :func:`~.rejection.warped_probs` (float32) with
    one-hot drafts. Seeded rows take counter-based uniforms and noise from (seed, output position): the token
    at output position o uses offset o, so they do not depend on the batch; other rows draw from
    ``generator``. Returns per row its emitted tokens (accepted drafts then the target's token) and its
    accepted count (waits for them: host lists)."""
    r, k1, v = logits.shape
    dev = logits.device
    ps = rows.params
    nd = torch.as_tensor(num_drafts, dtype=torch.int64).to(dev)
    if all(p.greedy for p in ps):
        am = logits.argmax(dim=-1)  # [R, K + 1]: the first maximum, as lz.sample_greedy
        ok = (drafts == am[:, : k1 - 1]) & (torch.arange(k1 - 1, device=dev)[None, :] < nd[:, None])
        acc = torch.cumprod(ok.to(torch.int64), dim=-1).sum(-1)
        tokens = am
    else:
        x = logits.float().reshape(r * k1, v)
        rep = np.repeat
        temp = torch.as_tensor(rep([0.0 if p.greedy else p.temperature for p in ps], k1), dtype=torch.float32)
        named: dict[str, Any] = {"temperature": temp.to(dev)}
        for name, vals, off in (
            ("top_k", [p.top_k_or_off for p in ps], 0),
            ("top_p", [p.top_p for p in ps], 1.0),
            ("min_p", [p.min_p for p in ps], 0.0),
        ):
            if any(val != off for val in vals):
                named[name] = torch.as_tensor(rep(vals, k1)).to(dev)
        probs = warped_probs(x, **named).reshape(r, k1, v)
        u = torch.rand((r, max(k1 - 1, 1)), generator=generator, device=dev, dtype=torch.float64)[:, : k1 - 1]
        e = torch.empty((r, k1, v), device=dev, dtype=torch.float32).exponential_(generator=generator)
        seeded = [i for i, s in enumerate(rows.seeds) if s is not None and not ps[i].greedy]
        if seeded:
            si = torch.as_tensor(seeded, dtype=torch.int64).to(dev)
            seeds = torch.as_tensor([rows.seeds[i] for i in seeded], dtype=torch.int64).to(dev)
            base = torch.as_tensor([rows.num_output_tokens[i] for i in seeded], dtype=torch.int64).to(dev)
            offs = base[:, None] + torch.arange(k1, device=dev)[None, :]  # [S, K + 1] output positions
            seeds2 = seeds[:, None].expand_as(offs)
            u[si] = counter_uniform(seeds2[:, : k1 - 1], offs[:, : k1 - 1])
            e[si] = counter_exponential(seeds2, offs, v).float()
        tokens, acc = rejection_sample(probs, drafts, nd, u, e)
    toks, accs = tokens.tolist(), acc.tolist()
    return [t[: a + 1] for t, a in zip(toks, accs, strict=True)], accs


def verify_step(
    logits: torch.Tensor,
    out: SchedulerOutput,
    sampler: Any,
    drafts: torch.Tensor | None = None,
) -> Any:
    """The draw of a verification step: ``logits`` ``[N, V]`` (per sampled chunk its ``1 + drafts`` rows,
    :func:`spec_layout`), ``drafts`` ``[R, K]`` int64 on the device (a draft model's, one row per speculating
    row in order) or None (the host drafts in ``out.spec_token_ids``). Plain rows are drawn by ``sampler``
    (their logprobs as usual); returns a
    :class:`~layerzero.engine.worker.sampler.SamplerOutput` (waits for the tokens).

    Raises:
        SamplingError: the plain rows' draw raised (its ``rows`` index the step's sampled rows)."""
    starts, counts = spec_layout(out)
    rows = out.sampling
    plain = [i for i, c in enumerate(counts) if c == 0]
    spec = [i for i, c in enumerate(counts) if c > 0]
    ids: list[list[int]] = [[] for _ in counts]
    lps: list[Any] = [None] * len(counts)
    tops: list[Any] = [None] * len(counts)
    dev = logits.device
    if plain:
        idx = torch.as_tensor([starts[i] for i in plain], dtype=torch.int64).to(dev)
        try:
            res = sampler(logits.index_select(0, idx), _subset(rows, plain))
        except SamplingError as exc:  # its rows index the plain rows: name the step's rows
            raise SamplingError([plain[i] for i in exc.rows], exc.__cause__ or exc) from exc.__cause__
        for j, i in enumerate(plain):
            ids[i], lps[i], tops[i] = res.sampled_token_ids[j], res.logprobs[j], res.top_logprobs[j]
    if spec:
        k = max(counts[i] for i in spec)
        gather = np.asarray([[starts[i] + min(j, counts[i]) for j in range(k + 1)] for i in spec])
        g = torch.as_tensor(gather, dtype=torch.int64).to(dev)
        lg = logits[g]  # [R, K + 1, V]
        if drafts is None:
            sids = [s for s in out.spec_token_ids if s]
            host = np.zeros((len(spec), k), dtype=np.int64)
            for r, d in enumerate(sids):
                host[r, : len(d)] = d
            drafts = torch.as_tensor(host).to(dev)
        got, _ = verify_rows(
            lg, drafts[:, :k], [counts[i] for i in spec], _subset(rows, spec), sampler.generator
        )
        for i, t in zip(spec, got, strict=True):
            ids[i] = t
    return SamplerOutput(ids, lps, tops)
