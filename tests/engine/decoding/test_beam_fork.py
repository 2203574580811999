"""Copy-on-write forking for beam search (docs/decoding.md, "Beam search and n"): after the first step each
beam request computes exactly its one new token (its parent's KV forked: full blocks shared, the partial
last block copied), every block comes back after a search (also one that raises midway), the scheduler's
fork admission and its fallbacks on a hand-checked pool, the model runner's block copy against a hand-made
KV tensor, and ``blocks_to_copy`` through the tensor-parallel step message. Transformers' equality is
``test_beam_search.py``'s (its searches run through the forks)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from ..conftest import prompts

BLOCK = 4


def _llm(path):
    from layerzero.engine import LLM

    return LLM(path, device="cpu", dtype=torch.float32, max_model_len=48, num_kv_blocks=64, block_size=BLOCK)


def _params(w, t, **kw):
    from layerzero.engine import BeamSearchParams

    return BeamSearchParams(beam_width=w, max_tokens=t, **kw)


def _no_leak(llm):
    core = llm.engine
    kv = core.kv
    kv.check_invariants()
    assert kv.pool.num_referenced == 0  # every refcount back to 0
    assert kv.num_free_blocks() == kv.num_blocks  # free or evictable (cached, unreferenced)
    assert not core.retained and not core.scheduler.retained and not core.scheduler.forks
    assert not core.requests and not core.scheduler.has_unfinished()


@pytest.mark.integration
def test_each_step_after_the_first_computes_one_token_per_beam(checkpoints, monkeypatch):
    llm = _llm(checkpoints["llama"])
    prompt = prompts(1, seed=61, lo=9, hi=9)[0]
    steps = []  # per engine step: (tokens per chunk, block copies)
    execute = llm.engine.executor.execute_model

    held = []  # retained beam requests at each engine step: dropped parents are released during the search

    def spy(out):
        steps.append((list(out.num_scheduled_tokens), list(out.blocks_to_copy)))
        held.append(len(llm.engine.retained))
        return execute(out)

    monkeypatch.setattr(llm.engine.executor, "execute_model", spy)
    before = llm.engine.stats.prompt_tokens
    w, t = 3, 10
    (out,) = llm.beam_search([prompt], _params(w, t, ignore_eos=True))
    assert len(out.sequences) == w and all(len(s.output_tokens) == t for s in out.sequences)
    # one engine step per search step (ignore_eos: no hypothesis ends before max_tokens)
    assert len(steps) == t
    assert steps[0] == ([len(prompt)], [])  # the prompt, prefilled once
    # Step s >= 1 runs W beams whose tokens are the prompt plus s generated ones, each forked from
    # its parent's first 9 + s - 1 tokens: exactly one token computed per beam, and one block copied per
    # beam when the parent's tokens end inside a block. Before the forks each beam was a new request whose
    # full blocks came from the prefix cache and which re-prefilled the rest: (9 + s - 1) % 4 + 1 tokens
    # per beam (1 to block_size, 2.5 on average here), so 3 to 12 tokens per step instead of 3.
    for s, (lens, copies) in enumerate(steps[1:], start=1):
        assert lens == [1] * w, (s, lens)
        assert len(copies) == (w if (len(prompt) + s - 1) % BLOCK else 0), (s, copies)
        assert len({d for _, d in copies}) == len(copies)
    assert llm.engine.stats.prompt_tokens - before == len(prompt)  # no prefill chunk after the first
    assert held[0] == 1 and max(held) <= 2 * w  # the step's parents and its beams, no more (else 1 + 3s)
    _no_leak(llm)


@pytest.mark.integration
@pytest.mark.parametrize("where", ["before_step", "after_step"])
def test_no_block_leaks_when_the_search_raises_midway(checkpoints, monkeypatch, where):
    from layerzero.engine import beam_search as bs

    llm = _llm(checkpoints["qwen3"])
    prompt = prompts(1, seed=62, lo=6, hi=6)[0]
    (ref,) = llm.beam_search([prompt], _params(2, 5))
    _no_leak(llm)
    real, calls = bs._CoreSteps._step, []

    def boom(self):
        calls.append(1)
        if len(calls) == 3 and where == "before_step":  # step 3's forks are queued, not admitted
            raise KeyboardInterrupt
        res = real(self)
        if len(calls) == 3:  # step 3's forks ran and finished, their outputs not read
            raise KeyboardInterrupt
        return res

    monkeypatch.setattr(bs._CoreSteps, "_step", boom)
    with pytest.raises(KeyboardInterrupt):
        llm.beam_search([prompt], _params(2, 5))
    _no_leak(llm)
    monkeypatch.setattr(bs._CoreSteps, "_step", real)
    (again,) = llm.beam_search([prompt], _params(2, 5))  # the engine is fine afterwards
    assert [s.tokens for s in again.sequences] == [s.tokens for s in ref.sequences]
    _no_leak(llm)


def _sched(num_blocks):
    from layerzero.engine.core.kv.block_manager import KVCacheManager
    from layerzero.engine.core.sched.policy import make_policy
    from layerzero.engine.core.sched.scheduler import Scheduler

    kv = KVCacheManager(num_blocks, BLOCK, watermark=0.0)
    return kv, Scheduler(kv, make_policy("fcfs"), max_num_seqs=8, max_num_batched_tokens=64)


def _seq(rid, toks):
    from layerzero.engine import SamplingParams
    from layerzero.engine.core.sequence import Sequence

    return Sequence(rid, 0, list(toks), len(toks), SamplingParams(max_tokens=1))


def _run_and_finish(sched, seq, tok):
    """Compute ``seq``'s scheduled chunk, append ``tok`` and finish it (as the engine loop does)."""
    from layerzero.engine.core.sequence import FinishReason

    sched.after_forward()
    seq.token_ids.append(tok)
    sched.finish(seq, FinishReason.LENGTH)


