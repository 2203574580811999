"""Batched sampling of one step on the device: raw logprobs, penalties, logit bias, min_tokens, then
temperature / top-k / top-p / min-p and the draw, through LayerZero's sampling ops (vLLM's v1 sampler, in that
order)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import layerzero as lz

from .sequence import Sequence
from .staging import to_device

__all__ = ["PendingSample", "Sampler", "SamplerOutput", "SamplingError", "sequence_seed"]


class SamplingError(RuntimeError):
    """Sampling a step raised; ``seqs``: the sequences whose rows raise when sampled alone (every row of the
    step when none does). The original exception is the ``__cause__``."""

    def __init__(self, seqs: list[Sequence], cause: BaseException) -> None:
        super().__init__(f"sampling failed for {len(seqs)} sequence(s): {type(cause).__name__}: {cause}")
        self.seqs = seqs


def sequence_seed(seed: int, index: int) -> int:
    """The random stream of completion ``index`` of a request with ``seed`` (index 0 uses the seed itself)."""
    return seed if index == 0 else (seed * 0x9E3779B1 + index) % (1 << 62)


@dataclass
class SamplerOutput:
    """Per sampled sequence: the token, its raw logprob, and the top-N raw logprobs ({token: logprob}, the
    chosen token included) when the request asked for them."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


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


def plain_greedy(seqs: list[Sequence]) -> bool:
    """Every row greedy with nothing that changes or reads its logits: no penalties, logit bias, min_tokens
    ban or logprobs (the step's tokens are then the rows' argmax, read from the logits as the model returned
    them)."""
    for s in seqs:
        p = s.params
        if (
            not p.greedy
            or p.penalized
            or p.logit_bias
            or p.logprobs is not None
            or s.num_output_tokens < p.min_tokens
        ):
            return False
    return True


class Sampler:
    """Samples the next token of every row of a step's logits ``[S, V]`` (the model's dtype; cast to float32
    for everything but a plain greedy step), row i for ``seqs[i]``."""

    def __init__(
        self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device, seed: int
    ) -> None:
        self.vocab_size, self.eos, self.device = vocab_size, eos_token_ids, device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample ``seqs``' next tokens from ``logits`` (float32 logits are modified in place); waits for
        them."""
        return self.resolve(self.launch(logits, seqs))

    @torch.no_grad()
    def launch(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """:meth:`_launch`; when it raises, each row is drawn alone to find the ones that raise.

        Raises:
            SamplingError: naming those sequences (all of them when no row raises alone); the draw's exception
                is its ``__cause__``. The engine fails those requests only (``LLMEngine.step``).
        """
        try:
            return self._launch(logits, seqs)
        except Exception as exc:
            bad = []
            for i, seq in enumerate(seqs):
                try:
                    self.resolve(self._launch(logits[i : i + 1], [seq]))
                except Exception:
                    bad.append(seq)
            raise SamplingError(bad or list(seqs), exc) from exc

    def _launch(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """Enqueue the draw of ``seqs``' next tokens from ``logits`` ``[S, V]`` and the transfer of the
        results to the host, without waiting for them (:meth:`resolve` does). A plain greedy step
        (:func:`plain_greedy`) takes ``lz.sample_greedy`` of the logits as they are (bf16 logits: no float32
        copy); otherwise they are cast to float32 (float32 logits are then modified in place). Penalties read
        the sequences' known tokens: async scheduling resolves a step before the next one samples a penalized
        sequence."""
        if plain_greedy(seqs):
            return self._pending(lz.sample_greedy(logits), [], [], [])
        logits = logits.float()
        want_lp = [s.params.logprobs is not None for s in seqs]
        raw = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        self._penalize(logits, seqs)
        self._bias(logits, seqs)
        if all(s.params.greedy for s in seqs):
            tokens = lz.sample_greedy(logits)
        else:
            tokens = self._sample(logits, seqs)
        rows = [i for i, w in enumerate(want_lp) if w]
        out = [tokens]
        if raw is not None:
            n = max(seqs[i].params.logprobs for i in rows)
            if len(rows) == len(seqs):
                sel, chosen = raw, tokens
            else:  # indexed through a staged tensor: a Python-list index would be a blocking copy
                (idx,) = to_device([np.asarray(rows, dtype=np.int64)], raw.device)
                sel, chosen = raw.index_select(0, idx), tokens.index_select(0, idx)
            top_v, top_i = sel.topk(n, dim=-1) if n else (sel[:, :0], sel[:, :0].long())
            out += [sel.gather(1, chosen.unsqueeze(1)).squeeze(1), top_v, top_i]
        return self._pending(tokens, out[1:], rows, [seqs[i].params.logprobs for i in rows])

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
        chosen: list[float | None] = [None] * len(ids)
        tops: list[dict[int, float] | None] = [None] * len(ids)
        if p.lp_rows:
            picked, top_v, top_i = (t.tolist() for t in p.host[1:])
            for j, (i, k) in enumerate(zip(p.lp_rows, p.lp_counts, strict=True)):
                d = dict(zip(top_i[j][:k], top_v[j][:k], strict=True))
                d[ids[i]] = picked[j]
                chosen[i], tops[i] = picked[j], d
        return SamplerOutput(ids, chosen, tops)

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        ps = [s.params for s in seqs]
        if not any(p.penalized for p in ps):
            return
        pad = self.vocab_size
        # the known output tokens: a row without penalties may have one pending (async scheduling; it does not
        # matter there), a penalized row never has (the engine reads the previous step before sampling it)
        outs = [s.token_ids[s.num_prompt_tokens :] for s in seqs]
        lp = max(s.num_prompt_tokens for s in seqs)
        lo = max(len(o) for o in outs)
        prompt = np.full((len(seqs), lp), pad, dtype=np.int64)
        output = np.full((len(seqs), lo), pad, dtype=np.int64)
        for i, (s, o) in enumerate(zip(seqs, outs, strict=True)):
            prompt[i, : s.num_prompt_tokens] = s.token_ids[: s.num_prompt_tokens]
            output[i, : len(o)] = o
        f32 = [
            np.asarray(v, dtype=np.float32)
            for v in (
                [p.repetition_penalty for p in ps],
                [p.presence_penalty for p in ps],
                [p.frequency_penalty for p in ps],
            )
        ]
        prompt_t, output_t, rep, pres, freq = to_device([prompt, output, *f32], self.device)
        logits.copy_(
            lz.apply_penalties(
                logits,
                prompt_t,
                output_t,
                repetition_penalty=rep,
                presence_penalty=pres,
                frequency_penalty=freq,
            )
        )

    def _bias(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows, cols, vals = [], [], []
        for i, s in enumerate(seqs):
            for t, b in (s.params.logit_bias or {}).items():
                rows.append(i), cols.append(t), vals.append(b)
            if (
                s.num_output_tokens < s.params.min_tokens
            ):  # no stop before min_tokens: EOS and stop ids banned
                banned = set(s.params.stop_token_ids or ()) | (
                    set() if s.params.ignore_eos else set(self.eos)
                )
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

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = self.device
        ps = [s.params for s in seqs]
        seeds = [-1 if s.seed is None or s.params.greedy else s.seed for s in seqs]
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
            named["offsets"] = np.asarray([s.num_output_tokens for s in seqs], dtype=np.int64)
        kwargs = dict(zip(named, to_device(list(named.values()), dev), strict=True))
        return lz.sample(logits, generator=self.generator, **kwargs)
