"""Penalty state on the device (``worker/penalty_state.py``) through the :class:`Sampler`, driven as the
engine drives it: sequences join, sample in random subsets mixed with plain rows, are preempted (their state
released, then rebuilt from the host's tokens) and finish (released); the pool grows. Oracles: after every
step each held row equals the sequence's prompt mask and ``Counter`` of its outputs, and every greedy token
equals the argmax of the float64 penalty formulas applied by hand to the step's logits."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from layerzero.engine.core.sched.output import SamplingMetadata
from layerzero.engine.sampling_params import SamplingParams
from layerzero.engine.worker.sampler import Sampler

V = 97


def _expected(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams) -> int:
    """argmax of the float64 hand formulas: repetition over prompt or output, then frequency and presence
    over the output (vLLM's order)."""
    row = logits.double().tolist()
    counts, seen = Counter(out), set(prompt) | set(out)
    for j, x in enumerate(row):
        if j in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        row[j] = x - p.frequency_penalty * counts[j] - p.presence_penalty * (counts[j] > 0)
    return max(range(V), key=lambda j: (row[j], -j))


@pytest.mark.parametrize("seed", [0, 1])
def test_device_counts_follow_the_tokens_through_preemption_and_finish(seed):
    g = torch.Generator().manual_seed(seed)
    sampler = Sampler(V, (0,), torch.device("cpu"), seed=1)
    state = sampler.penalties
    kinds = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.9),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0, repetition_penalty=0.6),
        SamplingParams(temperature=0.0),  # plain: no state
    ]
    live: dict[int, dict] = {}
    next_id, freed, preempted, checked = 100, [], [], 0
    for step in range(40):
        while len(live) < 12 and step < 30:  # joining sequences
            n = int(torch.randint(1, 9, (1,), generator=g))
            live[next_id] = dict(
                prompt=torch.randint(0, 30, (n,), generator=g).tolist(),
                out=[],
                params=kinds[next_id % len(kinds)],
                preemptions=0,
                sent=None,
            )
            next_id += 1
        ids = [sid for sid in live if torch.rand(1, generator=g).item() < 0.7]
        rows = SamplingMetadata(free_seq_ids=freed)
        for sid in ids:
            s = live[sid]
            p = s["params"]
            reset = p.penalized and s["sent"] != s["preemptions"]
            if reset:
                s["sent"] = s["preemptions"]
            rows.params.append(p)
            rows.seeds.append(None)
            rows.num_output_tokens.append(len(s["out"]))
            rows.prompt_token_ids.append(list(s["prompt"]) if reset else None)
            rows.output_token_ids.append(list(s["out"]) if reset else None)
            rows.seq_ids.append(sid)
            rows.penalty_reset.append(reset)
        state.release([*preempted, *rows.free_seq_ids])
        freed, preempted = [], []
        if not ids:
            continue
        # random logits, but bias the recent tokens up so penalties decide many argmaxes
        logits = torch.randn(len(ids), V, generator=g) * 2
        for i, sid in enumerate(ids):
            for t in live[sid]["out"][-3:] + live[sid]["prompt"][:2]:
                logits[i, t] += 2.0
        want = [
            _expected(logits[i], live[sid]["prompt"], live[sid]["out"], live[sid]["params"])
            for i, sid in enumerate(ids)
        ]
        got = sampler(logits.clone(), rows).sampled_token_ids
        assert [t[0] for t in got] == want, step
        for sid, (t,) in zip(ids, got, strict=True):
            live[sid]["out"].append(t)
        for sid, s in live.items():  # the held rows equal the host's view
            r = state.row_of.get(sid)
            if r is None:
                continue
            want_counts = torch.zeros(V, dtype=torch.int32)
            for t in s["out"]:
                want_counts[t] += 1
            assert torch.equal(state.counts[r], want_counts), (step, sid)
            assert torch.equal(
                state.prompt[r], torch.isin(torch.arange(V), torch.tensor(s["prompt"] or [-1]))
            )
            checked += 1
        for sid in list(live):  # preemptions and finishes
            u = torch.rand(1, generator=g).item()
            if u < 0.08:
                live[sid]["preemptions"] += 1
                preempted.append(sid)
            elif u < 0.16 or step >= 35:
                if live[sid]["sent"] is not None:
                    freed.append(sid)
                del live[sid]
    state.release(freed)
    assert checked > 100 and not state.row_of and state.capacity == 16  # grew once, from 8
    assert len(state._free) == state.capacity  # every row came back


def test_a_penalized_row_without_state_is_an_error_not_a_wrong_token():
    sampler = Sampler(V, (0,), torch.device("cpu"), seed=1)
    rows = SamplingMetadata(
        [SamplingParams(temperature=0.0, presence_penalty=1.0)],
        [None],
        [3],
        [None],
        [None],
        seq_ids=[5],
        penalty_reset=[False],
    )
    with pytest.raises(RuntimeError, match="out of step"):
        sampler(torch.randn(1, V), rows)


def test_stateless_metadata_counts_its_token_ids():
    """A hand-built metadata without seq ids (warm-up) penalizes from the ids it carries, holding nothing."""
    sampler = Sampler(V, (0,), torch.device("cpu"), seed=1)
    p = SamplingParams(temperature=0.0, repetition_penalty=3.0, presence_penalty=2.0)
    logits = torch.zeros(1, V)
    logits[0, 7] = 1.0
    logits[0, 8] = 0.5
    rows = SamplingMetadata([p], [None], [1], [[1]], [[7]])
    assert sampler(logits, rows).sampled_token_ids == [[8]]
    assert not sampler.penalties.row_of and sampler.penalties.capacity == 0