def test_scheduler_admits_a_fork_and_falls_back_when_it_cannot(caplog):
    kv, sched = _sched(3)
    parent = _seq("p", [1, 5, 6, 7, 8, 9])  # 6 tokens: block 0 full, block 1 half
    sched.add(parent, retain_kv=True)
    out = sched.schedule()
    assert out.num_scheduled_tokens == [6] and out.blocks_to_copy == []
    _run_and_finish(sched, parent, 11)
    table = kv.block_table(parent.seq_id)  # retained after its finish
    assert len(table) == 2
    child = _seq("c", [*parent.token_ids[:6], 11])
    sched.add(child, fork_of=(parent, 6), retain_kv=True)
    out = sched.schedule()
    # the fork: 6 tokens computed, 1 to compute; block 0 shared, block 1 copied into the last free block
    assert out.num_computed_tokens == [6] and out.num_scheduled_tokens == [1]
    (src, dst), *more = out.blocks_to_copy
    assert not more and src == table[1] and dst not in table
    assert out.block_tables.tolist() == [[table[0], dst]]
    assert kv.pool._ref[table[0]] == 2 and kv.pool._ref[table[1]] == 1 and kv.pool._ref[dst] == 1
    assert child.num_cached_tokens == 6
    _run_and_finish(sched, child, 13)  # retained: the pool stays full
    # no block left for a second fork's copy: it falls back (logged), waits, and is not lost
    other = _seq("d", [*parent.token_ids[:6], 12])
    sched.add(other, fork_of=(parent, 6))
    with caplog.at_level(logging.INFO, logger="layerzero.engine"):
        out = sched.schedule()
    assert (
        "admitted through the prefix cache" in caplog.text and "1 free blocks needed, 0 left" in caplog.text
    )
    assert other in sched.waiting and other.seq_id not in sched.forks
    assert out.seq_ids == []  # the ordinary way needs a block too: none this step
    # the parent released: the other one is admitted the ordinary way (block 0 from the prefix cache)
    sched.release(parent)
    out = sched.schedule()
    assert (
        out.seq_ids == [other.seq_id] and out.num_computed_tokens == [4] and out.num_scheduled_tokens == [3]
    )
    assert out.blocks_to_copy == []
    sched.release(child)
    kv.check_invariants()


