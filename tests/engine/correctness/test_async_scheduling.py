"""Async scheduling (step N+1 launched before step N's ids reach the host; its pending input ids gathered on
the device): the overlap really happens, and it changes no token. Oracle: the same engine without async
scheduling (itself checked against transformers in test_hf_parity / test_invariances, where async
configurations run too): greedy and seeded tokens equal, raw logprobs within 1e-5, finish reasons and token
counts equal; penalized requests keep the overlap (their counts live on the device)."""

from __future__ import annotations

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.integration
FAMILY = "qwen3"


def _params(i: int):
    from layerzero.engine import SamplingParams

    kinds = [
        dict(temperature=0.0, max_tokens=12, stop_token_ids=list(range(3, 512, 5)), min_tokens=2),
        dict(temperature=0.9, seed=100 + i, top_k=40, top_p=0.9, max_tokens=9, logprobs=2, ignore_eos=True),
        dict(temperature=0.0, max_tokens=7, ignore_eos=True, logit_bias={11: 2.5}),
        dict(temperature=0.7, seed=7 * i, min_p=0.05, max_tokens=11, ignore_eos=True),
    ]
    return SamplingParams(**kinds[i % len(kinds)])


def _run(checkpoints, ps, sps, async_scheduling, **kw):
    from layerzero.engine import LLM

    opts = dict(
        device="cpu",
        dtype=torch.float32,
        max_model_len=80,
        num_kv_blocks=64,
        max_num_seqs=5,
        max_num_batched_tokens=40,
    )
    opts.update(kw)
    llm = LLM(checkpoints[FAMILY], async_scheduling=async_scheduling, **opts)
    gathered, penalized_gathered = [], []
    execute = llm.engine.runner.execute

    def spy(out, prev_tokens=None, greedy=False):
        live = llm.engine.scheduler.scheduled  # the live sequences of the plain-data step
        pending = [s for s, _ in live if s.pending_index is not None]
        # a pending sequence's last token is not on the host yet: the device gathers it
        assert all(len(s.token_ids) == s.num_tokens - 1 for s in pending)
        assert [i for i, p in enumerate(out.pending_src) if p is not None] == [
            i for i, (s, _) in enumerate(live) if s.pending_index is not None
        ]
        gathered.append(len(pending))
        penalized_gathered.extend(s for s in pending if s.params.penalized)
        return execute(out, prev_tokens, greedy)

    llm.engine.runner.execute = spy
    outs = llm.generate(ps, sps, use_tqdm=False)
    return llm, outs, gathered, penalized_gathered


