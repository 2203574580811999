"""Model configuration: :class:`ModelConfig`, what the engine needs from a checkpoint's ``config.json``
(parsed by transformers' ``AutoConfig``, so configs written by transformers 4.x (``rope_theta`` /
``rope_scaling``) and 5.x (``rope_parameters``) both work), with its parts (:class:`RopeConfig`,
:class:`MoEConfig`) and the checks that refuse a config the engine would misread or silently ignore.

Split from ``config.py`` (the engine's own options, :class:`~layerzero.engine.config.EngineConfig`), which
re-exports these names: checkpoint parsing is a concern of its own."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import bad_config

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "MoEConfig",
    "ModelConfig",
    "RopeConfig",
    "read_json_object",
]

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""``model_type`` -> the Hugging Face architecture the engine implements."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: ``theta`` (base), ``rope_type`` (``default``, ``linear``, ``llama3``,
    ``yarn``, ...) and the type's own parameters (transformers' ``rope_parameters`` dict, theta included)."""

    theta: float
    rope_type: str = "default"
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MoEConfig:
    """Sparse MoE layers (Qwen3-MoE): ``num_experts`` E, ``top_k`` experts per token, ``norm_topk_prob``
    (renormalise the top-k router probabilities to sum to 1), ``intermediate_size`` per expert, and which
    layers are sparse (``decoder_sparse_step``; ``mlp_only_layers`` stay dense)."""

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
        """Parse ``<path>/config.json`` with transformers' ``AutoConfig`` (no remote code); the EOS ids are
        config.json's ``eos_token_id`` then ``generation_config.json``'s (when present), as transformers'
        ``generate`` and vLLM stop on both.

        Raises:
            ConfigurationError: naming the file: no config.json; config.json empty, not JSON or not a JSON
                object; an unsupported or missing ``model_type`` (the message lists the supported ones); a
                size that is not an int >= 1 or sizes that do not fit together (heads not dividing, ...); a
                feature the engine does not implement (see :meth:`from_hf`); an ``eos_token_id`` outside
                ``[0, vocab_size)``; a corrupted generation_config.json.
        """
        from transformers import AutoConfig

        path = Path(path)
        file = path / "config.json"
        if not file.is_file():
            raise bad_config(
                "checkpoint directory",
                "a directory with config.json (a Hugging Face checkpoint)",
                str(path),
                "Pass the directory save_pretrained / the hub download wrote.",
            )
        raw = read_json_object(file, "a JSON object (the model's Hugging Face config)")
        _check_model_type(raw.get("model_type"), str(file))
        # before transformers, whose own errors (or silence: hidden_size=-1 loads) say less
        _check_sizes({k: raw[k] for k in (*SIZES, *OPTIONAL_SIZES) if k in raw}, str(file))
        _check_head_dim(raw.get("head_dim"), str(file))
        try:
            hf = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
        except Exception as exc:  # transformers' validation errors vary by version
            raise bad_config(
                str(file),
                "a config transformers' AutoConfig accepts",
                f"{type(exc).__name__}: {str(exc).rstrip('.')}",
                _FIX_CONFIG,
            ) from exc
        cfg = cls.from_hf(hf, source=str(file))
        gen = path / "generation_config.json"
        if gen.is_file():
            eos = read_json_object(gen, "a JSON object (the generation defaults)").get("eos_token_id")
            extra = _token_ids(eos, f"eos_token_id in {gen}", cfg.vocab_size)
            cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys((*cfg.eos_token_ids, *extra))))
        return cfg

    @classmethod
    def from_hf(cls, hf: Any, source: str = "config.json") -> ModelConfig:
        """The :class:`ModelConfig` of a transformers config object (see :meth:`from_pretrained`); ``source``
        names it in error messages.

        Raises:
            ConfigurationError: an unsupported ``model_type``; a size that is not an int >= 1; heads not
                dividing; an odd ``head_dim``; a non-finite or non-positive ``rms_norm_eps`` / RoPE theta; MoE
                ``top_k`` > ``num_experts``; an ``eos_token_id`` outside ``[0, vocab_size)``; a feature the
                engine does not implement (each message lists what is supported): ``hidden_act`` other than
                SiLU, ``mlp_bias``, sliding-window or other non-full attention layers, partial rotary
                embeddings, a pre-quantized checkpoint (``quantization_config``).
        """
        mt = _check_model_type(getattr(hf, "model_type", None), source)
        moe_names = MOE_SIZES if mt == "qwen3_moe" else ()
        _check_sizes(
            {k: getattr(hf, k) for k in OPTIONAL_SIZES if hasattr(hf, k)}
            | {k: getattr(hf, k, None) for k in (*SIZES, *moe_names)},
            source,
            optional=tuple(k for k in OPTIONAL_SIZES if k not in moe_names),
        )
        heads, hidden = hf.num_attention_heads, hf.hidden_size
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = (
            getattr(hf, "head_dim", None) or hidden // heads
        )  # transformers' rule (no divisibility check)
        if heads % kv_heads:
            raise bad_config(
                f"num_attention_heads % num_key_value_heads in {source}",
                0,
                f"{heads} % {kv_heads}",
                "Each KV head serves a whole group of query heads (GQA). " + _FIX_CONFIG,
            )
        _check_head_dim(head_dim, source)
        eps = getattr(hf, "rms_norm_eps", None)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            raise bad_config(f"rms_norm_eps in {source}", "a finite float > 0", repr(eps), _FIX_CONFIG)
        _check_implemented(hf, source)
        moe = None
        if mt == "qwen3_moe":
            if hf.num_experts_per_tok > hf.num_experts:
                raise bad_config(
                    f"num_experts_per_tok in {source}",
                    f"<= num_experts ({hf.num_experts})",
                    hf.num_experts_per_tok,
                    _FIX_CONFIG,
                )
            moe = MoEConfig(
                hf.num_experts,
                hf.num_experts_per_tok,
                bool(hf.norm_topk_prob),
                hf.moe_intermediate_size,
                int(getattr(hf, "decoder_sparse_step", 1) or 1),
                tuple(getattr(hf, "mlp_only_layers", ())),
            )
        eos_ids = _token_ids(getattr(hf, "eos_token_id", None), f"eos_token_id in {source}", hf.vocab_size)
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hidden,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(eps),
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            rope=_rope(hf, source),
            moe=moe,
            eos_token_ids=eos_ids,
            torch_dtype=dtype if isinstance(dtype, torch.dtype) else None,
            hf_config=hf,
        )


SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
"""config.json sizes that must be ints >= 1."""
OPTIONAL_SIZES = (
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
)
"""Sizes that must be ints >= 1 when set (None: the default; a Qwen3-MoE config must set the MoE ones)."""
MOE_SIZES = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
ACTIVATIONS = ("silu", "swish")
"""``hidden_act`` values the engine implements: its gated MLP is SwiGLU (``lz.swiglu``); transformers maps
both names to SiLU."""
_FIX_CONFIG = "Fix config.json (or download the checkpoint again)."
_JSON_TYPES = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def read_json_object(file: Path, expected: str) -> dict[str, Any]:
    """The JSON object in ``file`` (a checkpoint's config.json, generation_config.json, a safetensors index,
    ...).

    Raises:
        ConfigurationError: the file is unreadable, empty, not valid JSON or not a JSON object (names the
            file).
    """
    fix = f"{file.name} is corrupted (an interrupted download or a bad edit?): download or write it again."
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise bad_config(
            str(file), expected, f"an unreadable file ({type(exc).__name__}: {exc})", fix
        ) from exc
    if not text.strip():
        raise bad_config(str(file), expected, "an empty file", fix)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # json.JSONDecodeError; absurdly deep nesting
        raise bad_config(str(file), expected, f"invalid JSON ({exc})", fix) from exc
    if not isinstance(value, dict):
        raise bad_config(
            str(file), expected, f"a JSON {_JSON_TYPES.get(type(value), type(value).__name__)}", fix
        )
    return value


def _check_model_type(mt: Any, source: str) -> str:
    """``mt``, checked to be one of :data:`SUPPORTED_ARCHITECTURES`."""
    if not isinstance(mt, str) or mt not in SUPPORTED_ARCHITECTURES:
        raise bad_config(
            f"model_type in {source}",
            f"one of {sorted(SUPPORTED_ARCHITECTURES)} ({', '.join(SUPPORTED_ARCHITECTURES.values())})",
            "no model_type key" if mt is None else repr(mt),
            "This engine implements Llama, Qwen3 and Qwen3-MoE checkpoints.",
        )
    return mt


