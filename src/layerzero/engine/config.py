"""Engine and model configuration: :class:`EngineConfig` (the ``LLM(...)`` options, frozen and validated) and
:class:`ModelConfig` (what the engine needs from a checkpoint's ``config.json``, parsed by transformers'
``AutoConfig``, so configs written by transformers 4.x (``rope_theta`` / ``rope_scaling``) and 5.x
(``rope_parameters``) both work)."""

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
    "CudaGraphKnobs",
    "EngineConfig",
    "MoEConfig",
    "ModelConfig",
    "RopeConfig",
    "resolve_device",
]

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""``model_type`` -> the Hugging Face architecture the engine implements."""
SCHEDULING_POLICIES = ("fcfs", "lpm", "priority")
PREFIX_CACHES = ("radix", "hash")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""``LLM(dtype=...)``: the model's compute dtypes (the CLI's ``--dtype`` choices are their names)."""
DEVICE_TYPES = ("cpu", "cuda")
"""Devices the engine runs on (:func:`resolve_device`)."""
QUANTIZATIONS = ("int8", "int4", "fp8", "fp8_w8a8")
"""``LLM(quantization=...)``: weight-only formats of the decoder linears, and W8A8 fp8 (e4m3 weights and
activations quantized per token: ``lz.fp8_linear``) (layers/quantized_linear.py)."""
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
}
"""``LLM(kv_cache_dtype=...)`` -> the KV pool's dtype (None: the model's dtype); fp8/int8 are read through
per-layer ``k_scale`` / ``v_scale`` (vLLM's ``kv_cache_dtype``; docs/engine.md "Quantized KV cache")."""


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


