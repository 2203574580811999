"""Structured outputs, the parts without a model: the bitmask unpacked and applied on the device (against
hand-worked cases and a numpy reference), the step's bitmask through the multi-rank step codec and
``SchedulerOutput.to_dict``, the backend selector's rules and reasons, and the server's mapping of
``response_format`` / ``structured_outputs``."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import layerzero as lz
from layerzero.engine import SamplingParams
from layerzero.engine.core.sched.output import GrammarBitmask, SamplingMetadata, SchedulerOutput
from layerzero.engine.structured_params import StructuredOutputsParams as S
from layerzero.engine.worker.grammar_bitmask import apply_grammar_bitmask


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The allowed tokens of ``bits`` as a bool ``[R, vocab_size]`` mask, read back through the op the
    sampler applies (``lz.apply_token_bitmask`` on zero logits: allowed = still finite)."""
    logits = torch.zeros(bits.shape[0], vocab_size)
    lz.apply_token_bitmask(logits, bits)
    return torch.isfinite(logits)


def test_unpack_hand_worked():
    bits = torch.tensor([[0b101, -1], [-(1 << 31), 0]], dtype=torch.int32)  # the sign bit: token 31
    m = unpack_bitmask(bits, 70)  # wider than the 64 ids the words cover: the rest banned
    assert m.shape == (2, 70) and m.dtype == torch.bool
    assert m[0].nonzero().flatten().tolist() == [0, 2, *range(32, 64)]
    assert m[1].nonzero().flatten().tolist() == [31]
    assert unpack_bitmask(bits, 33)[0].nonzero().flatten().tolist() == [0, 2, 32]


def _reference(logits: np.ndarray, rows: np.ndarray, bits: np.ndarray) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for r, words in zip(rows, bits, strict=True):
        for t in range(out.shape[1]):
            w = t // 32
            if w >= len(words) or not (int(words[w]) >> (t % 32)) & 1:
                out[r, t] = -np.inf
    return out


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_apply_matches_reference_and_leaves_other_rows(rows):
    g = np.random.default_rng(0)
    v = 100  # 4 words cover 128 ids
    logits = torch.from_numpy(g.standard_normal((4, v)).astype(np.float32))
    bits = g.integers(-(2**31), 2**31, size=(len(rows), 4), dtype=np.int64).astype(np.int32)
    b = GrammarBitmask(np.asarray(rows, dtype=np.int64), bits)
    calls = []

    def deferred():
        calls.append(1)
        return b

    want = _reference(logits.numpy(), b.rows, bits)
    sm = SamplingMetadata(grammar_bitmask=deferred)
    apply_grammar_bitmask(logits, sm)
    assert calls == [1]
    np.testing.assert_array_equal(logits.numpy().astype(np.float64), want)
    assert np.isinf(want).any() and np.isfinite(want).any()  # the case bans some and keeps some


def _step(bitmask) -> SchedulerOutput:
    p = SamplingParams(structured_outputs=S(regex="a+"))
    return SchedulerOutput(
        req_ids=["r0", "r1"],
        seq_ids=[0, 1],
        num_computed_tokens=[0, 3],
        num_scheduled_tokens=[3, 1],
        new_token_ids=[[1, 2, 3], [4]],
        pending_src=[None, None],
        sample=[True, True],
        block_tables=np.zeros((2, 1), dtype=np.int32),
        sampling=SamplingMetadata(
            [SamplingParams(), p], [None, None], [0, 2], [None, None], [None, None], bitmask
        ),
    )


def test_bitmask_through_step_codec_and_to_dict():
    from layerzero.engine.executor.step_codec import StepDecoder, StepEncoder

    b = GrammarBitmask(np.asarray([1], dtype=np.int64), np.asarray([[7, -1, 0]], dtype=np.int32))
    for bm in (b, lambda: b, None):
        got = StepDecoder().decode(StepEncoder().encode(_step(bm))).sampling.grammar_bitmask
        back = SchedulerOutput.from_dict(_step(bm).to_dict()).sampling.grammar_bitmask
        for x in (got, back):
            if bm is None:
                assert x is None
            else:
                assert x.rows.tolist() == [1] and x.bits.tolist() == [[7, -1, 0]] and x.bits.dtype == np.int32


