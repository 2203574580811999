"""Batched sampling of one step on the device: raw logprobs, penalties, logit bias, min_tokens, then
temperature / top-k / top-p / min-p and the draw, through LayerZero's sampling ops (vLLM's v1 sampler, in that
order)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import layerzero as lz

from ..core.sched.output import SamplingMetadata
from ..logits_processors import BatchState
from .grammar_bitmask import apply_grammar_bitmask
from .logits_restrict import restrict_tokens
from .penalty_state import PenaltyState
from .staging import to_device

__all__ = ["PendingSample", "Sampler", "SamplerOutput", "SamplingError", "sequence_seed"]


class SamplingError(RuntimeError):
    """Sampling a step raised; ``rows``: the sampled rows (indices into the step's sampled sequences) that
    raise when sampled alone (every row of the step when none does). The original exception is the
    ``__cause__``."""

    def __init__(self, rows: list[int], cause: BaseException) -> None:
        super().__init__(f"sampling failed for {len(rows)} sequence(s): {type(cause).__name__}: {cause}")
        self.rows = rows


def sequence_seed(seed: int, index: int) -> int:
    """The random stream of completion ``index`` of a request with ``seed`` (index 0 uses the seed itself)."""
    return seed if index == 0 else (seed * 0x9E3779B1 + index) % (1 << 62)


@dataclass
class SamplerOutput:
    """Per sampled sequence: its new tokens (a list: one token per step today, more once speculative decoding
    lands), their raw logprobs and their top-N raw logprobs ({token: logprob}, the chosen token included)
    when the request asked for them (else None). ``prompt_logprobs``: per prompt-logprob chunk of the step
    (``SchedulerOutput.prompt_logprobs`` order), per position its {token id: raw logprob}; empty when none
    (filled by the worker's output)."""

    sampled_token_ids: list[list[int]]
    logprobs: list[list[float] | None]
    top_logprobs: list[list[dict[int, float]] | None]
    prompt_logprobs: list[list[dict[int, float]]] = field(default_factory=list)


@dataclass
class PendingSample:
    """A step's draw in flight (:meth:`Sampler.launch`): ``tokens`` ``[S]`` int64 on the device (the next
    step's pending input ids are gathered from it), their host copies in transfer, and the logprob rows asked
    for."""

    tokens: torch.Tensor
    host: list[torch.Tensor]
    event: torch.cuda.Event | None
    lp_rows: list[int]
    lp_counts: list[int]


def plain_greedy(rows: SamplingMetadata) -> bool:
    """Every row greedy with nothing that changes or reads its logits: no penalties, logit bias, token
    restrictions (allowed ids, bad words, structured outputs), min_tokens ban or logprobs (the step's tokens
    are then the rows' argmax, read from the logits as the model returned them)."""
    for p, n in zip(rows.params, rows.num_output_tokens, strict=True):
        if (
            not p.greedy
            or p.penalized
            or p.logit_bias
            or p.restricted
            or p.logprobs is not None
            or n < p.min_tokens
        ):
            return False
    return True


class Sampler:
    """Samples the next token of every row of a step's logits ``[S, V]`` (the model's dtype; cast to float32
    for everything but a plain greedy step), row i as row i of the step's :class:`SamplingMetadata`."""

    def __init__(
        self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device, seed: int
    ) -> None:
        self.vocab_size, self.eos, self.device = vocab_size, eos_token_ids, device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        #: The penalized sequences' token counts on the device (rows freed by the worker: ``release``).
        self.penalties = PenaltyState(vocab_size, device)
        #: Logits-processor plugins (:class:`~layerzero.engine.logits_processors.BatchState`), set by the
        #: worker when the engine has any; None: none.
        self.logitsprocs: BatchState | None = None

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: SamplingMetadata) -> SamplerOutput:
        """Sample the ``rows``' next tokens from ``logits`` (float32 logits are modified in place); waits for
        them."""
        return self.resolve(self.launch(logits, rows))

    @torch.no_grad()
    def launch(self, logits: torch.Tensor, rows: SamplingMetadata) -> PendingSample:
        """:meth:`_launch`; when it raises, each row is drawn alone to find the ones that raise.

        Raises:
            SamplingError: naming those rows (all of them when no row raises alone); the draw's exception is
                its ``__cause__``. The engine core fails those requests only (``EngineCore.step``).
        """
        try:
            return self._launch(logits, rows)
        except Exception as exc:
            bad = []
            for i in range(len(rows)):
                try:
                    self.resolve(self._launch(logits[i : i + 1], _row(rows, i), count=False))
                except Exception:
                    bad.append(i)
            raise SamplingError(bad or list(range(len(rows))), exc) from exc

    def _launch(self, logits: torch.Tensor, rows: SamplingMetadata, count: bool = True) -> PendingSample:
        """Enqueue the draw of ``seqs``' next tokens from ``logits`` ``[S, V]`` and the transfer of the
        results to the host, without waiting for them (:meth:`resolve` does). A plain greedy step
        (:func:`plain_greedy`) takes ``lz.sample_greedy`` of the logits as they are (bf16 logits: no float32
        copy); otherwise they are cast to float32 (float32 logits are then modified in place). Penalties read
        the device state of :class:`PenaltyState` (``count``: the drawn tokens are added to it; False when a
        failed step's rows are drawn again one by one), so a penalized step needs nothing from the host."""
        procs = self.logitsprocs
        if plain_greedy(rows) and (procs is None or procs.argmax_invariant):
            return self._pending(lz.sample_greedy(logits), [], [], [])
        logits = logits.float()
        ps = rows.params
        want_lp = [p.logprobs is not None for p in ps]
        raw = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        counted = self._penalize(logits, rows)
        self._bias(logits, rows)
        if any(p.restricted for p in ps):
            restrict_tokens(logits, rows)  # allowed_token_ids, bad words
            apply_grammar_bitmask(logits, rows)  # structured outputs: the grammar's allowed tokens
        if procs is not None:
            logits = procs.apply(logits, all(p.greedy for p in ps))
        if all(p.greedy for p in ps):
            tokens = lz.sample_greedy(logits)
        else:
            tokens = self._sample(logits, rows)
        if counted is not None and count:  # the drawn tokens join the penalized rows' counts (device ops)
            state_rows, batch_rows = counted
            self.penalties.count(
                state_rows, tokens if batch_rows is None else tokens.index_select(0, batch_rows)
            )
        lp_rows = [i for i, w in enumerate(want_lp) if w]
        out = [tokens]
        if raw is not None:
            n = max(ps[i].logprobs for i in lp_rows)
            if len(lp_rows) == len(ps):
                sel, chosen = raw, tokens
            else:  # indexed through a staged tensor: a Python-list index would be a blocking copy
                (idx,) = to_device([np.asarray(lp_rows, dtype=np.int64)], raw.device)
                sel, chosen = raw.index_select(0, idx), tokens.index_select(0, idx)
            top_v, top_i = sel.topk(n, dim=-1) if n else (sel[:, :0], sel[:, :0].long())
            out += [sel.gather(1, chosen.unsqueeze(1)).squeeze(1), top_v, top_i]
        return self._pending(tokens, out[1:], lp_rows, [ps[i].logprobs for i in lp_rows])

    @staticmethod
    def _pending(
        tokens: torch.Tensor, extra: list[torch.Tensor], rows: list[int], counts: list[int]
    ) -> PendingSample:
        """Start the non-blocking copies of ``tokens`` (and the logprob tensors ``extra``) to the host and
        record an event after them."""
        host = [t.to("cpu", non_blocking=True) for t in (tokens, *extra)]
        event = None
        if tokens.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingSample(tokens, host, event, rows, counts)

    @staticmethod
    def resolve(p: PendingSample) -> SamplerOutput:
        """Wait for a launched draw and read it: token ids, raw logprobs of the chosen tokens and the
        top-N."""
        if p.event is not None:
            p.event.synchronize()
        ids = p.host[0].tolist()
        chosen: list[list[float] | None] = [None] * len(ids)
        tops: list[list[dict[int, float]] | None] = [None] * len(ids)
        if p.lp_rows:
            picked, top_v, top_i = (t.tolist() for t in p.host[1:])
            for j, (i, k) in enumerate(zip(p.lp_rows, p.lp_counts, strict=True)):
                d = dict(zip(top_i[j][:k], top_v[j][:k], strict=True))
                d[ids[i]] = picked[j]
                chosen[i], tops[i] = [picked[j]], [d]
        return SamplerOutput([[t] for t in ids], chosen, tops)

    def _penalize(
        self, logits: torch.Tensor, rows: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Apply the penalized rows' penalties to ``logits`` in place (``lz.apply_penalties``, counts form).

        With ``rows.seq_ids`` (the engine's steps) the counts are the device state (:class:`PenaltyState`,
        rebuilt for rows marked ``penalty_reset``): nothing is read from the host, so a pending token of async
        scheduling is already counted. Without (a hand-built metadata) each penalized row's token ids are
        counted on the device for this call only. Returns ``(state rows [P], their batch rows [P] or None when
        every row is penalized)`` for :meth:`PenaltyState.count` after the draw (None: no penalized row, or
        stateless)."""
        ps = rows.params
        pen = [i for i, p in enumerate(ps) if p.penalized]
        if not pen:
            return None
        stateful = len(rows.seq_ids) == len(ps)
        arrays = [
            np.asarray([getattr(ps[i], name) for i in pen], dtype=np.float32)
            for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
        ]
        whole = len(pen) == len(ps)
        if not whole:
            arrays.append(np.asarray(pen, dtype=np.int64))
        if not stateful:
            v = self.vocab_size
            for ids in (rows.prompt_token_ids, rows.output_token_ids):
                toks = [ids[i] or () for i in pen]
                m = np.full((len(pen), max(1, *(len(t) for t in toks))), v, dtype=np.int64)
                for j, t in enumerate(toks):
                    m[j, : len(t)] = t
                arrays.append(m)
        staged = to_device(arrays, self.device)
        rep, pres, freq = staged[:3]
        batch_rows = None if whole else staged[3]
        if stateful:
            state_rows = self.penalties.rows(rows, pen)
            prompt = self.penalties.prompt.index_select(0, state_rows)
            counts = self.penalties.counts.index_select(0, state_rows)
        else:
            prompt, output = staged[-2:]
        sub = logits if batch_rows is None else logits.index_select(0, batch_rows)
        res = lz.apply_penalties(
            sub,
            prompt,
            counts if stateful else output,
            repetition_penalty=rep,
            presence_penalty=pres,
            frequency_penalty=freq,
        )
        if batch_rows is None:
            logits.copy_(res)
        else:
            logits.index_copy_(0, batch_rows, res)
        return (state_rows, batch_rows) if stateful else None

    def _bias(self, logits: torch.Tensor, sm: SamplingMetadata) -> None:
        rows, cols, vals = [], [], []
        for i, (p, n) in enumerate(zip(sm.params, sm.num_output_tokens, strict=True)):
            for t, b in (p.logit_bias or {}).items():
                rows.append(i), cols.append(t), vals.append(b)
            if n < p.min_tokens:  # no stop before min_tokens: EOS and stop ids banned
                banned = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(self.eos))
                for t in banned:
                    rows.append(i), cols.append(t), vals.append(float("-inf"))
        if rows:
            r, c, v = to_device(
                [
                    np.asarray(rows, dtype=np.int64),
                    np.asarray(cols, dtype=np.int64),
                    np.asarray(vals, dtype=np.float32),
                ],
                self.device,
            )
            logits.index_put_((r, c), v.to(logits.dtype), accumulate=True)

    def _sample(self, logits: torch.Tensor, rows: SamplingMetadata) -> torch.Tensor:
        dev = self.device
        ps = rows.params
        seeds = [-1 if s is None or p.greedy else s for s, p in zip(rows.seeds, ps, strict=True)]
        seeded = any(x >= 0 for x in seeds)

        # per-row parameters in one staged copy; a filter no row uses is left out (None): the kernel then
        # skips its sort / mask entirely
        named = {"temperature": np.asarray([p.temperature for p in ps], dtype=np.float32)}
        for name, values, off, dtype in (
            ("top_k", [p.top_k_or_off for p in ps], 0, np.int32),
            ("top_p", [p.top_p for p in ps], 1.0, np.float32),
            ("min_p", [p.min_p for p in ps], 0.0, np.float32),
        ):
            if any(v != off for v in values):
                named[name] = np.asarray(values, dtype=dtype)
        if seeded:
            named["seeds"] = np.asarray(seeds, dtype=np.int64)
            named["offsets"] = np.asarray(rows.num_output_tokens, dtype=np.int64)
        kwargs = dict(zip(named, to_device(list(named.values()), dev), strict=True))
        return lz.sample(logits, generator=self.generator, **kwargs)


def _row(rows: SamplingMetadata, i: int) -> SamplingMetadata:
    """Row ``i`` of ``rows`` alone."""
    return SamplingMetadata(
        [rows.params[i]],
        [rows.seeds[i]],
        [rows.num_output_tokens[i]],
        [rows.prompt_token_ids[i]],
        [rows.output_token_ids[i]],
        seq_ids=rows.seq_ids[i : i + 1],
        penalty_reset=rows.penalty_reset[i : i + 1],
    )
