"""Unit tests of layerzero.core.policy / policy_schema: matching worked out by hand, every malformed input
rejected with a typed error, YAML attacks, round trips, hash stability and scoped layers across threads."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from layerzero.core.errors import ConfigurationError, LayerZeroError, PolicyValidationError
from layerzero.core.policy import (
    KNOWN_FIELDS,
    MAX_POLICY_BYTES,
    AllowRule,
    BoostRule,
    DenyRule,
    LockRule,
    Policy,
    safe_load_yaml,
)
from layerzero.core.policy_scope import current_scope_layers, layered, scoped
from layerzero.core.reasons import ReasonCode

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# A hand-built context: decode attention on an H100 (the example context of the design brief).
CTX = {
    "op": "attention",
    "device": "cuda",
    "device_name": "NVIDIA H100 80GB HBM3",
    "sm": 90,
    "gpu_generation": "HOPPER",
    "dtype": "float16",
    "batch": 4,
    "num_heads_q": 32,
    "num_heads_kv": 8,
    "head_dim": 128,
    "seq_len_q": 1,
    "seq_len_kv": 1024,
    "hidden_size": None,
    "layout": "BHSD",
    "mask": "none",
    "is_causal": True,
    "dropout": False,
    "phase": "decode",
    "graph_capture": False,
    "deterministic": False,
    "requires_grad": False,
    "tp_size": 1,
}
CPU = {**CTX, "device": "cpu", "device_name": "cpu", "sm": 0, "gpu_generation": "NONE", "dtype": "float32"}


def deny_when(when: dict, kernels: list[str] | None = None) -> Policy:
    return Policy.from_dict({"version": 1, "deny": [{"kernels": kernels or ["torch_sdpa"], "when": when}]})


def denied(
    policy: Policy, kernel: str = "torch_sdpa.flash", fields: dict = CTX, op: str = "attention"
) -> bool:
    return any(
        r.code is ReasonCode.POLICY_DENIED
        for r in policy.reasons_against(op, kernel, kernel.split(".")[0], fields)
    )


# ---------------------------------------------------------------- matching, worked out by hand
@pytest.mark.parametrize(
    ("when", "expected"),
    [
        ({"device": "cuda"}, True),
        ({"device": "cpu"}, False),
        ({"device_name": "*H100*"}, True),
        ({"device_name": "*h100*"}, False),  # globs are case-sensitive
        ({"device_name": "*A100*"}, False),
        ({"head_dim": 128}, True),
        ({"head_dim": 128.0}, True),
        ({"head_dim": 64}, False),
        ({"head_dim": "<=128"}, True),
        ({"head_dim": "<128"}, False),
        ({"head_dim": ">=128"}, True),
        ({"head_dim": ">128"}, False),
        ({"head_dim": "==128"}, True),
        ({"head_dim": "!=128"}, False),
        ({"head_dim": "!= 64"}, True),
        ({"head_dim": " <= 128 "}, True),
        ({"head_dim": "64..128"}, True),
        ({"head_dim": "128..256"}, True),
        ({"head_dim": "129..256"}, False),
        ({"sm": "90..90"}, True),
        ({"sm": ">=80"}, True),
        ({"sm": [80, 86]}, False),
        ({"sm": [80, ">=90"]}, True),
        ({"dtype": ["bfloat16", "float*"]}, True),
        ({"is_causal": True}, True),
        ({"is_causal": False}, False),
        ({"dropout": False}, True),
        ({"tp_size": 1}, True),
        ({"phase": "decode", "head_dim": ">64"}, True),  # AND of fields
        ({"phase": "decode", "head_dim": "<64"}, False),
        ({"hidden_size": ">0"}, False),  # None never matches
        ({"hidden_size": "!=5"}, False),
        ({"rotary_dim": 64}, False),  # absent field counts as None
        ({}, True),
    ],
)
def test_when_conditions(when: dict, expected: bool) -> None:
    assert denied(deny_when(when)) is expected


def test_bool_and_number_never_match_each_other() -> None:
    # Python says True == 1; a policy does not: a bool condition matches bools only and vice versa.
    weird = {**CTX, "tp_size": True, "is_causal": 1}
    assert not denied(deny_when({"tp_size": 1}), fields=weird)
    assert not denied(deny_when({"is_causal": True}), fields=weird)
    assert denied(deny_when({"is_causal": True}))


def test_glob_matches_strings_only_on_untyped_fields() -> None:
    fields = KNOWN_FIELDS | {"custom"}
    p = Policy.from_dict(
        {"version": 1, "deny": [{"kernels": ["x"], "when": {"custom": "1*"}}]}, known_fields=fields
    )
    assert denied(p, "x.k", {**CTX, "custom": "12"})
    assert not denied(p, "x.k", {**CTX, "custom": 12})
    q = Policy.from_dict(
        {"version": 1, "deny": [{"kernels": ["x"], "when": {"custom": "<=5"}}]}, known_fields=fields
    )
    assert denied(q, "x.k", {**CTX, "custom": 5}) and not denied(q, "x.k", {**CTX, "custom": "5"})


@pytest.mark.parametrize(
    ("kernels", "kernel", "expected"),
    [
        (["torch_sdpa"], "torch_sdpa.flash", True),  # bare backend id covers its kernels
        (["torch_sdpa.flash"], "torch_sdpa.flash", True),
        (["torch_sdpa.flash"], "torch_sdpa.math", False),
        (["torch_sdpa.*"], "torch_sdpa.cudnn", True),
        (["torch_*"], "torch_native.rms_norm", True),
        (["torch_sdpa.[fm]*"], "torch_sdpa.math", True),
        (["torch_sdpa.[fm]*"], "torch_sdpa.cudnn", False),
        (["flash"], "torch_sdpa.flash", False),  # not a substring match
        (["reference", "xformers.*"], "reference.attention", True),
    ],
)
def test_kernel_globs_match_kernel_or_backend(kernels: list[str], kernel: str, expected: bool) -> None:
    assert denied(deny_when({}, kernels), kernel) is expected


def test_op_glob_and_default() -> None:
    p = Policy.from_dict(
        {"version": 1, "deny": [{"op": "*_norm", "kernels": ["torch_native"]}, {"kernels": ["xformers"]}]}
    )
    assert denied(p, "torch_native.rms_norm", CPU, op="rms_norm")
    assert denied(p, "torch_native.layer_norm", CPU, op="layer_norm")
    assert not denied(p, "torch_native.rope", CPU, op="rope")
    assert denied(p, "xformers.cutlass", CPU, op="rope")  # op omitted = "*"


def test_lock_first_match_wins_and_when() -> None:
    p = Policy.from_dict(
        {
            "version": 1,
            "locks": [
                {"op": "attention", "kernel": "torch_sdpa.flash", "when": {"device": "cuda"}},
                {"op": "attention", "kernel": "torch_sdpa.math"},
                {"op": "attention", "kernel": "reference.attention"},
            ],
        }
    )
    assert p.lock_for("attention", CTX).kernel == "torch_sdpa.flash"
    assert p.lock_for("attention", CPU).kernel == "torch_sdpa.math"
    assert p.lock_for("rms_norm", CPU) is None
    assert p.locks[0].matches("attention", "torch_sdpa.flash", "torch_sdpa", CTX)
    assert not p.locks[0].matches("attention", "torch_sdpa.math", "torch_sdpa", CTX)


def test_allow_excludes_uncovered_kernels_only_where_it_applies() -> None:
    p = Policy.from_dict(
        {
            "version": 1,
            "allow": [
                {"op": "attention", "kernels": ["torch_sdpa.*", "reference"], "when": {"device": "cuda"}}
            ],
        }
    )
    reasons = p.reasons_against("attention", "xformers.cutlass", "xformers", CTX)
    assert [r.code for r in reasons] == [ReasonCode.POLICY_NOT_ALLOWED]
    assert "allow[0]" in reasons[0].message and "xformers.cutlass" in reasons[0].message
    assert p.reasons_against("attention", "torch_sdpa.flash", "torch_sdpa", CTX) == []
    assert p.reasons_against("attention", "xformers.cutlass", "xformers", CPU) == []  # when does not match
    assert p.reasons_against("rms_norm", "liger.rms_norm", "liger", CTX) == []  # other op


def test_two_applying_allow_rules_intersect() -> None:
    p = Policy.from_dict(
        {
            "version": 1,
            "allow": [
                {"kernels": ["torch_sdpa", "reference"]},
                {"kernels": ["torch_sdpa.flash", "xformers"]},
            ],
        }
    )
    assert p.reasons_against("attention", "torch_sdpa.flash", "torch_sdpa", CTX) == []
    assert len(p.reasons_against("attention", "torch_sdpa.math", "torch_sdpa", CTX)) == 1
    assert len(p.reasons_against("attention", "liger.x", "liger", CTX)) == 2


def test_deny_reason_names_rule_and_all_matching_rules_reported() -> None:
    p = Policy.from_yaml(
        "version: 1\ndeny:\n  - {kernels: [torch_sdpa]}\n  - {kernels: ['*.flash'], when: {sm: 90}}\n",
        source="prod.yaml",
    )
    reasons = p.reasons_against("attention", "torch_sdpa.flash", "torch_sdpa", CTX)
    assert [r.code for r in reasons] == [ReasonCode.POLICY_DENIED] * 2
    assert "prod.yaml: deny[0]" in reasons[0].message and "prod.yaml: deny[1]" in reasons[1].message
    assert "sm=90" in reasons[1].message


def test_boosts_sum_and_may_be_negative() -> None:
    p = Policy.from_dict(
        {
            "version": 1,
            "boosts": [
                {"op": "attention", "kernels": ["torch_sdpa.flash"], "by": 25.0},
                {"kernels": ["torch_sdpa"], "by": -5, "when": {"phase": "decode"}},
                {"kernels": ["torch_sdpa"], "by": 100, "when": {"phase": "prefill"}},
            ],
        }
    )
    assert p.boost("attention", "torch_sdpa.flash", "torch_sdpa", CTX) == 20.0
    assert p.boost("attention", "torch_sdpa.math", "torch_sdpa", CTX) == -5.0
    assert p.boost("rms_norm", "torch_sdpa.flash", "torch_sdpa", CTX) == -5.0
    assert p.boost("attention", "reference.attention", "reference", CTX) == 0.0
    assert Policy.empty().boost("attention", "torch_sdpa.flash", "torch_sdpa", CTX) == 0.0


def test_prefer_and_reference_only_helpers() -> None:
    p = Policy.prefer(["torch_sdpa", "torch_sdpa.flash"], by=10)
    assert p.boost("attention", "torch_sdpa.flash", "torch_sdpa", CTX) == 20.0  # one rule per id
    assert p.boost("attention", "torch_sdpa.math", "torch_sdpa", CTX) == 10.0
    assert Policy.prefer("liger").boost("rms_norm", "liger.rms_norm", "liger", CPU) == 1000.0
    r = Policy.reference_only()
    assert r.reasons_against("attention", "reference.attention", "reference", CTX) == []
    assert [x.code for x in r.reasons_against("rms_norm", "torch_native.rms_norm", "torch_native", CPU)] == [
        ReasonCode.POLICY_NOT_ALLOWED
    ]
    with pytest.raises(PolicyValidationError, match="at least one"):
        Policy.prefer([])
    with pytest.raises(PolicyValidationError, match=r"prefer\(ids\)\[1\]"):
        Policy.prefer(["ok", "bad id"])
    with pytest.raises(PolicyValidationError, match="finite"):
        Policy.prefer("ok", by=float("nan"))


def test_merged_precedence_and_identity_shortcuts() -> None:
    base = Policy.from_dict(
        {
            "version": 1,
            "locks": [{"op": "attention", "kernel": "torch_sdpa.math"}],
            "deny": [{"kernels": ["xformers"]}],
            "boosts": [{"kernels": ["a"], "by": 1}],
        }
    )
    top = Policy.from_dict(
        {
            "version": 1,
            "locks": [{"op": "attention", "kernel": "torch_sdpa.flash"}],
            "boosts": [{"kernels": ["a"], "by": 2}],
        }
    )
    m = base.merged(top)
    assert m.lock_for("attention", CTX).kernel == "torch_sdpa.flash"
    assert top.merged(base).lock_for("attention", CTX).kernel == "torch_sdpa.math"
    assert m.boost("attention", "a.k", "a", CTX) == 3.0
    assert denied(m, "xformers.cutlass")
    assert base.merged(Policy.empty()) is base and Policy.empty().merged(top) is top
    assert layered(base, [top]) == m and layered(base, []) is base
    with pytest.raises(PolicyValidationError, match="a Policy"):
        base.merged({"version": 1})  # type: ignore[arg-type]


def test_direct_construction_validates_and_accepts_plain_when() -> None:
    rule = DenyRule("attention", ["torch_sdpa.cudnn"], {"sm": "<90"})
    assert rule.kernels == ("torch_sdpa.cudnn",) and rule.when.to_data() == {"sm": "<90"}
    assert Policy(deny=[rule]).reasons_against("attention", "torch_sdpa.cudnn", "torch_sdpa", {"sm": 80})
    with pytest.raises(PolicyValidationError, match=r"lock\.kernel"):
        LockRule("attention", "torch_sdpa.*")
    with pytest.raises(PolicyValidationError, match=r"boost\.by"):
        BoostRule("*", ["a"], "10")  # type: ignore[arg-type]
    with pytest.raises(PolicyValidationError, match=r"Policy\.allow\[0\]: expected AllowRule, got DenyRule"):
        Policy(allow=[rule])  # type: ignore[list-item]
    assert AllowRule("*", ["a"]) != DenyRule("*", ["a"])


# ---------------------------------------------------------------- malformed input: typed errors
_BAD = [
    ({}, r"version: expected 1 \(required\)"),
    ({"version": 2}, "version: expected 1"),
    ({"version": True}, "version: expected 1"),
    ({"version": "1"}, "version: expected 1"),
    ({"version": 1, "dney": []}, r"top-level key 'dney'.*Did you mean 'deny'"),
    ({"version": 1, "deny": {"kernels": ["a"]}}, "deny: expected a list of rules, got dict"),
    ({"version": 1, "deny": ["a"]}, r"deny\[0\]: expected a mapping"),
    ({"version": 1, "deny": [{"kernels": []}]}, r"deny\[0\]\.kernels: expected a non-empty list"),
    ({"version": 1, "deny": [{"kernels": "a"}]}, r"deny\[0\]\.kernels: expected a list.*got str"),
    ({"version": 1, "deny": [{"kernels": [""]}]}, r"deny\[0\]\.kernels\[0\]"),
    ({"version": 1, "deny": [{"kernels": ["a b"]}]}, r"deny\[0\]\.kernels\[0\]"),
    ({"version": 1, "deny": [{"kernels": [3]}]}, r"deny\[0\]\.kernels\[0\]"),
    ({"version": 1, "deny": [{"op": "", "kernels": ["a"]}]}, r"deny\[0\]\.op"),
    ({"version": 1, "deny": [{}]}, r"deny\[0\]: expected the key\(s\) \['kernels'\]"),
    ({"version": 1, "deny": [{"kernels": ["a"], "kernel": "a.b"}]}, r"deny\[0\]\.kernel: expected one of"),
    ({"version": 1, "locks": [{"kernels": ["a.b"]}]}, r"locks\[0\]\.kernels.*Did you mean 'kernel'"),
    (
        {"version": 1, "locks": [{"op": "attention", "kernel": "torch_sdpa"}]},
        r"locks\[0\]\.kernel: expected an exact",
    ),
    ({"version": 1, "locks": [{"op": "attention", "kernel": "torch_sdpa.*"}]}, r"locks\[0\]\.kernel"),
    ({"version": 1, "boosts": [{"kernels": ["a"]}]}, r"boosts\[0\]: expected the key\(s\) \['by'\]"),
    (
        {"version": 1, "boosts": [{"kernels": ["a"], "by": "high"}]},
        r"boosts\[0\]\.by: expected a finite number",
    ),
    ({"version": 1, "boosts": [{"kernels": ["a"], "by": float("inf")}]}, r"boosts\[0\]\.by"),
    ({"version": 1, "boosts": [{"kernels": ["a"], "by": True}]}, r"boosts\[0\]\.by"),
    ({"version": 1, "deny": [{"kernels": ["a"], "when": ["sm"]}]}, r"deny\[0\]\.when: expected a mapping"),
    (
        {"version": 1, "deny": [{"kernels": ["a"], "when": {"hdim": 64}}]},
        r"deny\[0\]\.when\.hdim: expected a known context field.*Did you mean 'head_dim'",
    ),
    (
        {"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": "<=abc"}}]},
        r"deny\[0\]\.when\.head_dim: expected a comparison like '<=128'",
    ),
    (
        {"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": "=<128"}}]},
        r"when\.head_dim: expected a comparison",
    ),
    (
        {"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": "<="}}]},
        r"when\.head_dim: expected a comparison",
    ),
    ({"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": "256..64"}}]}, "lo <= hi"),
    ({"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": "64.."}}]}, "inclusive range"),
    ({"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": "<1e999"}}]}, "finite number"),
    ({"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": None}}]}, r"when\.head_dim: .*got null"),
    (
        {"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": []}}]},
        "non-empty list of alternatives",
    ),
    (
        {"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": [[64]]}}]},
        r"head_dim\[0\].*nested list",
    ),
    (
        {"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": {"lt": 5}}}]},
        r"when\.head_dim.*got dict",
    ),
    (
        {"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": "128"}}]},
        r"head_dim: expected a number.*int field",
    ),
    ({"version": 1, "deny": [{"kernels": ["a"], "when": {"head_dim": True}}]}, "int field"),
    (
        {"version": 1, "deny": [{"kernels": ["a"], "when": {"is_causal": "true"}}]},
        r"is_causal: expected true or false",
    ),
    ({"version": 1, "deny": [{"kernels": ["a"], "when": {"is_causal": 1}}]}, "bool field"),
    (
        {"version": 1, "deny": [{"kernels": ["a"], "when": {"device_name": 3090}}]},
        r"device_name: expected a string glob",
    ),
    ({"version": 1, "deny": [{"kernels": ["a"], "when": {"device": ">=1"}}]}, "string field"),
    ({"version": 1, "deny": [{"kernels": ["a"], "when": {"device": ""}}]}, "non-empty string glob"),
    ({"version": 1, "deny": [{"kernels": ["a"], "when": {"sm": [80, "x"]}}]}, r"when\.sm\[1\]"),
    (
        {"version": 1, "deny": [{"kernels": ["a"], "when": {"sm": float("nan")}}]},
        r"when\.sm: expected a finite",
    ),
    ("version: 1", "expected a mapping"),
]


@pytest.mark.parametrize(("data", "match"), _BAD)
def test_malformed_dicts_rejected(data: object, match: str) -> None:
    with pytest.raises(PolicyValidationError, match=match) as info:
        Policy.from_dict(data, source="bad.yaml")  # type: ignore[arg-type]
    assert str(info.value).startswith("bad.yaml: ")
    assert isinstance(info.value, ValueError)  # callers catching ValueError keep working


_BAD_YAML = [
    ("!!python/object/apply:os.system ['echo pwned']", "without tags"),
    ("version: 1\ndeny: !!python/object:collections.OrderedDict {}", "without tags"),
    ("version: !!int 1", "without tags"),
    ("version: !custom 1", "without tags"),
    ("version: 1\nversion: 1\n", "duplicate key 'version'"),
    ("version: 1\ndeny:\n  - {kernels: [a], kernels: [b]}\n", "duplicate key 'kernels'"),
    ("version: 1\ndeny: [\n", "not valid YAML"),
    ("version: 1\n---\nversion: 1\n", "not valid YAML"),
    ("", "empty document"),
    ("# only a comment\n", "empty document"),
    ("- version: 1", "expected a mapping"),
    ("a: &a [*a]", "alias bomb or a recursive structure"),
    ("[" * 40 + "]" * 40, "nesting depth"),
    ("version: 1\n\x00", "not valid YAML"),
    ("policies/does-not-exist.yaml", "expected an existing file"),
]


@pytest.mark.parametrize(("text", "match"), _BAD_YAML)
def test_malformed_yaml_rejected(text: str, match: str) -> None:
    with pytest.raises(PolicyValidationError, match=match):
        Policy.from_yaml(text)


def test_yaml_billion_laughs_is_bounded() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    with pytest.raises(PolicyValidationError, match="alias bomb"):
        Policy.from_yaml("\n".join(lines))
    # Legitimate aliases still work: reuse one `when:` block.
    ok = Policy.from_yaml(
        "version: 1\ndeny:\n  - {kernels: [a], when: &w {sm: '<90'}}\n  - {kernels: [b], when: *w}\n"
    )
    assert ok.deny[0].when == ok.deny[1].when


def test_size_limits_and_input_types(tmp_path: Path) -> None:
    with pytest.raises(PolicyValidationError, match="at most 1048576 bytes"):
        Policy.from_yaml("#" * (MAX_POLICY_BYTES + 1))
    big = tmp_path / "big.yaml"
    big.write_text("version: 1\n" + "#" * MAX_POLICY_BYTES)
    with pytest.raises(PolicyValidationError, match="at most 1048576 bytes"):
        Policy.from_yaml(big)
    with pytest.raises(PolicyValidationError, match="UTF-8"):
        Policy.from_yaml(b"version: 1\n\xff\xfe")
    with pytest.raises(PolicyValidationError, match="YAML text .* or a file path"):
        Policy.from_yaml(12)  # type: ignore[arg-type]
    with pytest.raises(PolicyValidationError, match="readable YAML file"):
        Policy.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(PolicyValidationError, match="readable YAML file"):
        Policy.from_yaml(tmp_path)  # a directory
    recursive: dict = {"version": 1}
    recursive["deny"] = [recursive]
    with pytest.raises(PolicyValidationError, match="recursive"):
        Policy.from_dict(recursive)


def test_from_yaml_reads_paths_text_and_bytes(tmp_path: Path) -> None:
    text = "version: 1\nlocks: [{op: attention, kernel: torch_sdpa.math}]\n"
    f = tmp_path / "p.yaml"
    f.write_text(text)
    by_path, by_str, by_text, by_bytes = (Policy.from_yaml(x) for x in (f, str(f), text, text.encode()))
    assert by_path == by_str == by_text == by_bytes
    assert by_path.source == str(f) and by_text.source == "<yaml>" and by_bytes.source == "<bytes>"
    assert by_path.locks[0].origin == f"{f}: locks[0]"
    data, source = safe_load_yaml("\ufeffversion: 1\n".encode())  # BOM is accepted
    assert data == {"version": 1} and source == "<bytes>"


def test_shipped_policies_load() -> None:
    files = [ROOT / "policies" / "default.yaml", *sorted((ROOT / "policies" / "examples").glob("*.yaml"))]
    assert len(files) >= 4
    for path in files:
        policy = Policy.from_yaml(path)
        assert Policy.from_dict(policy.to_dict()) == policy
    assert Policy.from_yaml(files[0]).is_empty


# ---------------------------------------------------------------- round trip, hash, ids
FULL = {
    "version": 1,
    "locks": [
        {"op": "attention", "kernel": "torch_sdpa.math", "when": {"device": "cpu", "head_dim": "<=128"}}
    ],
    "allow": [{"op": "attention", "kernels": ["torch_sdpa.*", "reference"], "when": {"device": "cuda"}}],
    "deny": [{"op": "*", "kernels": ["torch_sdpa.cudnn"], "when": {"sm": [80, ">=90"]}}],
    "boosts": [
        {"op": "attention", "kernels": ["torch_sdpa.flash"], "by": 25.0, "when": {"seq_len_q": "64..256"}}
    ],
}


def test_round_trip_is_exact() -> None:
    p = Policy.from_dict(FULL)
    assert p.to_dict() == FULL
    assert Policy.from_dict(p.to_dict()) == p and Policy.from_yaml(_dump(p.to_dict())) == p


def _dump(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data)


def test_hash_is_stable_and_semantic() -> None:
    p = Policy.from_dict(FULL)
    # Pinned value: a change here changes every cache key and must be deliberate.
    assert p.hash == Policy.from_dict(FULL, source="other").hash
    assert len(p.hash) == 64 and int(p.hash, 16) >= 0
    assert p.hash == _pinned_hash()
    assert Policy.empty().hash == Policy.from_dict({"version": 1}).hash
    reordered = {**FULL, "deny": FULL["deny"] + [{"kernels": ["xformers"]}]}
    swapped = {**FULL, "deny": [{"kernels": ["xformers"]}] + FULL["deny"]}
    assert Policy.from_dict(reordered).hash == Policy.from_dict(swapped).hash  # deny order has no effect
    locks2 = [{"op": "attention", "kernel": "torch_sdpa.flash"}]
    a = Policy.from_dict({"version": 1, "locks": FULL["locks"] + locks2})
    b = Policy.from_dict({"version": 1, "locks": locks2 + FULL["locks"]})
    assert a.hash != b.hash and a != b  # lock order is semantic (first match wins)
    same = [{"op": "*", "kernels": ["b", "a"], "when": {"sm": "==90", "device": "cuda"}}]
    other = [{"op": "*", "kernels": ["a", "b", "a"], "when": {"device": "cuda", "sm": 90}}]
    assert Policy.from_dict({"version": 1, "deny": same}) == Policy.from_dict({"version": 1, "deny": other})
    assert (
        Policy.from_dict({"version": 1, "deny": same}).hash
        != Policy.from_dict({"version": 1, "allow": same}).hash
    )
    assert len({p, Policy.from_dict(FULL)}) == 1  # hashable, equal by meaning


def _pinned_hash() -> str:
    import hashlib
    import json

    canonical = {
        "version": 1,
        "locks": [
            {
                "op": "attention",
                "kernel": "torch_sdpa.math",
                "when": {"device": {"glob": "cpu"}, "head_dim": {"cmp": "<=", "n": 128}},
            }
        ],
        "allow": [
            {
                "op": "attention",
                "kernels": ["reference", "torch_sdpa.*"],
                "when": {"device": {"glob": "cuda"}},
            }
        ],
        "deny": [
            {
                "op": "*",
                "kernels": ["torch_sdpa.cudnn"],
                "when": {"sm": {"any": [{"cmp": ">=", "n": 90}, {"eq": 80}]}},
            }
        ],
        "boosts": [
            {
                "op": "attention",
                "kernels": ["torch_sdpa.flash"],
                "by": 25,
                "when": {"seq_len_q": {"range": [64, 256]}},
            }
        ],
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def test_kernel_and_backend_ids() -> None:
    p = Policy.from_dict(FULL)
    assert p.kernel_ids() == {"torch_sdpa.math", "torch_sdpa.cudnn", "torch_sdpa.flash"}
    assert p.backend_ids() == {"reference"}


# ---------------------------------------------------------------- scoped layers
def test_scopes_nest_and_reset_on_error() -> None:
    a, b = Policy.prefer("a"), Policy.prefer("b")
    assert current_scope_layers() == ()
    with scoped(a):
        with scoped(b) as got:
            assert got is b and current_scope_layers() == (a, b)
            assert current_scope_layers() is current_scope_layers()
        assert current_scope_layers() == (a,)
        with pytest.raises(RuntimeError), scoped(b):
            raise RuntimeError("boom")
        assert current_scope_layers() == (a,)
    assert current_scope_layers() == ()
    with pytest.raises(PolicyValidationError, match="scoped\\(policy_layer\\): expected a Policy, got dict"):
        with scoped({"version": 1}):  # type: ignore[arg-type]
            pass


def test_layered_uses_innermost_lock() -> None:
    base = Policy.from_dict({"version": 1, "locks": [{"op": "attention", "kernel": "x.base"}]})
    outer = Policy.from_dict({"version": 1, "locks": [{"op": "attention", "kernel": "x.outer"}]})
    inner = Policy.from_dict({"version": 1, "locks": [{"op": "attention", "kernel": "x.inner"}]})
    with scoped(outer):
        assert layered(base).lock_for("attention", CTX).kernel == "x.outer"
        with scoped(inner):
            assert layered(base).lock_for("attention", CTX).kernel == "x.inner"
            assert layered(base) == base.merged(outer).merged(inner)


def test_scopes_are_per_thread() -> None:
    layers = [Policy.prefer(f"k{i}") for i in range(4)]
    barrier = threading.Barrier(len(layers))
    seen: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            assert current_scope_layers() == ()  # a new thread starts with no layers
            with scoped(layers[i]):
                with scoped(layers[(i + 1) % 4]):
                    barrier.wait(timeout=10)  # all threads are inside their scopes at once
                    seen[i] = current_scope_layers()
                    barrier.wait(timeout=10)
                assert current_scope_layers() == (layers[i],)
            assert current_scope_layers() == ()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with scoped(Policy.reference_only()):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(layers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert current_scope_layers() == (Policy.reference_only(),)
    assert not errors, errors
    assert seen == {i: (layers[i], layers[(i + 1) % 4]) for i in range(4)}


def test_scopes_are_per_asyncio_task() -> None:
    a, b = Policy.prefer("a"), Policy.prefer("b")

    async def task(layer: Policy, wait: asyncio.Event, go: asyncio.Event) -> tuple:
        with scoped(layer):
            wait.set()
            await go.wait()
            return current_scope_layers()

    async def main() -> tuple:
        e1, e2, go = asyncio.Event(), asyncio.Event(), asyncio.Event()
        with scoped(Policy.reference_only()):
            t1 = asyncio.create_task(task(a, e1, go))
            t2 = asyncio.create_task(task(b, e2, go))
        await e1.wait()
        await e2.wait()
        go.set()
        return await t1, await t2, current_scope_layers()

    r1, r2, outside = asyncio.run(main())
    assert r1 == (Policy.reference_only(), a) and r2 == (Policy.reference_only(), b) and outside == ()


# ---------------------------------------------------------------- from_env
def test_from_env_layers_env_over_file(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(
        "version: 1\nlocks: [{op: attention, kernel: torch_sdpa.flash}, {op: rope, kernel: a.b}]\n"
        "deny: [{kernels: [xformers]}]\n"
    )
    env = {
        "LAYERZERO_POLICY": str(f),
        "LAYERZERO_LOCK": "attention=torch_sdpa.math",
        "LAYERZERO_DENY": "liger",
        "LAYERZERO_PREFER": "torch_native,torch_sdpa.flash",
        "PATH": "/bin",
    }
    p = Policy.from_env(env)
    assert p.lock_for("attention", CTX).kernel == "torch_sdpa.math"  # env beats file
    assert p.lock_for("rope", CTX).kernel == "a.b"
    assert denied(p, "xformers.x") and denied(p, "liger.rms_norm")
    assert p.boost("rms_norm", "torch_native.rms_norm", "torch_native", CPU) == 1000.0
    assert Policy.from_env({}) == Policy.empty()
    allow = Policy.from_env({"LAYERZERO_ALLOW": "torch_sdpa", "LAYERZERO_DISABLED": "1"})
    assert (
        len(allow.reasons_against("attention", "torch_sdpa.flash", "torch_sdpa", CTX)) == 1
    )  # not reference
    assert len(allow.reasons_against("attention", "xformers.x", "xformers", CTX)) == 2


def test_from_env_errors_are_typed(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="LAYERZERO_LOCK"):
        Policy.from_env({"LAYERZERO_LOCK": "attention"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndeny: [{kernels: []}]\n")
    with pytest.raises(PolicyValidationError, match=r"bad\.yaml: deny\[0\]\.kernels"):
        Policy.from_env({"LAYERZERO_POLICY": str(bad)})
    with pytest.raises(LayerZeroError):
        Policy.from_env({"LAYERZERO_DENY": "a,,b"})


# ---------------------------------------------------------------------------------------- when: fields
def _sample_contexts():
    """Real contexts of several ops (CPU), built by the ops themselves: their fields() are what rules see."""
    import torch

    import layerzero as lz

    q = torch.ones(1, 2, 4, 8)
    x, w = torch.ones(2, 8), torch.ones(8)
    return [
        lz.explain("attention", q, q, q, window=(1, 0), is_causal=True, softcap=5.0).context,
        lz.explain("rms_norm", x, w).context,
        lz.explain("sample_topk", torch.ones(2, 5), 2).context,
    ]


def test_every_selection_context_field_is_accepted_in_when_with_its_kind():
    """FIELD_KINDS is derived from SelectionContext: every key of ctx.fields() is a known field, the kind fits
    the values real contexts hold, and a condition of that kind loads and matches the context's own value."""
    import dataclasses

    from layerzero.core.context import SelectionContext
    from layerzero.core.policy_schema import FIELD_KINDS, FieldKind

    ctxs = _sample_contexts()
    names = set(ctxs[0].fields())
    assert names == set(FIELD_KINDS) == set(KNOWN_FIELDS)
    assert {f.name for f in dataclasses.fields(SelectionContext)} <= names
    # the fields the hand list used to miss
    assert {
        "param_dtype": "str",
        "aligned_16": "bool",
        "has_softcap": "bool",
        "window_left": "int",
        "window_right": "int",
    }.items() <= {k: v.value for k, v in FIELD_KINDS.items()}.items()
    python_type = {FieldKind.STR: str, FieldKind.INT: int, FieldKind.BOOL: bool}
    seen = set()
    for ctx in ctxs:
        fields = ctx.fields()
        for name, value in fields.items():
            if value is None:
                continue
            seen.add(name)
            kind = FIELD_KINDS[name]
            assert type(value) is python_type[kind], (name, value, kind)
            cond = value if kind is not FieldKind.STR else str(value)
            pol = Policy.from_dict({"version": 1, "deny": [{"kernels": ["x.y"], "when": {name: cond}}]})
            assert pol.deny[0].when.matches(fields), name
    # a wrong kind is rejected at load time for each kind
    for name, bad in (("param_dtype", 16), ("aligned_16", "yes"), ("window_left", "4")):
        with pytest.raises(PolicyValidationError, match=name):
            Policy.from_dict({"version": 1, "deny": [{"kernels": ["x.y"], "when": {name: bad}}]})
    assert {"param_dtype", "aligned_16", "has_softcap", "window_left", "window_right"} <= seen
