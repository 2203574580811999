"""Property tests of policies: hash equal iff (independently normalized) dicts equal, comparison strings
agree with Python's operators, merged lock precedence, and boosts/reasons of a merge equal the parts'."""

from __future__ import annotations

import fnmatch
import json
import operator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerzero.core.policy import Policy
from layerzero.core.policy_schema import parse_condition

pytestmark = pytest.mark.property

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OPS = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}

ops = st.sampled_from(["attention", "rms_norm", "rope", "*", "*_norm"])
kernel_globs = st.sampled_from(
    ["torch_sdpa", "torch_sdpa.flash", "torch_sdpa.*", "reference", "liger.rms_norm", "xformers.[ab]*"]
)
exact_kernels = st.sampled_from(
    ["torch_sdpa.flash", "torch_sdpa.math", "reference.attention", "liger.rms_norm"]
)
# Conditions in one spelling per meaning (ints only, no "==N" strings), so that "equal meaning" and "equal
# data after sorting order-free lists" coincide; the library's own normalization is not used as the oracle.
int_cond = st.one_of(
    st.integers(-3, 300),
    st.builds(lambda o, n: f"{o}{n}", st.sampled_from(["<", "<=", ">", ">=", "!="]), st.integers(-3, 300)),
    st.builds(lambda a, d: f"{a}..{a + d}", st.integers(0, 256), st.integers(1, 64)),
)
whens = st.fixed_dictionaries(
    {},
    optional={
        "device": st.sampled_from(["cpu", "cuda", "c*"]),
        "head_dim": int_cond,
        "sm": st.one_of(int_cond, st.lists(int_cond, min_size=2, max_size=3, unique_by=json.dumps)),
        "is_causal": st.booleans(),
    },
)
glob_lists = st.lists(kernel_globs, min_size=1, max_size=3, unique=True)
lock_rules = st.fixed_dictionaries({"op": ops, "kernel": exact_kernels, "when": whens})
glob_rules = st.fixed_dictionaries({"op": ops, "kernels": glob_lists, "when": whens})
boost_rules = st.fixed_dictionaries(
    {"op": ops, "kernels": glob_lists, "when": whens, "by": st.integers(-100, 100).map(float)}
)
policies = st.fixed_dictionaries(
    {
        "version": st.just(1),
        "locks": st.lists(lock_rules, max_size=3),
        "allow": st.lists(glob_rules, max_size=2),
        "deny": st.lists(glob_rules, max_size=3),
        "boosts": st.lists(boost_rules, max_size=3),
    }
)
contexts = st.fixed_dictionaries(
    {
        "device": st.sampled_from(["cpu", "cuda"]),
        "head_dim": st.one_of(st.none(), st.integers(-5, 320)),
        "sm": st.integers(0, 120),
        "is_causal": st.booleans(),
    }
)


def normalized(d: dict) -> str:
    """Independent oracle of 'same meaning': order-free lists sorted, when keys sorted; locks keep order."""

    def rule(r: dict) -> dict:
        r = dict(r)
        if "kernels" in r:
            r["kernels"] = sorted(set(r["kernels"]))
        r["when"] = {
            k: (sorted(v, key=json.dumps) if isinstance(v, list) else v) for k, v in r["when"].items()
        }
        return r

    out = {"locks": [rule(r) for r in d["locks"]]}
    for name in ("allow", "deny", "boosts"):
        out[name] = sorted((rule(r) for r in d[name]), key=lambda r: json.dumps(r, sort_keys=True))
    return json.dumps(out, sort_keys=True)


def cond_ok(c: object, v: object) -> bool:
    """Independent interpreter of one generated condition (the oracle for matching)."""
    if isinstance(c, list):
        return any(cond_ok(x, v) for x in c)
    if v is None:
        return False
    if isinstance(c, bool) or isinstance(v, bool):
        return type(c) is bool and type(v) is bool and c == v
    if isinstance(c, int):
        return isinstance(v, int) and v == c
    if not isinstance(c, str):
        raise TypeError(c)
    if ".." in c:
        lo, hi = (int(p) for p in c.split(".."))
        return isinstance(v, int) and lo <= v <= hi
    for sym in ("<=", ">=", "!=", "<", ">"):
        if c.startswith(sym):
            return isinstance(v, int) and OPS[sym](v, int(c[len(sym) :]))
    return isinstance(v, str) and fnmatch.fnmatchcase(v, c)


