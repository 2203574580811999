"""Batch-level logits-processor plugins in vLLM v1's shape (``vllm.v1.sample.logits_processor``):
:class:`LogitsProcessor` (``__init__(config, device, is_pin_memory)``, ``is_argmax_invariant()``,
``update_state(batch_update)``, ``apply(logits)``, ``validate_params(params)``), told each step which rows
were added, removed or moved (:class:`BatchUpdate`) with their :class:`SamplingParams` (``extra_args``
carries per-request arguments), and applied to the step's float32 logits before the draw.

``LLM(logits_processors=[cls or "module:Class" / "module.Class", ...])`` (also ``AsyncLLM`` and the
CLI's ``--logits-processors``); docs/decoding.md, "Token restrictions and logits processors"."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch

from .errors import bad_config
from .sampling_params import SamplingParams

__all__ = [
    "AddedRequest",
    "BatchState",
    "BatchUpdate",
    "ForceTokenLogitsProcessor",
    "LogitsProcessor",
    "MoveDirectionality",
    "build_processors",
    "resolve_processor",
]


class MoveDirectionality(Enum):
    """A moved row: ``UNIDIRECTIONAL`` (row a goes to index b, whatever was at b is gone) or ``SWAP`` (rows a
    and b trade places)."""

    UNIDIRECTIONAL = auto()
    SWAP = auto()


#: (batch index, params, prompt token ids or None, output token ids known when added)
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the batch since the last step (vLLM v1's ``BatchUpdate``), to apply in this order:
    ``added`` (each new row's index, params, prompt ids (None: not sent) and known output ids; an added
    index may reuse a removed row's index, which replaces it), then ``removed`` (indices of rows that left
    and were not replaced), then ``moved`` (``(a, b, MoveDirectionality)``, one after another). Afterwards
    indices ``0..batch_size-1`` are the step's logits rows."""

    batch_size: int
    removed: Sequence[int]
    added: Sequence[AddedRequest]
    moved: Sequence[tuple[int, int, MoveDirectionality]]


class LogitsProcessor(ABC):
    """A batch-level logits processor (vLLM v1's interface). Instantiated once per worker with the engine's
    config (an :class:`~layerzero.engine.config.EngineConfig`), the device and whether host memory is
    pinned; every step :meth:`update_state` then :meth:`apply` on the ``[S, V]`` float32 logits, row i being
    batch index i."""

    @abstractmethod
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """Build the processor for one worker: ``config`` the :class:`EngineConfig`, ``device`` the worker's
        device, ``is_pin_memory`` whether pinned host memory is available (CUDA)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when :meth:`apply` never changes a row's argmax (greedy rows then skip it and stay on the
        greedy fast path); False makes every step with this processor go through the full sampler."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Track the batch: ``batch_update`` is None when no row was added, removed or moved."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits ``[S, V]`` float32 (may modify ``logits`` in place and return it)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request whose parameters (``extra_args``) this processor rejects; the
        front end turns it into an InvalidInputError before the request is queued. Default: accept all."""
        return


def resolve_processor(spec: Any) -> type[LogitsProcessor]:
    """A processor class from a class or its name (``"module:Class"`` or ``"module.Class"``).

    Raises:
        ConfigurationError: a name that does not import, or not a :class:`LogitsProcessor` subclass.
    """
    cls = spec
    if isinstance(spec, str):
        mod, sep, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
        if not mod or not name:
            raise bad_config("logits_processors item", '"module:Class" or "module.Class"', repr(spec))
        try:
            cls = importlib.import_module(mod)
            for part in name.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError) as exc:
            raise bad_config(
                "logits_processors item", "an importable class", f"{spec!r} ({type(exc).__name__}: {exc})"
            ) from None
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise bad_config(
            "logits_processors item",
            "a subclass of layerzero.engine.logits_processors.LogitsProcessor (or its name)",
            repr(spec),
        )
    return cls


def build_processors(config: Any, device: torch.device) -> list[LogitsProcessor]:
    """Instantiate ``config.logits_processors`` for one worker.

    Raises:
        ConfigurationError: a bad class (:func:`resolve_processor`) or a constructor that raised.
    """
    out = []
    for spec in getattr(config, "logits_processors", ()) or ():
        cls = resolve_processor(spec)
        try:
            out.append(cls(config, device, device.type == "cuda"))
        except Exception as exc:
            raise bad_config(
                "logits_processors item",
                f"a class {cls.__name__}(config, device, is_pin_memory) builds",
                f"{type(exc).__name__}: {exc}",
            ) from exc
    return out


