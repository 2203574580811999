"""Engine configuration: :class:`EngineConfig` (the ``LLM(...)`` options, frozen and validated), its
:class:`CudaGraphKnobs` (the decode CUDA graphs' tuning choices) and :func:`resolve_device`.

The model's configuration (:class:`ModelConfig`, parsed from a checkpoint's ``config.json``) lives in
``model_config.py``; its names are re-exported here, where the engine's users have always imported them."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from .errors import bad_config
from .model_config import (  # noqa: F401 - re-exported
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    MoEConfig,
    RopeConfig,
    read_json_object,
)
from .spec_decode.config import SpeculativeConfig

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CudaGraphKnobs",
    "EngineConfig",
    "LOAD_FORMATS",
    "MoEConfig",
    "ModelConfig",
    "RopeConfig",
    "resolve_device",
    "resolve_idle_poll_s",
    "resolve_max_model_len",
]

SCHEDULING_POLICIES = ("fcfs", "lpm", "priority")
PREFIX_CACHES = ("radix", "hash")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""``LLM(dtype=...)``: the model's compute dtypes (the CLI's ``--dtype`` choices are their names)."""
DEVICE_TYPES = ("cpu", "cuda")
"""Devices the engine runs on (:func:`resolve_device`)."""
QUANTIZATIONS = ("int8", "int4", "fp8", "fp8_w8a8")
"""``LLM(quantization=...)``: weight-only formats of the decoder linears, and W8A8 fp8 (e4m3 weights and
activations quantized per token: ``lz.fp8_linear``) (layers/quantized_linear.py)."""
LOAD_FORMATS = ("auto", "dummy")
"""``LLM(load_format=...)``: ``"auto"`` reads the checkpoint's safetensors; ``"dummy"`` fills the model with
seeded random weights (``loader.load_dummy_weights``; config.json is still read): benchmark a shape without
its weights (vLLM's ``load_format="dummy"``)."""
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
}
"""``LLM(kv_cache_dtype=...)`` -> the KV pool's dtype (None: the model's dtype); fp8/int8 are read through
per-layer ``k_scale`` / ``v_scale`` (vLLM's ``kv_cache_dtype``; docs/engine.md "Quantized KV cache")."""


IDLE_POLL_AUTO_S = 2.0
"""``idle_poll_s=None`` (auto) on CUDA: seconds the engine core polls, busy, after its last step (0 on CPU:
:func:`resolve_idle_poll_s`)."""

PIECEWISE_AUTO_TOKENS = 1024
"""``CudaGraphKnobs.piecewise_max_tokens=None`` (auto): piecewise graphs up to this many tokens, at any TP
(issue 37's TTFT range; the H200 measurements: ``benchmarks/results/engine/h200_2026-11-29_piecewise/``)."""