def _check_sizes(values: dict[str, Any], source: str, optional: tuple[str, ...] = OPTIONAL_SIZES) -> None:
    """Each of ``values`` (name -> value) is an int >= 1; None only for the ``optional`` names."""
    for name, v in values.items():
        if v is None and name in optional:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad_config(f"{name} in {source}", "an int >= 1", repr(v), _FIX_CONFIG)


def _check_head_dim(head_dim: int | None, source: str) -> None:
    if head_dim is not None and head_dim % 2:
        raise bad_config(
            f"head_dim in {source}",
            "an even number (RoPE rotates pairs of dimensions)",
            head_dim,
            _FIX_CONFIG,
        )


def _token_ids(value: Any, what: str, vocab_size: int) -> tuple[int, ...]:
    """``value`` (None, an id or a list of ids) as a tuple of ids, each checked to be in the vocabulary."""
    if value is None:
        return ()
    ids = list(value) if isinstance(value, (list, tuple)) else [value]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise bad_config(
                what,
                f"token ids in [0, {vocab_size}) (vocab_size)",
                repr(value),
                "An id outside the vocabulary can never be sampled, so generation would not stop there; "
                "fix the id (or vocab_size).",
            )
    return tuple(ids)


def _sliding_layers(hf: Any) -> list[int]:
    """The layers whose attention is a sliding window (Qwen3's ``use_sliding_window`` / ``layer_types``, the
    rule of transformers 4.x and 5.x): none when no window is set or the window covers
    ``max_position_embeddings``."""
    window = getattr(hf, "sliding_window", None)
    if window is None or not getattr(hf, "use_sliding_window", True) or window >= hf.max_position_embeddings:
        return []
    types = getattr(hf, "layer_types", None)
    if types is not None:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    return list(range(int(getattr(hf, "max_window_layers", 0) or 0), hf.num_hidden_layers))


def _check_implemented(hf: Any, source: str) -> None:
    """Refuse what the engine would silently ignore (different tokens, not an error): each message lists what
    is supported."""
    act = getattr(hf, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise bad_config(
            f"hidden_act in {source}",
            f"one of {ACTIVATIONS} (the engine's MLP is SwiGLU)",
            repr(act),
            "This engine implements SiLU-gated MLPs only (Llama, Qwen3, Qwen3-MoE).",
        )
    if getattr(hf, "mlp_bias", False):
        raise bad_config(
            f"mlp_bias in {source}",
            "false (the engine's gate/up/down projections have no bias)",
            repr(hf.mlp_bias),
            "Checkpoints with MLP biases are not supported.",
        )
    types = sorted(set(getattr(hf, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if types:
        raise bad_config(
            f"layer_types in {source}",
            "only 'full_attention' layers",
            types,
            "The engine implements full causal attention only.",
        )
    sliding = _sliding_layers(hf)
    if sliding:
        raise bad_config(
            f"sliding-window attention in {source}",
            "full attention on every layer (use_sliding_window false, or layer_types all 'full_attention')",
            f"sliding_window={hf.sliding_window} on layers {sliding}",
            "The engine implements full causal attention only; a window >= max_position_embeddings "
            "is full attention and is accepted.",
        )
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    prf = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if prf not in (None, 1, 1.0):
        raise bad_config(
            f"partial_rotary_factor in {source}",
            "1.0 (RoPE over the whole head_dim)",
            repr(prf),
            "Partial rotary embeddings are not supported.",
        )
    quant = getattr(hf, "quantization_config", None)
    if quant:
        method = (
            quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        )
        raise bad_config(
            f"quantization_config in {source}",
            "none (a float16 / bfloat16 / float32 checkpoint)",
            f"quant_method {method!r}",
            "Pre-quantized checkpoints are not loaded: load the float "
            "checkpoint and pass LLM(quantization='int8' | 'int4' | 'fp8' | 'fp8_w8a8').",
        )


def _rope(hf: Any, source: str = "config.json") -> RopeConfig:
    """RoPE parameters from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x).

    Raises:
        ConfigurationError: a theta that is not a finite number > 0.
    """
    params = getattr(hf, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", 10000.0)
    if (
        isinstance(theta, bool)
        or not isinstance(theta, (int, float))
        or not math.isfinite(theta)
        or theta <= 0
    ):
        raise bad_config(f"rope_theta in {source}", "a finite number > 0", repr(theta), _FIX_CONFIG)
    return RopeConfig(float(theta), str(rope_type), params)
