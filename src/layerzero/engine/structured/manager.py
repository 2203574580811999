"""The engine core's structured-output state (docs/decoding.md, "Structured outputs").

- :meth:`StructuredOutputManager.prepare` (``EngineCore.add_request``): picks the backend
  (:func:`~.select.select_backend`) and compiles the constraint against the vocabulary, cached per
  (backend, constraint); a constraint that does not compile is an ``InvalidInputError`` and nothing is queued.
- :meth:`~StructuredOutputManager.add`: one matcher per sequence (``n > 1``: each completion its own).
- :meth:`~StructuredOutputManager.bitmask`: per step, a deferred fill of the structured rows' token bitmask;
  the worker runs it after launching the forward (the host fill overlaps the device's forward), the
  multi-rank step codec before sending the step.
- :meth:`~StructuredOutputManager.accept`: each appended token (``EngineLoop._append``); a token the grammar
  rejects is a bug and raises; True once the grammar terminated (the sequence then ends with ``"stop"``).

Matchers follow the sequences' known tokens only (a pending token, async scheduling, is accepted when it is
read), so a rolled-back step or a preemption by recompute (tokens kept) leaves them valid; a finished or
aborted sequence's matcher is dropped (:meth:`~StructuredOutputManager.free`, or the next step's sweep)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import layerzero as lz

from ..core.sched.output import GrammarBitmask
from ..errors import bad_input
from ..sampling_params import SamplingParams
from ..structured_params import StructuredOutputsParams
from .pinned import BitmaskBuffers, HostBitmask
from .select import Selection, check_request, select_backend

__all__ = ["COMPILED_CACHE", "GrammarRejectedError", "StructuredOutputManager"]

log = logging.getLogger("layerzero.engine")

COMPILED_CACHE = 512
"""Compiled grammars the engine core keeps (one per distinct constraint and backend)."""


class GrammarRejectedError(RuntimeError):
    """A sampled token the sequence's grammar does not allow (the bitmask should have banned it: a bug)."""


class StructuredOutputManager:
    """Grammar state for one engine core: the tokenizer at ``tokenizer_path`` (loaded on the first structured
    request, with transformers), ``vocab_size`` (the model's; the bitmask covers ``max(model, tokenizer)``
    ids, those past the tokenizer always banned), ``eos_ids`` (the grammar's stop tokens) and
    ``max_compiled`` (compiled grammars kept, least recently used dropped first)."""

    def __init__(
        self,
        tokenizer_path: str | Path,
        vocab_size: int,
        eos_ids: set[int],
        max_compiled: int = COMPILED_CACHE,
    ) -> None:
        self.tokenizer_path, self.vocab_size, self.eos_ids = tokenizer_path, vocab_size, eos_ids
        self.max_compiled = max_compiled
        self._tokenizer: Any = None
        self._backends: dict[str, Any] = {}
        # (backend, constraint) -> compiled grammar, least recently used dropped past max_compiled (a live
        # matcher keeps its own reference)
        self._compiled: OrderedDict[tuple[str, StructuredOutputsParams], Any] = OrderedDict()
        self._matchers: dict[int, tuple[Any, Any]] = {}  # seq_id -> (sequence, matcher)
        #: (kind, backend) -> (requests, reason of the last selection): which backend took what, and why.
        self.selections: dict[tuple[str, str], tuple[int, str]] = {}
        self._buffers = BitmaskBuffers()  # the fills' host buffers, by step parity

    @property
    def active(self) -> int:
        """Matchers held (live structured sequences, until swept)."""
        return len(self._matchers)

    @property
    def fill_threads(self) -> dict[int, int]:
        """xgrammar's measured fill choices so far: rows (a power of two) -> threads (see ``FillThreads``)."""
        b = self._backends.get("xgrammar")
        return {} if b is None else b.threads.choices()

    # ------------------------------------------------------------------------------------------ compile
    def _backend(self, name: str) -> Any:
        b = self._backends.get(name)
        if b is not None:
            return b
        if self._tokenizer is None:
            from ..loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_path)
            if self._tokenizer is None:
                raise bad_input(
                    "structured_outputs",
                    "a checkpoint with a tokenizer (grammars are compiled against its vocabulary)",
                    f"no tokenizer files in {self.tokenizer_path}",
                )
        vocab = max(self.vocab_size, len(self._tokenizer))
        stops = sorted(t for t in self.eos_ids if 0 <= t < vocab)
        from .backends import GuidanceBackend, XgrammarBackend

        kind = XgrammarBackend if name == "xgrammar" else GuidanceBackend
        b = self._backends[name] = kind(self._tokenizer, vocab, stops)
        self.width = (vocab + 31) // 32
        return b

    def prepare(self, params: SamplingParams) -> Selection | None:
        """Select and compile ``params.structured_outputs`` (cached); None for an unconstrained request.

        Raises:
            InvalidInputError: no backend compiles it (:func:`select_backend`), it does not compile against
                this vocabulary, ``min_tokens`` with a constraint (the grammar may allow only EOS while
                ``min_tokens`` bans it), a checkpoint without a tokenizer.
        """
        sel = check_request(params)
        if sel is None:
            return None
        so = params.structured_outputs
        key = (sel.backend, so)
        if key not in self._compiled:
            try:
                t0 = time.perf_counter()
                self._compiled[key] = self._backend(sel.backend).compile(so)
                log.info(
                    "structured outputs: %s constraint compiled by %s in %.1f ms (%s)",
                    so.kind,
                    sel.backend,
                    1e3 * (time.perf_counter() - t0),
                    sel.reason,
                )
            except Exception as exc:  # the backends' own error types
                if isinstance(exc, lz.InvalidInputError):
                    raise
                raise bad_input(
                    f"structured_outputs.{so.kind}",
                    f"a constraint {sel.backend} can compile against the model's vocabulary",
                    f"{type(exc).__name__}: {str(exc)[:300]}",
                ) from exc
        self._compiled.move_to_end(key)
        while len(self._compiled) > self.max_compiled:
            self._compiled.popitem(last=False)
        n, _ = self.selections.get((so.kind, sel.backend), (0, ""))
        self.selections[(so.kind, sel.backend)] = (n + 1, sel.reason)
        return sel

    # ------------------------------------------------------------------------------------------ matchers
    def add(self, seq: Any) -> None:
        """A fresh matcher for ``seq`` (its params :meth:`prepare` d before)."""
        so = seq.params.structured_outputs
        sel = select_backend(so)
        self._matchers[seq.seq_id] = (
            seq,
            self._backends[sel.backend].matcher(self._compiled[sel.backend, so]),
        )

    def free(self, seq: Any) -> None:
        """Drop ``seq``'s matcher (finished or aborted)."""
        self._matchers.pop(seq.seq_id, None)

    def clear(self) -> None:
        """Drop every matcher (shutdown)."""
        self._matchers.clear()

    def accept(self, seq: Any, token: int) -> bool:
        """Advance ``seq``'s matcher by ``token``; whether the grammar has terminated (a stop token ended it).

        Raises:
            GrammarRejectedError: the grammar does not allow ``token`` (the bitmask should have banned it,
                unless the grammar allows no token at all).
        """
        _, m = self._matchers[seq.seq_id]
        if not m.accept(token):
            raise GrammarRejectedError(
                f"structured outputs: token {token} sampled at output position {seq.num_output_tokens - 1} "
                f"is not allowed by the {m.backend} grammar of request {seq.request_id!r}: the grammar "
                "allows no token there (an empty language), or the token bitmask failed to ban it (a bug)"
            )
        return m.is_terminated()

    def bitmask(self, sampled: list[Any], before: Callable[[], None] | None = None) -> _DeferredFill | None:
        """The deferred fill of the structured rows among a step's ``sampled`` sequences (row i = sequence
        i), or None when there are none. ``before``: called first when the fill runs (async scheduling reads
        the previous step there, so the matchers have its tokens). Sweeps matchers of sequences that
        ended."""
        if not self._matchers:
            return None
        for sid in [k for k, (s, _) in self._matchers.items() if s.finished]:
            del self._matchers[sid]
        rows, entries = [], []
        for i, seq in enumerate(sampled):
            e = self._matchers.get(seq.seq_id)
            if e is not None:
                rows.append(i)
                entries.append(e)
        if not rows:
            return None
        return _DeferredFill(self._backends, rows, entries, self.width, before, self._buffers.next())


