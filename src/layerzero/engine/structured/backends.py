"""The grammar backends behind one matcher interface, compiled against the tokenizer's vocabulary.

A matcher follows one sequence's output: :meth:`accept` each appended token (False: the grammar rejects it),
fill row ``i`` of a packed token bitmask (int32 ``[R, W]``, ``W = ceil(V / 32)``; bit ``j`` of word ``w``
allows token ``32 w + j``: xgrammar's and llguidance's common layout), :meth:`is_terminated` once a stop token
(EOS) ended the grammar. Token ids past the tokenizer's vocabulary (a model vocabulary padded wider) are never
allowed. Stop tokens are the engine's EOS ids: the grammar allows them exactly where its output may end."""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

from ..structured_params import StructuredOutputsParams
from .select import guidance_grammar, xgrammar_grammar

__all__ = ["GuidanceBackend", "Matcher", "XgrammarBackend"]


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
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, so: StructuredOutputsParams) -> Any:
        """``so``'s ``CompiledGrammar`` (raises xgrammar's error when it cannot)."""
        return self.compiler.compile_grammar(xgrammar_grammar(so))

    def matcher(self, compiled: Any) -> _XgrammarMatcher:
        """A fresh matcher at the grammar's start."""
        return _XgrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bits: np.ndarray, rows: list[int]) -> None:
        """Fill ``bits[rows[i]]`` with ``matchers[i]``'s allowed next tokens (xgrammar's threads)."""
        self.batch.batch_fill_next_token_bitmask([m.m for m in matchers], bits, rows)


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
