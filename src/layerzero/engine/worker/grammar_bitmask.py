"""Structured outputs on the device: a step's packed grammar bitmask applied to its float32 logits (every
token the row's grammar does not allow gets -inf) by ``lz.apply_token_bitmask`` (a fused Triton kernel on
CUDA: no ``[R, 32 W]`` bool tensor, no gather/scatter of logits rows; xgrammar's and llguidance's bit layout).

The in-process engine's fill writes the indices and the bitmask straight into a pinned host buffer
(``structured/pinned.py``, two by step parity), copied here in one non-blocking transfer; a bitmask that came
as plain arrays (the multi-rank step codec, a verification step's row subset, tests) goes through the worker's
staging (``staging.to_device``: one pinned copy, one transfer)."""

from __future__ import annotations

import numpy as np
import torch

import layerzero as lz

from ..core.sched.output import GrammarBitmask, SamplingMetadata, resolve_bitmask
from .staging import to_device

__all__ = ["apply_grammar_bitmask", "bitmask_warmup_plan", "warm_bitmask"]


def _device_arrays(b: GrammarBitmask, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [R], bits [R, W])`` of ``b`` on ``device``: from its host buffer when it has one (one copy),
    else staged from its arrays."""
    if b.host is not None:  # (HostBitmask, the claim it was filled in)
        buffer, generation = b.host
        return buffer.to_device(device, generation)
    rows = np.asarray(b.rows, dtype=np.int32)  # int32 indices on every path (the warm-up's key)
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(rows)), torch.from_numpy(np.ascontiguousarray(b.bits))
    idx, bits = to_device([rows, np.asarray(b.bits, dtype=np.int32)], device)
    return idx, bits


def apply_grammar_bitmask(logits: torch.Tensor, rows: SamplingMetadata) -> None:
    """Set the logits of the tokens each structured row's grammar bans to -inf, in place (``logits``
    ``[S, V]`` float32, row i as ``rows`` row i). ``rows.grammar_bitmask`` may be a deferred host fill: it is
    run here, after the step's forward was launched. A no-op without structured rows, or when every structured
    row's grammar allows every token this step (the fill drops such rows)."""
    b: GrammarBitmask | None = resolve_bitmask(rows.grammar_bitmask)
    if b is None or len(b.rows) == 0:
        return
    idx, bits = _device_arrays(b, logits.device)
    n = len(b.rows)
    every_row = n == logits.shape[0] and bool((b.rows == np.arange(n)).all())
    lz.apply_token_bitmask(logits, bits, None if every_row else idx)


def bitmask_warmup_plan(row_counts: list[int]) -> list[tuple[int, bool]]:
    """The start-up warm-up's bitmask applications (``worker/warmup.py``): ``(rows, subset)`` for each row
    count, on all of a step's rows (``indices=None``) and on a subset of them (``indices`` given)."""
    return [(n, sub) for n in row_counts for sub in (False, True)]


def warm_bitmask(rows: int, subset: bool, vocab: int, device: torch.device) -> None:
    """One ``lz.apply_token_bitmask`` on zero float32 logits with every token allowed (nothing changes), with
    int32 indices when ``subset``, as :func:`apply_grammar_bitmask` passes them."""
    logits = torch.zeros(rows + subset, vocab, dtype=torch.float32, device=device)
    bits = torch.full((rows, -(-vocab // 32)), -1, dtype=torch.int32, device=device)
    idx = torch.arange(rows, dtype=torch.int32, device=device) if subset else None
    lz.apply_token_bitmask(logits, bits, idx)
