"""A verification step's draw (:func:`verify_step`): the plain rows through the engine's
:class:`~layerzero.engine.worker.sampler.Sampler`, the speculating rows through exact rejection sampling
(:func:`~.rejection.rejection_sample`) with each request's own random stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import layerzero as lz

from ..core.sched.output import GrammarBitmask, SamplingMetadata, SchedulerOutput, resolve_bitmask
from ..worker.sampler import SamplerOutput, SamplingError
from ..worker.staging import to_device
from .rejection import rejection_sample

__all__ = ["spec_layout", "verify_rows", "verify_step"]


MAX_VERIFY_ELEMENTS = 1 << 26
"""Rows x positions x vocabulary verified at once (float32: 256 MiB per temporary); larger steps verify in
row blocks (unseeded rows then draw block by block from the engine's generator; seeded rows' streams do not
depend on it)."""


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
    """Rows ``idx`` of ``rows``, in that order, with their sequence ids and penalty resets (the worker's
    device penalty state); a grammar bitmask (structured outputs, a deferred fill run now) keeps the rows
    among ``idx``, renumbered."""
    b = resolve_bitmask(rows.grammar_bitmask)
    if b is not None:
        where = {r: j for j, r in enumerate(idx)}
        keep = [k for k, r in enumerate(b.rows.tolist()) if r in where]
        b = (
            GrammarBitmask(np.asarray([where[int(b.rows[k])] for k in keep], np.int64), b.bits[keep])
            if keep
            else None
        )
    return SamplingMetadata(
        [rows.params[i] for i in idx],
        [rows.seeds[i] for i in idx],
        [rows.num_output_tokens[i] for i in idx],
        [rows.prompt_token_ids[i] for i in idx],
        [rows.output_token_ids[i] for i in idx],
        b,
        seq_ids=[rows.seq_ids[i] for i in idx] if rows.seq_ids else [],
        penalty_reset=[rows.penalty_reset[i] for i in idx] if rows.penalty_reset else [],
    )


def verify_rows(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: list[int],
    rows: SamplingMetadata,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
    max_elements: int = MAX_VERIFY_ELEMENTS,
    before_read: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Verify ``R`` speculating rows: ``logits`` ``[R, K + 1, V]`` (row r's positions past ``num_drafts[r]``
    ignored), ``drafts`` ``[R, K]`` int64 on the logits' device, ``rows`` their sampling parameters. Greedy
    rows accept drafts equal to the target's argmax and emit the argmax (plain greedy's tokens); sampled rows
    go through :func:`~.rejection.rejection_sample` over ``lz.sampling_probs`` (float32) with the
    drafts' distributions ``draft_probs`` ``[R, K, V]`` (None: one-hot drafts). Seeded rows take counter-based
    uniforms and noise from (seed, output position): the token at output position o uses offset o, so they do
    not depend on the batch; other rows draw from ``generator``. Returns per row its emitted tokens (accepted
    drafts then the target's token) and its accepted count (waits for them: host lists). ``max_elements``:
    rows x positions x vocabulary verified at once (larger steps go in row blocks).

    ``before_read(tokens, accepted)``: called once the result is queued on the device and its copy to the
    host launched, before the host waits for it: ``tokens`` ``[R, K + 1]`` int64 (row r emits its first
    ``accepted[r] + 1``), ``accepted`` ``[R]`` int64, both on the device; work it queues runs on the device
    while the host waits (the next round's first draft step, ``DraftProposer.ahead_hook``). Not called when
    the step verifies in row blocks."""
    r, k1, v = logits.shape
    step = max(1, max_elements // (k1 * v))
    if r > step:  # bounded temporaries (probabilities, sorts, noise): row blocks
        toks: list[list[int]] = []
        accs: list[int] = []
        for a in range(0, r, step):
            b = min(a + step, r)
            t, c = verify_rows(
                logits[a:b],
                drafts[a:b],
                num_drafts[a:b],
                _subset(rows, list(range(a, b))),
                generator,
                None if draft_probs is None else draft_probs[a:b],
                max_elements=max_elements,
            )
            toks += t
            accs += c
        return toks, accs
    dev = logits.device
    ps = rows.params
    i64 = np.int64
    if all(p.greedy for p in ps):
        (nd,) = to_device([np.asarray(num_drafts, dtype=i64)], dev)
        am = logits.argmax(dim=-1)  # [R, K + 1]: the first maximum, as lz.sample_greedy
        ok = (drafts == am[:, : k1 - 1]) & (torch.arange(k1 - 1, device=dev)[None, :] < nd[:, None])
        acc = torch.cumprod(ok.to(torch.int64), dim=-1).sum(-1)
        tokens = am
    else:
        # every host array in one staged copy (a pageable copy would wait for the GPU)
        named = {"temperature": np.repeat(np.asarray([p.temperature for p in ps], dtype=np.float32), k1)}
        for name, vals, off, dt in (
            ("top_k", [p.top_k_or_off for p in ps], 0, np.int32),
            ("top_p", [p.top_p for p in ps], 1.0, np.float32),
            ("min_p", [p.min_p for p in ps], 0.0, np.float32),
        ):
            if any(val != off for val in vals):
                named[name] = np.repeat(np.asarray(vals, dtype=dt), k1)
        seeded = [i for i, s in enumerate(rows.seeds) if s is not None and not ps[i].greedy]
        host = [
            np.asarray(num_drafts, dtype=i64),
            np.asarray(seeded, dtype=i64),
            np.asarray([rows.seeds[i] for i in seeded], dtype=i64),
            np.asarray([rows.num_output_tokens[i] for i in seeded], dtype=i64),
            *named.values(),
        ]
        nd, si, seeds, base, *vals = to_device(host, dev)
        x = logits.float().reshape(r * k1, v)
        probs = lz.sampling_probs(x, **dict(zip(named, vals, strict=True))).reshape(r, k1, v)
        u = torch.rand((r, max(k1 - 1, 1)), generator=generator, device=dev, dtype=torch.float64)[:, : k1 - 1]
        e = torch.empty((r, k1, v), device=dev, dtype=torch.float32).exponential_(generator=generator)
        if seeded:
            offs = base[:, None] + torch.arange(k1, device=dev)[None, :]  # [S, K + 1] output positions
            seeds2 = seeds[:, None].expand_as(offs)
            u[si] = lz.seeded_uniform(seeds2[:, : k1 - 1], offs[:, : k1 - 1])
            e[si] = lz.seeded_exponential(seeds2, offs, v).float()
        tokens, acc = rejection_sample(probs, drafts, nd, u, e, draft_probs)
    both = torch.cat([tokens, acc[:, None]], dim=1)  # one transfer to the host
    if before_read is None:
        listed = both.tolist()
    else:
        read = _read_later(both)
        before_read(tokens, acc)
        listed = read()
    toks, accs = [b[:-1] for b in listed], [b[-1] for b in listed]
    return [t[: a + 1] for t, a in zip(toks, accs, strict=True)], accs


def _read_later(t: torch.Tensor) -> Callable[[], list]:
    """``t``'s values as nested lists, read when the returned function is called: the copy to the host is
    launched now, non-blocking, with an event after it on CUDA (as the sampler's pending draw:
    ``Sampler._pending`` / ``resolve``), so the call waits for that copy alone, not for the work queued
    after it."""
    host = t.to("cpu", non_blocking=True)
    done = None
    if t.device.type == "cuda":
        done = torch.cuda.Event()
        done.record()

    def read() -> list:
        if done is not None:
            done.synchronize()
        return host.tolist()

    return read


def verify_step(
    logits: torch.Tensor,
    out: SchedulerOutput,
    sampler: Any,
    drafts: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    before_read: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> Any:
    """The draw of a verification step: ``logits`` ``[N, V]`` (per sampled chunk its ``1 + drafts`` rows,
    :func:`spec_layout`), ``drafts`` ``[R, K]`` int64 on the device (a draft model's, one row per speculating
    row in order) or None (the host drafts in ``out.spec_token_ids``), ``draft_probs`` ``[R, K, V]`` their
    distributions (None: one-hot). Plain rows are drawn by ``sampler``
    (their logprobs as usual); ``before_read``: :func:`verify_rows`' (the speculating rows'); returns a
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
    k = max((counts[i] for i in spec), default=0)
    host = [np.asarray([starts[i] for i in plain], dtype=np.int64)]
    if spec:
        host.append(
            np.asarray([[starts[i] + min(j, counts[i]) for j in range(k + 1)] for i in spec], np.int64)
        )
        if drafts is None:
            d = np.zeros((len(spec), k), dtype=np.int64)
            for r, ids_r in enumerate(s for s in out.spec_token_ids if s):
                d[r, : len(ids_r)] = ids_r
            host.append(d)
    staged = to_device(host, dev)  # one copy
    if plain:
        idx = staged[0]
        try:
            res = sampler(logits.index_select(0, idx), _subset(rows, plain))
        except SamplingError as exc:  # its rows index the plain rows: name the step's rows
            raise SamplingError([plain[i] for i in exc.rows], exc.__cause__ or exc) from exc.__cause__
        for j, i in enumerate(plain):
            ids[i], lps[i], tops[i] = res.sampled_token_ids[j], res.logprobs[j], res.top_logprobs[j]
    if spec:
        lg = logits[staged[1]]  # [R, K + 1, V]
        if drafts is None:
            drafts = staged[2]
        q = None if draft_probs is None else draft_probs[:, :k]
        got, _ = verify_rows(
            _biased(
                lg, [rows.params[i] for i in spec], [rows.num_output_tokens[i] for i in spec], sampler.eos
            ),
            drafts[:, :k],
            [counts[i] for i in spec],
            _subset(rows, spec),
            sampler.generator,
            q,
            before_read=before_read,
        )
        for i, t in zip(spec, got, strict=True):
            ids[i] = t
        want = [r for r, i in enumerate(spec) if rows.params[i].logprobs is not None]
        if want:
            _spec_logprobs(lg, want, [spec[r] for r in want], [got[r] for r in want], rows, lps, tops)
    return SamplerOutput(ids, lps, tops)


def _biased(lg: torch.Tensor, params: list[Any], num_out: list[int], eos: Any) -> torch.Tensor:
    """``lg`` ``[R, K + 1, V]`` with each row's ``logit_bias`` added at every position and, at positions whose
    token would come before ``min_tokens`` (output index ``num_out + j < min_tokens``), its stop ids and
    ``eos`` (unless ``ignore_eos``) banned (-inf): the plain sampler's bias and ban, per position (float32,
    after the raw logprobs, as there); ``lg`` itself when no row has either."""
    r_, j_, c_, v_ = [], [], [], []
    k1 = lg.shape[1]
    for r, (p, n) in enumerate(zip(params, num_out, strict=True)):
        for t, b in (p.logit_bias or {}).items():
            for j in range(k1):
                r_.append(r), j_.append(j), c_.append(t), v_.append(b)
        if n < p.min_tokens:
            banned = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos))
            for j in range(min(k1, p.min_tokens - n)):
                for t in banned:
                    r_.append(r), j_.append(j), c_.append(t), v_.append(float("-inf"))
    if not r_:
        return lg
    i64 = np.int64
    rr, jj, cc, vv = to_device(
        [np.asarray(r_, i64), np.asarray(j_, i64), np.asarray(c_, i64), np.asarray(v_, np.float32)], lg.device
    )
    out = lg.float().clone()
    out.index_put_((rr, jj, cc), vv, accumulate=True)
    return out


def _spec_logprobs(
    lg: torch.Tensor,
    want: list[int],
    step_rows: list[int],
    emitted: list[list[int]],
    rows: SamplingMetadata,
    lps: list[Any],
    tops: list[Any],
) -> None:
    """The raw logprobs (``log_softmax`` of the model's logits, as the plain sampler reports them) of each
    emitted token of the speculating rows ``want`` (rows of ``lg`` ``[R, K + 1, V]``) that asked for them,
    with their top-N, written into ``lps`` / ``tops`` at ``step_rows``."""
    k1 = lg.shape[1]
    tok = np.zeros((len(want), k1), dtype=np.int64)
    for w, t in enumerate(emitted):
        tok[w, : len(t)] = t
    sel, tok_t = to_device([np.asarray(want, dtype=np.int64), tok], lg.device)
    raw = torch.log_softmax(lg.index_select(0, sel).float(), dim=-1)  # [W, K + 1, V]
    n = max(rows.params[i].logprobs for i in step_rows)
    chosen = raw.gather(-1, tok_t[..., None]).squeeze(-1).tolist()
    top_v, top_i = raw.topk(n, dim=-1) if n else (raw[..., :0], raw[..., :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for w, (i, t) in enumerate(zip(step_rows, emitted, strict=True)):
        cnt = rows.params[i].logprobs
        lps[i] = chosen[w][: len(t)]
        entries = []
        for j, x in enumerate(t):
            d = dict(zip(top_i[w][j][:cnt], top_v[w][j][:cnt], strict=True))
            d[x] = chosen[w][j]
            entries.append(d)
        tops[i] = entries
