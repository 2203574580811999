"""SelectionContext: the frozen, hashable description of one call that selection decides on.

Invariant that makes caching sound: a context is built *only from the cache key* of the call (see
``layerzero.ops``), so every call that maps to the same key has the same context and therefore the same
answer. Sequence lengths and batch size enter the key bucketed to the next power of two; constraints and
policy comparisons on those fields therefore see the bucket's upper bound (``seq_len_q=1024`` means
"513..1024"). Exact facts that matter (decode = one query token, Sq == Sk) are kept as exact flags.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import fields as dc_fields
from typing import Any

import torch

from .device import DeviceSpec
from .types import Layout, MaskKind, Phase


def bucket(n: int) -> int:
    """Round ``n`` (a length or batch size) up to a power of two; 0 and 1 stay themselves.

    >>> [bucket(n) for n in (0, 1, 2, 3, 5, 1024, 1025)]
    [0, 1, 2, 4, 8, 1024, 2048]
    """
    return n if n <= 1 else 1 << (n - 1).bit_length()


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.float16`` -> ``"float16"`` (the spelling used in policies and reports)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class SelectionContext:
    """Everything selection may look at for one call. Fields an op does not have stay ``None``.

    Attention fields: ``batch`` (bucketed), ``num_heads_q``/``num_heads_kv``, ``head_dim`` (q/k) and
    ``head_dim_v``, ``seq_len_q``/``seq_len_kv`` (bucket upper bounds, tokens), ``layout`` of the inputs,
    ``mask`` kind, ``is_causal``, ``seq_equal`` (Sq == Sk exactly), ``dropout`` (p > 0), ``scale_default``.
    Local attention: ``window_left``/``window_right`` (tokens, exact; -1 = unbounded on that side; both None
    when no window is asked) and ``has_softcap`` (True when a logit soft-cap is applied, None otherwise: the
    cap value itself is not a constraint, so it stays out of the key), ``has_alibi`` (True when ALiBi slopes
    are given, None otherwise: the slope values stay out of the key). None defaults keep other ops' PerfDB
    bucket keys unchanged. Norm fields: ``hidden_size`` (exact), ``param_dtype`` (weight/bias dtype),
    ``fused_residual``, ``has_bias``. RoPE: ``interleaved``, ``rotary_dim``. Sampling: ``vocab_size`` (exact),
    ``has_generator``. Mixture of experts (fused_moe): ``batch`` (tokens T, bucketed), ``hidden_size`` (H),
    ``intermediate_size`` (I, per expert), ``num_experts`` (E) and ``top_k`` (K), all exact but T. Paged KV
    cache (paged_attention, reshape_and_cache): ``kv_layout`` (``"NHD"``/``"HND"``) and ``page_size`` (tokens
    per block), both exact. Common: ``dtype`` of the main input, ``device`` (a :class:`DeviceSpec`),
    ``stride_last_1`` and ``contiguous`` (all tensor inputs), ``aligned_16`` (CUDA inputs: data pointers and
    every stride but the last are 16-byte multiples, as fused CUDA kernels need), ``requires_grad`` (autograd
    will record this call), ``graph_capture`` (a CUDA graph is being captured), ``deterministic`` (torch
    deterministic mode), ``tp_size``.
    """

    op: str
    device: DeviceSpec
    dtype: torch.dtype
    batch: int | None = None
    num_heads_q: int | None = None
    num_heads_kv: int | None = None
    head_dim: int | None = None
    head_dim_v: int | None = None
    seq_len_q: int | None = None
    seq_len_kv: int | None = None
    seq_equal: bool = True
    layout: Layout | None = None
    mask: MaskKind = MaskKind.NONE
    is_causal: bool = False
    dropout: bool = False
    scale_default: bool = True
    hidden_size: int | None = None
    param_dtype: torch.dtype | None = None
    fused_residual: bool = False
    has_bias: bool = False
    interleaved: bool = False
    rotary_dim: int | None = None
    vocab_size: int | None = None
    has_generator: bool = False
    stride_last_1: bool = True
    aligned_16: bool = True
    contiguous: bool = True
    requires_grad: bool = False
    graph_capture: bool = False
    deterministic: bool = False
    tp_size: int = 1
    kv_layout: str | None = None
    page_size: int | None = None
    window_left: int | None = None
    window_right: int | None = None
    has_softcap: bool | None = None
    has_alibi: bool | None = None
    intermediate_size: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    # quantize / dequantize: the format name ("int8", "fp8_e4m3", "fp8_e5m2", "mxfp4", "nvfp4", "int4") and
    # which elements share a scale ("tensor", "channel:<axis>", "group:<g>", "block:<bm>x<bk>"); batch = rows
    # (bucketed) and hidden_size = the last dim K (exact)
    quant_format: str | None = None
    quant_granularity: str | None = None
    # paged_attention / reshape_and_cache: the dtype of a quantized KV cache (float8_e4m3fn, int8); None when
    # the cache has the model's dtype (unquantized), so other keys' PerfDB buckets are unchanged
    kv_dtype: torch.dtype | None = None
    # linear_cross_entropy: the loss reduction ("mean", "sum", "none"); the collectives (all_reduce,
    # reduce_scatter): the reduce op ("sum", "avg", "max", "min", "product"); None for other ops
    reduction: str | None = None
    # collectives (all_reduce, all_gather, reduce_scatter, all_to_all): the process group's size, the
    # torch.distributed backend ("nccl", "gloo", ...), the group's name (symmetric buffers are per group) and
    # the message size in bytes (this rank's input, bucketed to a power of two: checks see the bucket's upper
    # bound); None for other ops, so their PerfDB buckets are unchanged
    world_size: int | None = None
    comm_backend: str | None = None
    comm_group: str | None = None
    message_bytes: int | None = None

    @property
    def phase(self) -> Phase | None:
        """DECODE when exactly one query token per sequence, PREFILL otherwise (None for non-attention
        ops)."""
        if self.seq_len_q is None:
            return None
        return Phase.DECODE if self.seq_len_q == 1 else Phase.PREFILL

    @property
    def gqa_ratio(self) -> int | None:
        """Query heads per KV head (1 = MHA, Hq = MQA); None when not an attention op or not divisible."""
        if not self.num_heads_q or not self.num_heads_kv or self.num_heads_q % self.num_heads_kv:
            return None
        return self.num_heads_q // self.num_heads_kv

    def bucket_key(self) -> str:
        """A stable string naming this context's bucket, used as the PerfDB row key (device and process-group
        name excluded: :data:`NON_BUCKET_FIELDS`)."""
        parts = [
            f"{k}={v}"
            for k, v in sorted(self.fields().items())
            if k not in NON_BUCKET_FIELDS and v is not None
        ]
        return ";".join(parts)

    def fields(self) -> dict[str, Any]:
        """Primitive values by name, as policies' ``when:`` clauses and reports see them."""
        dev = self.device
        out: dict[str, Any] = {}
        for f in dc_fields(self):
            name, value = f.name, getattr(self, f.name)
            if name == "device":
                continue
            if isinstance(value, torch.dtype):
                value = dtype_name(value)
            elif isinstance(value, (Layout, MaskKind)):
                value = value.value
            out[name] = value
        phase = self.phase
        out.update(
            device=dev.device_type,
            device_name=dev.name,
            sm=dev.sm_int,
            gpu_generation=dev.generation.name,
            phase=None if phase is None else phase.value,
            gqa_ratio=self.gqa_ratio,
        )
        return out


_DEVICE_FIELDS = frozenset({"device", "device_name", "sm", "gpu_generation"})
NON_BUCKET_FIELDS = _DEVICE_FIELDS | {"comm_group"}
"""Fields a bucket (PerfDB row key, shipped-timings record) leaves out: the device's (the fingerprint covers
it) and a collective's process-group name (an identity, not a shape: a group's timings serve another group of
the same world size and transport)."""


ContextBuilder = Callable[[tuple[Any, ...]], SelectionContext]
"""An op's context builder: its cache key (the named key, or the plain-tuple form of one) -> the
:class:`SelectionContext` of every call with that key (dispatch calls it on a cache miss only)."""
