"""The reference backend's kernels, one import point: the float32/float64 oracle of every op.

The implementations live in one module per op family (``attention.py``, ``norms.py``, ``rope.py``,
``sampling.py``, ``penalties.py``, ``token_bitmask.py``, ``swiglu.py``, ``moe.py``); this module re-exports
them so registration code can use ``from layerzero.backends.reference.kernels import attention, rms_norm,
...``. Each is plain PyTorch written for clarity, computes in float32 (float64 when the input is float64) and
returns the input dtype; input validation is the ops layer's job.
"""

from __future__ import annotations

from layerzero.backends.reference.attention import attention
from layerzero.backends.reference.moe import fused_moe
from layerzero.backends.reference.norms import layer_norm, rms_norm
from layerzero.backends.reference.penalties import apply_penalties
from layerzero.backends.reference.rope import qk_norm_rope, rope, rotate_every_two, rotate_half
from layerzero.backends.reference.sampling import sample, sample_greedy, sample_topk, sample_topp
from layerzero.backends.reference.swiglu import geglu, reglu, swiglu
from layerzero.backends.reference.token_bitmask import apply_token_bitmask

__all__ = [
    "apply_penalties",
    "apply_token_bitmask",
    "attention",
    "fused_moe",
    "layer_norm",
    "qk_norm_rope",
    "rms_norm",
    "rope",
    "rotate_every_two",
    "rotate_half",
    "sample",
    "sample_greedy",
    "sample_topk",
    "sample_topp",
    "swiglu",
    "geglu",
    "reglu",
]
