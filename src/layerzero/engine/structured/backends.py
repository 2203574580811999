"""The grammar backends behind one matcher interface, compiled against the tokenizer's vocabulary.

A matcher follows one sequence's output: :meth:`accept` each appended token (False: the grammar rejects it),
fill row ``i`` of a packed token bitmask (int32 ``[R, W]``, ``W = ceil(V / 32)``; bit ``j`` of word ``w``
allows token ``32 w + j``: xgrammar's and llguidance's common layout), :meth:`is_terminated` once a stop token
(EOS) ended the grammar. Token ids past the tokenizer's vocabulary (a model vocabulary padded wider) are never
allowed. Stop tokens are the engine's EOS ids: the grammar allows them exactly where its output may end."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Protocol

import numpy as np

from ..structured_params import StructuredOutputsParams
from .select import guidance_grammar, xgrammar_grammar

__all__ = ["FillThreads", "GuidanceBackend", "Matcher", "XgrammarBackend"]

log = logging.getLogger("layerzero.engine")


class Matcher(Protocol):
    """One sequence's grammar state (see the module docstring)."""

    backend: str

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it (the state is then undefined)."""
        ...

    def is_terminated(self) -> bool:
        """Whether the grammar has ended (a stop token accepted, or, llguidance, nothing can follow)."""
        ...


class XgrammarBackend:
    """xgrammar (Dong et al. 2024, "XGrammar"): ``TokenizerInfo`` of ``tokenizer`` padded to ``vocab_size``
    ids with ``stop_ids`` as its stop tokens, one ``GrammarCompiler``, and a ``BatchGrammarMatcher`` that
    fills many rows at once on its own threads (``threads``, at most the machine's cores)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], threads: int = 8) -> None:
        import xgrammar as xgr

        threads = max(1, min(threads, os.cpu_count() or 1))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        # a step's fill on one thread or on ``threads``, measured per row count (FillThreads): xgrammar's
        # threads cost more than they save when each row's mask is cheap (0.14 vs 0.30 ms for 64 JSON rows)
        self.batches = [xgr.BatchGrammarMatcher(max_threads=1)]
        if threads > 1:
            self.batches.append(xgr.BatchGrammarMatcher(max_threads=threads))
        self.threads = FillThreads(threads)

    def compile(self, so: StructuredOutputsParams) -> Any:
        """``so``'s ``CompiledGrammar`` (raises xgrammar's error when it cannot)."""
        return self.compiler.compile_grammar(xgrammar_grammar(so))

    def matcher(self, compiled: Any) -> _XgrammarMatcher:
        """A fresh matcher at the grammar's start."""
        return _XgrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bits: np.ndarray, rows: list[int]) -> None:
        """Fill ``bits[rows[i]]`` with ``matchers[i]``'s allowed next tokens (every word of each row written),
        on one thread or xgrammar's pool, whichever :class:`FillThreads` measured faster for this many
        rows."""
        n = len(matchers)
        v = self.threads.pick(n) if len(self.batches) > 1 else 0
        t0 = time.perf_counter()
        self.batches[v].batch_fill_next_token_bitmask([m.m for m in matchers], bits, rows)
        self.threads.record(n, v, time.perf_counter() - t0)


class FillThreads:
    """Chooses, per row-count bucket (rows rounded up to a power of two), whether a step's batch fill runs on
    one thread (variant 0) or on xgrammar's pool of ``threads`` (variant 1), by measurement: each variant's
    first :attr:`EXPLORE` fills of the bucket are timed (alternating), the one with the lower median is kept
    (the choice and both medians logged), and the bucket is measured again after :attr:`RECHECK` fills (the
    grammars' states change). A pool wakes its threads on every call, which costs more than it saves when
    the rows' masks are cheap (most JSON states: a cached mask) and pays when they are not (long free-form
    strings, large grammars)."""

    EXPLORE = 5
    RECHECK = 4096

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._times: dict[int, tuple[list[float], list[float]]] = {}
        self._chosen: dict[int, tuple[int, int]] = {}  # bucket -> (variant, fills since chosen)

    @staticmethod
    def _bucket(rows: int) -> int:
        return 1 << max(rows - 1, 0).bit_length()

    def pick(self, rows: int) -> int:
        """The variant for a fill of ``rows`` rows (0: one thread, 1: the pool)."""
        b = self._bucket(rows)
        chosen = self._chosen.get(b)
        if chosen is not None:
            return chosen[0]
        one, pool = self._times.setdefault(b, ([], []))
        return 0 if len(one) <= len(pool) else 1

    def record(self, rows: int, variant: int, seconds: float) -> None:
        """The fill of ``rows`` rows on ``variant`` took ``seconds``."""
        b = self._bucket(rows)
        chosen = self._chosen.get(b)
        if chosen is not None:
            n = chosen[1] + 1
            if n >= self.RECHECK:  # measure this bucket again
                del self._chosen[b]
                self._times.pop(b, None)
            else:
                self._chosen[b] = (chosen[0], n)
            return
        times = self._times.setdefault(b, ([], []))
        times[variant].append(seconds)
        one, pool = times
        if len(one) >= self.EXPLORE and len(pool) >= self.EXPLORE:
            m1, mp = sorted(one)[len(one) // 2], sorted(pool)[len(pool) // 2]
            v = int(mp < m1)
            self._chosen[b] = (v, 0)
            log.info(
                "structured outputs: xgrammar fills of up to %d rows run %s (median %.3f ms on one thread, "
                "%.3f ms on %d threads)",
                b,
                "on one thread" if v == 0 else f"on {self.threads} threads",
                1e3 * m1,
                1e3 * mp,
                self.threads,
            )

    def choices(self) -> dict[int, int]:
        """Bucket (rows, a power of two) -> the chosen variant's thread count, for the buckets decided."""
        return {b: (1 if v == 0 else self.threads) for b, (v, _) in self._chosen.items()}


class _XgrammarMatcher:
    backend = "xgrammar"

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.m = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(int(token)))

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())


class GuidanceBackend:
    """llguidance (Microsoft's ``llguidance``: an Earley parser over a lexer, masks computed lazily): its
    ``LLTokenizer`` of ``tokenizer`` with ``vocab_size`` ids and ``stop_ids`` as EOS. A compiled grammar is a
    pristine ``LLMatcher``, deep-copied for each sequence."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_ids)

    def compile(self, so: StructuredOutputsParams) -> Any:
        """A pristine ``LLMatcher`` of ``so``.

        Raises:
            ValueError: llguidance cannot compile it (its error).
        """
        import llguidance as ll

        m = ll.LLMatcher(self.tokenizer, guidance_grammar(so), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> _GuidanceMatcher:
        """A fresh matcher at the grammar's start."""
        return _GuidanceMatcher(compiled.deep_copy())

    def fill(self, matchers: list[Any], bits: np.ndarray, rows: list[int]) -> None:
        """Fill ``bits[rows[i]]`` with ``matchers[i]``'s allowed next tokens (in place, C-contiguous rows)."""
        nbytes = bits.shape[1] * 4
        for m, r in zip(matchers, rows, strict=True):
            m.m.unsafe_compute_mask_ptr(bits[r].ctypes.data, nbytes)
            if m.m.is_error():
                raise RuntimeError(f"llguidance matcher error: {m.m.get_error()}")


class _GuidanceMatcher:
    backend = "guidance"

    def __init__(self, m: Any) -> None:
        self.m = m

    def accept(self, token: int) -> bool:
        return bool(self.m.consume_token(int(token))) and not self.m.is_error()

    def is_terminated(self) -> bool:
        return bool(self.m.is_stopped())
