"""Custom kernels: ``lz.register_kernel`` / ``@lz.kernel`` / ``lz.unregister_kernel`` and Triton launch
configs.

A custom attention kernel (plain float64 math written here, the oracle of these tests) registered with a high
priority must be picked by ``lz.which``, listed by ``lz.explain``, counted by ``lz.trace`` and produce the
oracle's numbers; bad registrations raise typed errors; unregistering restores the previous choice.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import layerzero as lz
from layerzero.core.custom import CANONICAL_ARGS, CONSTRAINT_FIELDS, LaunchConfig, is_custom_backend
from layerzero.core.errors import ConfigurationError, UnknownKernelError, UnknownOperationError
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import Layout, MaskKind

pytestmark = pytest.mark.unit

KID = "mylib.attention"


def oracle(q, k, v, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0):
    """float64 softmax(q k^T * scale) v, BHSD, no GQA (the custom kernel declares supports_gqa=False)."""
    s = q.double() @ k.double().transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, -1) @ v.double()).to(q.dtype)


@pytest.fixture
def calls():
    """Register KID (records its calls) and always remove it afterwards."""
    seen: list[tuple] = []

    def my_attention(q, k, v, attn_mask, is_causal, scale, dropout_p):
        """My attention: float64 math."""
        seen.append((tuple(q.shape), is_causal, scale))
        return oracle(q, k, v, attn_mask, is_causal, scale)

    lz.register_kernel(
        "attention",
        KID,
        my_attention,
        priority=1000,
        device_types={"cpu"},
        supports_gqa=False,
        mask_kinds={"none"},
        layouts={"BHSD"},
    )
    yield seen
    if KID in RUNTIME.registry.kernels:
        lz.unregister_kernel(KID)


def _qkv(h=2, hkv=None, s=5, d=8):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(1, h, s, d, generator=g),
        torch.randn(1, hkv or h, s, d, generator=g),
        torch.randn(1, hkv or h, s, d, generator=g),
    )


def test_custom_kernel_is_chosen_explained_traced_and_correct(calls):
    q, k, v = _qkv()
    assert lz.which("attention", q, k, v, is_causal=True) == KID
    report = lz.explain("attention", q, k, v, is_causal=True)
    assert report.chosen == KID and report.candidate(KID).score.priority == 1000
    with lz.trace() as t:
        out = lz.attention(q, k, v, is_causal=True, scale=0.5)
    assert t.counts[("attention", KID)] == 1
    assert calls == [((1, 2, 5, 8), True, 0.5)]
    torch.testing.assert_close(out, oracle(q, k, v, is_causal=True, scale=0.5))
    # its constraints are data: GQA inputs are routed elsewhere, with the reason
    qg, kg, vg = _qkv(h=4, hkv=2)
    assert lz.which("attention", qg, kg, vg) != KID
    assert [r.code for r in lz.validate(KID, "attention", qg, kg, vg)] == [lz.ReasonCode.GQA_UNSUPPORTED]


def test_bshd_inputs_are_transposed_for_a_bhsd_kernel(calls):
    q, k, v = _qkv()
    out = lz.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="BSHD")
    assert calls == [((1, 2, 5, 8), False, None)]  # the kernel saw BHSD
    torch.testing.assert_close(out, oracle(q, k, v).transpose(1, 2))


def test_unregister_restores_previous_choice(calls):
    q, k, v = _qkv()
    assert lz.which("attention", q, k, v) == KID
    spec = lz.unregister_kernel(KID)
    assert spec.kernel_id == KID and KID not in RUNTIME.registry.kernels
    assert "mylib" not in RUNTIME.registry.backends  # the auto-registered backend went with its last kernel
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"


def test_backend_is_auto_registered_available_and_custom(calls):
    backend = RUNTIME.registry.backend("mylib")
    assert backend.available and is_custom_backend(RUNTIME.registry, "mylib")
    spec = RUNTIME.registry.kernel(KID)
    assert spec.description == "My attention: float64 math."
    assert spec.layouts == frozenset({Layout.BHSD}) and spec.mask_kinds == frozenset({MaskKind.NONE})


def test_decorator_registers_and_returns_the_function():
    x, w = torch.randn(3, 16), torch.randn(16)

    @lz.kernel("rms_norm", "mylib.rms", priority=1000, device_types=["cpu"], dtypes=["float32"])
    def rms(x, weight, eps, residual):
        return (
            x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * weight.double()
        ).float()

    try:
        assert callable(rms) and rms.__name__ == "rms"
        assert lz.which("rms_norm", x, w) == "mylib.rms"
        expected = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        torch.testing.assert_close(lz.rms_norm(x, w).double(), expected, atol=1e-6, rtol=1e-6)
        assert lz.which("rms_norm", x.double(), w.double()) != "mylib.rms"  # dtypes={"float32"}
    finally:
        lz.unregister_kernel("mylib.rms")


def test_duplicate_needs_replace(calls):
    def other(q, k, v, attn_mask, is_causal, scale, dropout_p):
        return oracle(q, k, v, attn_mask, is_causal, scale)

    with pytest.raises(ConfigurationError, match="already registered|not registered yet"):
        lz.register_kernel("attention", KID, other)
    spec = lz.register_kernel("attention", KID, other, priority=7, replace=True, device_types={"cpu"})
    assert RUNTIME.registry.kernel(KID) is spec and spec.priority == 7


def _ok(q, k, v, attn_mask, is_causal, scale, dropout_p):
    return q


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(op="attentoin", kernel_id="mylib.x", fn=_ok), UnknownOperationError, "attentoin"),
        (dict(op="attention", kernel_id="nodot", fn=_ok), ConfigurationError, "'backend.name'"),
        (dict(op="attention", kernel_id="my lib.x", fn=_ok), ConfigurationError, "kernel_id"),
        (
            dict(op="attention", kernel_id="torch_sdpa.mine", fn=_ok),
            ConfigurationError,
            "built-in backend ids",
        ),
        (dict(op="attention", kernel_id="mylib.x", fn=42), ConfigurationError, "a callable"),
        (
            dict(op="attention", kernel_id="mylib.x", fn=lambda q, k, v: q),
            ConfigurationError,
            "7 positional args",
        ),
        (
            dict(op="rms_norm", kernel_id="mylib.x", fn=_ok),
            ConfigurationError,
            r"4 positional args \(x, weight",
        ),
        (
            dict(op="attention", kernel_id="mylib.x", fn=_ok, head_dim_maxx=4),
            ConfigurationError,
            "head_dim_max",
        ),
        (
            dict(op="attention", kernel_id="mylib.x", fn=_ok, kernel_id_=1),
            ConfigurationError,
            "constraint name",
        ),
        (
            dict(op="attention", kernel_id="mylib.x", fn=_ok, is_reference=True),
            ConfigurationError,
            "constraint name",
        ),
        (
            dict(op="attention", kernel_id="mylib.x", fn=_ok, dtypes={"float13"}),
            ConfigurationError,
            "float13",
        ),
        (dict(op="attention", kernel_id="mylib.x", fn=_ok, layouts="BHDS"), ConfigurationError, "BHDS"),
        (dict(op="attention", kernel_id="mylib.x", fn=_ok, sm_min="eight"), ConfigurationError, "sm_min"),
        (dict(op="attention", kernel_id="mylib.x", fn=_ok, head_dim_max=-1), ConfigurationError, "int >= 0"),
        (
            dict(op="attention", kernel_id="mylib.x", fn=_ok, supports_gqa="yes"),
            ConfigurationError,
            "True or False",
        ),
        (dict(op="attention", kernel_id="mylib.x", fn=_ok, check=3), ConfigurationError, "callable"),
        (dict(op="attention", kernel_id="mylib.x", fn=_ok, priority=1.5), ConfigurationError, "priority"),
        (
            dict(op="attention", kernel_id="mylib.x", fn=_ok, generations={"VOLTA"}),
            ConfigurationError,
            "VOLTA",
        ),
    ],
)
def test_bad_registrations_raise_typed_errors(kwargs, error, match):
    op, kid, fn = kwargs.pop("op"), kwargs.pop("kernel_id"), kwargs.pop("fn")
    before = RUNTIME.registry.version if RUNTIME._ready else None
    with pytest.raises(error, match=match):
        lz.register_kernel(op, kid, fn, **kwargs)
    assert kid not in RUNTIME.registry.kernels and "mylib" not in RUNTIME.registry.backends
    if before is not None:
        assert RUNTIME.registry.version == before  # nothing was half-registered


def test_unknown_constraint_message_lists_the_valid_names():
    with pytest.raises(ConfigurationError) as info:
        lz.register_kernel("attention", "mylib.x", _ok, head_dimmax=4)
    assert all(name in str(info.value) for name in ("head_dim_max", "supports_gqa", "device_types"))
    assert "fn" not in CONSTRAINT_FIELDS and "kernel_id" not in CONSTRAINT_FIELDS


def test_unregister_errors():
    with pytest.raises(UnknownKernelError, match="nope.kernel"):
        lz.unregister_kernel("nope.kernel")
    with pytest.raises(ConfigurationError, match="registered with lz.register_kernel"):
        lz.unregister_kernel("torch_sdpa.math")
    assert "torch_sdpa.math" in RUNTIME.registry.kernels


def test_constraint_coercion():
    spec = lz.register_kernel(
        "attention",
        "mylib.coerce",
        _ok,
        dtypes=[torch.float16, "bfloat16"],
        sm_min="8.6",
        sm_max=(9, 0),
        generations=["hopper", "AMPERE"],
        layouts=Layout.BSHD,
        mask_kinds=[MaskKind.BOOL, "float"],
        device_types="cuda",
    )
    try:
        assert spec.dtypes == frozenset({torch.float16, torch.bfloat16})
        assert (spec.sm_min, spec.sm_max) == ((8, 6), (9, 0))
        assert {g.name for g in spec.generations} == {"HOPPER", "AMPERE"}
        assert spec.layouts == frozenset({Layout.BSHD}) and spec.device_types == frozenset({"cuda"})
        assert spec.mask_kinds == frozenset({MaskKind.BOOL, MaskKind.FLOAT})
    finally:
        lz.unregister_kernel("mylib.coerce")


def test_signature_accepts_varargs_and_defaults_and_warns_when_uninspectable(caplog):
    def star(*args):
        return args[0]

    assert lz.register_kernel("attention", "mylib.star", star, device_types={"cpu"}).fn is star
    lz.unregister_kernel("mylib.star")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="layerzero.custom"):
        lz.register_kernel("rms_norm", "mylib.builtin", torch.add, device_types={"cpu"})  # no signature
    lz.unregister_kernel("mylib.builtin")
    assert any("cannot inspect the signature" in r.getMessage() for r in caplog.records)
    from layerzero.ops import OPS

    assert set(CANONICAL_ARGS) == set(OPS), "add the new op's canonical kernel arguments to CANONICAL_ARGS"


@pytest.mark.parametrize("op", ["sample", "apply_penalties"])
def test_custom_kernel_of_a_batched_sampling_op_gets_the_canonical_arguments(op):
    seen = []

    def spy(*args):
        seen.append(args)
        return args[0].argmax(-1) if op == "sample" else args[0].clone()

    lz.register_kernel(op, "mylib.spy", spy, priority=1000, device_types={"cpu"})
    try:
        logits, ids = torch.randn(2, 6), torch.tensor([[1, 6], [6, 6]])
        if op == "sample":
            lz.sample(logits, top_p=torch.ones(2), seeds=torch.tensor([3, -1]))
        else:
            lz.apply_penalties(logits, ids, ids[:, :1], frequency_penalty=torch.zeros(2))
    finally:
        lz.unregister_kernel("mylib.spy")
    (args,) = seen
    assert len(args) == len(CANONICAL_ARGS[op]) and args[0] is logits
    given = [name for name, a in zip(CANONICAL_ARGS[op], args, strict=True) if a is not None]
    assert given == (
        ["logits", "top_p", "seeds"]
        if op == "sample"
        else ["logits", "prompt_token_ids", "output_token_ids", "frequency_penalty"]
    )


# ----------------------------------------------------------------------------- Triton launch configs


def test_launch_config_is_validated_and_passed_to_the_kernel():
    seen = []

    def triton_like(q, k, v, attn_mask, is_causal, scale, dropout_p, *, launch_config):
        seen.append(launch_config.as_kwargs())
        return oracle(q, k, v, attn_mask, is_causal, scale)

    lz.register_kernel(
        "attention",
        "mytriton.attn",
        triton_like,
        priority=1000,
        device_types={"cpu"},
        supports_gqa=False,
        launch_config={"num_warps": 8, "num_stages": 2, "BLOCK_M": 64, "BLOCK_N": 32},
    )
    try:
        q, k, v = _qkv()
        torch.testing.assert_close(lz.attention(q, k, v), oracle(q, k, v))
        assert seen == [{"num_warps": 8, "num_stages": 2, "num_ctas": 1, "BLOCK_M": 64, "BLOCK_N": 32}]
    finally:
        lz.unregister_kernel("mytriton.attn")


def test_launch_config_requires_the_keyword():
    with pytest.raises(ConfigurationError, match="launch_config="):
        lz.register_kernel("attention", "mytriton.x", _ok, launch_config={"num_warps": 4})


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"num_warps": 3}, "num_warps"),
        ({"num_warps": 64}, "num_warps"),
        ({"num_warps": 0}, "num_warps"),
        ({"num_warps": True}, "num_warps"),
        ({"num_stages": 0}, "num_stages"),
        ({"num_stages": 9}, "num_stages"),
        ({"num_ctas": 3}, "num_ctas"),
        ({"BLOCK_M": 48}, "BLOCK_M"),
        ({"BLOCK_K": 1 << 21}, "BLOCK_K"),
        ({"block_m": 64}, "BLOCK"),
        ({"num_threads": 128}, "launch_config keys"),
    ],
)
def test_bad_launch_configs(cfg, match):
    with pytest.raises(ConfigurationError, match=match):
        LaunchConfig.from_dict(cfg)


def test_launch_config_not_a_dict_and_good_edges():
    with pytest.raises(ConfigurationError, match="a dict"):
        LaunchConfig.from_dict([("num_warps", 4)])
    cfg = LaunchConfig.from_dict(
        {"num_warps": 32, "num_stages": 8, "num_ctas": 16, "BLOCK": 1 << 20, "BLOCK_N": 1}
    )
    assert cfg.as_kwargs() == {
        "num_warps": 32,
        "num_stages": 8,
        "num_ctas": 16,
        "BLOCK": 1 << 20,
        "BLOCK_N": 1,
    }
    assert LaunchConfig().as_kwargs() == {"num_warps": 4, "num_stages": 3, "num_ctas": 1}


def test_window_or_softcap_kernels_must_take_the_two_extra_args():
    """A custom attention kernel declaring supports_window/supports_softcap is called with (..., window,
    softcap): registration refuses one that cannot take them, and the declared kernel receives them."""
    import torch.nn.functional as F

    def seven(q, k, v, attn_mask, is_causal, scale, dropout_p):
        return F.scaled_dot_product_attention(q, k, v)

    with pytest.raises(ConfigurationError, match="9 positional args"):
        lz.register_kernel("attention", "mywin.seven", seven, supports_window=True, device_types={"cpu"})
    seen = []

    def nine(q, k, v, attn_mask, is_causal, scale, dropout_p, window=None, softcap=None):
        seen.append((window, softcap))
        return lz_reference_attention(q, k, v, is_causal, scale, window, softcap)

    lz.register_kernel(
        "attention",
        "mywin.nine",
        nine,
        supports_window=True,
        supports_softcap=True,
        device_types={"cpu"},
        priority=1000,
    )
    try:
        q = torch.randn(1, 2, 8, 16)
        out = lz.attention(q, q, q, window=(2, 0), softcap=5.0)
        assert seen and seen[-1] == ((2, 0), 5.0)
        torch.testing.assert_close(out, lz_reference_attention(q, q, q, False, None, (2, 0), 5.0))
    finally:
        lz.unregister_kernel("mywin.nine")


def test_window_kernels_need_defaults_for_the_extra_args():
    """Calls without window/softcap pass the 7 canonical args only: a 9-arg kernel without defaults would
    raise TypeError on every such call (and fall back), so registration refuses it."""

    def nine_required(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap):
        return q

    with pytest.raises(ConfigurationError, match="need defaults"):
        lz.register_kernel(
            "attention", "mywin.required", nine_required, supports_softcap=True, device_types={"cpu"}
        )
    assert "mywin.required" not in {k["kernel_id"] for k in lz.list_kernels("attention")}


def lz_reference_attention(q, k, v, is_causal, scale, window, softcap):
    """The reference kernel with window/softcap, through a lock (the oracle for the test above)."""
    with lz.disabled():
        return lz.attention(q, k, v, is_causal=is_causal, scale=scale, window=window, softcap=softcap)