class _DeferredFill:
    """Fills a step's :class:`GrammarBitmask` when called (once; later calls return the same result): runs
    ``before``, then each backend fills its rows straight into ``host`` (the step's parity buffer, pinned:
    the worker copies it to the device in one transfer). A sequence that ended meanwhile (``before`` read a
    step that finished it: its token in this step is dropped) gets an all-allowed row, and so does a grammar
    that allows no token (its sampled token is rejected: the request fails with ``"error"``, not the batch).
    Rows whose grammar allows every token this step are then dropped (moved out of the bitmask), so only rows
    that ban something reach the device; none left: an empty bitmask (the sampler skips the op)."""

    def __init__(
        self,
        backends: dict[str, Any],
        rows: list[int],
        entries: list[tuple[Any, Any]],
        width: int,
        before: Callable[[], None] | None,
        host: HostBitmask,
    ) -> None:
        self.backends, self.rows, self.entries, self.width, self.before = (
            backends,
            rows,
            entries,
            width,
            before,
        )
        self.host = host
        self.result: GrammarBitmask | None = None

    def __call__(self) -> GrammarBitmask:
        if self.result is not None:
            return self.result
        if self.before is not None:
            self.before()
        indices, bits = self.host.claim(len(self.rows), self.width)
        for name, b in self.backends.items():
            idx = [j for j, (s, m) in enumerate(self.entries) if m.backend == name and not s.finished]
            if idx:
                b.fill([self.entries[j][1] for j in idx], bits, idx)
        # a grammar that allows no token at all (an empty language, a dead end); or.reduce: half any()'s time
        dead = np.bitwise_or.reduce(bits, axis=1) == 0
        for j, (s, _) in enumerate(self.entries):
            if s.finished:
                bits[j] = -1
            elif dead[j]:  # unmasked: its token is then rejected, failing its request alone and loudly
                log.error("structured outputs: the grammar of request %r allows no next token", s.request_id)
                bits[j] = -1
        rows = np.asarray(self.rows, dtype=np.int64)
        keep = np.bitwise_and.reduce(bits, axis=1) != -1  # some token banned: the row needs the mask
        n = int(keep.sum())
        if n < len(rows):  # move the kept rows to the front (in order; a row never moves back)
            where = np.flatnonzero(keep)
            bits[:n] = bits[where]
            rows = rows[where]
        indices[:n] = rows
        self.host.set_rows(n)
        self.result = GrammarBitmask(rows, bits[:n], host=(self.host, self.host.generation))
        return self.result