def test_released_parent_and_preempted_fork_recompute_from_their_tokens():
    kv, sched = _sched(8)
    parent = _seq("p", [1, 2, 3, 4, 5])
    sched.add(parent, retain_kv=True)
    sched.schedule()
    _run_and_finish(sched, parent, 6)
    child = _seq("c", [1, 2, 3, 4, 5, 6])
    sched.add(child, fork_of=(parent, 5))
    sched.release(parent)  # before the child's admission: its fork is dropped
    assert parent.seq_id not in kv and not sched.forks
    out = sched.schedule()
    assert out.num_computed_tokens == [4] and out.num_scheduled_tokens == [2] and out.blocks_to_copy == []
    _run_and_finish(sched, child, 9)
    # a fork preempted after its admission is recomputed from its tokens like any preempted sequence
    p2 = _seq("p2", [7, 8, 9, 10, 11, 12, 13])
    sched.add(p2, retain_kv=True)
    sched.schedule()
    sched.after_forward()
    p2.token_ids.append(1)
    from layerzero.engine.core.sequence import FinishReason

    sched.finish(p2, FinishReason.LENGTH)
    c2 = _seq("c2", p2.token_ids)
    sched.add(c2, fork_of=(p2, 7))
    out = sched.schedule()
    assert out.num_computed_tokens == [7] and len(out.blocks_to_copy) == 1
    sched.preempt(c2)
    assert c2.num_computed_tokens == 0 and c2 in sched.waiting and c2.seq_id not in sched.forks
    out = sched.schedule()
    assert out.num_computed_tokens == [4] and out.num_scheduled_tokens == [4] and out.blocks_to_copy == []
    sched.release(p2)
    kv.check_invariants()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_model_runner_copies_whole_blocks_in_every_layer(dtype):
    from layerzero.engine.worker.model_runner import ModelRunner

    g = torch.Generator().manual_seed(63)
    shape = (7, 2, 3, 2, 5)  # [num_blocks, K/V, block_size, Hkv, D]: odd sizes
    layers = [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]
    draft = [torch.randn(shape, generator=g).to(dtype)]
    want = [c.clone() for c in (*layers, *draft)]
    pairs = [(2, 5), (2, 6), (0, 3)]  # one src copied twice
    for w in want:  # by hand: block dst becomes block src, K and V, nothing else changes
        for s, d in pairs:
            w[d] = w[s].clone()
    fake = SimpleNamespace(kv_caches=layers, device=torch.device("cpu"))
    ModelRunner.copy_blocks(fake, pairs, draft)
    for got, ref in zip((*layers, *draft), want, strict=True):
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_step_codec_and_plain_data_carry_blocks_to_copy():
    from layerzero.engine.core.sched.output import SchedulerOutput
    from layerzero.engine.executor.step_codec import StepDecoder, StepEncoder

    out = SchedulerOutput(
        req_ids=["a"],
        seq_ids=[3],
        num_computed_tokens=[6],
        num_scheduled_tokens=[1],
        new_token_ids=[[11]],
        pending_src=[None],
        sample=[False],
        blocks_to_copy=[(4, 9), (17, 2)],
    )
    got = StepDecoder().decode(StepEncoder().encode(out))
    assert got.blocks_to_copy == [(4, 9), (17, 2)]
    assert SchedulerOutput.from_dict(out.to_dict()).blocks_to_copy == [(4, 9), (17, 2)]
    assert StepDecoder().decode(StepEncoder().encode(SchedulerOutput())).blocks_to_copy == []


@pytest.mark.integration
def test_async_scheduling_gives_the_same_beams(checkpoints):
    """Async scheduling (the CUDA default) reads a step after launching the next: the forks see their
    parents' finished KV all the same."""
    from layerzero.engine import LLM

    prompt = prompts(1, seed=64, lo=10, hi=10)[0]
    want = _llm(checkpoints["qwen3"]).beam_search([prompt], _params(3, 6, length_penalty=0.5))[0]
    llm = LLM(
        checkpoints["qwen3"],
        device="cpu",
        dtype=torch.float32,
        max_model_len=48,
        num_kv_blocks=64,
        block_size=BLOCK,
        async_scheduling=True,
    )
    assert llm.engine.async_scheduling
    (got,) = llm.beam_search([prompt], _params(3, 6, length_penalty=0.5))
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    assert [s.score for s in got.sequences] == pytest.approx([s.score for s in want.sequences], abs=1e-6)
    _no_leak(llm)