def _summary(outs):
    return [(c.token_ids, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


@pytest.mark.parametrize("pool", [64, 6], ids=["ample-pool", "tiny-pool"])
def test_same_tokens_as_sync_and_the_overlap_happens(checkpoints, pool):
    ps = prompts(10, seed=31, lo=3, hi=30)
    sps = [_params(i) for i in range(len(ps))]
    sync, s_outs, s_gathered, _ = _run(checkpoints, ps, sps, False, num_kv_blocks=pool)
    asyn, a_outs, a_gathered, _ = _run(checkpoints, ps, sps, True, num_kv_blocks=pool)
    assert _summary(a_outs) == _summary(s_outs)
    for so, ao in zip(s_outs, a_outs, strict=True):
        for sc, ac in zip(so.outputs, ao.outputs, strict=True):
            if sc.logprobs is not None:
                for sd, ad in zip(sc.logprobs, ac.logprobs, strict=True):
                    assert sd.keys() == ad.keys() and max(abs(sd[t] - ad[t]) for t in sd) < 1e-5
    assert sum(s_gathered) == 0 and sum(a_gathered) > len(ps)  # sync never gathers; async does, most steps
    total = sum(len(c.token_ids) for o in a_outs for c in o.outputs)
    assert asyn.stats()["generation_tokens"] == sync.stats()["generation_tokens"] == total
    if pool == 6:
        assert asyn.stats()["preemptions"] > 0
    assert not asyn.engine.has_unfinished() and asyn.engine.kv.usage() == 0.0
    asyn.engine.kv.check_invariants()


def test_penalized_requests_keep_the_overlap_and_their_tokens(checkpoints):
    """Penalty counts live on the device (worker/penalty_state.py): a penalized sequence is launched with its
    token still pending (counted there), and its tokens equal the synchronous engine's."""
    from layerzero.engine import SamplingParams

    ps = prompts(4, seed=32, lo=4, hi=20)
    pen = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        ignore_eos=True,
        repetition_penalty=1.5,
        frequency_penalty=0.4,
        presence_penalty=0.3,
    )
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    sps = [pen, plain, pen, plain]
    _, s_outs, _, _ = _run(checkpoints, ps, sps, False)
    asyn, a_outs, gathered, penalized = _run(checkpoints, ps, sps, True)
    assert _summary(a_outs) == _summary(s_outs)
    assert len(penalized) >= 2 * 8  # launched with a pending penalized token: most of their decode steps
    _, _, gathered_plain, _ = _run(checkpoints, ps, [plain] * 4, True)
    assert sum(gathered) == sum(gathered_plain)  # the penalized batch overlaps as much as the plain one
    state = asyn.engine.executor.worker.sampler.penalties
    assert 0 < len(state.row_of) <= 2 and state.capacity == 8  # released with the next step that runs
    asyn.generate(ps[:1], plain, use_tqdm=False)
    assert not state.row_of  # every finished sequence gave its row back


def test_async_scheduling_option_is_validated(checkpoints):
    from layerzero import ConfigurationError
    from layerzero.engine import LLM

    with pytest.raises(ConfigurationError, match="async_scheduling"):
        LLM(checkpoints[FAMILY], device="cpu", async_scheduling="yes")
    llm = LLM(checkpoints[FAMILY], device="cpu", dtype=torch.float32, max_model_len=32, num_kv_blocks=8)
    assert llm.engine.async_scheduling is False  # None: on for CUDA only


def test_a_sequence_ended_by_length_is_not_computed_again(checkpoints):
    """``length_capped``: once the pending token is the last one max_tokens allows, the sequence is not
    scheduled again, so it is forwarded exactly as often as in the synchronous loop (prompt chunk +
    max_tokens - 1 decodes)."""
    from layerzero.engine import LLM, SamplingParams

    ps = prompts(3, seed=33, lo=4, hi=12)
    counts = {}
    for mode in (False, True):
        llm = LLM(
            checkpoints[FAMILY],
            device="cpu",
            dtype=torch.float32,
            max_model_len=48,
            num_kv_blocks=32,
            async_scheduling=mode,
        )
        seen: dict[str, int] = {}
        execute = llm.engine.runner.execute

        def spy(out, prev_tokens=None, greedy=False, seen=seen, execute=execute):
            for rid in out.req_ids:
                seen[rid] = seen.get(rid, 0) + 1
            return execute(out, prev_tokens, greedy)

        llm.engine.runner.execute = spy
        llm.generate(
            ps,
            [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 5)],
            use_tqdm=False,
        )
        counts[mode] = sorted(seen.values())
    assert counts[False] == counts[True] == [1, 2, 5]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_ids_a_greedy_graph_sampled_are_the_step_tokens(checkpoints, async_scheduling):
    """The engine asks for a greedy graph (``execute(greedy=True)``) exactly on plain greedy steps and takes
    the ids it returns (``StepLogits.pending``) instead of sampling: a stand-in graph that always "samples" id
    7 shows up in the output of plain greedy requests only (CPU has no graphs, so the stand-in wraps the real
    forward)."""
    from layerzero.engine import LLM, SamplingParams
    from layerzero.engine.worker.model_runner import StepLogits
    from layerzero.engine.worker.sampler import PendingSample

    llm = LLM(
        checkpoints[FAMILY],
        device="cpu",
        dtype=torch.float32,
        max_model_len=80,
        num_kv_blocks=64,
        max_num_seqs=4,
        async_scheduling=async_scheduling,
    )
    execute, asked = llm.engine.runner.execute, []

    def graph(out, prev_tokens=None, greedy=False):
        res = execute(out, prev_tokens, greedy)
        asked.append(greedy)
        if not greedy:
            return res
        ids = torch.full((res.logits.shape[0],), 7, dtype=torch.int64)
        return StepLogits(res.logits, PendingSample(ids, [ids.clone()], None, [], []))

    llm.engine.runner.execute = graph
    plain = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    other = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    assert llm.generate([[5, 6, 9]], plain, use_tqdm=False)[0].outputs[0].token_ids == [7] * 5
    assert all(asked) and asked
    asked.clear()
    out = llm.generate([[5, 6, 9]], other, use_tqdm=False)[0].outputs[0]
    assert not any(asked) and out.token_ids != [7] * 5 and len(out.logprobs) == 5
