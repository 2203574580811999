"""The bad-call catalogue: one test (or table) per class of defect it found.

1. non-string ids and non-path arguments, malformed ``lz.tune`` / ``lz.warmup`` cases -> typed errors naming
   the argument (never a bare TypeError);
2. a positive temperature so small that ``logits / T`` overflows -> greedy argmax (not a
   KernelExecutionError);
3. masks of rank < 4 -> served by every mask-accepting kernel, equal to a float64 oracle, no health charged;
4. policies naming unknown ops / kernels / backends -> PolicyValidationError (files) or ConfigurationError
   (environment, like ``lz.prefer``), malformed ``config:`` and duplicate ``<<`` merge keys rejected, a bad
   ``LAYERZERO_CAPABILITIES`` file raises on ``lz.reload()``;
5. ``register_kernel``: unknown device types rejected, ``mask_kinds=None`` means every mask kind;
6. ``lz.sample`` / ``lz.apply_penalties``: per-row tensors of the wrong type, dtype, shape or device, CPU
   values out of range, token ids outside ``[0, V]`` -> InvalidInputError naming the argument; values on other
   devices are not read (that would synchronize).
7. ``lz.fused_moe``: every malformed argument (ranks, packed w13 halves, w2 shape, dtypes, devices, top_k,
   expert ids out of range on CPU) -> InvalidInputError naming it, before any kernel runs.

Runs under ``python -O`` too (no assert-based validation in src/).
"""

from __future__ import annotations

import math

import pytest
import torch

import layerzero as lz
from layerzero.core.specs import MaskKind

pytestmark = pytest.mark.unit


def _attn_kernel(q, k, v, attn_mask, is_causal, scale, dropout_p):
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale
    )


# ----------------------------------------------------------------------------- 5. register_kernel constraints
@pytest.mark.parametrize(
    ("device_types", "match"),
    [
        (
            {"gpu"},
            r"device_types: expected torch device types such as \['cpu', 'cuda', 'mps', 'xpu'\].*got "
            r"'gpu'.*'cuda'",
        ),
        ({"cda"}, r"got 'cda'.*Did you mean 'cuda'"),
        ({"cuda:0"}, r"got 'cuda:0'"),
        ({"cpu", 3}, r"got 3"),
        (None, r"device_types: expected a set.*got None"),
        (set(), r"got an empty set"),
    ],
)
def test_register_kernel_rejects_unknown_device_types(device_types, match):
    with pytest.raises(lz.ConfigurationError, match=match):
        lz.register_kernel("attention", "mylib.cat5", _attn_kernel, device_types=device_types)
    assert "mylib.cat5" not in {k["kernel_id"] for k in lz.list_kernels("attention")}


def test_register_kernel_device_types_known_and_other_torch_types():
    spec = lz.register_kernel("attention", "mylib.cat5", _attn_kernel, device_types=["CUDA", "cpu", "hpu"])
    assert spec.device_types == frozenset({"cuda", "cpu", "hpu"})
    lz.unregister_kernel("mylib.cat5")


def test_register_kernel_mask_kinds_none_means_every_kind():
    spec = lz.register_kernel("attention", "mylib.cat5", _attn_kernel, device_types={"cpu"}, mask_kinds=None)
    assert spec.mask_kinds == frozenset(MaskKind) == frozenset({MaskKind.NONE, MaskKind.BOOL, MaskKind.FLOAT})
    q = torch.randn(1, 2, 4, 8)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    assert lz.validate("mylib.cat5", "attention", q, q, q, attn_mask=mask) == []
    lz.unregister_kernel("mylib.cat5")
    with pytest.raises(
        lz.ConfigurationError,
        match=r"mask_kinds: expected values from \['bool', 'float', 'none'\], "
        r"got None",
    ):
        lz.register_kernel("attention", "mylib.cat5", _attn_kernel, mask_kinds={"bool", None})
    with pytest.raises(lz.ConfigurationError, match="dtypes: expected a set"):
        lz.register_kernel("attention", "mylib.cat5", _attn_kernel, dtypes=None)


# ------------------------------------------------------------------------------ 3. masks of rank < 4
def _mask_cases(dtype):
    """(name, mask) of every rank < 4 (plus an expanded, stride-0 view and an Sk = 1 broadcast) for q
    [B=2, Hq=4, Sq=5, D=8], k/v [2, 2, Sk=7, 8] (GQA)."""
    g = torch.Generator().manual_seed(3)
    m1 = torch.rand(7, generator=g) > 0.3
    m1[0] = True  # every row keeps a key
    m2 = torch.rand(5, 7, generator=g) > 0.3
    m2[:, 0] = True
    m3 = torch.rand(4, 5, 7, generator=g) > 0.3
    m3[..., 0] = True
    return [
        ("bool[Sk]", m1),
        ("bool[Sq,Sk]", m2),
        ("bool[Hq,Sq,Sk]", m3),
        ("bool[Sk].expand(Sq,Sk)", m1.expand(5, 7)),
        ("bool[1]", torch.ones(1, dtype=torch.bool)),
        ("float[Sk]", torch.where(m1, 0.0, -1e4).to(dtype)),
        ("float[Sq,Sk]", torch.randn(5, 7, generator=g).to(dtype)),
        ("float[Hq,1,Sk]", torch.randn(4, 1, 7, generator=g).to(dtype)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_low_rank_masks_served_by_every_kernel_without_fallback_or_health_charge(dtype):
    import sys
    from pathlib import Path

    from layerzero.core.runtime import RUNTIME

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
    from _shapes import attention_oracle

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 5, 8, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 7, 8, generator=g).to(dtype) for _ in range(2))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    served = set()
    RUNTIME.health.reset()
    for kid in [info["kernel_id"] for info in lz.list_kernels("attention")]:
        for name, mask in _mask_cases(dtype):
            if lz.validate(kid, "attention", q, k, v, attn_mask=mask):
                continue
            lz.lock("attention", kid)
            try:
                with lz.trace() as tr:
                    out = lz.attention(q, k, v, attn_mask=mask)
            finally:
                lz.unlock("attention")
            assert tr.fallbacks == [] and tr.kernels_for("attention") == [kid], (kid, name, tr.fallbacks)
            ref = attention_oracle(q, k, v, attn_mask=mask)
            torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=f"{kid} {name}")
            served.add(kid)
    assert RUNTIME.health.snapshot() == {}, "a valid mask charged a backend's health"
    assert {"reference.attention", "torch_sdpa.math"} <= served
    if dtype == torch.float32:
        assert "torch_sdpa.flash" in served  # the kernel that raised IndexError on a 1-D mask
    # unlocked calls too: the default choice serves a 1-D key-padding mask without a fallback
    with lz.trace() as tr:
        out = lz.attention(q, k, v, attn_mask=_mask_cases(dtype)[0][1])
    assert tr.fallbacks == []
    torch.testing.assert_close(
        out.double(), attention_oracle(q, k, v, attn_mask=_mask_cases(dtype)[0][1]), rtol=tol, atol=tol
    )


