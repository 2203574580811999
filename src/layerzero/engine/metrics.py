"""Per-step engine statistics (``LLM.stats()`` and a periodic log line)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

__all__ = ["EngineStats", "StepStats"]

log = logging.getLogger("layerzero.engine")


@dataclass
class StepStats:
    """One step: sequences and tokens in the batch (prefill tokens: chunks of more than one token; decode:
    one), tokens sampled, time split in seconds of host time (on CUDA, ``forward_s`` is the launch and the
    wait for the GPU lands in ``sample_s``, whose first device-to-host copy waits for the forward)."""

    num_seqs: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0
    num_sampled: int = 0
    schedule_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    detokenize_s: float = 0.0


@dataclass
class EngineStats:
    """Totals since the engine started plus the last step; ``prefix_hit_rate`` is cached / looked-up prompt
    tokens, ``kv_usage`` the fraction of KV blocks held by running sequences; ``cascade_steps`` the steps
    (decode, or with prefill chunks) run as cascade attention and ``cascade_saved_tokens`` the KV tokens (per
    layer) their shared level did not read again. Start-up: ``startup_s`` (seconds to build the engine:
    weights, KV pool, CUDA graphs, warm-up; ``LLM``'s whole constructor), ``weights_bytes`` and
    ``weights_load_s`` (rank 0's weight bytes and the seconds reading or, with ``load_format="dummy"``,
    drawing them, synchronised), ``warmup_s`` and ``warmup_shapes``
    (the start-up warm-up's seconds and dummy runs, 0 when it is off; docs/engine.md "Start-up and
    warm-up"); ``spec_decode``: speculative decoding's counters
    (:meth:`~layerzero.engine.spec_decode.SpecDecodeState.as_dict`: drafts, draft and accepted tokens,
    acceptance rate, mean acceptance length, rows decoded without speculation and why), empty when off."""

    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished_requests: int = 0
    prefix_hit_rate: float = 0.0
    kv_usage: float = 0.0
    num_kv_blocks: int = 0
    cascade_steps: int = 0
    cascade_saved_tokens: int = 0
    startup_s: float = 0.0
    weights_bytes: int = 0
    weights_load_s: float = 0.0
    warmup_s: float = 0.0
    warmup_shapes: int = 0
    spec_decode: dict = field(default_factory=dict)
    time_s: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("schedule", "forward", "sample", "detokenize"), 0.0)
    )
    last_step: StepStats = field(default_factory=StepStats)
    _last_log: float = field(default_factory=time.monotonic, repr=False)

    def record(self, step: StepStats, kv_usage: float, hit_rate: float, log_every_s: float = 5.0) -> None:
        """Add a step; log a summary line at most every ``log_every_s`` seconds (logger
        ``layerzero.engine``)."""
        self.steps += 1
        self.prompt_tokens += step.num_prefill_tokens
        self.generation_tokens += step.num_sampled
        self.preemptions += step.num_preempted
        for k in self.time_s:
            self.time_s[k] += getattr(step, f"{k}_s")
        self.kv_usage, self.prefix_hit_rate, self.last_step = kv_usage, hit_rate, step
        now = time.monotonic()
        if now - self._last_log >= log_every_s:
            self._last_log = now
            log.info(
                "step %d: %d seqs, %d prefill + %d decode tokens, KV %.1f%%, prefix hit %.1f%%, "
                "preemptions %d",
                self.steps,
                step.num_seqs,
                step.num_prefill_tokens,
                step.num_decode_tokens,
                100 * kv_usage,
                100 * hit_rate,
                self.preemptions,
            )

    def as_dict(self) -> dict:
        """A plain-dict copy."""
        d = asdict(self)
        d.pop("_last_log", None)
        return d