def test_selector_rules_and_reasons():
    from layerzero.engine.structured import check_request, select_backend

    assert select_backend(S(regex="a+")).backend == "xgrammar"
    assert select_backend(S(regex="a+", backend="guidance")).reason == "backend='guidance' asked for"
    gap = select_backend(S(json={"type": "string", "maxLength": 3}))
    assert gap.backend == "guidance" and "control characters" in gap.reason
    assert (
        select_backend(S(json={"type": "string", "maxLength": 3}, backend="xgrammar")).backend == "xgrammar"
    )
    lark = select_backend(S(grammar='start: "a" | "b"'))
    assert lark.backend == "guidance" and lark.reason.startswith("xgrammar cannot compile this grammar")
    with pytest.raises(lz.InvalidInputError, match="xgrammar: "):
        select_backend(S(grammar='start: "a"', backend="xgrammar"))
    with pytest.raises(lz.InvalidInputError, match="xgrammar: .*; llguidance: "):
        select_backend(S(regex="(a"))
    with pytest.raises(lz.InvalidInputError, match="min_tokens"):
        check_request(SamplingParams(min_tokens=1, structured_outputs=S(regex="a")))
    assert check_request(SamplingParams()) is None


def _req(**kw):
    return types.SimpleNamespace(response_format=kw.get("fmt"), structured_outputs=kw.get("so"))