def test_low_rank_mask_reaches_kernels_as_a_4d_view():
    seen = []

    def spy(q, k, v, attn_mask, is_causal, scale, dropout_p):
        seen.append((tuple(attn_mask.shape), attn_mask.data_ptr()))
        return _attn_kernel(q, k, v, attn_mask, is_causal, scale, dropout_p)

    lz.register_kernel("attention", "mylib.spy", spy, priority=1000, device_types={"cpu"})
    try:
        q = torch.randn(1, 2, 3, 8)
        mask = torch.tensor([True, False, True])
        lz.attention(q, q, q, attn_mask=mask)
        lz.attention(q, q, q, attn_mask=mask[None].expand(3, 3))
    finally:
        lz.unregister_kernel("mylib.spy")
    assert seen == [((1, 1, 1, 3), mask.data_ptr()), ((1, 1, 3, 3), mask.data_ptr())]  # views, no copy


# ------------------------------------------------------------------------------ 2. tiny temperatures
# Worked by hand: the maximum is token 2 (1e10); token 0 is 1e4 below it, so at T <= 1e-20 its weight is
# exp(-1e4 / T) = 0 and softmax((x - max) / T) is one-hot at token 2; x / T itself overflows float32 (1e10 /
# 1e-30).
BIG = torch.tensor([[1e10 - 1e4, -3.0, 1e10, 5e9, 0.0], [-1.0, 7.0, 2.0, 6.5, -50.0]])
BIG_ARGMAX = [2, 1]
TIES = torch.tensor([[0.0, 5.0, 5.0, 1.0], [2.0, 2.0, -1.0, 2.0]])  # maxima tied: first index is 1, then 0
TINY = [
    1e-40,
    1e-45,
    5e-39,
    1e-300,
]  # below float32's smallest normal (~1.18e-38): greedy, first index on ties
SMALL = [2e-38, 1e-30, 1e-20]  # normal float32 but logits / T overflows: the kernels must not produce NaN


@pytest.mark.parametrize("temperature", TINY + SMALL)
@pytest.mark.parametrize("op", ["sample_topk", "sample_topp"])
def test_tiny_temperature_gives_the_argmax_token(op, temperature):
    fn, arg = (lz.sample_topk, 3) if op == "sample_topk" else (lz.sample_topp, 0.9)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        assert fn(BIG, arg, temperature=temperature, generator=gen).tolist() == BIG_ARGMAX
        assert fn(BIG.double(), arg, temperature=temperature, generator=gen).tolist() == BIG_ARGMAX
    for cut in ((lz.sample_topk, 10**6), (lz.sample_topp, 1.0)):  # no cut: the whole vocabulary
        assert cut[0](BIG, cut[1], temperature=temperature).tolist() == BIG_ARGMAX


@pytest.mark.parametrize("temperature", TINY)
def test_temperature_below_float32_tiny_is_greedy_first_index_on_ties_and_draws_nothing(temperature):
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert lz.sample_topk(TIES, 3, temperature=temperature, generator=gen).tolist() == [1, 0]
    assert lz.sample_topp(TIES, 0.9, temperature=temperature, generator=gen).tolist() == [1, 0]
    assert torch.equal(gen.get_state(), state), "greedy calls must not draw"
    key, _ = lz.ops.sampling.prepare_topk(TIES, 3, temperature=temperature)
    assert key.greedy is True


def test_small_positive_temperature_keeps_tied_maxima_and_nothing_else():
    """Above the greedy threshold the softmax is exact: tied maxima share the mass, every other token
    gets 0."""
    drawn = {
        tuple(lz.sample_topk(TIES, 4, temperature=1e-30, generator=torch.Generator().manual_seed(s)).tolist())
        for s in range(40)
    }
    assert all(a in (1, 2) and b in (0, 1, 3) for a, b in drawn)
    assert (
        len({a for a, _ in drawn}) == 2 and len({b for _, b in drawn}) == 3
    )  # uniform among ties, not greedy


