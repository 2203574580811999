"""A bounded soak of one ``LLM`` (issue 35): 2,000 requests mixing good ones with every bad kind the engine
must survive (refused inputs, requests that raise inside a step, streams closed early or left open across
other calls, interrupted calls), in a small KV pool (preemption) with async scheduling and prefix caching.

Oracle: every good request's tokens equal those of a clean run of the same (prompt, parameters) (greedy and
seeded requests: the same tokens alone or in any batch). At the end no request, sequence or block is left, the
block pool's invariants hold, and the resident memory is flat after the warm-up.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random

import pytest
import torch

import layerzero as lz

from ..conftest import deadline

pytestmark = pytest.mark.stress

NUM_REQUESTS = 2000
WARMUP = 400
RSS_GROWTH_LIMIT = (
    48 * 2**20
)  # bytes; a leak of one block table, sequence or request per call would exceed it


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def good_params():
    """(name, SamplingParams) of the good kinds: greedy and seeded sampling, various lengths and stops."""
    from layerzero.engine import SamplingParams

    kinds = []
    for n in (1, 3, 7):
        kinds.append(SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        kinds.append(SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=100 + n, ignore_eos=True))
    kinds.append(SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2))
    kinds.append(SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[7, 9, 11]))
    return kinds


def poisoned(rng: random.Random):
    """A request whose parameters passed validation and raise in the sampler."""
    from layerzero.engine import SamplingParams

    sp = SamplingParams(max_tokens=5, temperature=0.7, ignore_eos=True)
    field, value = rng.choice(
        [("top_k", 2**31), ("seed", 2**63), ("temperature", 1e39), ("repetition_penalty", 1e39)]
    )
    object.__setattr__(sp, field, value)
    return sp


def test_soak_one_llm_survives_every_bad_kind(checkpoints, monkeypatch):
    from layerzero.engine import LLM, SamplingParams

    llm = LLM(
        checkpoints["qwen3"],
        device="cpu",
        dtype=torch.float32,
        max_model_len=64,
        num_kv_blocks=14,
        block_size=8,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        async_scheduling=True,
    )
    rng = random.Random(0)
    base = [1, 30, 31, 32, 33, 34, 35, 36, 37]  # a shared first block: prefix-cache hits
    prompts = [base + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    prompts += [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(2, 30))] for _ in range(8)]
    kinds = good_params()
    combos = [(p, k) for p in range(len(prompts)) for k in range(len(kinds))]
    clean_out = llm.generate([prompts[p] for p, _ in combos], [kinds[k] for _, k in combos], use_tqdm=False)
    clean = {c: o.outputs[0].token_ids for c, o in zip(combos, clean_out, strict=True)}

    runner = llm.engine.runner
    real_execute, interrupt_at = runner.execute, [-1]

    def execute(*args, **kwargs):
        interrupt_at[0] -= 1
        if interrupt_at[0] == 0:
            raise KeyboardInterrupt
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)
    counts = dict.fromkeys(("good", "refused", "failed", "closed", "interrupted", "open_stream"), 0)
    open_streams: list = []  # (generator, combo, tokens so far)
    rss_after_warmup = 0
    done = 0
    with deadline(300):
        while done < NUM_REQUESTS:
            if rss_after_warmup == 0 and done >= WARMUP:
                gc.collect()
                rss_after_warmup = rss_bytes()
            kind = rng.random()
            if kind < 0.55:  # a batch of good requests, some with a poisoned one among them
                batch = [rng.choice(combos) for _ in range(rng.randrange(1, 7))]
                params = [kinds[k] for _, k in batch]
                bad_at = rng.randrange(len(batch) + 1) if rng.random() < 0.4 else None
                ps = [prompts[p] for p, _ in batch]
                if bad_at is not None:
                    ps.insert(bad_at, prompts[rng.randrange(len(prompts))])
                    params.insert(bad_at, poisoned(rng))
                outs = llm.generate(ps, params, use_tqdm=False)
                if bad_at is not None:
                    bad = outs.pop(bad_at)
                    assert bad.outputs[0].finish_reason == "error" and bad.error
                    counts["failed"] += 1
                for c, o in zip(batch, outs, strict=True):
                    assert o.error is None and o.outputs[0].token_ids == clean[c], (c, o)
                counts["good"] += len(batch)
                done += len(ps)
            elif kind < 0.7:  # refused before anything is queued
                bad_prompt = rng.choice([[1, 600], [], [1] * 65, "a\ud800", None, [1, -2], [1, 2.0]])
                with pytest.raises((lz.InvalidInputError, ValueError)):
                    if rng.random() < 0.5:
                        llm.generate([prompts[0], bad_prompt], SamplingParams(max_tokens=2), use_tqdm=False)
                    else:
                        llm.generate([prompts[0]], SamplingParams(max_tokens=2, top_k=2**31), use_tqdm=False)
                counts["refused"] += 1
                done += 1
            elif kind < 0.8:  # a stream closed after its first delta
                c = rng.choice(combos)
                s = llm.stream(prompts[c[0]], kinds[c[1]])
                first = next(s)
                assert clean[c][: len(first.outputs[0].token_ids)] == first.outputs[0].token_ids
                s.close()
                counts["closed"] += 1
                done += 1
            elif kind < 0.9:  # a stream left open across other calls, read to its end later
                c = rng.choice(combos)
                open_streams.append((llm.stream(prompts[c[0]], kinds[c[1]]), c, []))
                counts["open_stream"] += 1
                done += 1
            else:  # an interrupted call: KeyboardInterrupt in its first few steps
                interrupt_at[0] = rng.randrange(1, 4)
                batch = [rng.choice(combos) for _ in range(rng.randrange(1, 5))]
                try:
                    llm.generate([prompts[p] for p, _ in batch], [kinds[k] for _, k in batch], use_tqdm=False)
                except KeyboardInterrupt:
                    counts["interrupted"] += 1
                interrupt_at[0] = -1
                done += len(batch)
            if open_streams and rng.random() < 0.3:  # advance or finish one open stream
                gen, c, toks = open_streams.pop(rng.randrange(len(open_streams)))
                for delta in gen:
                    toks += delta.outputs[0].token_ids
                assert toks == clean[c]
        for gen, c, toks in open_streams:
            for delta in gen:
                toks += delta.outputs[0].token_ids
            assert toks == clean[c]
    del open_streams
    gc.collect()
    eng = llm.engine
    assert all(counts.values()), counts  # every kind happened
    assert eng.requests == {} and not eng.has_unfinished()
    assert not eng.scheduler.waiting and not eng.scheduler.running
    assert eng.kv.usage() == 0.0
    eng.kv.check_invariants()
    growth = rss_bytes() - rss_after_warmup
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth / 2**20:.1f} MiB after the warm-up"
    again = llm.generate(
        [prompts[p] for p, _ in combos[:12]], [kinds[k] for _, k in combos[:12]], use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in again] == [clean[c] for c in combos[:12]]
    print("soak:", counts, f"RSS growth after warm-up {growth / 2**20:.1f} MiB")


def test_poisoned_params_are_really_refused_by_validation():
    """The soak sneaks its poisoned values past validation; each is refused when constructed normally."""
    from layerzero.engine import SamplingParams

    for field, value in [
        ("top_k", 2**31),
        ("seed", 2**63),
        ("temperature", 1e39),
        ("repetition_penalty", 1e39),
    ]:
        with pytest.raises(lz.InvalidInputError):
            SamplingParams(**{field: value})
        assert dataclasses.replace(SamplingParams(), **{field: 1}) is not None
