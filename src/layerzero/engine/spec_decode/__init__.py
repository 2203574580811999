"""Speculative decoding (issue 39 section 3; docs/decoding.md "Speculative decoding"): the config
(:class:`SpeculativeConfig`), the host side (:class:`SpecDecodeState`: n-gram drafts, which rows speculate,
acceptance counters), the device side (``proposer.DraftProposer``: draft-model and layer-skip drafts) and
exact rejection sampling (``rejection``, ``verify``). Importing this package loads only the config and host
side."""

from .config import SPEC_METHODS, SpeculativeConfig
from .state import SpecDecodeState, unsupported_reason

__all__ = ["SPEC_METHODS", "SpecDecodeState", "SpeculativeConfig", "unsupported_reason"]
