"""Reason codes: why a kernel cannot run, or why it was ranked as it was.

A :class:`Reason` is a stable machine-readable :class:`ReasonCode` (its string value never changes once
released) plus a human message. Checks return *all* reasons that apply, never a bare bool, so a report
can show every obstacle at once (the xFormers ``not_supported_reasons`` pattern).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any


class ReasonCategory(str, enum.Enum):
    """The family a reason code belongs to (used to group reports)."""

    HARDWARE = "hardware"
    DTYPE = "dtype"
    SHAPE = "shape"
    LAYOUT = "layout"
    MASK = "mask"
    GQA = "gqa"
    HEAD_DIM = "head_dim"
    STRIDE = "stride"
    CAUSAL = "causal"
    DROPOUT = "dropout"
    DETERMINISM = "determinism"
    CUDA_GRAPH = "cuda_graph"
    POLICY = "policy"
    BACKEND = "backend"
    AUTOGRAD = "autograd"
    MEMORY = "memory"
    DISTRIBUTED = "distributed"


class ReasonCode(str, enum.Enum):
    """Stable reason codes. The value is the wire format (JSON, logs); never rename a released value."""

    # hardware / platform
    DEVICE_TYPE_UNSUPPORTED = "DEVICE_TYPE_UNSUPPORTED"
    SM_TOO_OLD = "SM_TOO_OLD"
    SM_TOO_NEW = "SM_TOO_NEW"
    GPU_GENERATION_UNSUPPORTED = "GPU_GENERATION_UNSUPPORTED"
    CPU_ISA_MISSING = "CPU_ISA_MISSING"
    PLATFORM_UNSUPPORTED = "PLATFORM_UNSUPPORTED"
    # dtype
    DTYPE_UNSUPPORTED = "DTYPE_UNSUPPORTED"
    DTYPE_MISMATCH = "DTYPE_MISMATCH"
    KV_CACHE_DTYPE_UNSUPPORTED = (
        "KV_CACHE_DTYPE_UNSUPPORTED"  # a quantized paged KV cache the kernel cannot read
    )
    # shape
    SHAPE_MISMATCH = "SHAPE_MISMATCH"
    SEQ_LEN_TOO_LONG = "SEQ_LEN_TOO_LONG"
    SEQ_LEN_TOO_SHORT = "SEQ_LEN_TOO_SHORT"
    HIDDEN_SIZE_UNSUPPORTED = "HIDDEN_SIZE_UNSUPPORTED"
    # layout
    LAYOUT_UNSUPPORTED = "LAYOUT_UNSUPPORTED"
    KV_LAYOUT_UNSUPPORTED = "KV_LAYOUT_UNSUPPORTED"
    # mask
    MASK_UNSUPPORTED = "MASK_UNSUPPORTED"
    MASK_WITH_CAUSAL = "MASK_WITH_CAUSAL"
    SLIDING_WINDOW_UNSUPPORTED = (
        "SLIDING_WINDOW_UNSUPPORTED"  # lz.attention(window=...) on a kernel without it
    )
    SOFTCAP_UNSUPPORTED = (
        "SOFTCAP_UNSUPPORTED"  # lz.attention(softcap=...) on a kernel without logit soft-capping
    )
    ALIBI_UNSUPPORTED = "ALIBI_UNSUPPORTED"  # lz.attention(alibi_slopes=...) on a kernel without ALiBi
    ALIBI_REQUIRED = (
        "ALIBI_REQUIRED"  # a kernel that serves only lz.attention(alibi_slopes=...) calls, on another call
    )
    # GQA
    GQA_UNSUPPORTED = "GQA_UNSUPPORTED"
    GQA_RATIO_INVALID = "GQA_RATIO_INVALID"
    # head_dim
    HEAD_DIM_INVALID = "HEAD_DIM_INVALID"
    HEAD_DIM_TOO_LARGE = "HEAD_DIM_TOO_LARGE"
    HEAD_DIM_NOT_ALIGNED = "HEAD_DIM_NOT_ALIGNED"
    HEAD_DIM_MISMATCH = "HEAD_DIM_MISMATCH"
    # stride / alignment
    STRIDE_LAST_DIM_NOT_1 = "STRIDE_LAST_DIM_NOT_1"
    ALIGNMENT_INVALID = "ALIGNMENT_INVALID"
    # causal
    CAUSAL_UNSUPPORTED = "CAUSAL_UNSUPPORTED"
    CAUSAL_SEQ_MISMATCH = "CAUSAL_SEQ_MISMATCH"
    # dropout
    DROPOUT_UNSUPPORTED = "DROPOUT_UNSUPPORTED"
    # determinism
    NON_DETERMINISTIC = "NON_DETERMINISTIC"
    # autograd
    BACKWARD_UNSUPPORTED = "BACKWARD_UNSUPPORTED"
    # CUDA graph
    CUDA_GRAPH_UNSAFE = "CUDA_GRAPH_UNSAFE"
    # policy
    POLICY_DENIED = "POLICY_DENIED"
    POLICY_NOT_ALLOWED = "POLICY_NOT_ALLOWED"
    POLICY_LOCKED_OTHER = "POLICY_LOCKED_OTHER"
    POLICY_DISABLED = "POLICY_DISABLED"
    # backend availability / health
    BACKEND_NOT_INSTALLED = "BACKEND_NOT_INSTALLED"
    BACKEND_VERSION_UNSUPPORTED = "BACKEND_VERSION_UNSUPPORTED"
    BACKEND_IMPORT_FAILED = "BACKEND_IMPORT_FAILED"
    BACKEND_UNHEALTHY = "BACKEND_UNHEALTHY"
    TORCH_TOO_OLD = "TORCH_TOO_OLD"
    BACKEND_QUARANTINED = "BACKEND_QUARANTINED"
    # device memory
    WORKSPACE_TOO_LARGE = "WORKSPACE_TOO_LARGE"
    # collectives (process group, transport)
    COMM_BACKEND_UNSUPPORTED = "COMM_BACKEND_UNSUPPORTED"  # e.g. NCCL-only kernel on a Gloo group
    WORLD_SIZE_UNSUPPORTED = "WORLD_SIZE_UNSUPPORTED"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    REDUCE_OP_UNSUPPORTED = "REDUCE_OP_UNSUPPORTED"
    P2P_UNAVAILABLE = "P2P_UNAVAILABLE"  # no NVLink / CUDA peer access between the group's GPUs
    SYMM_MEM_UNAVAILABLE = "SYMM_MEM_UNAVAILABLE"  # no symmetric buffer for the group, or no symm_mem ops
    MULTICAST_ENABLED = "MULTICAST_ENABLED"  # NVLink multicast not switched off (TORCH_SYMM_MEM_DISABLE_...)
    # Every code here is emitted by some check (tests/unit/test_reasons.py keeps it so); add a code together
    # with the check that emits it.

    @property
    def category(self) -> ReasonCategory:
        """The :class:`ReasonCategory` this code belongs to."""
        return _CATEGORY[self]


_C = ReasonCategory
_R = ReasonCode
_CATEGORY: dict[ReasonCode, ReasonCategory] = {
    **dict.fromkeys(
        [
            _R.DEVICE_TYPE_UNSUPPORTED,
            _R.SM_TOO_OLD,
            _R.SM_TOO_NEW,
            _R.GPU_GENERATION_UNSUPPORTED,
            _R.CPU_ISA_MISSING,
            _R.PLATFORM_UNSUPPORTED,
        ],
        _C.HARDWARE,
    ),
    **dict.fromkeys([_R.DTYPE_UNSUPPORTED, _R.DTYPE_MISMATCH, _R.KV_CACHE_DTYPE_UNSUPPORTED], _C.DTYPE),
    **dict.fromkeys(
        [_R.SHAPE_MISMATCH, _R.SEQ_LEN_TOO_LONG, _R.SEQ_LEN_TOO_SHORT, _R.HIDDEN_SIZE_UNSUPPORTED], _C.SHAPE
    ),
    **dict.fromkeys([_R.LAYOUT_UNSUPPORTED, _R.KV_LAYOUT_UNSUPPORTED], _C.LAYOUT),
    **dict.fromkeys(
        [
            _R.MASK_UNSUPPORTED,
            _R.MASK_WITH_CAUSAL,
            _R.SLIDING_WINDOW_UNSUPPORTED,
            _R.SOFTCAP_UNSUPPORTED,
            _R.ALIBI_UNSUPPORTED,
            _R.ALIBI_REQUIRED,
        ],
        _C.MASK,
    ),
    **dict.fromkeys([_R.GQA_UNSUPPORTED, _R.GQA_RATIO_INVALID], _C.GQA),
    **dict.fromkeys(
        [_R.HEAD_DIM_INVALID, _R.HEAD_DIM_TOO_LARGE, _R.HEAD_DIM_NOT_ALIGNED, _R.HEAD_DIM_MISMATCH],
        _C.HEAD_DIM,
    ),
    **dict.fromkeys([_R.STRIDE_LAST_DIM_NOT_1, _R.ALIGNMENT_INVALID], _C.STRIDE),
    **dict.fromkeys([_R.CAUSAL_UNSUPPORTED, _R.CAUSAL_SEQ_MISMATCH], _C.CAUSAL),
    _R.DROPOUT_UNSUPPORTED: _C.DROPOUT,
    _R.NON_DETERMINISTIC: _C.DETERMINISM,
    _R.BACKWARD_UNSUPPORTED: _C.AUTOGRAD,
    **dict.fromkeys([_R.CUDA_GRAPH_UNSAFE], _C.CUDA_GRAPH),
    **dict.fromkeys(
        [_R.POLICY_DENIED, _R.POLICY_NOT_ALLOWED, _R.POLICY_LOCKED_OTHER, _R.POLICY_DISABLED], _C.POLICY
    ),
    **dict.fromkeys(
        [
            _R.BACKEND_NOT_INSTALLED,
            _R.BACKEND_VERSION_UNSUPPORTED,
            _R.BACKEND_IMPORT_FAILED,
            _R.BACKEND_UNHEALTHY,
            _R.TORCH_TOO_OLD,
            _R.BACKEND_QUARANTINED,
        ],
        _C.BACKEND,
    ),
    _R.WORKSPACE_TOO_LARGE: _C.MEMORY,
    **dict.fromkeys(
        [
            _R.COMM_BACKEND_UNSUPPORTED,
            _R.WORLD_SIZE_UNSUPPORTED,
            _R.MESSAGE_TOO_LARGE,
            _R.REDUCE_OP_UNSUPPORTED,
            _R.P2P_UNAVAILABLE,
            _R.SYMM_MEM_UNAVAILABLE,
            _R.MULTICAST_ENABLED,
        ],
        _C.DISTRIBUTED,
    ),
}


@dataclass(frozen=True, slots=True)
class Reason:
    """One reason a kernel was rejected (or demoted): a stable ``code`` and a human ``message``."""

    code: ReasonCode
    message: str

    @property
    def category(self) -> ReasonCategory:
        """The category of :attr:`code`."""
        return self.code.category

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form: ``{"code": ..., "category": ..., "message": ...}``."""
        return {"code": self.code.value, "category": self.category.value, "message": self.message}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Reason:
        """Inverse of :meth:`to_dict` (the category is derived from the code)."""
        return cls(ReasonCode(data["code"]), str(data["message"]))

    def to_json(self) -> str:
        """Serialize to a JSON string."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Reason:
        """Parse the output of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


def reason(code: ReasonCode, message: str) -> Reason:
    """Shorthand constructor used by checks."""
    return Reason(code, message)