def _env_piecewise_max_tokens() -> int | None:
    """``LAYERZERO_PIECEWISE_MAX_TOKENS`` as an int (None, auto, when unset or empty).

    Raises:
        ConfigurationError: a value that is not an int."""
    raw = os.environ.get("LAYERZERO_PIECEWISE_MAX_TOKENS", "").strip()
    try:
        return int(raw) if raw else None
    except ValueError:
        raise bad_config(
            "LAYERZERO_PIECEWISE_MAX_TOKENS",
            "an int >= 0 (tokens)",
            repr(raw),
            "Unset it, or give the largest step to replay in piecewise graphs, e.g. 512.",
        ) from None


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
    piecewise_max_tokens: int | None = dataclasses.field(default_factory=_env_piecewise_max_tokens)
    """Steps with prefill tokens (prefill, chunked prefill, mixed with decode rows) of at most this many
    tokens replay piecewise graphs (``worker/piecewise.py``: the layers' other ops captured, each attention
    call eager between them; buckets 16, 32, 64, ... up to it): a short prompt's first token then costs ~L + 1
    graph replays and L attention calls of host time instead of ~10 L eager launches (H200, Qwen3-0.6B shape:
    TTFT 30-35 -> 6.1-7.7 ms for 16-1,024-token prompts). 0: off, every such step eager. None (auto, the
    default): :data:`PIECEWISE_AUTO_TOKENS` at any ``tensor_parallel_size`` (TP 2 with pieces passed its
    two-H200 test against TP 1). vLLM captures up to 512. The default comes from
    ``LAYERZERO_PIECEWISE_MAX_TOKENS`` when set (an A/B switch for servers and benchmarks)."""

    def __post_init__(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)} | {"piecewise_max_tokens": None}
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
            ("piecewise_max_tokens", 0, True),
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
    warmup: bool | None = None
    cuda_graph: CudaGraphKnobs = dataclasses.field(default_factory=CudaGraphKnobs)
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    load_format: str = "auto"
    speculative_config: SpeculativeConfig | None = None
    logits_processors: tuple[Any, ...] = ()
    idle_poll_s: float | None = None

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
        if self.warmup is not None and not isinstance(self.warmup, bool):
            raise bad_config(
                "LLM warmup", "True, False or None (None: on for CUDA devices)", repr(self.warmup)
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise bad_config("LLM seed", "an int", repr(self.seed))
        ip = self.idle_poll_s
        if ip is not None and (
            isinstance(ip, bool) or not isinstance(ip, int | float) or not 0 <= ip < float("inf")
        ):
            raise bad_config(
                "LLM idle_poll_s",
                "None or a finite number of seconds >= 0 (None: 2 on CUDA, 0 on CPU)",
                repr(ip),
            )
        if not isinstance(self.cuda_graph, CudaGraphKnobs):
            raise bad_config(
                "LLM cuda_graph",
                "a CudaGraphKnobs (layerzero.engine.config)",
                repr(self.cuda_graph),
                "Build it with CudaGraphKnobs(field=value, ...); omitted fields keep their defaults.",
            )
        self._check_parallel(resolve_device(self.device))
        self._check_logits_processors()
        self._check_speculative()

    def _check_speculative(self) -> None:
        """``speculative_config``: a :class:`SpeculativeConfig`, a dict of vLLM's keys or a JSON string (kept
        as the config); refused with tensor parallelism (not implemented: the draft would need its own
        shards) and with logits-processor plugins (not implemented: they are not applied at verified
        positions)."""
        spec = SpeculativeConfig.from_any(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if spec is not None and self.tensor_parallel_size > 1:
            raise bad_config(
                "LLM speculative_config",
                "None with tensor_parallel_size > 1 (speculative decoding runs on one rank)",
                spec.to_dict(),
                "Drop speculative_config or use tensor_parallel_size=1.",
            )
        if spec is not None and self.logits_processors:
            raise bad_config(
                "LLM speculative_config",
                "None with logits_processors (the plugins see one row per sequence and step; verified "
                "positions are not given to them yet)",
                spec.to_dict(),
                "Drop speculative_config or logits_processors.",
            )

    def _check_logits_processors(self) -> None:
        """``logits_processors``: a list of :class:`~.logits_processors.LogitsProcessor` subclasses or
        their names, resolved now (a bad one fails at start-up); stored as a tuple, each class that imports
        back by its name as ``"module:Class"`` (so the config crosses to the engine-core process)."""
        from .logits_processors import resolve_processor

        procs = self.logits_processors
        if procs is None:
            procs = ()
        if isinstance(procs, (str, type)) or not isinstance(procs, (list, tuple)):
            raise bad_config(
                "LLM logits_processors",
                "a list of LogitsProcessor classes or 'module:Class' names",
                repr(procs),
            )
        out = []
        for spec in procs:
            cls = resolve_processor(spec)
            name = f"{cls.__module__}:{cls.__qualname__}"
            try:
                same = resolve_processor(name) is cls
            except Exception:  # defined in a function or __main__: kept as the class (this process only)
                same = False
            out.append(spec if isinstance(spec, str) else name if same else cls)
        object.__setattr__(self, "logits_processors", tuple(out))

    def _check_parallel(self, dev: torch.device) -> None:
        """``tensor_parallel_size`` / ``enable_expert_parallel`` / ``data_parallel_size`` / ``load_format``
        (docs/parallel.md, "Flags")."""
        for name in ("tensor_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad_config(f"LLM {name}", "an int >= 1", repr(v))
        if not isinstance(self.enable_expert_parallel, bool):
            raise bad_config("LLM enable_expert_parallel", "True or False", repr(self.enable_expert_parallel))
        if not isinstance(self.load_format, str) or self.load_format not in LOAD_FORMATS:
            raise bad_config(
                "LLM load_format",
                f"one of {LOAD_FORMATS}",
                repr(self.load_format),
                "'auto' reads the checkpoint's weights; 'dummy' fills the model with seeded random ones.",
            )
        ranks = self.tensor_parallel_size * self.data_parallel_size
        if ranks > 1 and dev.index is not None:
            raise bad_config(
                "LLM device",
                f"'cuda' or 'cpu' without an index with tensor_parallel_size={self.tensor_parallel_size}, "
                f"data_parallel_size={self.data_parallel_size}",
                repr(self.device),
                "Rank i runs on cuda:i, replica r on the r-th group of tensor_parallel_size GPUs (choose the "
                "GPUs with CUDA_VISIBLE_DEVICES).",
            )
        if ranks > 1 and dev.type == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n < ranks:
                raise bad_config(
                    "LLM tensor_parallel_size * data_parallel_size",
                    f"<= the visible GPUs ({n})",
                    ranks,
                    "One GPU per rank: lower tensor_parallel_size / data_parallel_size or make more GPUs "
                    "visible (CUDA_VISIBLE_DEVICES).",
                )


def resolve_idle_poll_s(ec: EngineConfig, device_type: str | None) -> float:
    """``ec.idle_poll_s`` in seconds; None (auto): :data:`IDLE_POLL_AUTO_S` on ``"cuda"``, else 0 (the CPU's
    cores are the engine's own)."""
    if ec.idle_poll_s is not None:
        return float(ec.idle_poll_s)
    return IDLE_POLL_AUTO_S if device_type == "cuda" else 0.0


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


def resolve_max_model_len(ec: EngineConfig, cfg: ModelConfig) -> int:
    """Tokens per sequence: ``ec.max_model_len``, or the model's ``max_position_embeddings`` when None.

    Raises:
        ConfigurationError: a ``max_model_len`` above the model's ``max_position_embeddings``.
    """
    n = ec.max_model_len or cfg.max_position_embeddings
    if n > cfg.max_position_embeddings:
        raise bad_config(
            "max_model_len", f"<= the model's max_position_embeddings ({cfg.max_position_embeddings})", n
        )
    return n