@pytest.mark.parametrize("temperature", TINY + SMALL)
def test_reference_kernels_tiny_temperature(temperature):
    from layerzero.backends.reference import sampling as ref

    gen = torch.Generator().manual_seed(0)
    assert ref.sample_topk(BIG, 3, temperature, gen).tolist() == BIG_ARGMAX
    assert ref.sample_topp(BIG, 0.9, temperature, gen).tolist() == BIG_ARGMAX
    assert ref.sample_topp(BIG, 1.0, temperature, gen).tolist() == BIG_ARGMAX
    probs = ref._probs(BIG, temperature) if temperature >= ref.GREEDY_BELOW else None
    if probs is not None:
        assert torch.equal(probs, torch.nn.functional.one_hot(torch.tensor(BIG_ARGMAX), 5).float())


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton is not installed"
)
@pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning"
)  # numpy: (x - max) / T -> -inf, intended
@pytest.mark.parametrize("temperature", TINY + SMALL)
def test_triton_draw_tiny_temperature_under_the_interpreter(temperature):
    """The Triton kernel on CPU tensors through the interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
    without a CUDA device): every cut path (top-k, top-p, none) and every uniform gives the argmax."""
    import os

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from layerzero.backends.triton import sampling

    for u in (torch.zeros(2), torch.full((2,), 0.5), torch.ones(2) - 2**-24):
        for cut in ({"k": 3}, {"p": 0.9}, {"k": None}):
            assert sampling.draw(BIG, u, temperature=temperature, **cut).tolist() == BIG_ARGMAX, (u, cut)
    a, b = sampling.sample_topk(TIES, 3, temperature, torch.Generator().manual_seed(0)).tolist()
    if temperature in TINY:
        assert (a, b) == (1, 0)  # greedy: first index on ties
    else:
        assert a in (1, 2) and b in (0, 1, 3)  # the tied maxima only


# ---------------------------------------------------------------------------- 1. non-string ids, paths, cases
Q = torch.ones(1, 2, 4, 8)


def _noop_attention(q, k, v, attn_mask, is_causal, scale, dropout_p):
    return q


NON_STR_IDS = [
    (
        "lock-kernel-None",
        lambda: lz.lock("attention", None),
        lz.UnknownKernelError,
        r"lz\.lock\(kernel_id\): expected a kernel id .*\(a str\), got NoneType",
    ),
    (
        "lock-op-int",
        lambda: lz.lock(1, "torch_sdpa.math"),
        lz.UnknownOperationError,
        r"lz\.lock\(op\): expected an op id \(a str\) from "
        r"\['all_gather', 'all_reduce', 'all_to_all', 'apply_penalties'.*got int",
    ),
    (
        "unlock-op-list",
        lambda: lz.unlock(["attention"]),
        lz.UnknownOperationError,
        r"lz\.unlock\(op\).*got list",
    ),
    (
        "register-op-list",
        lambda: lz.register_kernel(["attention"], "mylib.k", _noop_attention),
        lz.UnknownOperationError,
        r"lz\.register_kernel\(op\): expected an op id \(a str\).*got list",
    ),
    (
        "register-kernel-id-int",
        lambda: lz.register_kernel("attention", 7, _noop_attention),
        lz.ConfigurationError,
        r"lz\.register_kernel\(kernel_id\): expected a kernel id .*got int 7",
    ),
    (
        "kernel-decorator-op-None",
        lambda: lz.kernel(None, "mylib.k"),
        lz.UnknownOperationError,
        r"lz\.kernel\(op\).*got NoneType",
    ),
    (
        "unregister-int",
        lambda: lz.unregister_kernel(123),
        lz.UnknownKernelError,
        r"lz\.unregister_kernel\(kernel_id\): expected a kernel id .*got int 123",
    ),
    (
        "validate-kernel-None",
        lambda: lz.validate(None, "attention", Q, Q, Q),
        lz.UnknownKernelError,
        r"lz\.validate\(kernel_id\).*got NoneType",
    ),
    (
        "validate-op-int",
        lambda: lz.validate("torch_sdpa.math", 5, Q, Q, Q),
        lz.UnknownOperationError,
        r"lz\.validate\(op\).*got int",
    ),
    (
        "list-kernels-int",
        lambda: lz.list_kernels(123),
        lz.UnknownOperationError,
        r"lz\.list_kernels\(op\).*got int",
    ),
    (
        "tune-op-list",
        lambda: lz.tune(["attention"], [{}], progress=False),
        lz.UnknownOperationError,
        r"lz\.tune\(op\): expected an op id \(a str\).*got list",
    ),
    (
        "explain-op-int",
        lambda: lz.explain(123, Q, Q, Q),
        lz.UnknownOperationError,
        r"lz\.explain\(op\).*got int",
    ),
    ("which-op-int", lambda: lz.which(123, Q, Q, Q), lz.UnknownOperationError, r"lz\.which\(op\).*got int"),
    (
        "select-op-tuple",
        lambda: lz.select(("attention",), Q, Q, Q),
        lz.UnknownOperationError,
        r"lz\.select\(op\).*got tuple",
    ),
    (
        "load-config-int",
        lambda: lz.load_config(123),
        lz.ConfigurationError,
        r"load_config\(path\): expected a file path \(str or os\.PathLike\), got int",
    ),
    (
        "load-capabilities-int",
        lambda: lz.load_capabilities(123),
        lz.ConfigurationError,
        r"load_capabilities\(path\): expected a file path \(str or os\.PathLike\), got int",
    ),
    (
        "load-capabilities-missing",
        lambda: lz.load_capabilities("no/such/caps.yaml"),
        lz.ConfigurationError,
        r"capability overrides path: expected an existing YAML file, got 'no/such/caps\.yaml'",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "match"), [c[1:] for c in NON_STR_IDS], ids=[c[0] for c in NON_STR_IDS]
)
def test_non_string_ids_and_paths_raise_typed_errors_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, lz.LayerZeroError) and isinstance(info.value, ValueError)
    assert lz.get_locks() == {}


SIG = (
    r"expected lz\.attention\(q, k, v, \*, attn_mask=None, is_causal=False, .*softcap=None, "
    r"alibi_slopes=None\)"
)
BAD_CASES = [
    (
        "misspelt-keyword",
        ((Q, Q, Q), {"is_casual": True}),
        r"case 1: arguments of lz\.attention: " + SIG + r".*unexpected keyword argument 'is_casual'",
    ),
    ("too-few-positional", ((Q, Q), {}), r"case 1: .*" + SIG + r", got 2 positional argument\(s\).*'v'"),
    ("too-many-positional", ((Q, Q, Q, None), {}), r"case 1: .*too many positional arguments"),
    ("keyword-given-twice", ((Q, Q, Q), {"q": Q}), r"case 1: .*multiple values for argument 'q'"),
]