@dataclass(frozen=True, slots=True)
class CudaGraphKnobs:
    """Tuning choices of the engine's decode CUDA graphs (``runner/cuda_graph.py``), read when the graphs are
    built: ``LLM(model, cuda_graph=CudaGraphKnobs(lanes=1))``. Defaults from H200 A/Bs of batch-1 decode; the
    measurements are in ``benchmarks/results/knobs/engine_cuda_graph.md``.

    Raises:
        ConfigurationError: a field of the wrong type or out of range (the message names it, expected vs got).
    """

    packed_inputs: bool = True
    """Small decode buckets read their inputs from one packed buffer the step's single host-to-device copy
    writes (no device copies into the graph's buffers: a batch-1 step's GPU input preparation 23-27 -> 11
    µs)."""
    greedy_in_graph: bool = True
    """Packed buckets with two or more lanes also capture greedy graphs (forward, ``lz.sample_greedy``, the
    ids into the next lane's input slots), so steady greedy decode steps chain; False: plain graphs, sampled
    after them."""
    h2d_aside: bool = True
    """A chained step's input copy runs on a side stream, overlapping the step before; False: on the current
    stream."""
    d2h_aside: bool = True
    """A greedy graph's ids go to the host on a side stream; False: on the current stream."""
    lanes: int = 2
    """Input buffers (lanes) per packed bucket of at most ``lane_max_batch`` rows, taken by alternate steps:
    one is written while the step before reads another (each lane its own graphs); greedy graphs need two or
    more."""
    lane_max_batch: int = 8
    """Packed buckets up to this many rows get ``lanes`` lanes and greedy graphs, bigger ones one lane: the
    ~20 µs a step the lanes save matter where steps are short, and every graph is one more capture at
    start-up."""
    narrow_tokens: int | None = 2048
    """When the decode graphs' block tables are wider than this many tokens, batch-1 graphs this wide are
    captured too and replayed while the sequence fits (``triton.paged_decode``'s small tiles apply up to 2048
    tokens: a batch-1 step 697 -> 654 µs at ``max_model_len`` 40960); None: off."""
    pack_max_bytes: int = 64 << 10
    """Buckets whose packed inputs fit this many bytes are packed; larger ones copy their rows into the shared
    buffers (a big bucket's full-width table would cost more to send than the copies it saves)."""

    def __post_init__(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in ("packed_inputs", "greedy_in_graph", "h2d_aside", "d2h_aside"):
            if not isinstance(getattr(self, name), bool):
                raise bad_config(
                    f"CudaGraphKnobs.{name}",
                    "True or False",
                    repr(getattr(self, name)),
                    f"The default is {defaults[name]!r}.",
                )
        for name, least, none in (
            ("lanes", 1, False),
            ("lane_max_batch", 1, False),
            ("pack_max_bytes", 0, False),
            ("narrow_tokens", 1, True),
        ):
            v = getattr(self, name)
            if (v is not None or not none) and (isinstance(v, bool) or not isinstance(v, int) or v < least):
                raise bad_config(
                    f"CudaGraphKnobs.{name}",
                    f"an int >= {least}" + (" or None" if none else ""),
                    repr(v),
                    f"The default is {defaults[name]!r}.",
                )


@dataclass(frozen=True)
class EngineConfig:
    """Options of :class:`~layerzero.engine.LLM` (see its docstring for each); validated on construction.

    Raises:
        ConfigurationError: a value out of range or of the wrong type (the message names it and the range); a
            device this process cannot use (:func:`resolve_device`).
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
    cuda_graph: CudaGraphKnobs = CudaGraphKnobs()

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
        if (
            isinstance(f, bool)
            or not isinstance(f, (int, float))
            or not math.isfinite(f)
            or not 0.0 < f <= 1.0
        ):
            raise bad_config("LLM kv_cache_memory_fraction", "a float in (0, 1]", repr(f))
        if self.prefix_cache not in PREFIX_CACHES:
            raise bad_config("LLM prefix_cache", f"one of {PREFIX_CACHES}", repr(self.prefix_cache))
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise bad_config(
                "LLM scheduling_policy", f"one of {SCHEDULING_POLICIES}", repr(self.scheduling_policy)
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad_config(
                "LLM quantization",
                f"one of {QUANTIZATIONS} or None",
                repr(self.quantization),
                "Weight-only: int8 and fp8 (e4m3) per output channel, int4 in groups of 128; "
                "fp8_w8a8: fp8 weights and activations (per token).",
            )
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad_config(
                "LLM kv_cache_dtype",
                f"one of {tuple(KV_CACHE_DTYPES)}",
                repr(self.kv_cache_dtype),
                "'auto' keeps the model's dtype; 'fp8' (e4m3) and 'int8' halve the pool's bytes per "
                "token vs bf16.",
            )
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise bad_config(
                "LLM async_scheduling",
                "True, False or None (None: on for CUDA devices)",
                repr(self.async_scheduling),
            )
        if self.cascade_attention is not None and not isinstance(self.cascade_attention, bool):
            raise bad_config(
                "LLM cascade_attention",
                "True, False or None (None: on for CUDA with prefix caching)",
                repr(self.cascade_attention),
            )
        if self.freeze_gc is not None and not isinstance(self.freeze_gc, bool):
            raise bad_config(
                "LLM freeze_gc", "True, False or None (None: on for CUDA devices)", repr(self.freeze_gc)
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise bad_config("LLM seed", "an int", repr(self.seed))
        if not isinstance(self.cuda_graph, CudaGraphKnobs):
            raise bad_config(
                "LLM cuda_graph",
                "a CudaGraphKnobs (layerzero.engine.config)",
                repr(self.cuda_graph),
                "Build it with CudaGraphKnobs(field=value, ...); omitted fields keep their defaults.",
            )
        resolve_device(self.device)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device the engine runs on: ``device`` parsed (``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a
    :class:`torch.device`), or, for None, CUDA when ``torch.cuda.is_available()``, else the CPU.

    Raises:
        ConfigurationError: not a device string; a device type other than :data:`DEVICE_TYPES`; a CUDA device
            this process cannot use (a torch built without CUDA, no visible GPU, an index past the last GPU).
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    expected = "a torch device string ('cpu', 'cuda', 'cuda:1') or None"
    if not isinstance(device, (str, torch.device)):
        raise bad_config("LLM device", expected, repr(device))
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise bad_config("LLM device", expected, repr(device)) from exc
    if dev.type not in DEVICE_TYPES:
        raise bad_config(
            "LLM device",
            f"a device of type {DEVICE_TYPES} (the engine runs there)",
            repr(device),
            "Pass device='cuda' or 'cpu' (or None: CUDA when available).",
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
            why = (
                "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES?)"
                if built
                else f"this torch ({torch.__version__}) is built without CUDA"
            )
            raise bad_config(
                "LLM device",
                "a device this process can use",
                f"{device!r}, but {why}",
                "Pass device='cpu' (or None: CUDA when available), or install a CUDA build of torch.",
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise bad_config("LLM device", f"a CUDA index in [0, {count}) (the visible GPUs)", repr(device))
    return dev
