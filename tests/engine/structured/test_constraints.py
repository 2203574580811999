"""Issue 39, structured outputs beyond JSON schemas, on the random-weight checkpoint (only the grammar makes
the output valid): regexes full-match (``re.fullmatch``), an EBNF grammar's output parses (a hand-written
parser), ``choice`` gives one of the choices, ``json_object`` an object; the llguidance backend on each kind;
uncompilable constraints are typed errors before anything is queued (front end and engine core); a token
the grammar rejects fails its request loudly; async scheduling on and off give the same tokens."""

from __future__ import annotations

import json
import re

import pytest
import torch

import layerzero as lz

from ..conftest import deadline

pytestmark = pytest.mark.integration
FAMILY = "qwen3"
N = 20

REGEXES = [
    r"[a-z]{2,5}-[0-9]{3}",  # (llguidance's \d is Unicode's Nd, newer than Python's tables)
    r"(cat|dog|bird)s?",
    r"[0-9]{1,3}(\.[0-9]{1,3}){3}",
    r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}",
    r"0x[0-9a-f]{2,4}",
]

CHOICES = ("yes", "no", "maybe so")
ODD = ('say "hi"', "a\\b", "café", "tab\there")  # escaping: quotes, backslash, non-ASCII, control

GRAMMAR = r"""
root ::= expr
expr ::= term (op term){0,3}
term ::= num | "(" inner ")"
inner ::= num (op num){0,2}
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]{0,1}
"""

LARK = r"""
start: item ("," item){0,2}
item: /[a-c]{1,3}/ | "<" /[0-9]/ ">"
"""


