"""Beam search (vLLM's ``LLM.beam_search`` API and output types) with transformers' selection and scoring
rules, so that its hypotheses and scores equal ``generate(num_beams=W, do_sample=False, length_penalty=L)``.

Each step asks the engine for the top-K raw logprobs of every running beam's next token (one request per
beam, its prompt the beam's tokens so far, ``max_tokens=1``). The first step prefills each prompt once; every
later beam request is a copy-on-write fork of its parent beam's KV, kept by the engine core until released
(``EngineCore.add_request(fork_of=..., retain_kv=True)``), so it computes only its one new token
(docs/decoding.md, "Beam search and n")."""

from __future__ import annotations

import itertools
import numbers
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .core.errors import EngineCoreError
from .core.messages import EngineCoreAbort, EngineCoreRequest
from .errors import bad_input
from .sampling_params import MAX_LOGPROBS, SamplingParams

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "llm_beam_search", "run_beam_search"]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` W >= 1 hypotheses kept and returned; ``max_tokens`` >= 1
    new tokens at most; ``ignore_eos``: the tokenizer's EOS does not end a hypothesis; ``temperature``: 0.0
    only (deterministic beam search; beam sampling is refused); ``length_penalty`` L (any finite float): a
    hypothesis's score is its cumulative logprob / (new tokens, EOS included) ** L, transformers' rule;
    ``include_stop_str_in_output``: accepted for vLLM compatibility (the text is decoded from all tokens).

    K = 2 * W candidates are read per beam and step (transformers' ``beams_to_keep`` with one EOS token), so
    W <= 10 (K is a logprobs count, at most 20).

    Raises:
        InvalidInputError: a value of the wrong type or out of range; temperature != 0.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name, lo, hi in (("beam_width", 1, MAX_LOGPROBS // 2), ("max_tokens", 1, None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo or (hi and v > hi):
                rng = f"an int in [{lo}, {hi}]" if hi else f"an int >= {lo}"
                raise bad_input(f"BeamSearchParams.{name}", rng, repr(v))
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, numbers.Real) or not abs(float(lp)) < float("inf"):
            raise bad_input("BeamSearchParams.length_penalty", "a finite float", repr(lp))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or float(t) != 0.0:
            raise bad_input(
                "BeamSearchParams.temperature",
                "0.0 (deterministic beam search)",
                repr(t),
                "Beam sampling is not implemented; use SamplingParams(n=..., temperature=...) to sample.",
            )
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad_input(f"BeamSearchParams.{name}", "a bool", repr(getattr(self, name)))


@dataclass
class BeamSearchSequence:
    """One finished hypothesis (vLLM's ``BeamSearchSequence``): ``tokens`` the prompt's then the generated
    token ids (vLLM's convention: the prompt included), ``logprobs`` per generated token its {token id: raw
    logprob} of the K candidates read, ``cum_logprob`` the sum of the generated tokens' raw logprobs (natural
    log, float64 sum of the engine's float32 values), ``text`` ``tokenizer.decode(tokens)`` (prompt
    included, as vLLM), ``finish_reason`` ``"stop"`` (ended with EOS) or ``"length"``, ``score``
    transformers' ``sequences_scores``: ``cum_logprob / num_generated ** length_penalty`` (EOS counted),
    ``num_prompt_tokens`` where the generated tokens start."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float = 0.0
    num_prompt_tokens: int = 0

    @property
    def output_tokens(self) -> list[int]:
        """The generated token ids (``tokens`` after the prompt)."""
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """vLLM's ``BeamSearchOutput``: one prompt's ``sequences``, best ``score`` first (W of them)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    out: list[int]
    cum: float
    lps: list[dict[int, float]]
    parent: Any = None  # the handle of the beam this one extends (its KV), None for the prompt
    handle: Any = None  # this beam's own request's handle, once its step ran


class _Instance:
    """One prompt's search state, transformers' ``_beam_search`` for one batch item: ``running`` (up to W
    live beams, best cumulative logprob first), ``finished`` (up to W (score, beam) hypotheses), ``done``
    (the early-stop heuristic holds: no running beam can beat the worst finished one, so nothing is added)."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.running = [_Beam([], 0.0, [])]
        self.finished: list[tuple[float, _Beam, bool]] = []
        self.done = False


def run_beam_search(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    eos_token_ids: Sequence[int],
    step: Callable[[list[tuple[list[int], Any]], int], list[tuple[dict[int, float], Any]]],
    decode: Callable[[list[int]], str] | None = None,
    release: Callable[[list[Any]], None] | None = None,
) -> list[BeamSearchOutput]:
    """Beam search over ``prompts`` (token-id lists), transformers' algorithm
    (``GenerationMixin._beam_search``, ``early_stopping=False``, the default) per prompt:

    1. every running beam's next-token logprobs added to its cumulative logprob; the best K = 2W candidates
       over all beams kept (transformers' ``beams_to_keep``);
    2. a candidate *hits a stop* when its token is an EOS (unless ``ignore_eos``) or it reaches
       ``max_tokens``; the best W candidates that do not are the next running beams;
    3. a candidate among the best W (by cumulative logprob) that hits a stop becomes a finished hypothesis
       with score ``cum_logprob / new_tokens ** length_penalty``; the best W finished ones are kept;
    4. when W hypotheses are finished and the best running beam's ``cum_logprob / new_tokens **
       length_penalty`` is not above the worst finished score, the prompt is done (transformers' heuristic
       for ``early_stopping=False``); every prompt stops at ``max_tokens``.

    ``step(reqs, k)``: for each ``(tokens, parent)`` (a live beam's tokens, prompt + generated, and the handle
    ``step`` returned for the beam it extends, None in the first step) its top-``k`` next-token raw logprobs
    ({token id: logprob}) and a handle of its own (e.g. its retained KV), called once per step with every
    live beam of every prompt. ``release(handles)``: handles no later beam extends (None: not told).
    ``decode``: token ids to text (None: no text). Returns one :class:`BeamSearchOutput` per prompt, best
    score first.
    """
    w = params.beam_width
    eos = frozenset(() if params.ignore_eos else eos_token_ids)
    k = max(2, 1 + len(eos)) * w
    if k > MAX_LOGPROBS:
        raise bad_input(
            "BeamSearchParams.beam_width", f"<= {MAX_LOGPROBS // (k // w)} with {len(eos)} EOS tokens", w
        )
    lp_pow = params.length_penalty
    insts = [_Instance(list(p)) for p in prompts]
    for g in range(params.max_tokens):
        live = [(inst, b) for inst in insts if not inst.done for b in inst.running]
        if not live:
            break
        res = step([(inst.prompt + b.out, b.parent) for inst, b in live], k)
        per: dict[int, list[tuple[float, int, _Beam, int, dict[int, float]]]] = {}
        for j, ((inst, b), (top, handle)) in enumerate(zip(live, res, strict=True)):
            b.handle = handle
            for t, lp in top.items():
                per.setdefault(id(inst), []).append((b.cum + lp, j, b, t, top))
        last = g + 1 == params.max_tokens
        for inst in insts:
            if inst.done:
                continue
            # transformers: torch.topk over [W * V], the best K by cumulative logprob (exact ties, whose order
            # torch.topk leaves unspecified, go to the lower beam, then the lower token id)
            cands = sorted(per.get(id(inst), []), key=lambda c: (-c[0], c[1], c[3]))[:k]
            new_running, new_finished = [], []
            for rank, (cum, _, b, t, top) in enumerate(cands):
                beam = _Beam([*b.out, t], cum, [*b.lps, top], b.handle)
                hit = t in eos or last
                if not hit:
                    if len(new_running) < w:
                        new_running.append(beam)
                elif rank < w:
                    new_finished.append((cum / (g + 1) ** lp_pow, beam, t in eos))
            merged = sorted(inst.finished + new_finished, key=lambda f: -f[0])
            inst.finished, inst.running = merged[:w], new_running
            if len(inst.finished) == w and inst.running and not last:
                best = inst.running[0].cum / (g + 1) ** lp_pow
                inst.done = not best > inst.finished[-1][0]
            if not inst.running:
                inst.done = True
        if release is not None:  # the step's parents, and its beams no running beam extends
            keep = {nb.parent for inst in insts if not inst.done for nb in inst.running}
            gone = {b.parent for _, b in live} | {b.handle for _, b in live}
            release([h for h in gone if h is not None and h not in keep])
    outs = []
    for inst in insts:
        seqs = []
        for score, beam, stopped in inst.finished:
            tokens = inst.prompt + beam.out
            seqs.append(
                BeamSearchSequence(
                    tokens=tokens,
                    logprobs=beam.lps,
                    cum_logprob=beam.cum,
                    text=decode(tokens) if decode is not None else None,
                    finish_reason="stop" if stopped else "length",
                    stop_reason=beam.out[-1] if stopped else None,
                    score=score,
                    num_prompt_tokens=len(inst.prompt),
                )
            )
        outs.append(BeamSearchOutput(seqs))
    return outs


def llm_beam_search(llm: Any, prompts: Sequence[Any], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """:meth:`layerzero.engine.LLM.beam_search`: validate every prompt (strings tokenized; vLLM's
    ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` dicts accepted) and run :func:`run_beam_search`, each
    step one batch of engine-core requests over every live beam (a one-token greedy request with
    ``logprobs=K``, after the first step a copy-on-write fork of its parent beam's KV: :class:`_CoreSteps`).
    EOS ids: the model's and the tokenizer's (what ends a ``generate()`` completion). Every KV block the
    search retained is released when it returns or raises.

    Raises:
        InvalidInputError: ``params`` not a :class:`BeamSearchParams`, no prompts, a bad prompt, a prompt
            longer than ``max_model_len - max_tokens``.
        EngineCoreError: a beam's request failed inside an engine step.
    """
    if not isinstance(params, BeamSearchParams):
        raise bad_input("params", "a BeamSearchParams", type(params).__name__)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise bad_input("prompts", "a non-empty list of prompts", repr(prompts)[:80])
    inputs = llm.input_processor
    ids = []
    for p in prompts:
        if isinstance(p, dict):
            p = p["prompt_token_ids"] if "prompt_token_ids" in p else p.get("prompt")  # noqa: PLW2901
        toks = inputs.encode(p)[1]
        if len(toks) + params.max_tokens > inputs.max_model_len:
            raise bad_input(
                "prompt length + BeamSearchParams.max_tokens",
                f"<= max_model_len ({inputs.max_model_len})",
                len(toks) + params.max_tokens,
                "Shorten the prompt or lower max_tokens.",
            )
        ids.append(toks)
    core = llm.engine
    eos = sorted(t for t in {*core.eos, inputs.eos_token_id} if t is not None and 0 <= t < core.vocab_size)
    steps = _CoreSteps(llm)
    tok = llm.tokenizer
    try:
        return run_beam_search(
            ids, params, eos, steps.step, tok.decode if tok is not None else None, steps.release
        )
    finally:
        steps.close()


class _CoreSteps:
    """Runs beam-search steps on ``llm``'s engine core: each beam one greedy one-token request with ``logprobs
    = k``, added with ``retain_kv`` (its KV kept for its children) and, after the first step, ``fork_of`` its
    parent beam's request (that request's tokens, all computed, shared copy-on-write). Handles are
    ``(request id, tokens)``. Other callers' requests stepped meanwhile get their outputs as ``LLM._step``
    hands them out."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.core = llm, llm.engine
        self.eos = llm.input_processor.eos_token_id
        self.prefix = f"beam-{uuid.uuid4().hex[:12]}-"
        self.ids = itertools.count()
        self.live: set[str] = set()  # added, not finished
        self.retained: set[str] = set()  # added, not released

    def step(self, reqs: list[tuple[list[int], Any]], k: int) -> list[tuple[dict[int, float], Any]]:
        """Add every beam's request and step the core until each has its token's top-``k`` logprobs.

        Raises:
            EngineCoreError: a beam's request failed inside a step (its ``error``)."""
        sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True)
        rids = []
        with self.llm._lock:
            for toks, parent in reqs:
                rid = f"{self.prefix}{next(self.ids)}"
                req = EngineCoreRequest(rid, list(toks), sp, 0, time.time(), self.eos)
                self.core.add_request(req, fork_of=parent, retain_kv=True)
                self.live.add(rid)
                self.retained.add(rid)
                rids.append(rid)
        tops: dict[str, dict[int, float]] = {}
        while self.live:
            for o in self._step():
                if o.error is not None or o.finish_reason in ("error", "abort"):
                    raise EngineCoreError(f"beam search: beam request {o.request_id} failed: {o.error}")
                if o.new_logprobs:
                    tops[o.request_id] = o.new_logprobs[0]
                if o.finish_reason is not None:
                    self.live.discard(o.request_id)
        return [(tops[rid], (rid, len(toks))) for rid, (toks, _) in zip(rids, reqs, strict=True)]

    def _step(self) -> list[Any]:
        """One core step (``LLM._step``: other callers' outputs go to their boxes); this search's outputs."""
        return [o for o in self.llm._step() if o.request_id in self.live]

    def release(self, handles: list[Any]) -> None:
        """Release the retained KV of ``handles`` (no later beam forks from them)."""
        for rid, _ in handles:
            if rid in self.retained:
                self.retained.discard(rid)
                self.core.release_kv(rid)

    def close(self) -> None:
        """Abort the unfinished requests and release every retained KV (at the end and on any error)."""
        with self.llm._lock:
            if self.live:
                self.core.abort_requests([EngineCoreAbort(rid) for rid in self.live])
                self.live.clear()
            for rid in self.retained:
                self.core.release_kv(rid)
            self.retained.clear()
