"""``SpeculativeConfig``: the validated ``speculative_config`` of ``LLM`` / ``AsyncLLM`` / ``layerzero serve
--speculative-config JSON`` (vLLM's keys: ``method``, ``num_speculative_tokens``, ``model``,
``prompt_lookup_min``, ``prompt_lookup_max``; plus ``num_layers`` for ``"layer_skip"`` self-speculation)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import bad_config

__all__ = ["SPEC_METHODS", "SpeculativeConfig"]

SPEC_METHODS = ("ngram", "draft_model", "layer_skip")
"""``"ngram"``: prompt lookup on the sequence's own tokens (host side, no model); ``"draft_model"``: a second
small model with the target's vocabulary; ``"layer_skip"``: the target's first ``num_layers`` layers, its
final norm and LM head (self-speculation)."""

_KEYS = (
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "num_layers",
)


def _int(name: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad_config(f"speculative_config {name}", f"an int >= {lo}", repr(v))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings (vLLM's ``speculative_config`` keys).

    - ``method``: one of :data:`SPEC_METHODS`.
    - ``num_speculative_tokens`` (k >= 1): draft tokens proposed per step for each speculating sequence; a
      step verifies them with the target model in one forward of k + 1 positions.
    - ``model``: the draft checkpoint directory (``"draft_model"`` only; same tokenizer and vocabulary size as
      the target).
    - ``prompt_lookup_min`` / ``prompt_lookup_max`` (``"ngram"`` only; vLLM's defaults: neither given -> 5
      and 5, one given -> the other equals it): the n-gram sizes matched against the sequence's earlier
      tokens, the longest first.
    - ``num_layers`` (``"layer_skip"`` only): the draft is the target's first m layers; 1 <= m < the target's
      layer count (checked against the model by :meth:`check_model`).

    Raises:
        ConfigurationError: an unknown key or method, a value of the wrong type or out of range, a missing
            ``model`` for ``"draft_model"`` / ``num_layers`` for ``"layer_skip"``, a key another method owns.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise bad_config("speculative_config method", f"one of {SPEC_METHODS}", repr(self.method))
        _int("num_speculative_tokens", self.num_speculative_tokens, 1)
        m = self.method
        owners = {"model": "draft_model", "num_layers": "layer_skip"}
        for key in ("model", "num_layers", "prompt_lookup_min", "prompt_lookup_max"):
            owner = owners.get(key, "ngram")
            if getattr(self, key) is not None and m != owner:
                raise bad_config(
                    f"speculative_config {key}",
                    f"unset with method {m!r} (it belongs to method {owner!r})",
                    repr(getattr(self, key)),
                )
        if m == "draft_model":
            if not isinstance(self.model, (str, Path)) or not str(self.model):
                raise bad_config(
                    "speculative_config model",
                    "the draft checkpoint's directory (method 'draft_model')",
                    repr(self.model),
                    "Pass a small model with the target's tokenizer, e.g. {'method': 'draft_model', "
                    "'model': '/path/to/draft', 'num_speculative_tokens': 4}.",
                )
            object.__setattr__(self, "model", str(self.model))
        if m == "layer_skip":
            if self.num_layers is None:
                raise bad_config(
                    "speculative_config num_layers",
                    "an int >= 1 (method 'layer_skip': the draft is the target's first num_layers layers)",
                    None,
                )
            _int("num_layers", self.num_layers, 1)
        if m == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is not None:
                _int("prompt_lookup_min", lo, 1)
            if hi is not None:
                _int("prompt_lookup_max", hi, 1)
            if lo is None and hi is None:
                lo = hi = 5
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            if lo > hi:
                raise bad_config(
                    "speculative_config prompt_lookup_min",
                    f"<= prompt_lookup_max ({hi})",
                    lo,
                )
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_any(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """A :class:`SpeculativeConfig` from itself, a dict of vLLM's keys, or a JSON object string (the
        CLI's ``--speculative-config``); None stays None.

        Raises:
            ConfigurationError: not one of those, invalid JSON, an unknown key, or a bad value."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise bad_config("speculative_config", "a JSON object", repr(value), str(exc)) from None
        if not isinstance(value, Mapping):
            raise bad_config(
                "speculative_config", "a dict (vLLM's keys), a JSON object string or None", repr(value)
            )
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise bad_config("speculative_config keys", f"a subset of {_KEYS}", unknown)
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise bad_config(f"speculative_config {key}", "present (required)", "missing")
        return cls(**dict(value))

    def to_dict(self) -> dict[str, Any]:
        """The set keys as a plain dict (JSON-able)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def check_model(self, num_layers: int, vocab_size: int, draft_vocab_size: int | None = None) -> None:
        """Check against the target model (``num_layers`` layers, ``vocab_size`` tokens) and, for
        ``"draft_model"``, the draft's ``draft_vocab_size``.

        Raises:
            ConfigurationError: ``num_layers`` not in [1, target layers); a draft vocabulary size that differs
                from the target's."""
        if self.method == "layer_skip" and not 1 <= self.num_layers < num_layers:
            raise bad_config(
                "speculative_config num_layers",
                f"in [1, {num_layers}) (fewer than the target's {num_layers} layers)",
                self.num_layers,
            )
        if self.method == "draft_model" and draft_vocab_size != vocab_size:
            raise bad_config(
                "speculative_config model's vocab_size",
                f"the target's ({vocab_size}): the draft must share the target's tokenizer",
                draft_vocab_size,
            )
