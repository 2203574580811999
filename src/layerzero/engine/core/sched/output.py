"""``SchedulerOutput``: one step as plain data (ids, counts, token ids, block tables, sampling parameters),
what the executor hands to its workers; the live :class:`~layerzero.engine.core.sequence.Sequence` objects
stay in the scheduler (vLLM V1's ``SchedulerOutput``). Lists of ints and strings, :class:`SamplingParams` (a
frozen dataclass of plain values) and one int32 numpy matrix (the block tables: raw bytes plus a shape in
msgpack; :meth:`SchedulerOutput.to_dict` gives nested lists), so a step can go to another process
unchanged."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...sampling_params import SamplingParams

__all__ = ["GrammarBitmask", "PromptLogprobsRows", "SamplingMetadata", "SchedulerOutput"]


@dataclass
class GrammarBitmask:
    """The tokens each structured-output row of a step may take (docs/decoding.md, "Structured outputs"):
    ``rows`` ``[R]`` int64 (indices into the step's sampled rows), ``bits`` ``[R, W]`` int32,
    ``W = ceil(V / 32)``: bit ``j`` of word ``w`` set = token ``32 w + j`` allowed (xgrammar's / llguidance's
    layout); ids from ``32 W`` on are banned. ``host``: ``(buffer, claim)``, the in-process engine's host
    buffer holding ``rows`` and ``bits`` and the claim they were filled in (``structured/pinned.py``: the
    worker copies it in one transfer), None otherwise; not serialized."""

    rows: np.ndarray
    bits: np.ndarray
    host: Any = field(default=None, repr=False, compare=False)


def resolve_bitmask(b: GrammarBitmask | Callable[[], GrammarBitmask] | None) -> GrammarBitmask | None:
    """``SamplingMetadata.grammar_bitmask`` as data: a deferred fill (a callable) is run now."""
    return b() if callable(b) else b


@dataclass
class SamplingMetadata:
    """What the sampler needs of each sampled row (the step's sampled chunks, in order): its parameters, its
    own random stream (``seeds``: None = the engine's), the output tokens it has so far (a pending one
    included: the min_tokens ban and the seeded streams' offsets), and, for rows with penalties marked
    ``penalty_reset``, the prompt and the known output tokens (``prompt_token_ids`` / ``output_token_ids``,
    None for other rows); a row with bad words not so marked gets the tail of its known output tokens its
    longest bad word reads (``output_token_ids``; its prompt None). ``grammar_bitmask``: the structured-output
    rows' allowed tokens (:class:`GrammarBitmask`), or a callable that fills it on the host (the engine core
    sets it; the worker calls it after launching the forward, so the fill overlaps the device's work), or None
    (no structured row).

    Penalty state lives on the worker's device (``worker/penalty_state.py``), keyed by ``seq_ids`` (each row's
    sequence id): a penalized row is ``penalty_reset`` (its token ids sent, the state rebuilt from them) on
    its first sampled step and after each preemption, and sends nothing more for penalties afterwards (the
    worker counts each drawn token on the device). ``free_seq_ids``: sequences that finished since the last
    step whose state the worker gives back (preempted ones are ``SchedulerOutput.preempted_seq_ids``). A
    metadata without ``seq_ids`` (built by hand: warm-up, tests) is stateless: penalized rows then carry their
    token ids every step."""

    params: list[SamplingParams] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    prompt_token_ids: list[list[int] | None] = field(default_factory=list)
    output_token_ids: list[list[int] | None] = field(default_factory=list)
    grammar_bitmask: GrammarBitmask | Callable[[], GrammarBitmask] | None = None
    seq_ids: list[int] = field(default_factory=list)
    penalty_reset: list[bool] = field(default_factory=list)
    free_seq_ids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.params)

    def add(self, seq: Any) -> None:
        """Append the row of ``seq`` (a :class:`~layerzero.engine.core.sequence.Sequence` or anything with its
        ``params``, ``seed``, ``token_ids``, ``num_prompt_tokens``, ``num_output_tokens``, ``seq_id`` and
        ``num_preemptions``). A penalized sequence is marked ``penalty_reset`` (with its token ids) when its
        state was not sent since its last preemption (recorded on ``seq``: :func:`penalty_state_sent`)."""
        p = seq.params
        self.params.append(p)
        self.seeds.append(seq.seed)
        self.num_output_tokens.append(seq.num_output_tokens)
        self.seq_ids.append(seq.seq_id)
        reset = p.penalized and getattr(seq, PENALTY_SENT, None) != seq.num_preemptions
        self.penalty_reset.append(reset)
        if reset:
            setattr(seq, PENALTY_SENT, seq.num_preemptions)
            self.prompt_token_ids.append(seq.token_ids[: seq.num_prompt_tokens])
            self.output_token_ids.append(seq.token_ids[seq.num_prompt_tokens :])
        elif p.bad_words_token_ids:  # the known output tail multi-token bad words read (logits_restrict.py)
            k = max(len(w) for w in p.bad_words_token_ids) - 1
            n = len(seq.token_ids) - seq.num_prompt_tokens
            self.prompt_token_ids.append(None)
            self.output_token_ids.append(seq.token_ids[len(seq.token_ids) - min(k, n) :] if k else [])
        else:
            self.prompt_token_ids.append(None)
            self.output_token_ids.append(None)

    @classmethod
    def from_seqs(cls, seqs: Any) -> SamplingMetadata:
        """The rows of ``seqs``, in order (:meth:`add`)."""
        out = cls()
        for s in seqs:
            out.add(s)
        return out


PENALTY_SENT = "penalty_state_sent_at"
"""The attribute :meth:`SamplingMetadata.add` sets on a penalized sequence: its ``num_preemptions`` when its
penalty state was last sent to the workers (a preemption, by recompute or by a failed step's rollback, makes
the next sampled step send it again)."""


def penalty_state_sent(seq: Any) -> bool:
    """Whether the workers were sent penalty state of ``seq`` (by :meth:`SamplingMetadata.add`): a finished
    one is then listed in ``free_seq_ids``."""
    return getattr(seq, PENALTY_SENT, None) is not None


@dataclass
class PromptLogprobsRows:
    """The chunks of a step whose prompt positions need logprobs (``SamplingParams.prompt_logprobs``), in
    chunk order: ``chunks`` (the chunk's index in the step), ``num_rows`` (its first k positions: those that
    predict a prompt token, so the chunk's last position too when the prompt goes on in a later chunk, but not
    the prompt's last position, whose logits are the sampled row), ``top_n`` and ``target_ids`` (the k prompt
    tokens those positions predict: the chunk's next tokens, the last one maybe the next chunk's first).
    Empty in a step no request asks for them (the common case: nothing extra is computed)."""

    chunks: list[int] = field(default_factory=list)
    num_rows: list[int] = field(default_factory=list)
    top_n: list[int] = field(default_factory=list)
    target_ids: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.chunks)

    def add(self, chunk: int, top_n: int, target_ids: list[int]) -> None:
        """Chunk ``chunk``'s first ``len(target_ids)`` positions, predicting ``target_ids``."""
        self.chunks.append(chunk)
        self.num_rows.append(len(target_ids))
        self.top_n.append(top_n)
        self.target_ids.append(target_ids)


@dataclass
class SchedulerOutput:
    """One step's work, per chunk in batch order (B chunks): ``req_ids`` / ``seq_ids`` (request, completion),
    ``num_computed_tokens`` (the chunk's first position), ``num_scheduled_tokens`` (its length),
    ``new_token_ids`` (the ids of its tokens the host knows: all of them, or all but a last token that is
    still pending on the device), ``pending_src`` (that pending token's row in the previous step's sampled
    ids, else None: async scheduling), ``sample`` (whether the step samples the chunk's next token: the chunk
    reaches the end of its known tokens); ``block_tables`` ``[B, W]`` int32 (each chunk's block ids, rows
    padded with 0; None when nothing is scheduled), ``preempted_seq_ids`` (completions preempted by
    recompute this step), ``sampling`` (per sampled row, in chunk order: :class:`SamplingMetadata`) and
    ``prompt_logprobs`` (the chunks' prompt positions whose logprobs the step computes:
    :class:`PromptLogprobsRows`, usually empty); ``spec_token_ids`` (speculative decoding: per chunk the
    drafts it verifies after its last token, ``[]`` for none, -1 for a draft model's that the worker
    proposes; its ``new_token_ids`` then hold the last token and the drafts (0 for -1), and
    ``num_scheduled_tokens`` counts them; empty when speculative decoding is off); ``blocks_to_copy``
    ``[(src, dst)]`` block ids whose KV (every layer, K and V) the workers copy before the step's forward:
    the partial last block of a parent a child was forked from (copy-on-write, beam search:
    :meth:`~layerzero.engine.core.kv.block_manager.KVCacheManager.fork`), usually empty."""

    req_ids: list[str] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    pending_src: list[int | None] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    block_tables: np.ndarray | None = None
    preempted_seq_ids: list[int] = field(default_factory=list)
    sampling: SamplingMetadata = field(default_factory=SamplingMetadata)
    prompt_logprobs: PromptLogprobsRows = field(default_factory=PromptLogprobsRows)
    spec_token_ids: list[list[int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        """Chunks (sequences) in the step."""
        return len(self.seq_ids)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens in the step's forward."""
        return sum(self.num_scheduled_tokens)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON / msgpack data: every field, the block tables as nested lists and the sampling
        parameters as dicts of their init fields (:meth:`from_dict` rebuilds the output)."""
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("sampling", "prompt_logprobs")
        }
        d["block_tables"] = None if self.block_tables is None else self.block_tables.tolist()
        s = self.sampling
        d["sampling"] = {
            "params": [_params_dict(p) for p in s.params],
            "seeds": s.seeds,
            "num_output_tokens": s.num_output_tokens,
            "prompt_token_ids": s.prompt_token_ids,
            "output_token_ids": s.output_token_ids,
            "grammar_bitmask": _bitmask_dict(resolve_bitmask(s.grammar_bitmask)),
            "seq_ids": s.seq_ids,
            "penalty_reset": s.penalty_reset,
            "free_seq_ids": s.free_seq_ids,
        }
        d["prompt_logprobs"] = dataclasses.asdict(self.prompt_logprobs)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SchedulerOutput:
        """The output :meth:`to_dict` described."""
        d = dict(d)
        s = dict(d.pop("sampling"))
        s["params"] = [SamplingParams(**p) for p in s["params"]]
        gb = s.pop("grammar_bitmask", None)
        if gb is not None:
            s["grammar_bitmask"] = GrammarBitmask(
                np.asarray(gb["rows"], dtype=np.int64), np.asarray(gb["bits"], dtype=np.int32)
            )
        tables = d.pop("block_tables")
        plp = d.pop("prompt_logprobs", None) or {}
        d["blocks_to_copy"] = [(int(a), int(b)) for a, b in d.get("blocks_to_copy", ())]
        return cls(
            **d,
            block_tables=None if tables is None else np.asarray(tables, dtype=np.int32),
            sampling=SamplingMetadata(**s),
            prompt_logprobs=PromptLogprobsRows(**plp),
        )


def _bitmask_dict(b: GrammarBitmask | None) -> dict[str, Any] | None:
    return None if b is None else {"rows": b.rows.tolist(), "bits": b.bits.tolist()}


def _params_dict(p: SamplingParams) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(p):
        if f.init:
            v = getattr(p, f.name)
            if f.name == "logit_bias" and v is not None:
                v = {int(k): float(b) for k, b in v.items()}
            elif f.name == "extra_args" and v is not None:
                v = dict(v)
            elif f.name == "structured_outputs" and v is not None:
                v = v.to_dict()
            elif f.name == "bad_words_token_ids" and v is not None:
                v = [list(w) for w in v]
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
    return out
