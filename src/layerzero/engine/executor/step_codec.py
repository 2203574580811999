"""The step message rank 0 sends the other tensor-parallel ranks each step: a
:class:`~layerzero.engine.core.sched.output.SchedulerOutput` as plain msgpack data (no pickle), made cheap to
build and to read (vLLM V1 sends a request's static data once, then only what changed; nano-vllm writes the
step into shared memory):

- the block tables as one raw int32 buffer plus its shape (not nested lists);
- each request's :class:`SamplingParams` once: the encoder remembers which request ids the workers hold (at
  most ``capacity``, least recently used forgotten first, the forgotten ids named in the message so both sides
  forget the same ones) and sends a request's parameters again only when it is new or they changed (a new
  object);
- a structured-output step's grammar bitmask (filled on rank 0's host before the message is sent) as raw
  bytes plus its shape;
- everything else as the lists it is.

:class:`StepEncoder` (rank 0) and :class:`StepDecoder` (each worker) are a pair: every message must be decoded
in order, none skipped. Measured: ``benchmarks/parallel/bench_step_channel.py``
(``benchmarks/results/parallel/step_channel.md``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import numpy as np

from ..core.sched.output import (
    GrammarBitmask,
    PromptLogprobsRows,
    SamplingMetadata,
    SchedulerOutput,
    resolve_bitmask,
)
from ..core.serial import params_fields
from ..sampling_params import SamplingParams
from .channel import pack, unpack

__all__ = ["StepDecoder", "StepEncoder"]

_PLAIN = tuple(
    f.name
    for f in dataclasses.fields(SchedulerOutput)
    if f.name not in ("block_tables", "sampling", "prompt_logprobs")
)


class StepEncoder:
    """Rank 0's side: :meth:`encode` a step into bytes. ``capacity``: request ids whose parameters the workers
    keep (a multiple of the running batch: a preempted request that comes back later is sent again)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._sent: OrderedDict[str, SamplingParams] = OrderedDict()  # request id -> params the workers hold

    def encode(self, out: SchedulerOutput) -> bytes:
        """``["step", fields, tables, new_params, forget, sampling_rest, prompt_logprobs]`` as msgpack."""
        fields = [getattr(out, name) for name in _PLAIN]
        t = out.block_tables
        tables = None if t is None else [np.ascontiguousarray(t, dtype=np.int32).tobytes(), list(t.shape)]
        s = out.sampling
        new: dict[int, dict[str, Any]] = {}
        # sampled rows follow the step's sampled chunks in order: their request ids
        rows = [rid for rid, sample in zip(out.req_ids, out.sample, strict=True) if sample]
        for i, (rid, params) in enumerate(zip(rows, s.params, strict=True)):
            if self._sent.get(rid) is not params:
                new[i] = params_fields(params)
                self._sent[rid] = params
            self._sent.move_to_end(rid)
        forget = []
        while len(self._sent) > self.capacity:
            forget.append(self._sent.popitem(last=False)[0])
        rest = [
            s.seeds,
            s.num_output_tokens,
            s.prompt_token_ids,
            s.output_token_ids,
            None,
            s.seq_ids,
            s.penalty_reset,
            s.free_seq_ids,
        ]
        gb = resolve_bitmask(s.grammar_bitmask)
        if gb is not None:
            bits = np.ascontiguousarray(gb.bits, dtype=np.int32)
            rest[4] = [
                np.ascontiguousarray(gb.rows, dtype=np.int64).tobytes(),
                bits.tobytes(),
                list(bits.shape),
            ]
        plp = dataclasses.asdict(out.prompt_logprobs)
        return pack(["step", fields, tables, new, forget, rest, plp])


class StepDecoder:
    """A worker's side: :meth:`decode` rebuilds each step :class:`StepEncoder` encoded, in order."""

    def __init__(self) -> None:
        self._params: dict[str, SamplingParams] = {}

    def decode(self, data: bytes | list[Any]) -> SchedulerOutput:
        """The step in ``data`` (the message's bytes, or the list they unpack to).

        Raises:
            KeyError: a sampled request whose parameters were never sent (a message was skipped: the encoder
                and decoder are out of step).
        """
        msg = unpack(data) if isinstance(data, bytes) else data
        _, fields, tables, new, forget, rest, plp = msg
        out = dict(zip(_PLAIN, fields, strict=True))
        out["blocks_to_copy"] = [(a, b) for a, b in out["blocks_to_copy"]]  # msgpack gives lists
        rows = [rid for rid, sample in zip(out["req_ids"], out["sample"], strict=True) if sample]
        params = []
        for i, rid in enumerate(rows):
            fresh = new.get(i)
            if fresh is not None:
                self._params[rid] = SamplingParams(**fresh)
            params.append(self._params[rid])
        for rid in forget:
            self._params.pop(rid, None)
        block_tables = None
        if tables is not None:
            raw, shape = tables
            block_tables = np.frombuffer(raw, dtype=np.int32).reshape(shape).copy()
        seeds, num_out, prompts, outputs, gb, seq_ids, reset, free = rest
        bitmask = None
        if gb is not None:
            rows_raw, bits_raw, shape = gb
            bitmask = GrammarBitmask(
                np.frombuffer(rows_raw, dtype=np.int64).copy(),
                np.frombuffer(bits_raw, dtype=np.int32).reshape(shape).copy(),
            )
        return SchedulerOutput(
            **out,
            block_tables=block_tables,
            sampling=SamplingMetadata(
                params=params,
                seeds=seeds,
                num_output_tokens=num_out,
                prompt_token_ids=prompts,
                output_token_ids=outputs,
                grammar_bitmask=bitmask,
                seq_ids=seq_ids,
                penalty_reset=reset,
                free_seq_ids=free,
            ),
            prompt_logprobs=PromptLogprobsRows(**plp),
        )
