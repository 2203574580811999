"""LayerZero's serving engine: ``from layerzero.engine import LLM, SamplingParams``.

A reference LLM engine on LayerZero's ops (Llama, Qwen3, Qwen3-MoE; paged KV cache, prefix caching, continuous
batching with chunked prefill). It imports only the public ``layerzero`` API, and ``import layerzero`` does
not import it. See docs/engine.md.
"""

from .config import EngineConfig
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
