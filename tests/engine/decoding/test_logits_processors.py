"""Logits-processor plugins (vLLM v1's interface): the batch updates replayed by a processor always give the
step's row order (seeded random batches against the hand-kept truth); the example processor changes exactly
the rows that ask for it in a mixed batch (the others equal a run without it); bad classes and bad
per-request arguments are typed errors before anything runs."""

from __future__ import annotations

import random

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.integration
FORCE = "layerzero.engine.logits_processors:ForceTokenLogitsProcessor"


def _replay(state: dict[int, int], bu) -> None:
    """Apply a BatchUpdate to index -> key the way vLLM's processors do (added, removed, then moved)."""
    from layerzero.engine.logits_processors import MoveDirectionality

    for index, params, _, _ in bu.added:
        state[index] = params.extra_args["key"]
    for index in bu.removed:
        state.pop(index)
    for a, b, how in bu.moved:
        va, vb = state.pop(a, None), state.pop(b, None)
        if va is not None:
            state[b] = va
        if how is MoveDirectionality.SWAP and vb is not None:
            state[a] = vb


def test_batch_updates_replay_to_the_step_order():
    from layerzero.engine import SamplingParams
    from layerzero.engine.core.sched.output import SamplingMetadata
    from layerzero.engine.logits_processors import BatchState, LogitsProcessor

    seen = []

    class Rec(LogitsProcessor):
        def __init__(self, config=None, device=None, is_pin_memory=False):
            pass

        def is_argmax_invariant(self):
            return True

        def update_state(self, bu):
            seen.append(bu)

        def apply(self, logits):
            return logits

    state = BatchState([Rec()])
    rng = random.Random(0)
    mirror: dict[int, int] = {}
    live: list[int] = []
    fresh = iter(range(1000))
    for _ in range(300):
        live = [k for k in live if rng.random() > 0.3] + [next(fresh) for _ in range(rng.randint(0, 3))]
        rng.shuffle(live)
        rows = SamplingMetadata()
        for k in live:
            rows.params.append(SamplingParams(extra_args={"key": k}))
            rows.seeds.append(None), rows.num_output_tokens.append(0)
            rows.prompt_token_ids.append(None), rows.output_token_ids.append(None)
        state.update(list(live), rows)
        if seen[-1] is not None:
            _replay(mirror, seen[-1])
            assert seen[-1].batch_size == len(live)
        assert mirror == dict(enumerate(live))


def test_force_token_hand_checked():
    from layerzero.engine import SamplingParams
    from layerzero.engine.logits_processors import BatchUpdate, ForceTokenLogitsProcessor

    p = ForceTokenLogitsProcessor(None, torch.device("cpu"), False)
    p.update_state(
        BatchUpdate(
            3,
            [],
            [
                (0, SamplingParams(), None, []),
                (2, SamplingParams(extra_args={"force_token_id": 1}), None, []),
            ],
            [],
        )
    )
    logits = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    out = p.apply(logits.clone())
    inf = float("-inf")
    assert out.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [inf, 9, inf, inf]]


def test_processor_changes_exactly_its_rows_in_a_mixed_batch(checkpoints):
    from layerzero.engine import LLM, SamplingParams

    llm = LLM(
        checkpoints["qwen3"],
        device="cpu",
        dtype=torch.float32,
        max_model_len=48,
        num_kv_blocks=128,
        logits_processors=[FORCE],
    )
    ps = prompts(5, seed=71, lo=4, hi=9)

    def sp(force=None, **kw):
        extra = None if force is None else {"force_token_id": force}
        return SamplingParams(max_tokens=6, ignore_eos=True, extra_args=extra, **kw)

    params = [
        sp(temperature=0.0),
        sp(7, temperature=0.0),
        sp(temperature=1.0, seed=4),
        sp(11, temperature=1.0, seed=5),
        sp(temperature=0.0, logprobs=2),
    ]
    outs = llm.generate(ps, params, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == [7] * 6 and outs[3].outputs[0].token_ids == [11] * 6
    alone = llm.generate([ps[i] for i in (0, 2, 4)], [params[i] for i in (0, 2, 4)], use_tqdm=False)
    for i, a in zip((0, 2, 4), alone, strict=True):
        assert outs[i].outputs[0].token_ids == a.outputs[0].token_ids
        assert outs[i].outputs[0].token_ids != [7] * 6
    # a request without the argument gets plain greedy (its row is untouched on a greedy step too)
    (g,) = llm.generate([ps[0]], sp(temperature=0.0), use_tqdm=False)
    assert g.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_bad_processors_and_arguments_are_typed_errors(checkpoints):
    from layerzero import ConfigurationError, InvalidInputError
    from layerzero.engine import LLM, SamplingParams
    from layerzero.engine.config import EngineConfig
    from layerzero.engine.logits_processors import ForceTokenLogitsProcessor

    path = str(checkpoints["qwen3"])
    for bad in ([int], ["no_such_module_xyz:Proc"], ["layerzero.engine:NoSuchClass"], FORCE):
        with pytest.raises(ConfigurationError, match="logits_processors"):
            EngineConfig(path, device="cpu", logits_processors=bad)
    ec = EngineConfig(path, device="cpu", logits_processors=[ForceTokenLogitsProcessor])
    assert ec.logits_processors == (FORCE,)  # by name: crosses to the core process
    llm = LLM(
        path, device="cpu", dtype=torch.float32, max_model_len=32, num_kv_blocks=32, logits_processors=[FORCE]
    )
    with pytest.raises(InvalidInputError, match="force_token_id"):
        llm.generate([[1, 5, 6]], SamplingParams(extra_args={"force_token_id": "x"}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_async_llm_runs_the_plugin_in_its_core_process(checkpoints):
    """``AsyncLLM(logits_processors=[name])``: the config crosses to the engine-core process by name, the
    plugin runs there on the request's ``extra_args``; a class not importable by name is refused."""
    import asyncio

    from layerzero import ConfigurationError
    from layerzero.engine import AsyncLLM, SamplingParams
    from layerzero.engine.logits_processors import ForceTokenLogitsProcessor

    class Local(ForceTokenLogitsProcessor):
        pass

    opts = dict(device="cpu", dtype=torch.float32, max_model_len=32, num_kv_blocks=32, max_num_seqs=4)
    with pytest.raises(ConfigurationError, match="importable"):
        AsyncLLM(checkpoints["qwen3"], logits_processors=[Local], **opts)
    eng = AsyncLLM(checkpoints["qwen3"], logits_processors=[FORCE], **opts)
    try:

        async def one(extra, rid):
            sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, extra_args=extra)
            return [
                t
                for o in [o async for o in eng.generate([1, 5, 9, 4], sp, rid)]
                for t in o.outputs[0].token_ids
            ]

        async def both():
            return await asyncio.gather(one({"force_token_id": 13}, "a"), one(None, "b"))

        forced, plain = asyncio.run(asyncio.wait_for(both(), 120))
    finally:
        eng.shutdown()
    assert forced == [13] * 5 and plain != [13] * 5 and len(plain) == 5
