"""A small fake engine core for the process-boundary tests: implements ``EngineCoreProtocol`` (and the
utility methods) without a model. The engine core process builds it by name (``core_factory``).

Completion ``index`` of a request whose prompt is ``p`` emits, at its ``t``-th step, token
``fake_token(p, index, t)``; it finishes with ``"length"`` after ``max_tokens`` tokens, or ``"stop"`` at a
token in ``stop_token_ids``. At most ``max_num_seqs`` requests run per step, the others wait (FCFS); each
running completion holds ``ceil(tokens / block_size)`` of ``num_kv_blocks`` blocks.

:func:`fake_engine` starts an ``AsyncLLM`` whose core process builds one of these classes.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import layerzero as lz
from layerzero.engine.core.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats

VOCAB = 512


def fake_token(prompt: list[int], index: int, t: int, vocab: int = VOCAB) -> int:
    """The token completion ``index`` of ``prompt`` gets at its step ``t`` (0-based)."""
    return (sum(prompt) * 31 + 7 * t + 3 * index + 11) % vocab


class FakeEngineCore:
    step_s = 0.0  # seconds each step sleeps (a slow model)
    crash_at_step: int | None = None  # the step that raises (a failing core)

    def __init__(self, config) -> None:
        self.config = config
        self.vocab = VOCAB
        if (Path(config.model) / "config.json").is_file():
            from layerzero.engine.config import ModelConfig

            self.vocab = ModelConfig.from_pretrained(config.model).vocab_size
        self.max_model_len = config.max_model_len or 256
        self.num_kv_blocks = config.num_kv_blocks or 64
        self.waiting: dict[str, object] = {}
        self.running: dict[str, dict] = {}
        self.steps = 0
        self.prompt_tokens = self.generation_tokens = 0

    def add_request(self, request) -> None:
        rid = request.request_id
        if rid in self.waiting or rid in self.running:
            raise lz.InvalidInputError(f"request_id: expected a new id, got {rid!r}")
        self.waiting[rid] = request

    def abort_requests(self, aborts) -> None:
        for a in aborts:
            self.waiting.pop(a.request_id, None)
            st = self.running.get(a.request_id)
            if st is None:
                continue
            for i in [a.index] if a.index is not None else list(st["done"]):
                st["done"][i] = True
            if all(st["done"].values()):
                del self.running[a.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> EngineCoreOutputs:
        self.steps += 1
        if self.crash_at_step is not None and self.steps >= self.crash_at_step:
            raise RuntimeError("fake core: step failed")
        if self.step_s:
            time.sleep(self.step_s)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            rid = next(iter(self.waiting))
            req = self.waiting.pop(rid)
            n = req.sampling_params.n
            self.running[rid] = {
                "req": req,
                "t": {i: 0 for i in range(n)},
                "done": {i: False for i in range(n)},
            }
            self.prompt_tokens += len(req.prompt_token_ids)
        outs = []
        for rid, st in list(self.running.items()):
            req, sp = st["req"], st["req"].sampling_params
            for i, t in st["t"].items():
                if st["done"][i]:
                    continue
                tok = fake_token(req.prompt_token_ids, i, t, self.vocab)
                st["t"][i] = t + 1
                self.generation_tokens += 1
                finish = stop = None
                if tok in (sp.stop_token_ids or ()) and t + 1 >= sp.min_tokens:
                    finish, stop = "stop", tok
                elif t + 1 >= sp.max_tokens:
                    finish = "length"
                lps = [{tok: -0.5}] if sp.logprobs is not None else None
                outs.append(EngineCoreOutput(rid, i, [tok], lps, -0.5 * (t + 1), None, finish, stop))
                if finish:
                    st["done"][i] = True
            if all(st["done"].values()):
                del self.running[rid]
        return EngineCoreOutputs(outs, time.time(), self.get_stats())

    def get_stats(self) -> SchedulerStats:
        bs = self.config.block_size
        used = sum(
            math.ceil((len(st["req"].prompt_token_ids) + t) / bs)
            for st in self.running.values()
            for i, t in st["t"].items()
            if not st["done"][i]
        )
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=used / self.num_kv_blocks,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
        )

    def kernel_report(self) -> dict:
        return {"fake.op": {"1": {"kernel": "fake.kernel", "why": ["fake"]}}, "pid": os.getpid()}

    def reset_prefix_cache(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.running.clear()
        self.waiting.clear()


class SlowFakeEngineCore(FakeEngineCore):
    step_s = 0.004


class CrashingFakeEngineCore(FakeEngineCore):
    crash_at_step = 3


class FailingFakeEngineCore(FakeEngineCore):
    def __init__(self, config) -> None:
        raise lz.ConfigurationError("fake core: max_model_len: expected <= 64, got 65. Lower it.")


class BrokenFakeEngineCore(FakeEngineCore):
    def __init__(self, config) -> None:
        raise OSError("fake core: no such device")


def fake_engine(model: str, core: str = "SlowFakeEngineCore", **options):
    """An ``AsyncLLM`` on ``model`` (CPU) whose engine core process builds the fake class ``core`` of this
    module; ``options``: more ``AsyncLLM`` keywords. The caller shuts it down."""
    from layerzero.engine import AsyncLLM

    return AsyncLLM(model, device="cpu", _core_factory=f"{__name__}:{core}", **options)