@pytest.mark.parametrize(("case", "match"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_tune_and_warmup_cases_that_do_not_bind_raise_invalid_input(case, match):
    good = ((Q, Q, Q), {"is_causal": True})
    with pytest.raises(lz.InvalidInputError, match=r"lz\.tune\('attention'\) " + match):
        lz.tune("attention", [good, case], progress=False, warmup=0, iters=1, repeats=1)
    with pytest.raises(lz.InvalidInputError, match=r"lz\.warmup\('attention'\) " + match):
        lz.warmup("attention", [good, case])


def test_tune_shape_dict_with_non_string_keys_and_inspection_with_bad_arguments():
    with pytest.raises(
        lz.InvalidInputError, match=r"lz\.tune case 0: shape parameter names: expected str names"
    ):
        lz.tune("attention", [{1: 2}], progress=False)
    with pytest.raises(lz.InvalidInputError, match=r"lz\.explain: arguments of lz\.attention.*'is_casual'"):
        lz.explain("attention", Q, Q, Q, is_casual=True)
    with pytest.raises(
        lz.InvalidInputError,
        match=r"lz\.which: arguments of lz\.rms_norm: expected "
        r"lz\.rms_norm\(x, weight, eps=1e-06, \*, residual=None\)",
    ):
        lz.which("rms_norm", torch.ones(2, 8))
    # a valid call is still served and selected the same way
    assert (
        lz.which("attention", Q, Q, Q, is_causal=True)
        == lz.select("attention", Q, Q, Q, is_causal=True).kernel_id
    )


# -------------------------------------------------------------------------- 4. policies naming unknown things
def _policy_file(tmp_path, text):
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


UNKNOWN_NAMES = [
    (
        "lock-unknown-op",
        "locks: [{op: atention, kernel: torch_sdpa.math}]",
        r"locks\[0\]: op 'atention' matches no registered op\. Did you mean 'attention'\? Known: "
        r"\['all_gather', 'all_reduce', 'all_to_all', 'apply_penalties', 'apply_token_bitmask', 'attention'",
    ),
    (
        "allow-unknown-kernel",
        "allow: [{kernels: [torch_sdpa.mth]}]",
        r"allow\[0\]: 'torch_sdpa\.mth' matches no kernel or backend id\. Did you mean 'torch_sdpa\.math'\?",
    ),
    (
        "deny-unknown-glob",
        "deny: [{op: attention, kernels: ['nope.*']}]",
        r"deny\[0\]: 'nope\.\*' matches no kernel",
    ),
    (
        "boost-unknown-backend",
        "boosts: [{kernels: [torch_spda], by: 5}]",
        r"boosts\[0\]: 'torch_spda' matches no kernel or backend id\. Did you mean 'torch_sdpa'\?",
    ),
    (
        "lock-unknown-kernel",
        "locks: [{op: attention, kernel: torch_sdpa.mth}]",
        r"locks\[0\]: lock kernel 'torch_sdpa\.mth' is not a registered kernel\. Did you mean "
        r"'torch_sdpa\.math'\?",
    ),
    (
        "lock-kernel-of-another-op",
        "locks: [{op: attention, kernel: reference.rms_norm}]",
        r"locks\[0\]: lock kernel 'reference\.rms_norm' serves op 'rms_norm', which the lock's op "
        r"'attention' does not match\. Kernels of the lock's op\(s\): \['flash_attn2\.attention'",
    ),
    (
        "op-glob-matching-nothing",
        "deny: [{op: 'attn*', kernels: [reference]}]",
        r"deny\[0\]: op 'attn\*' matches no registered op",
    ),
]


@pytest.mark.parametrize(
    ("rules", "match"), [c[1:] for c in UNKNOWN_NAMES], ids=[c[0] for c in UNKNOWN_NAMES]
)
def test_policy_file_naming_unknown_things_raises_before_any_selection(tmp_path, rules, match):
    path = _policy_file(tmp_path, f"version: 1\n{rules}\n")
    lz.load_config(path)
    for call in (
        lambda: lz.attention(Q, Q, Q),
        lambda: lz.explain("attention", Q, Q, Q),
        lambda: lz.validate("torch_sdpa.math", "attention", Q, Q, Q),
    ):
        with pytest.raises(lz.PolicyValidationError, match=str(path).replace(".", r"\.") + ": " + match):
            call()
    lz.load_config(_policy_file(tmp_path, "version: 1\n"))  # fixed: served again
    assert lz.attention(Q, Q, Q).shape == Q.shape


def test_policy_globs_and_known_but_unavailable_backends_are_accepted(tmp_path):
    infos = {i["kernel_id"]: i for i in lz.list_kernels()}
    lz.load_config(
        _policy_file(
            tmp_path,
            """version: 1
allow: [{op: attention, kernels: ['torch_sdpa.*', reference, 'flash_attn?.attention']}]
deny: [{kernels: [flashinfer, flashinfer.attention, xformers]}]
boosts: [{op: 'sample_*', kernels: [reference], by: 1}]
locks: [{op: '*_norm', kernel: reference.rms_norm, when: {op: rms_norm}}]
""",
        )
    )
    assert lz.which("attention", Q, Q, Q).startswith(("torch_sdpa.", "reference."))
    assert lz.which("rms_norm", torch.ones(2, 8), torch.ones(8)) == "reference.rms_norm"
    if not torch.cuda.is_available():
        assert (
            infos["flashinfer.attention"]["available"] is False
        )  # registered but unavailable here: still a name


@pytest.mark.parametrize(
    ("var", "value", "error", "match"),
    [
        (
            "LAYERZERO_LOCK",
            "atention=torch_sdpa.math",
            lz.UnknownOperationError,
            r"LAYERZERO_LOCK: op 'atention' matches no registered op\. Did you mean 'attention'\?.*Fix or "
            r"unset LAYERZERO_LOCK",
        ),
        (
            "LAYERZERO_LOCK",
            "attention=torch_sdpa.mth",
            lz.UnknownKernelError,
            r"LAYERZERO_LOCK: lock kernel 'torch_sdpa\.mth' is not a registered kernel",
        ),
        (
            "LAYERZERO_ALLOW",
            "torch_sdpa.mth",
            lz.UnknownKernelError,
            r"LAYERZERO_ALLOW: 'torch_sdpa\.mth' matches no kernel or backend id\. Did you mean "
            r"'torch_sdpa\.math'\?",
        ),
        (
            "LAYERZERO_DENY",
            "torch_sdpa.flash,nope",
            lz.UnknownKernelError,
            r"LAYERZERO_DENY: 'nope' matches no kernel",
        ),
        (
            "LAYERZERO_PREFER",
            "nope.kernel",
            lz.UnknownKernelError,
            r"LAYERZERO_PREFER: 'nope\.kernel' matches no kernel or backend id\. Known: \[",
        ),
    ],
)
def test_environment_naming_unknown_things_raises_like_lz_prefer(monkeypatch, var, value, error, match):
    monkeypatch.setenv(var, value)
    lz.reload()
    with pytest.raises(error, match=match) as info:
        lz.attention(Q, Q, Q)
    assert isinstance(info.value, lz.ConfigurationError)
    if var == "LAYERZERO_PREFER":  # the same mistake through the API: same type, same wording
        with pytest.raises(
            error, match=r"lz\.prefer: 'nope\.kernel' matches no kernel or backend id\. Known: \["
        ):
            lz.prefer("nope.kernel").__enter__()
    monkeypatch.delenv(var)
    lz.reload()
    assert lz.attention(Q, Q, Q).shape == Q.shape


def test_environment_may_name_a_custom_kernel_registered_after_the_policy_loaded(monkeypatch):
    monkeypatch.setenv("LAYERZERO_ALLOW", "mylib.*,reference")
    lz.reload()
    with pytest.raises(lz.UnknownKernelError, match=r"LAYERZERO_ALLOW: 'mylib\.\*' matches no kernel"):
        lz.which("attention", Q, Q, Q)
    lz.register_kernel("attention", "mylib.late", _attn_kernel, priority=999, device_types={"cpu"})
    try:
        assert lz.which("attention", Q, Q, Q) == "mylib.late"
    finally:
        lz.unregister_kernel("mylib.late")
    with pytest.raises(
        lz.UnknownKernelError, match=r"'mylib\.\*' matches no kernel"
    ):  # gone again: checked again
        lz.which("attention", Q, Q, Q)


@pytest.mark.parametrize("value", ["false", "[]", "0", "'strict'", "[strict]"])
def test_policy_file_config_must_be_a_mapping(tmp_path, value):
    before = lz.get_config()
    with pytest.raises(lz.ConfigurationError, match=r"config: expected a mapping of options.*got "):
        lz.load_config(_policy_file(tmp_path, f"version: 1\nconfig: {value}\n"))
    assert lz.get_config() == before
    assert (
        lz.load_config(_policy_file(tmp_path, "version: 1\nconfig:\n")) == before
    )  # empty value: no options
    assert lz.load_config(_policy_file(tmp_path, "version: 1\nconfig: {strict: true}\n")).strict is True


def test_duplicate_yaml_merge_keys_are_rejected(tmp_path):
    from layerzero.core.policy import safe_load_yaml

    anchors = "a: &a {op: attention}\nb: &b {kernels: [reference]}\n"
    with pytest.raises(
        lz.PolicyValidationError,
        match=r"line 5: expected unique mapping keys, got duplicate key "
        r"'<<'\. List the merged mappings in one key",
    ):
        safe_load_yaml(anchors + "c:\n  <<: *a\n  <<: *b\n")
    data, _ = safe_load_yaml(anchors + "c:\n  <<: [*a, *b]\n")
    assert data["c"] == {"op": "attention", "kernels": ["reference"]}
    path = _policy_file(
        tmp_path, "version: 1\ndeny:\n  - &r {op: attention, kernels: [xformers]}\n  - <<: *r\n    <<: *r\n"
    )
    with pytest.raises(lz.PolicyValidationError, match="duplicate key '<<'"):
        lz.load_config(path)


def test_bad_capabilities_file_raises_on_reload(tmp_path, monkeypatch):
    from layerzero.core.runtime import RUNTIME

    RUNTIME.ensure_ready()
    spec = RUNTIME.registry.kernel("torch_sdpa.math")
    bad = tmp_path / "caps.yaml"
    bad.write_text("version: 1\nkernels: {torch_sdpa.math: {head_dim_maxx: 64}}\n", encoding="utf-8")
    monkeypatch.setenv("LAYERZERO_CAPABILITIES", str(bad))
    with pytest.raises(
        lz.ConfigurationError,
        match=r"caps\.yaml: kernels\.torch_sdpa\.math\.head_dim_maxx: expected "
        r"one of \[.*'head_dim_max'",
    ):
        lz.reload()
    bad.write_text("version: 1\nkernels: {torch_sdpa.mth: {head_dim_max: 64}}\n", encoding="utf-8")
    with pytest.raises(lz.UnknownKernelError, match="torch_sdpa.mth"):
        lz.reload()
    good = tmp_path / "good.yaml"
    good.write_text(
        f"version: 1\nkernels: {{torch_sdpa.math: {{head_dim_max: {spec.head_dim_max or 512}}}}}\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("LAYERZERO_CAPABILITIES", str(good))
    lz.reload()
    assert RUNTIME.registry.kernel("torch_sdpa.math").head_dim_max == (spec.head_dim_max or 512)
    RUNTIME.registry.add_kernel(spec, replace=True)  # restore the built-in constraints for later tests


# -------------------------------------------------------------------------- 6. lz.sample / lz.apply_penalties
LG = torch.zeros(3, 11)  # [B=3, V=11]
I64 = torch.zeros(3, dtype=torch.int64)
F32 = torch.ones(3)
IDS = torch.tensor([[1, 2, 11], [0, 11, 11], [5, 5, 5]])  # right-padded with V = 11


def _sample(**kw):
    logits = kw.pop("logits", LG)
    return lambda: lz.sample(logits, **kw)


def _pen(prompt=IDS, output=IDS, logits=LG, **kw):
    return lambda: lz.apply_penalties(logits, prompt, output, **kw)


BATCH_SAMPLING = [
    ("sample-logits-1d", _sample(logits=torch.zeros(11)), r"lz\.sample: logits rank: expected 2 dims, got 1"),
    (
        "sample-logits-int",
        _sample(logits=torch.zeros(3, 11, dtype=torch.int64)),
        r"lz\.sample: logits\.dtype",
    ),
    (
        "sample-logits-empty",
        _sample(logits=torch.zeros(0, 11)),
        r"logits shape: expected \[B, V\] with B >= 1",
    ),
    # non-finite logits (CPU values): no distribution to sample from, never a kernel failure charged to a
    # backend
    (
        "sample-logits-nan",
        _sample(logits=torch.tensor([[0.0, math.nan, 1.0]] * 3)),
        r"logits values: expected no NaN",
    ),
    (
        "sample-logits-posinf",
        _sample(logits=torch.tensor([[0.0, math.inf, 1.0]] * 3)),
        r"got inf at index \[0, 1\]",
    ),
    (
        "sample-logits-row-neginf",
        _sample(logits=torch.tensor([[0.0, 1.0], [-math.inf, -math.inf], [1.0, 0.0]])),
        r"logits row maximum values: expected a finite logit in every row.*got -inf at index 1",
    ),
    (
        "topk-logits-nan",
        lambda: lz.sample_topk(torch.tensor([[math.nan, 1.0]]), 1),
        r"lz\.sample_topk: logits values",
    ),
    (
        "topp-logits-posinf",
        lambda: lz.sample_topp(torch.tensor([[math.inf, 1.0]]), 0.5),
        r"lz\.sample_topp: logits",
    ),
    (
        "sample-temp-float",
        _sample(temperature=0.7),
        r"temperature: expected a float32 tensor \[B\] or None, "
        r"got float.*torch\.full\(\(3,\), value",
    ),
    (
        "sample-temp-f64",
        _sample(temperature=F32.double()),
        r"temperature\.dtype: expected float32, got torch\.float64",
    ),
    (
        "sample-temp-shape",
        _sample(temperature=torch.ones(4)),
        r"temperature shape: expected \[B\] = \[3\].*got \[4\]",
    ),
    ("sample-temp-2d", _sample(temperature=torch.ones(3, 1)), r"temperature shape: .*got \[3, 1\]"),
    (
        "sample-temp-device",
        _sample(temperature=torch.ones(3, device="meta")),
        r"temperature\.device: expected cpu",
    ),
    (
        "sample-temp-negative",
        _sample(temperature=torch.tensor([1.0, -0.5, 1.0])),
        r"temperature values: expected finite values >= 0 \(0 means greedy\), got -0\.5 at index 1",
    ),
    (
        "sample-temp-nan",
        _sample(temperature=torch.tensor([1.0, 1.0, math.nan])),
        r"temperature values:.*got nan at index 2",
    ),
    (
        "sample-temp-inf",
        _sample(temperature=torch.tensor([math.inf, 1.0, 1.0])),
        r"temperature values:.*got inf",
    ),
    ("sample-topk-float", _sample(top_k=F32), r"top_k\.dtype: expected int64 or int32, got torch\.float32"),
    (
        "sample-topk-negative",
        _sample(top_k=torch.tensor([3, -1, 0])),
        r"top_k values: expected values >= 0.*got -1 at index 1",
    ),
    (
        "sample-topp-zero",
        _sample(top_p=torch.tensor([0.5, 0.0, 1.0])),
        r"top_p values: expected values in \(0, 1\].*got 0\.0",
    ),
    ("sample-topp-big", _sample(top_p=torch.tensor([1.5, 1.0, 1.0])), r"top_p values:.*got 1\.5 at index 0"),
    ("sample-topp-nan", _sample(top_p=torch.tensor([math.nan, 1.0, 1.0])), r"top_p values:.*got nan"),
    (
        "sample-minp-negative",
        _sample(min_p=torch.tensor([0.0, 0.1, -0.1])),
        r"min_p values: expected values in \[0, 1\]",
    ),
    ("sample-minp-big", _sample(min_p=torch.tensor([0.0, 2.0, 0.0])), r"min_p values:.*got 2\.0 at index 1"),
    ("sample-minp-f16", _sample(min_p=F32.half()), r"min_p\.dtype: expected float32, got torch\.float16"),
    (
        "sample-seeds-int32",
        _sample(seeds=I64.int()),
        r"seeds\.dtype: expected int64, got torch\.int32.*torch\.int64",
    ),
    (
        "sample-seeds-list",
        _sample(seeds=[1, 2, 3]),
        r"seeds: expected a int64 tensor \[B\] or None, got list",
    ),
    (
        "sample-offsets-alone",
        _sample(offsets=I64),
        r"offsets: expected None when seeds is None.*Pass seeds= as well",
    ),
    (
        "sample-offsets-shape",
        _sample(seeds=I64, offsets=torch.zeros(2, dtype=torch.int64)),
        r"offsets shape: expected \[B\] = \[3\]",
    ),
    ("sample-generator", _sample(generator=3), r"generator: expected a torch\.Generator or None, got int"),
    # ---- apply_penalties
    (
        "pen-logits-3d",
        _pen(logits=torch.zeros(1, 3, 11)),
        r"lz\.apply_penalties: logits rank: expected 2 dims",
    ),
    (
        "pen-logits-empty",
        _pen(logits=torch.zeros(3, 0)),
        r"logits shape: expected \[B, V\] with B >= 1 and V >= 1",
    ),
    (
        "pen-prompt-float",
        _pen(prompt=IDS.float()),
        r"prompt_token_ids\.dtype: expected int64 or int32, got torch\.float32",
    ),
    (
        "pen-output-1d",
        _pen(output=IDS[0]),
        r"output_token_ids shape: expected \[B, L\] with B = 3.*got \[3\].*"
        r"Right-pad ragged rows with the vocabulary size 11",
    ),
    ("pen-output-batch", _pen(output=IDS[:2]), r"output_token_ids shape: .*got \[2, 3\]"),
    (
        "pen-prompt-list",
        _pen(prompt=[[1]]),
        r"prompt_token_ids: expected an int64/int32 tensor \[B, L\], got list",
    ),
    ("pen-prompt-device", _pen(prompt=IDS.to("meta")), r"prompt_token_ids\.device: expected cpu.*got meta"),
    (
        "pen-id-too-big",
        _pen(output=torch.tensor([[1], [12], [0]])),
        r"output_token_ids values: expected token ids in \[0, 11\] \(11 = padding\), got 12 at index \[1, "
        r"0\]",
    ),
    (
        "pen-id-negative",
        _pen(prompt=torch.tensor([[-1], [0], [0]])),
        r"prompt_token_ids values:.*got -1 at index \[0, 0\]",
    ),
    (
        "pen-rep-zero",
        _pen(repetition_penalty=torch.tensor([1.0, 0.0, 1.0])),
        r"repetition_penalty values: expected finite values > 0 \(1: off\), got 0\.0 at index 1",
    ),
    (
        "pen-rep-inf",
        _pen(repetition_penalty=torch.tensor([1.0, 1.0, math.inf])),
        r"repetition_penalty values:.*got inf",
    ),
    ("pen-rep-f64", _pen(repetition_penalty=F32.double()), r"repetition_penalty\.dtype: expected float32"),
    (
        "pen-presence-nan",
        _pen(presence_penalty=torch.tensor([0.0, math.nan, 0.0])),
        r"presence_penalty values: expected finite values \(0: off\), got nan at index 1",
    ),
    (
        "pen-frequency-shape",
        _pen(frequency_penalty=torch.zeros(3, 1)),
        r"frequency_penalty shape: expected \[B\] = \[3\]",
    ),
    (
        "pen-frequency-scalar",
        _pen(frequency_penalty=0.5),
        r"frequency_penalty: expected a float32 tensor \[B\] or None",
    ),
]


@pytest.mark.parametrize(
    ("call", "match"), [c[1:] for c in BATCH_SAMPLING], ids=[c[0] for c in BATCH_SAMPLING]
)
def test_batch_sampling_and_penalties_bad_inputs_raise_invalid_input(call, match):
    from layerzero.core.runtime import RUNTIME

    RUNTIME.ensure_ready()
    before = len(RUNTIME.cache)
    with pytest.raises(lz.InvalidInputError, match=match) as info:
        call()
    assert isinstance(info.value, ValueError)
    assert len(RUNTIME.cache) == before  # rejected before any selection


def test_values_of_non_cpu_tensors_are_not_read():
    """On another device reading values would synchronize: ranks, dtypes and devices are checked, values are
    not (meta tensors have none to read; a CUDA tensor is treated the same way)."""
    from layerzero.ops import OPS

    logits = torch.zeros(3, 11, device="meta")
    bad = torch.full((3,), -1.0, device="meta")
    prepare = OPS["sample"][0]
    key, args = prepare(
        logits, temperature=bad, top_p=bad, min_p=bad, top_k=torch.full((3,), -1, device="meta")
    )
    assert key.has_temperature and key.has_top_p and key.has_min_p and key.has_top_k and not key.has_seeds
    ids = torch.full((3, 2), 99, device="meta")
    key, _ = OPS["apply_penalties"][0](logits, ids, ids, repetition_penalty=bad, presence_penalty=bad)
    assert key.has_repetition and key.has_presence and not key.has_frequency


def test_edge_values_are_accepted():
    """The ends of every range: T = 0 (greedy), k = 0 and k > V (no cut), p = 1, min_p 0 and 1, seeds < 0, the
    padding id V, an empty prompt and output."""
    out = lz.sample(
        LG,
        temperature=torch.tensor([0.0, 1e-40, 2.0]),
        top_k=torch.tensor([0, 11, 10**6]),
        top_p=torch.tensor([1.0, 1e-9, 0.5]),
        min_p=torch.tensor([0.0, 1.0, 0.5]),
        seeds=torch.tensor([-1, 0, 2**63 - 1]),
        offsets=torch.tensor([0, -3, 2**62]),
    )
    assert out.shape == (3,) and out.dtype == torch.int64 and out[:2].tolist() == [0, 0]
    empty = torch.empty(3, 0, dtype=torch.int32)
    out = lz.apply_penalties(
        LG,
        empty,
        IDS.int(),
        repetition_penalty=torch.tensor([1e-3, 1.0, 1e3]),
        presence_penalty=torch.tensor([-2.0, 0.0, 5.0]),
        frequency_penalty=-F32,
    )
    assert out.shape == LG.shape and bool(torch.isfinite(out).all())


# ------------------------------------------------------------------------------ 7. lz.fused_moe arguments
MOE_X, MOE_W13, MOE_W2 = torch.ones(3, 8), torch.ones(4, 10, 8), torch.ones(4, 8, 5)  # T 3, H 8, E 4, I 5
MOE_TW, MOE_IDS = torch.full((3, 2), 0.5), torch.tensor([[0, 1], [2, 3], [3, 3]])  # K 2


def _moe(**kw):
    args = {"x": MOE_X, "w13": MOE_W13, "w2": MOE_W2, "topk_weights": MOE_TW, "topk_ids": MOE_IDS, **kw}
    return lambda: lz.fused_moe(*args.values())


MOE_CASES = [
    ("x-list", _moe(x=[[1.0]]), r"lz\.fused_moe: x: expected a torch\.Tensor, got list"),
    ("x-rank-3", _moe(x=torch.ones(1, 3, 8)), r"x rank: expected 2 dims, got 3 dims"),
    ("x-int", _moe(x=torch.ones(3, 8, dtype=torch.int64)), r"x\.dtype: expected one of float32"),
    ("x-hidden-0", _moe(x=torch.ones(3, 0)), r"hidden size \(x\.shape\[1\]\): expected >= 1, got 0"),
    ("w13-rank", _moe(w13=torch.ones(10, 8)), r"w13 rank: expected 3 dims, got 2"),
    (
        "w13-odd-2i",
        _moe(w13=torch.ones(4, 9, 8)),
        r"w13 shape: expected \[E, 2I, H\].*even.*got \[4, 9, 8\]"
        r".*torch\.cat\(\(gate, up\), 0\)",
    ),
    ("w13-no-experts", _moe(w13=torch.ones(0, 10, 8)), r"w13 shape:.*E >= 1.*got \[0, 10, 8\]"),
    (
        "w13-hidden",
        _moe(w13=torch.ones(4, 10, 7)),
        r"w13 shape: expected \[E, 2I, H\] with H = x\.shape\[1\] = 8",
    ),
    (
        "w13-dtype",
        _moe(w13=torch.ones(4, 10, 8, dtype=torch.bfloat16)),
        r"w13\.dtype: expected torch\.float32",
    ),
    ("w13-device", _moe(w13=torch.ones(4, 10, 8, device="meta")), r"w13\.device: expected cpu.*got meta"),
    (
        "w2-transposed",
        _moe(w2=torch.ones(4, 5, 8)),
        r"w2 shape: expected \[E, H, I\] = \[4, 8, 5\].*got \[4, 5, 8\]",
    ),
    ("w2-experts", _moe(w2=torch.ones(3, 8, 5)), r"w2 shape: expected \[E, H, I\] = \[4, 8, 5\]"),
    ("w2-dtype", _moe(w2=torch.ones(4, 8, 5, dtype=torch.float16)), r"w2\.dtype: expected torch\.float32"),
    (
        "ids-float",
        _moe(topk_ids=torch.zeros(3, 2)),
        r"topk_ids\.dtype: expected int32 or int64, got torch\.float32",
    ),
    ("ids-not-tensor", _moe(topk_ids=[[0, 1]] * 3), r"topk_ids: expected a torch\.Tensor, got list"),
    (
        "ids-rows",
        _moe(topk_ids=torch.zeros(2, 2, dtype=torch.int64)),
        r"topk_ids shape: expected \[T, K\] with "
        r"T = x\.shape\[0\] = 3, got \[2, 2\]",
    ),
    ("ids-1d", _moe(topk_ids=torch.zeros(3, dtype=torch.int64)), r"topk_ids shape: expected \[T, K\]"),
    ("ids-device", _moe(topk_ids=torch.zeros(3, 2, dtype=torch.int64, device="meta")), r"topk_ids\.device"),
    (
        "ids-too-big",
        _moe(topk_ids=torch.tensor([[0, 1], [2, 5], [3, 4]])),
        r"topk_ids values: expected expert ids in \[0, 4\).*or E for a slot with no expert here, "
        r"got values in \[0, 5\]",
    ),
    (
        "ids-negative",
        _moe(topk_ids=torch.tensor([[0, -1], [2, 3], [3, 3]], dtype=torch.int32)),
        r"topk_ids values:.*got values in \[-1, 3\]",
    ),
    (
        "k-zero",
        _moe(topk_ids=torch.zeros(3, 0, dtype=torch.int64), topk_weights=torch.zeros(3, 0)),
        r"top_k \(topk_ids\.shape\[1\]\): expected >= 1, got 0",
    ),
    (
        "weights-bf16",
        _moe(topk_weights=MOE_TW.bfloat16()),
        r"topk_weights\.dtype: expected torch\.float32.*"
        r"topk_weights\.float\(\)",
    ),
    (
        "weights-shape",
        _moe(topk_weights=torch.ones(3, 1)),
        r"topk_weights shape: expected topk_ids' shape \[3, 2\]",
    ),
    ("weights-rows", _moe(topk_weights=torch.ones(4, 2)), r"topk_weights shape: expected \[T, K\] with T = "),
]


@pytest.mark.parametrize(("fn", "match"), [c[1:] for c in MOE_CASES], ids=[c[0] for c in MOE_CASES])
def test_fused_moe_bad_arguments_raise_invalid_input(fn, match):
    with pytest.raises(lz.InvalidInputError, match=match) as info:
        fn()
    assert isinstance(info.value, ValueError)


def test_fused_moe_ids_on_cpu_checked_even_on_the_fast_path():
    assert _moe()().shape == (3, 8)  # the valid call these cases perturb
    with pytest.raises(lz.InvalidInputError, match=r"topk_ids values"):
        _moe(topk_ids=torch.tensor([[0, 1], [2, 3], [3, 9]]))()