def parse_expr(s: str) -> bool:
    """Whether ``s`` is in :data:`GRAMMAR`'s language (recursive descent, written from the grammar)."""
    pos = 0

    def num() -> bool:
        nonlocal pos
        m = re.match(r"[1-9][0-9]?", s[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    def seq(item, most: int) -> bool:
        nonlocal pos
        if not item():
            return False
        for _ in range(most):
            if pos < len(s) and s[pos] in "+-*":
                pos += 1
                if not item():
                    return False
            else:
                break
        return True

    def term() -> bool:
        nonlocal pos
        if s[pos : pos + 1] == "(":
            pos += 1
            if not seq(num, 2) or s[pos : pos + 1] != ")":
                return False
            pos += 1
            return True
        return num()

    return seq(term, 3) and pos == len(s)


def test_the_grammar_checker_can_fail():
    assert parse_expr("1+(2*33)-4") and parse_expr("(5)")
    assert not parse_expr("1+") and not parse_expr("(1+(2))") and not parse_expr("1+2+3+4+5")


@pytest.fixture(scope="module")
def engines(checkpoints):
    """(sync engine, async-scheduling engine) on the same checkpoint."""
    from layerzero.engine import LLM

    kw = dict(device="cpu", dtype=torch.float32, max_model_len=128, num_kv_blocks=1024, max_num_seqs=256)
    return (
        LLM(checkpoints[FAMILY], async_scheduling=False, **kw),
        LLM(checkpoints[FAMILY], async_scheduling=True, **kw),
    )


def sp(so=None, **kw):
    from layerzero.engine import SamplingParams
    from layerzero.engine.structured_params import StructuredOutputsParams

    kw.setdefault("n", N)
    kw.setdefault("temperature", 1.0)
    kw.setdefault("max_tokens", 64)
    return SamplingParams(structured_outputs=None if so is None else StructuredOutputsParams(**so), **kw)


def run(llm, params):
    with deadline(120):
        return llm.generate(["Say something:"] * len(params), params, use_tqdm=False)


def texts(out, finish="stop"):
    assert all(c.finish_reason == finish for c in out.outputs), [c.finish_reason for c in out.outputs]
    return [c.text for c in out.outputs]


def test_regex_grammar_choice_json_object_with_both_backends(engines):
    llm = engines[0]
    cases = []  # (params, check)
    for backend in (None, "guidance"):
        for i, rx in enumerate(REGEXES):
            cases.append(
                (sp({"regex": rx, "backend": backend}, seed=i), lambda t, rx=rx: re.fullmatch(rx, t))
            )
        cases.append((sp({"grammar": GRAMMAR, "backend": backend}, seed=7), parse_expr))
        cases.append((sp({"choice": CHOICES, "backend": backend}, seed=8), lambda t: t in CHOICES))
        cases.append((sp({"choice": ODD, "backend": backend}, seed=11), lambda t: t in ODD))
        # any JSON object has no bound: a logit bias towards closing brackets and quotes (the grammar still
        # masks them wherever they are invalid) ends it within max_tokens
        closers = {llm.tokenizer.convert_tokens_to_ids(c): 8.0 for c in ("}", "]", '"')}
        cases.append(
            (
                sp({"json_object": True, "backend": backend}, seed=9, max_tokens=100, logit_bias=closers),
                lambda t: isinstance(json.loads(t), dict),
            )
        )
    # a Lark grammar: xgrammar cannot compile it, so the selector falls back to llguidance
    lark_item = re.compile(r"[a-c]{1,3}|<[0-9]>")
    cases.append(
        (sp({"grammar": LARK}, seed=10), lambda t: all(lark_item.fullmatch(x) for x in t.split(",")))
    )
    outs = run(llm, [p for p, _ in cases])
    for (p, check), out in zip(cases, outs, strict=True):
        got = texts(out)
        bad = [t for t in got if not check(t)]
        assert not bad, (p.structured_outputs, bad[:3])
    choice_outs = [
        set(texts(o)) for (p, _), o in zip(cases, outs, strict=True) if p.structured_outputs.kind == "choice"
    ]
    assert all(len(s) >= 2 for s in choice_outs)  # sampled, not forced to one
    sel = llm.engine.structured.selections
    assert (
        sel[("grammar", "guidance")][0] >= 2 and "xgrammar cannot compile" in sel[("grammar", "guidance")][1]
    )
    assert sel[("regex", "xgrammar")][0] == len(REGEXES) and sel[("regex", "guidance")][0] == len(REGEXES)


def test_uncompilable_constraints_are_typed_errors_before_queueing(engines):
    from layerzero.engine.core.messages import EngineCoreRequest

    llm = engines[0]
    bad = [
        {"regex": "("},
        {"json": {"type": "nosuchtype"}},
        {"grammar": "root ::= undefined_rule"},
        {"grammar": LARK, "backend": "xgrammar"},
        {"regex": "[", "backend": "guidance"},
    ]
    for so in bad:
        with pytest.raises(lz.InvalidInputError, match="structured_outputs"):
            llm.generate(["x"], sp(so, n=1), use_tqdm=False)
        # the engine core checks on its own too (another front end): nothing queued
        with pytest.raises(lz.InvalidInputError, match="structured_outputs"):
            llm.engine.add_request(EngineCoreRequest("bad", [1, 5, 6], sp(so, n=1), 0, 0.0, None))
        assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    with pytest.raises(lz.InvalidInputError, match="min_tokens"):
        llm.generate(["x"], sp({"regex": "a+"}, n=1, min_tokens=2), use_tqdm=False)
    (ok,) = llm.generate(["x"], sp({"regex": "ab?"}, n=1), use_tqdm=False)  # the engine still serves
    assert re.fullmatch("ab?", ok.outputs[0].text)


def test_limits_as_usual_and_grammar_end_under_ignore_eos(engines):
    llm = engines[0]
    eos = llm.tokenizer.eos_token_id
    short, ign = run(
        llm,
        [
            sp({"regex": r"[a-z]{30,40}"}, max_tokens=3, seed=1),
            sp({"choice": ["yes", "no"]}, ignore_eos=True, max_tokens=32, seed=2),
        ],
    )
    assert all(len(c.token_ids) == 3 for c in short.outputs) and texts(short, "length")
    assert all(c.token_ids[-1] == eos for c in ign.outputs)  # the grammar ended it: EOS kept (ignore_eos)
    assert set(texts(ign)) <= {"yes", "no"}


def test_async_scheduling_gives_the_same_tokens(engines, monkeypatch):
    from layerzero.engine.core import llm_engine

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 50}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
    }
    params = [
        sp({"json": schema}, n=4, seed=5),
        sp({"regex": r"[a-z]{3,8}"}, n=4, seed=6),
        sp(None, n=2, seed=3),
    ]
    calls = []
    real = llm_engine._EarlyRead.__call__
    monkeypatch.setattr(llm_engine._EarlyRead, "__call__", lambda self: (calls.append(1), real(self))[1])
    sync, asyn = (run(llm, params) for llm in engines)
    assert calls  # async: step N read inside N+1's bitmask fill
    monkeypatch.setattr(llm_engine.EngineLoop, "structured_early_read", False)
    late = run(engines[1], params)  # async, N read before N+1 is scheduled
    for a, b, c in zip(sync, asyn, late, strict=True):
        assert [x.token_ids for x in a.outputs] == [x.token_ids for x in b.outputs]
        assert [x.token_ids for x in a.outputs] == [x.token_ids for x in c.outputs]
    assert all(json.loads(t)["b"] in "xy" for t in texts(sync[0]))


@pytest.mark.parametrize("which", [0, 1], ids=["sync", "async"])
def test_a_token_the_grammar_rejects_fails_its_request_loudly(engines, which, monkeypatch, caplog):
    import layerzero.engine.worker.sampler as sampler_mod

    llm = engines[which]
    monkeypatch.setattr(sampler_mod, "apply_grammar_bitmask", lambda logits, rows: None)  # mask lost
    with caplog.at_level("ERROR", logger="layerzero.engine"):
        con, free = run(llm, [sp({"regex": "z{5}"}, n=1, seed=1), sp(None, n=1, seed=2, max_tokens=8)])
    assert con.outputs[0].finish_reason == "error"
    assert free.outputs[0].finish_reason == "length" and len(free.outputs[0].token_ids) == 8
    assert "not allowed by the xgrammar grammar" in caplog.text
    assert llm.engine.structured.bitmask([]) is None  # no rows; sweeps the ended sequences' matchers
    assert llm.engine.structured.active == 0


def test_a_grammar_that_allows_nothing_fails_alone(engines):
    dead, free = run(engines[1], [sp({"grammar": "root ::= root"}, n=1), sp(None, n=1, seed=2, max_tokens=8)])
    assert dead.outputs[0].finish_reason == "error" and "allows no token" in dead.error
    assert free.outputs[0].finish_reason == "length" and len(free.outputs[0].token_ids) == 8
