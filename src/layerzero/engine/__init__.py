"""LayerZero's serving engine: ``from layerzero.engine import LLM, SamplingParams``.

A reference LLM engine on LayerZero's ops (Llama, Qwen3, Qwen3-MoE; paged KV cache, prefix caching, continuous
batching with chunked prefill). It imports only the public ``layerzero`` API, and ``import layerzero`` does
not import it. See docs/engine.md. ``AsyncLLM`` (the online engine, its core in a child process) and
``EngineDeadError`` (and the beam-search types) are imported on first use.
"""

from typing import Any

from .config import EngineConfig
from .llm import LLM
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecDecodeMetrics
from .sampling_params import SamplingParams, StructuredOutputsParams
from .spec_decode.config import SpeculativeConfig

__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SpecDecodeMetrics",
    "SpeculativeConfig",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name == "AsyncLLM":
        from .async_llm import AsyncLLM

        return AsyncLLM
    if name in ("BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"):
        from . import beam_search

        return getattr(beam_search, name)
    if name == "EngineDeadError":
        from .core.errors import EngineDeadError

        return EngineDeadError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
