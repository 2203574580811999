"""Structured outputs on the device: a step's packed grammar bitmask applied to its float32 logits (every
token the row's grammar does not allow gets -inf), vectorized: the int32 words ``[R, W]`` are copied to the
logits' device and unpacked there to a bool mask ``[R, 32 W]`` (no per-token host work; xgrammar's and
llguidance's bit layout)."""

from __future__ import annotations

import torch

from ..core.sched.output import GrammarBitmask, SamplingMetadata, resolve_bitmask
from .staging import to_device

__all__ = ["apply_grammar_bitmask", "unpack_bitmask"]

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``bits`` ``[R, W]`` int32 (bit ``j`` of word ``w`` = token ``32 w + j``) as a bool ``[R, vocab_size]``
    mask, True = allowed; ids from ``32 W`` on are False (banned)."""
    dev = bits.device
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).to(torch.bool).flatten(1)  # arithmetic shift: -1 = all
    n = allowed.shape[1]
    if n >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - n), value=False)


def apply_grammar_bitmask(logits: torch.Tensor, rows: SamplingMetadata) -> None:
    """Set the logits of the tokens each structured row's grammar bans to -inf, in place (``logits``
    ``[S, V]`` float32, row i as ``rows`` row i). ``rows.grammar_bitmask`` may be a deferred host fill: it is
    run here, after the step's forward was launched. A no-op without structured rows."""
    b: GrammarBitmask | None = resolve_bitmask(rows.grammar_bitmask)
    if b is None or len(b.rows) == 0:
        return
    idx, bits = to_device([b.rows, b.bits], logits.device)
    banned = ~unpack_bitmask(bits, logits.shape[1])
    if len(b.rows) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
    else:
        sub = logits.index_select(0, idx).masked_fill_(banned, float("-inf"))
        logits.index_copy_(0, idx, sub)