class BatchState:
    """The worker's view of the batch for ``processors``: the rows (sequence ids) of the last step, turned
    into a :class:`BatchUpdate` for each new step. The step's sampled rows are the batch (a completion in a
    step that does not sample it is removed and added again later, with its params and its then-known output
    tokens)."""

    def __init__(self, processors: list[LogitsProcessor]) -> None:
        self.processors = processors
        self.argmax_invariant = all(p.is_argmax_invariant() for p in processors)
        self.slots: list[int | None] = []  # batch index -> sequence id (None: a hole)
        self.batch_size = 0

    def update(self, keys: list[int], rows: Any) -> None:
        """Announce the step whose sampled rows are ``keys`` (sequence ids, logits row order) with their
        :class:`~layerzero.engine.core.sched.output.SamplingMetadata` ``rows``."""
        new = {k: i for i, k in enumerate(keys)}
        slots = list(self.slots)
        pos = {k: i for i, k in enumerate(slots) if k is not None}
        gone = [i for i, k in enumerate(slots) if k is not None and k not in new]
        free = list(gone)
        added = []
        for k, i in new.items():
            if k in pos:
                continue
            at = free.pop(0) if free else len(slots)
            if at == len(slots):
                slots.append(None)
            slots[at], pos[k] = k, at
            outs = rows.output_token_ids[i]
            added.append((at, rows.params[i], rows.prompt_token_ids[i], list(outs or ())))
        for at in free:  # removed, not reused
            slots[at] = None
        moved = []
        for j, k in enumerate(keys):  # swaps into place, one after another
            p = pos[k]
            if p != j:
                while len(slots) <= j:
                    slots.append(None)
                other = slots[j]
                slots[j], slots[p] = k, other
                pos[k] = j
                if other is not None:
                    pos[other] = p
                moved.append((p, j, MoveDirectionality.SWAP))
        self.slots = slots[: len(keys)]
        changed = added or free or moved or len(keys) != self.batch_size
        self.batch_size = len(keys)
        bu = BatchUpdate(len(keys), free, added, moved) if changed else None
        for proc in self.processors:
            proc.update_state(bu)

    def apply(self, logits: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        """Every processor on ``logits`` ``[S, V]`` float32 in order (argmax-invariant ones skipped when
        every row is greedy: they cannot change the draw).

        Raises:
            ValueError: ``logits`` rows differ from the announced batch size, or a processor returned
                another shape.
        """
        if logits.shape[0] != self.batch_size:
            raise ValueError(f"logits processors: {logits.shape[0]} rows, the batch has {self.batch_size}")
        for proc in self.processors:
            if all_greedy and proc.is_argmax_invariant():
                continue
            out = proc.apply(logits)
            if out.shape != logits.shape:
                raise ValueError(
                    f"{type(proc).__name__}.apply: expected logits {tuple(logits.shape)}, got "
                    f"{tuple(out.shape)}"
                )
            logits = out
        return logits


class ForceTokenLogitsProcessor(LogitsProcessor):
    """Example plugin: a request with ``extra_args={"force_token_id": t}`` gets token t at every step (every
    other logit -inf); other rows are untouched. Not argmax-invariant (it changes greedy rows)."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """No state but the forced rows: batch index -> token id."""
        self.device = device
        self.forced: dict[int, int] = {}  # batch index -> token id

    def is_argmax_invariant(self) -> bool:
        """False: forcing a token changes greedy rows."""
        return False

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """``extra_args["force_token_id"]``, when present, is an int >= 0 (the vocabulary bound is not
        known here: an id past it makes :meth:`apply` raise, which fails the step's requests)."""
        t = (sampling_params.extra_args or {}).get("force_token_id")
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
            raise ValueError(f"extra_args force_token_id: expected a token id (int >= 0), got {t!r}")

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Track the forced rows through the update (added, removed, then moved)."""
        if batch_update is None:
            return
        for index, params, _, _ in batch_update.added:
            t = (params.extra_args or {}).get("force_token_id")
            if t is None:
                self.forced.pop(index, None)
            else:
                self.forced[index] = int(t)
        for index in batch_update.removed:
            self.forced.pop(index, None)
        for a, b, how in batch_update.moved:
            ta, tb = self.forced.pop(a, None), self.forced.pop(b, None)
            if ta is not None:
                self.forced[b] = ta
            if how is MoveDirectionality.SWAP and tb is not None:
                self.forced[a] = tb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Every logit of a forced row but its token's -inf, in place (two small index tensors staged)."""
        if not self.forced:
            return logits
        rows = [i for i in self.forced if i < logits.shape[0]]
        idx = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        tok = torch.tensor([self.forced[i] for i in rows], dtype=torch.long).to(
            logits.device, non_blocking=True
        )
        kept = logits[idx, tok]
        logits[idx] = float("-inf")
        logits[idx, tok] = kept
        return logits
