"""Quantized linear layers: weight-only (``LLM(quantization="int8"|"int4"|"fp8")``) and W8A8 fp8
(``quantization="fp8_w8a8"``).

At load time :func:`quantize_model` replaces every decoder :class:`~.linear.Linear` (packed QKV, ``o_proj``,
packed gate/up, ``down_proj``) with a :class:`QuantizedLinear` holding ``lz.quantize``'s codes and scales as
buffers instead of the float weight. The embedding, the norms, the LM head (kept in the model dtype: its
logits decide every token) and the MoE experts / router stay in the model dtype.

Forward: ``lz.quantized_linear(x, W_q, b)``, dispatched: by default ``torch_native.quantized_linear``
dequantizes the weight to the model dtype on every call and drops it afterwards (nothing is cached, so the
memory saving holds; the price is one dequantization per layer per step); the fused low-bit GEMM
``triton.quantized_linear`` (codes decoded in registers, no float copy) is opt in until it is measured on a
GPU: ``lz.lock("quantized_linear", "triton.quantized_linear")``.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import nn

import layerzero as lz

from ..errors import bad_config
from .linear import Linear

__all__ = [
    "QUANTIZATION_FORMATS",
    "W8A8",
    "INT4_GROUP_SIZE",
    "INT4_MIN_GROUP_SIZE",
    "QuantizationSummary",
    "QuantizedLinear",
    "int4_group_size",
    "module_bytes",
    "quantize_model",
]

log = logging.getLogger("layerzero.engine")

QUANTIZATION_FORMATS = {"int8": "int8", "int4": "int4", "fp8": "fp8_e4m3", "fp8_w8a8": "fp8_e4m3"}
"""``LLM(quantization=...)`` -> ``lz.quantize`` format of the weight. int8 and fp8 (e4m3) have one float32
scale per output channel (``axis=0``); int4 is asymmetric with groups along ``in_features``
(:func:`int4_group_size`). ``fp8_w8a8`` stores the weight as ``fp8`` does and quantizes the activations too
(:data:`W8A8`)."""
W8A8 = frozenset({"fp8_w8a8"})
"""Quantizations whose forward is ``lz.fp8_linear`` (activations quantized to e4m3 per token, one fp8 GEMM:
vLLM's fp8 on Hopper) instead of the weight-only ``lz.quantized_linear``."""
INT4_GROUP_SIZE = 128
"""int4's group size along ``in_features`` (GPTQ's / AWQ's usual 128)."""
INT4_MIN_GROUP_SIZE = 16
"""The smallest fallback group: below it the scales and zero points cost more than 5/16 byte per weight."""


def int4_group_size(in_features: int, layer: str = "linear") -> int:
    """int4's group size for a weight with ``in_features`` columns: 128 when it divides ``in_features``; else
    the largest power of two in [16, 64] dividing it, with a WARNING (``lz.configure(strict=True)`` raises
    instead).

    Raises:
        ConfigurationError: no power of two >= 16 divides ``in_features`` (or strict mode and 128 does not).
    """
    if in_features % INT4_GROUP_SIZE == 0:
        return INT4_GROUP_SIZE
    g = INT4_GROUP_SIZE // 2
    while g >= INT4_MIN_GROUP_SIZE and in_features % g:
        g //= 2
    if g < INT4_MIN_GROUP_SIZE:
        raise bad_config(
            f"int4 quantization of {layer} (in_features {in_features})",
            f"in_features divisible by a power of two in [{INT4_MIN_GROUP_SIZE}, {INT4_GROUP_SIZE}]",
            in_features,
            "Use quantization='int8' or 'fp8' (per channel) for this model.",
        )
    if lz.get_config().strict:
        raise bad_config(
            f"int4 group size of {layer}",
            f"{INT4_GROUP_SIZE} dividing in_features",
            in_features,
            f"Strict mode refuses the fallback to groups of {g}; lz.configure(strict=False) allows it.",
        )
    log.warning(
        "int4 quantization of %s: in_features %d is not divisible by %d; using groups of %d",
        layer,
        in_features,
        INT4_GROUP_SIZE,
        g,
    )
    return g


class QuantizedLinear(nn.Module):
    """``y = x @ dequantize(W_q).T (+ b)``: a weight-only quantized :class:`~.linear.Linear` (same
    ``offsets``).

    Buffers: ``qdata`` (int8 ``[N, K]``, ``float8_e4m3fn`` ``[N, K]`` or uint8 ``[N, K/2]`` for int4),
    ``qscale`` (float32 ``[N, 1]`` or ``[N, K/g]``), ``qzero`` (int4: uint8 ``[N, K/g]``); ``bias`` stays in
    the model dtype.
    """

    def __init__(self, linear: Linear, quantization: str, name: str = "linear") -> None:
        super().__init__()
        fmt = QUANTIZATION_FORMATS[quantization]
        w = linear.weight.detach()
        self.quantization, self.offsets = quantization, dict(linear.offsets)
        self.out_features, self.in_features = w.shape
        if quantization == "int4":
            qt = lz.quantize(w, fmt, group_size=int4_group_size(self.in_features, name))
        else:
            qt = lz.quantize(w, fmt, axis=0)
        self.qdata: torch.Tensor
        self.qscale: torch.Tensor
        self.qzero: torch.Tensor | None
        self.register_buffer("qdata", qt.data)
        self.register_buffer("qscale", qt.scale)
        self.register_buffer("qzero", qt.zero_point)
        self.bias = linear.bias
        self._meta = (qt.format, qt.shape, qt.dtype, qt.axis, qt.group_size)

    @property
    def group_size(self) -> int | None:
        """int4's group size along ``in_features`` (None: one scale per output channel)."""
        g = self._meta[4]
        return g if isinstance(g, int) else None

    def qtensor(self) -> lz.QuantizedTensor:
        """The weight as an ``lz.QuantizedTensor`` (views of the buffers, current device)."""
        fmt, shape, dtype, axis, group = self._meta
        return lz.QuantizedTensor(self.qdata, self.qscale, self.qzero, None, fmt, shape, dtype, axis, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in_features]`` -> ``[T, out_features]``: ``lz.fp8_linear`` for W8A8, else
        ``lz.quantized_linear``."""
        if self.quantization in W8A8:
            return lz.fp8_linear(x, self.qtensor(), self.bias)
        return lz.quantized_linear(x, self.qtensor(), self.bias)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.quantization}{g}"


class QuantizationSummary(NamedTuple):
    """What :func:`quantize_model` did: the number of layers replaced and the bytes of their weights before
    (float) and after (codes + scales + zero points); ``bias`` bytes are in neither."""

    layers: int
    float_bytes: int
    quantized_bytes: int


def module_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module`` (shared tensors, e.g. tied embeddings, counted
    once)."""
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


@torch.no_grad()
def quantize_model(model: nn.Module, quantization: str) -> QuantizationSummary:
    """Replace every :class:`~.linear.Linear` of ``model`` except ``lm_head`` by a :class:`QuantizedLinear`,
    one layer at a time (each float weight is freed once its layer is quantized; the peak is the float model).

    Raises:
        ConfigurationError: an unknown ``quantization``; an int4 layer with no valid group size; a
            tensor-parallel model (``model.parallel.tp_size > 1``: not supported yet).
    """
    if quantization not in QUANTIZATION_FORMATS:
        raise bad_config(
            "LLM quantization", f"one of {sorted(QUANTIZATION_FORMATS)} or None", repr(quantization)
        )
    tp = getattr(getattr(model, "parallel", None), "tp_size", 1)
    if tp > 1:
        raise bad_config(
            f"quantization={quantization!r} with tensor_parallel_size {tp}",
            "tensor_parallel_size 1 (quantized weights are not sharded across ranks yet)",
            tp,
            "Serve the quantized model on one rank, or the float model with tensor parallelism.",
        )
    targets = [
        (n, m) for n, m in model.named_modules() if isinstance(m, Linear) and n.split(".")[-1] != "lm_head"
    ]
    before = after = 0
    for name, lin in targets:
        q = QuantizedLinear(lin, quantization, name)
        before += lin.weight.numel() * lin.weight.element_size()
        after += q.qtensor().nbytes
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q)
        lin.weight = None  # type: ignore[assignment]  # drop the float weight now (the module object may still be referenced)
    return QuantizationSummary(len(targets), before, after)