def test_server_mapping():
    from layerzero.engine.entrypoints.openai.errors import OpenAIError
    from layerzero.engine.entrypoints.openai.structured import structured_outputs_from as f

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert f(_req()) is None and f(_req(fmt={"type": "text"})) is None
    assert f(_req(fmt={"type": "json_object"})) == S(json_object=True)
    assert f(
        _req(fmt={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    ) == S(json=schema)
    assert f(_req(so={"regex": "a+", "backend": "guidance"})) == S(regex="a+", backend="guidance")
    for bad, param in [
        (_req(fmt={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
        (_req(fmt={"type": "xml"}), "response_format"),
        (_req(fmt="json"), "response_format"),
        (_req(fmt={"type": "json_object"}, so={"regex": "a"}), "structured_outputs"),
        (_req(so={"regex": "a", "choice": ["b"]}), "structured_outputs"),
        (_req(so={"nope": 1}), "structured_outputs"),
    ]:
        with pytest.raises(OpenAIError) as e:
            f(bad)
        assert e.value.status == 400 and e.value.param == param


def test_manager_pads_the_vocabulary_and_handles_ended_rows(checkpoints):
    """A model vocabulary wider than the tokenizer's (600 > 512): those ids are never allowed; a rejected
    token raises; a sequence that ended before the fill gets an all-allowed row;
    ``before`` runs once, first."""
    from layerzero.engine.structured.manager import GrammarRejectedError, StructuredOutputManager

    m = StructuredOutputManager(checkpoints["qwen3"], 600, {2})
    params = [
        SamplingParams(structured_outputs=S(regex="ab")),
        SamplingParams(structured_outputs=S(choice=["x"])),
    ]
    seqs = [
        types.SimpleNamespace(seq_id=i, params=p, finished=False, request_id=str(i), num_output_tokens=1)
        for i, p in enumerate(params)
    ]
    for s, p in zip(seqs, params, strict=True):
        assert m.prepare(p).backend == "xgrammar"
        m.add(s)
    order = []
    fill = m.bitmask([types.SimpleNamespace(seq_id=9), *seqs], before=lambda: order.append("before"))
    seqs[1].finished = True  # ended by the early read
    b = fill()
    assert fill() is b and order == ["before"]
    # the ended sequence's row allows every token: dropped from the bitmask (nothing to apply)
    assert b.rows.tolist() == [1] and b.bits.shape == (1, (600 + 31) // 32)
    allowed = np.flatnonzero(np.unpackbits(b.bits[0].view(np.uint8), bitorder="little"))
    tok = m._tokenizer
    pieces = [tok.decode([int(t)]) for t in allowed]
    assert pieces and all(p and "ab".startswith(p) for p in pieces)  # "a" or "ab": the regex's first tokens
    assert allowed.max() < 512
    assert b.host is not None and b.host[0].rows == 1 and np.shares_memory(b.bits, b.host[0].tensor.numpy())
    with pytest.raises(GrammarRejectedError, match="not allowed"):
        m.accept(seqs[0], tok.convert_tokens_to_ids("z"))


class _FakeBackend:
    """A grammar backend whose matchers fill fixed words (``m.words``) into their rows."""

    def fill(self, matchers, bits, rows):
        for m, r in zip(matchers, rows, strict=True):
            bits[r] = m.words


def test_fill_drops_all_allowed_rows_and_alternates_host_buffers():
    """Rows whose words allow every token leave the bitmask (the others keep their order and step rows); the
    host buffers alternate by step parity, so the previous step's bitmask survives the next fill; the
    worker applies the buffer's rows like a float64 reference."""
    from layerzero.engine.structured.manager import _DeferredFill
    from layerzero.engine.structured.pinned import BitmaskBuffers

    bufs = BitmaskBuffers()
    w = 3
    words = [[-1, -1, -1], [5, 0, 1 << 30], [-1, -1, -1], [0, -1, 7]]
    entries = [
        (types.SimpleNamespace(finished=False), types.SimpleNamespace(backend="fake", words=x)) for x in words
    ]
    fill = _DeferredFill({"fake": _FakeBackend()}, [0, 2, 3, 5], entries, w, None, bufs.next())
    b = fill()
    assert b.rows.tolist() == [2, 5] and b.bits.tolist() == [words[1], words[3]]
    everything = [(e[0], types.SimpleNamespace(backend="fake", words=[-1] * w)) for e in entries[:2]]
    other = _DeferredFill({"fake": _FakeBackend()}, [0, 1], everything, w, None, bufs.next())()
    assert len(other.rows) == 0 and other.bits.shape == (0, w)  # nothing to apply
    assert b.bits.tolist() == [words[1], words[3]]  # the other parity's buffer: untouched
    g = np.random.default_rng(1)
    logits = torch.from_numpy(g.standard_normal((6, 90)).astype(np.float32))
    want = _reference(logits.numpy(), b.rows, b.bits.copy())
    apply_grammar_bitmask(logits, SamplingMetadata(grammar_bitmask=b))
    np.testing.assert_array_equal(logits.numpy().astype(np.float64), want)
    before = logits.clone()
    apply_grammar_bitmask(logits, SamplingMetadata(grammar_bitmask=other))  # no rows: a no-op
    assert torch.equal(logits, before)
    _DeferredFill({"fake": _FakeBackend()}, [1], entries[1:2], w, None, bufs.next())()  # b's parity again
    with pytest.raises(RuntimeError, match="claimed again before this step's bitmask was applied"):
        apply_grammar_bitmask(logits, SamplingMetadata(grammar_bitmask=b))  # stale: loud, not wrong


def test_fill_threads_keeps_the_measured_faster_variant_per_bucket(caplog):
    """Each row-count bucket alternates one thread / the pool for EXPLORE fills each, then keeps the lower
    median (logged), independently per bucket, and measures again after RECHECK fills."""
    from layerzero.engine.structured.backends import FillThreads

    ft = FillThreads(8)
    ft.RECHECK = 3
    cost = {
        (64, 0): 1e-4,
        (64, 1): 5e-4,
        (8, 0): 9e-4,
        (8, 1): 2e-4,
    }  # seconds per fill, by (bucket, variant)
    seen = []
    with caplog.at_level("INFO", logger="layerzero.engine"):
        for _ in range(2 * FillThreads.EXPLORE):
            for rows, bucket in ((33, 64), (5, 8)):
                v = ft.pick(rows)
                seen.append((bucket, v))
                ft.record(rows, v, cost[bucket, v])
    assert sorted(seen).count((64, 0)) == FillThreads.EXPLORE == sorted(seen).count((64, 1))
    assert ft.pick(64) == 0 and ft.pick(7) == 1 and ft.choices() == {64: 1, 8: 8}
    assert "up to 64 rows run on one thread" in caplog.text and "up to 8 rows run on 8 threads" in caplog.text
    for _ in range(ft.RECHECK):  # the chosen variant's fills, then the bucket is measured again
        ft.record(40, ft.pick(40), cost[64, 0])
    assert 64 not in ft.choices() and 8 in ft.choices()


def test_xgrammar_fill_writes_whole_rows_on_either_variant(checkpoints):
    """The host buffers are not zeroed between fills: a fill into a dirty buffer (any variant) equals a fill
    into zeros, for matchers at different states."""
    from layerzero.engine.structured.manager import StructuredOutputManager

    m = StructuredOutputManager(checkpoints["qwen3"], 600, {2})
    p = SamplingParams(structured_outputs=S(regex="(ab|ba)+c"))
    m.prepare(p)
    backend = m._backends["xgrammar"]
    tok = m._tokenizer
    matchers = [backend.matcher(m._compiled["xgrammar", p.structured_outputs]) for _ in range(3)]
    for i, text in enumerate(["", "a", "ab"]):
        for t in tok.encode(text, add_special_tokens=False) if text else []:
            assert matchers[i].accept(t)
    w = m.width
    clean = np.zeros((3, w), np.int32)
    backend.batches[0].batch_fill_next_token_bitmask([x.m for x in matchers], clean, [0, 1, 2])
    assert len({r.tobytes() for r in clean}) == 3  # three different states, three different rows
    for v in range(len(backend.batches)):
        dirty = np.random.default_rng(v).integers(-(2**31), 2**31 - 1, (3, w), dtype=np.int32)
        backend.batches[v].batch_fill_next_token_bitmask([x.m for x in matchers], dirty, [0, 1, 2])
        np.testing.assert_array_equal(dirty, clean)
