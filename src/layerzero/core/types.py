"""Small shared enums of the call description: tensor layout, mask kind, serving phase.

Both :mod:`layerzero.core.specs` (what a kernel supports) and :mod:`layerzero.core.context` (what a call is)
use them; they live here so that neither of those two modules imports the other (``core`` has no import
cycles). ``specs`` re-exports them, so ``from layerzero.core.specs import Layout`` keeps working. Imports
nothing.
"""

from __future__ import annotations

import enum

__all__ = ["Layout", "MaskKind", "Phase"]


class Layout(str, enum.Enum):
    """Attention tensor layouts. BHSD = [batch, heads, seq, head_dim] (SDPA); BSHD = [batch, seq, heads,
    head_dim] (flash-attn)."""

    BHSD = "BHSD"
    BSHD = "BSHD"


class MaskKind(str, enum.Enum):
    """What ``attn_mask`` is: absent, boolean (True = attend) or additive float."""

    NONE = "none"
    BOOL = "bool"
    FLOAT = "float"


class Phase(str, enum.Enum):
    """Serving phase derived from the query length: decode = one query token per sequence."""

    PREFILL = "prefill"
    DECODE = "decode"