@pytest.mark.distributed
def test_tensor_parallel_ranks_copy_the_forked_blocks(checkpoints):
    """Two ranks (Gloo, CPU): every rank gets ``blocks_to_copy`` in the step message and copies its shard of
    the KV heads, so the beams equal one rank's (a rank that skipped the copy would attend to a stale
    block)."""
    from layerzero.engine import LLM

    kw = {"device": "cpu", "max_model_len": 48, "num_kv_blocks": 32, "block_size": BLOCK}
    prompt = prompts(1, seed=65, lo=7, hi=7)[0]
    params = _params(2, 5, ignore_eos=True)
    with LLM(checkpoints["qwen3"], **kw) as one:
        (want,) = one.beam_search([prompt], params)
    with LLM(checkpoints["qwen3"], tensor_parallel_size=2, **kw) as two:
        (got,) = two.beam_search([prompt], params)
        _no_leak(two)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    assert [s.score for s in got.sequences] == pytest.approx([s.score for s in want.sequences], abs=1e-4)


@pytest.mark.integration
def test_fork_and_retain_refuse_bad_input_before_queueing(checkpoints):
    from layerzero import InvalidInputError
    from layerzero.engine import SamplingParams
    from layerzero.engine.core.messages import EngineCoreRequest

    llm = _llm(checkpoints["qwen3"])
    core = llm.engine
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    core.add_request(EngineCoreRequest("p", [1, 5, 6, 7, 8], sp), retain_kv=True)
    while core.has_unfinished_requests():
        core.step()
    parent = core.retained["p"]
    toks = [*parent.token_ids]  # 5 prompt tokens, their KV computed, and the sampled one
    bad = [
        ("q", toks, {"fork_of": ("nope", 5)}, "not released"),
        ("q", toks, {"fork_of": ("p", 0)}, r"\[1, 5\]"),
        ("q", toks, {"fork_of": ("p", 6)}, r"\[1, 5\]"),
        ("q", toks[:5], {"fork_of": ("p", 5)}, r"\[1, 4\]"),  # the fork must compute a token
        ("q", [2, *toks[1:]], {"fork_of": ("p", 5)}, "first 5 tokens"),
        ("q", toks, {"fork_of": ["p", 5]}, "parent_request_id"),
        ("q", toks, {"fork_of": ("p", True)}, r"\[1, 5\]"),
        ("p", toks, {}, "a new id"),  # retained under that id
    ]
    for rid, ids, kw, match in bad:
        with pytest.raises(InvalidInputError, match=match):
            core.add_request(EngineCoreRequest(rid, ids, sp), **kw)
    with pytest.raises(InvalidInputError, match="n with fork_of"):
        core.add_request(EngineCoreRequest("q", toks, SamplingParams(n=2, max_tokens=1)), retain_kv=True)
    plp = SamplingParams(max_tokens=1, prompt_logprobs=1)
    with pytest.raises(InvalidInputError, match="prompt_logprobs"):
        core.add_request(EngineCoreRequest("q", toks, plp), fork_of=("p", 5))
    assert not core.has_unfinished_requests() and list(core.retained) == ["p"]
    core.release_kv("p")
    core.release_kv("p")  # released ids are ignored
    _no_leak(llm)


@pytest.mark.integration
@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_quantized_kv_forks_equal_recomputing(checkpoints, kv_dtype):
    """A quantized KV pool (1-byte elements, per-layer scales): the forks' byte-copied partial blocks give
    the beams that recomputing every beam's tokens gives (the same engine with ``fork_of`` dropped, so each
    beam request is prefilled through the prefix cache)."""
    from layerzero.engine import LLM

    llm = LLM(
        checkpoints["qwen3"],
        device="cpu",
        dtype=torch.float32,
        max_model_len=48,
        num_kv_blocks=64,
        block_size=BLOCK,
        kv_cache_dtype=kv_dtype,
    )
    prompt = prompts(1, seed=66, lo=10, hi=10)[0]
    params = _params(3, 6, length_penalty=0.8)
    (forked,) = llm.beam_search([prompt], params)
    core = llm.engine
    add, seen = core.add_request, []

    def no_fork(req, *, fork_of=None, retain_kv=False):
        seen.append(fork_of)
        add(req, retain_kv=retain_kv)

    core.add_request = no_fork
    assert core.reset_prefix_cache()
    (recomputed,) = llm.beam_search([prompt], params)
    assert seen[0] is None and all(f is not None for f in seen[1:])
    assert [s.tokens for s in forked.sequences] == [s.tokens for s in recomputed.sequences]
    assert [s.score for s in forked.sequences] == pytest.approx(
        [s.score for s in recomputed.sequences], abs=1e-5
    )
    _no_leak(llm)
