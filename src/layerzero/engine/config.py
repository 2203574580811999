"""Engine and model configuration: :class:`EngineConfig` (the ``LLM(...)`` options, frozen and validated) and
:class:`ModelConfig` (what the engine needs from a checkpoint's ``config.json``, parsed by transformers'
``AutoConfig``, so configs written by transformers 4.x (``rope_theta`` / ``rope_scaling``) and 5.x
(``rope_parameters``) both work)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import bad_config

__all__ = ["SUPPORTED_ARCHITECTURES", "EngineConfig", "MoEConfig", "ModelConfig", "RopeConfig"]

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
"""``model_type`` -> the Hugging Face architecture the engine implements."""
SCHEDULING_POLICIES = ("fcfs", "lpm", "priority")
PREFIX_CACHES = ("radix", "hash")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANTIZATIONS = ("int8", "int4", "fp8", "fp8_w8a8")
"""``LLM(quantization=...)``: weight-only formats of the decoder linears, and W8A8 fp8 (e4m3 weights and activations
quantized per token: ``lz.fp8_linear``) (layers/quantized_linear.py)."""
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
"""``LLM(kv_cache_dtype=...)`` -> the KV pool's dtype (None: the model's dtype); fp8/int8 are read through per-layer
``k_scale`` / ``v_scale`` (vLLM's ``kv_cache_dtype``; docs/engine.md "Quantized KV cache")."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: ``theta`` (base), ``rope_type`` (``default``, ``linear``, ``llama3``, ``yarn``,
    ...) and the type's own parameters (transformers' ``rope_parameters`` dict, theta included)."""

    theta: float
    rope_type: str = "default"
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MoEConfig:
    """Sparse MoE layers (Qwen3-MoE): ``num_experts`` E, ``top_k`` experts per token, ``norm_topk_prob``
    (renormalise the top-k router probabilities to sum to 1), ``intermediate_size`` per expert, and which layers
    are sparse (``decoder_sparse_step``; ``mlp_only_layers`` stay dense)."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool
    intermediate_size: int
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) uses experts (transformers' Qwen3-MoE rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a decoder-only checkpoint's config the engine's models use (sizes in elements)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope: RopeConfig
    moe: MoEConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: torch.dtype | None = None
    hf_config: Any = None

    @property
    def qk_norm(self) -> bool:
        """Qwen3's per-head RMSNorm of q and k before RoPE."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Parse ``<path>/config.json`` with transformers' ``AutoConfig`` (no remote code).

        Raises:
            ConfigurationError: no config.json, an unsupported ``model_type`` (the message lists the supported
                ones), or inconsistent sizes (heads not dividing, ...).
        """
        from transformers import AutoConfig

        path = Path(path)
        if not (path / "config.json").is_file():
            raise bad_config("checkpoint directory", "a directory with config.json (a Hugging Face checkpoint)",
                             str(path), "Pass the directory save_pretrained / the hub download wrote.")
        hf = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
        return cls.from_hf(hf)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """The :class:`ModelConfig` of a transformers config object (see :meth:`from_pretrained`)."""
        mt = getattr(hf, "model_type", None)
        if mt not in SUPPORTED_ARCHITECTURES:
            raise bad_config("model_type", f"one of {sorted(SUPPORTED_ARCHITECTURES)} "
                             f"({', '.join(SUPPORTED_ARCHITECTURES.values())})", repr(mt),
                             "This engine implements Llama, Qwen3 and Qwen3-MoE checkpoints.")
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        if heads % kv_heads:
            raise bad_config("num_attention_heads % num_key_value_heads", 0, f"{heads} % {kv_heads}")
        moe = None
        if mt == "qwen3_moe":
            moe = MoEConfig(hf.num_experts, hf.num_experts_per_tok, bool(hf.norm_topk_prob), hf.moe_intermediate_size,
                            int(getattr(hf, "decoder_sparse_step", 1) or 1), tuple(getattr(hf, "mlp_only_layers", ())))
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),))
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return cls(model_type=mt, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                   intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=heads,
                   num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=float(hf.rms_norm_eps),
                   max_position_embeddings=int(hf.max_position_embeddings),
                   tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
                   attention_bias=bool(getattr(hf, "attention_bias", False)), rope=_rope(hf), moe=moe,
                   eos_token_ids=eos_ids, torch_dtype=dtype if isinstance(dtype, torch.dtype) else None, hf_config=hf)


def _rope(hf: Any) -> RopeConfig:
    """RoPE parameters from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x)."""
    params = getattr(hf, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    return RopeConfig(float(params.get("rope_theta", 10000.0)), str(rope_type), params)


@dataclass(frozen=True)
class EngineConfig:
    """Options of :class:`~layerzero.engine.LLM` (see its docstring for each); validated on construction.

    Raises:
        ConfigurationError: a value out of range or of the wrong type (the message names it and the range).
    """

    model: str
    dtype: torch.dtype | None = None
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.9
    enable_prefix_caching: bool = True
    prefix_cache: str = "radix"
    scheduling_policy: str = "fcfs"
    enforce_eager: bool = False
    seed: int = 0
    cpu_kv_cache_bytes: int = 1 << 30
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    async_scheduling: bool | None = None
    cascade_attention: bool | None = None
    freeze_gc: bool | None = None

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = True) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad_config(f"LLM {name}", "an int >= 1" + (" or None" if allow_none else ""), repr(v))

        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks"):
            positive(name)
        for name in ("max_num_seqs", "block_size", "cpu_kv_cache_bytes"):
            positive(name, allow_none=False)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise bad_config("LLM dtype", f"one of {[str(d) for d in DTYPES]} or None", repr(self.dtype))
        f = self.kv_cache_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0.0 < f <= 1.0:
            raise bad_config("LLM kv_cache_memory_fraction", "a float in (0, 1]", repr(f))
        if self.prefix_cache not in PREFIX_CACHES:
            raise bad_config("LLM prefix_cache", f"one of {PREFIX_CACHES}", repr(self.prefix_cache))
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise bad_config("LLM scheduling_policy", f"one of {SCHEDULING_POLICIES}", repr(self.scheduling_policy))
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad_config("LLM quantization", f"one of {QUANTIZATIONS} or None", repr(self.quantization),
                             "Weight-only: int8 and fp8 (e4m3) per output channel, int4 in groups of 128; "
                             "fp8_w8a8: fp8 weights and activations (per token).")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad_config("LLM kv_cache_dtype", f"one of {tuple(KV_CACHE_DTYPES)}", repr(self.kv_cache_dtype),
                             "'auto' keeps the model's dtype; 'fp8' (e4m3) and 'int8' halve the pool's bytes per "
                             "token vs bf16.")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise bad_config("LLM async_scheduling", "True, False or None (None: on for CUDA devices)",
                             repr(self.async_scheduling))
        if self.cascade_attention is not None and not isinstance(self.cascade_attention, bool):
            raise bad_config("LLM cascade_attention", "True, False or None (None: on for CUDA with prefix caching)",
                             repr(self.cascade_attention))
        if self.freeze_gc is not None and not isinstance(self.freeze_gc, bool):
            raise bad_config("LLM freeze_gc", "True, False or None (None: on for CUDA devices)", repr(self.freeze_gc))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise bad_config("LLM seed", "an int", repr(self.seed))
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise bad_config("LLM device", "a torch device string ('cpu', 'cuda', 'cuda:1') or None",
                                 repr(self.device)) from exc