def rule_applies(r: dict, op: str, ctx: dict) -> bool:
    return fnmatch.fnmatchcase(op, r["op"]) and all(cond_ok(c, ctx.get(f)) for f, c in r["when"].items())


@SETTINGS
@given(policies, policies)
def test_hash_equal_iff_normalized_dicts_equal(a: dict, b: dict) -> None:
    pa, pb = Policy.from_dict(a), Policy.from_dict(b)
    assert (pa.hash == pb.hash) == (normalized(a) == normalized(b))
    assert (pa == pb) == (pa.hash == pb.hash)


@SETTINGS
@given(policies, st.randoms(use_true_random=False))
def test_hash_ignores_order_of_order_free_lists(d: dict, rnd) -> None:
    shuffled = {**d, **{k: rnd.sample(d[k], len(d[k])) for k in ("allow", "deny", "boosts")}}
    assert Policy.from_dict(shuffled).hash == Policy.from_dict(d).hash
    assert Policy.from_dict(Policy.from_dict(d).to_dict()).hash == Policy.from_dict(d).hash


@SETTINGS
@given(
    st.sampled_from(sorted(OPS)),
    st.integers(-(10**12), 10**12),
    st.integers(-(10**12), 10**12),
    st.sampled_from(["", " ", "  "]),
)
def test_comparisons_agree_with_python(op: str, n: int, x: int, pad: str) -> None:
    cond = parse_condition(f"{pad}{op}{pad}{n}{pad}", "t")
    assert cond.matches(x) is OPS[op](x, n)
    assert cond.matches(float(x)) is OPS[op](float(x), n)
    assert cond.matches(None) is False and cond.matches(str(x)) is False


@SETTINGS
@given(st.integers(-1000, 1000), st.integers(0, 1000), st.integers(-1500, 1500))
def test_ranges_are_inclusive(lo: int, width: int, x: int) -> None:
    assert parse_condition(f"{lo}..{lo + width}", "t").matches(x) is (lo <= x <= lo + width)


@SETTINGS
@given(policies, policies, st.sampled_from(["attention", "rms_norm", "rope"]), contexts)
def test_merged_lock_precedence(a: dict, b: dict, op: str, ctx: dict) -> None:
    pa, pb = Policy.from_dict(a), Policy.from_dict(b)
    merged = pa.merged(pb)
    expected = pb.lock_for(op, ctx) or pa.lock_for(op, ctx)
    assert merged.lock_for(op, ctx) is expected
    # Brute force: the first lock of b, then of a, whose op and when match.
    first = next((r["kernel"] for r in b["locks"] + a["locks"] if rule_applies(r, op, ctx)), None)
    assert (None if expected is None else expected.kernel) == first
    for kernel_id in ("torch_sdpa.flash", "liger.rms_norm", "reference.attention"):
        backend = kernel_id.split(".")[0]
        assert merged.boost(op, kernel_id, backend, ctx) == pytest.approx(
            pa.boost(op, kernel_id, backend, ctx) + pb.boost(op, kernel_id, backend, ctx)
        )
        got = sorted(r.message for r in merged.reasons_against(op, kernel_id, backend, ctx))
        parts = pa.reasons_against(op, kernel_id, backend, ctx) + pb.reasons_against(
            op, kernel_id, backend, ctx
        )
        assert got == sorted(r.message for r in parts)


@SETTINGS
@given(policies, st.sampled_from(["attention", "rms_norm"]), contexts)
def test_deny_matches_hand_evaluation(d: dict, op: str, ctx: dict) -> None:
    """Evaluate deny rules with the tiny independent interpreter above and compare."""
    policy = Policy.from_dict(d)
    for kernel_id in ("torch_sdpa.flash", "liger.rms_norm", "xformers.a1"):
        backend = kernel_id.split(".")[0]
        expected = sum(
            1
            for r in d["deny"]
            if rule_applies(r, op, ctx)
            and any(
                fnmatch.fnmatchcase(kernel_id, k) or fnmatch.fnmatchcase(backend, k) for k in r["kernels"]
            )
        )
        got = [
            r for r in policy.reasons_against(op, kernel_id, backend, ctx) if r.code.value == "POLICY_DENIED"
        ]
        assert len(got) == expected
