"""CPU ISA as data: ``KernelSpec.cpu_isa`` in the shared filter, in register_kernel and capability overrides,
in ``lz.explain``; and the one ISA-routed torch kernel, ``torch_sdpa.cpu_fp32_upcast`` (float16 attention on
CPUs without native fp16 arithmetic), checked against a float64 oracle.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import layerzero as lz
from layerzero.core.capabilities import load_overrides
from layerzero.core.constraints import check_constraints
from layerzero.core.context import SelectionContext
from layerzero.core.device import DeviceSpec
from layerzero.core.errors import ConfigurationError
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import CPU_ISA_NAMES, KernelSpec

pytestmark = pytest.mark.unit
HOST = DeviceSpec.detect("cpu")


def cpu(isa) -> DeviceSpec:
    return dataclasses.replace(HOST, cpu_isa=frozenset(isa))


def spec(isa) -> KernelSpec:
    return KernelSpec(
        "isa_test.k", "rms_norm", lambda *a: None, cpu_isa=None if isa is None else frozenset(isa)
    )


def ctx(device, dtype=torch.float32) -> SelectionContext:
    return SelectionContext(op="rms_norm", device=device, dtype=dtype, hidden_size=64)


# ----------------------------------------------------------------------------- the shared filter


def test_all_features_present_passes():
    assert check_constraints(spec({"avx2", "avx512"}), ctx(cpu({"avx2", "avx512", "fma"}))) == []


def test_missing_features_named_with_what_the_cpu_has():
    (reason,) = check_constraints(spec({"avx2", "avx512", "amx_bf16"}), ctx(cpu({"avx2", "fma"})))
    assert reason.code is R.CPU_ISA_MISSING
    assert "missing ['amx_bf16', 'avx512']" in reason.message
    assert "this CPU has ['avx2', 'fma']" in reason.message


def test_unreadable_isa_fails_closed():
    (reason,) = check_constraints(spec({"avx2"}), ctx(cpu(())))
    assert reason.code is R.CPU_ISA_MISSING and "none detected" in reason.message


@pytest.mark.parametrize("isa", [None, ()])
def test_no_requirement_never_rejects(isa):
    assert check_constraints(spec(isa), ctx(cpu(()))) == []


def test_not_checked_off_cpu():
    cuda = dataclasses.replace(HOST, device_type="cuda", index=0, sm=(9, 0), cpu_isa=frozenset())
    assert check_constraints(spec({"avx512"}), ctx(cuda)) == []


def test_names_are_the_device_spelling():
    """Every ISA name the host reports is a valid requirement (the names CPU_ISA_NAMES lists)."""
    assert HOST.cpu_isa <= CPU_ISA_NAMES


# ------------------------------------------------------------------------ register_kernel, overrides, explain


def _fn(x, weight, eps, residual):
    return x


def test_register_kernel_coerces_and_validates_cpu_isa():
    try:
        s = lz.register_kernel("rms_norm", "isareg.upper", _fn, cpu_isa={"AVX2"}, device_types={"cpu"})
        assert s.cpu_isa == frozenset({"avx2"})
    finally:
        lz.unregister_kernel("isareg.upper")
    with pytest.raises(ConfigurationError, match="cpu_isa"):
        lz.register_kernel("rms_norm", "isareg.typo", _fn, cpu_isa={"avx512bf16"})


def test_capability_override_parses_cpu_isa(tmp_path):
    good = tmp_path / "ok.yaml"
    good.write_text("version: 1\nkernels:\n  torch_native.rms_norm: {cpu_isa: [avx2, fma]}\n")
    assert load_overrides(good) == {"torch_native.rms_norm": {"cpu_isa": frozenset({"avx2", "fma"})}}
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nkernels:\n  torch_native.rms_norm: {cpu_isa: [avx9]}\n")
    with pytest.raises(ConfigurationError, match="cpu_isa"):
        load_overrides(bad)


def test_explain_shows_the_missing_isa():
    absent = sorted(CPU_ISA_NAMES - HOST.cpu_isa)[0]
    x, w = torch.randn(2, 64), torch.ones(64)
    try:
        lz.register_kernel(
            "rms_norm", "isareg.needs", _fn, priority=99, cpu_isa={absent}, device_types={"cpu"}
        )
        report = lz.explain("rms_norm", x, w)
        (reason,) = report.candidate("isareg.needs").reasons
        assert reason.code is R.CPU_ISA_MISSING and absent in reason.message
        assert f"CPU_ISA_MISSING: needs CPU ISA ['{absent}']" in str(report)
        assert lz.which("rms_norm", x, w) != "isareg.needs"
    finally:
        lz.unregister_kernel("isareg.needs")


# ----------------------------------------------------------------------------- torch_sdpa.cpu_fp32_upcast


def attn_ctx(isa, dtype=torch.float16) -> SelectionContext:
    return SelectionContext(
        op="attention",
        device=cpu(isa),
        dtype=dtype,
        batch=1,
        num_heads_q=8,
        num_heads_kv=8,
        head_dim=64,
        head_dim_v=64,
        seq_len_q=512,
        seq_len_kv=512,
        is_causal=True,
    )


def _upcast_reasons(c):
    s = RUNTIME.registry.kernel("torch_sdpa.cpu_fp32_upcast")
    return check_constraints(s, c) + s.check(c)


def test_upcast_routing_by_isa_and_dtype():
    RUNTIME.ensure_ready()
    assert _upcast_reasons(attn_ctx({"avx2", "avx512", "avx512_bf16"})) == []
    (reason,) = _upcast_reasons(attn_ctx({"avx2", "avx512", "avx512_fp16"}))
    assert reason.code is R.PLATFORM_UNSUPPORTED and "avx512_fp16" in reason.message
    assert {r.code for r in _upcast_reasons(attn_ctx({"avx2"}, torch.bfloat16))} == {R.DTYPE_UNSUPPORTED}
    decode = dataclasses.replace(attn_ctx({"avx2", "avx512"}), seq_len_q=1)
    assert {r.code for r in _upcast_reasons(decode)} == {R.SEQ_LEN_TOO_SHORT}


@pytest.mark.skipif(
    "avx512_fp16" in HOST.cpu_isa, reason="this CPU has native fp16: the upcast kernel is off"
)
def test_upcast_chosen_for_float16_on_this_cpu_and_not_for_bf16():
    q = torch.randn(1, 4, 32, 64).half()
    assert lz.which("attention", q, q, q, is_causal=True) == "torch_sdpa.cpu_fp32_upcast"
    assert lz.which("attention", q[:, :, :1], q, q) == "torch_sdpa.flash"  # decode stays native
    qb = q.bfloat16()
    assert lz.which("attention", qb, qb, qb, is_causal=True) == "torch_sdpa.flash"


def _oracle(q, k, v, mask, causal, scale):
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).tril().logical_not(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return s.softmax(-1) @ v


CASES = [  # (B, Hq, Hkv, Sq, Sk, D, causal, mask kind, scale)
    (1, 4, 4, 33, 33, 64, True, None, None),
    (2, 8, 2, 17, 45, 80, False, "bool", None),
    (1, 6, 3, 1, 129, 128, False, None, 0.2),
    (3, 2, 2, 64, 64, 40, False, "float", None),
    (1, 4, 1, 7, 7, 256, True, None, None),
]


@pytest.mark.correctness
@pytest.mark.parametrize("case", CASES)
def test_upcast_is_at_least_as_accurate_as_float16_flash(case):
    """Numeric contract: the float32 attention of the float16 inputs rounded once: error vs float64 within
    fp16 resolution and no worse than torch's float16 flash kernel on the same inputs."""
    RUNTIME.ensure_ready()
    b, hq, hkv, sq, sk, d, causal, mask_kind, scale = case
    g = torch.Generator().manual_seed(sum(case[:6]))
    q = torch.randn(b, hq, sq, d, generator=g).half()
    k = torch.randn(b, hkv, sk, d, generator=g).half()
    v = torch.randn(b, hkv, sk, d, generator=g).half()
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, sq, sk, generator=g) > 0.3
        mask[..., 0] = True
    elif mask_kind == "float":
        mask = torch.randn(b, 1, sq, sk, generator=g).half()
    args = (q, k, v, mask, causal, scale, 0.0)
    want = _oracle(q, k, v, mask, causal, scale)
    got = RUNTIME.registry.kernel("torch_sdpa.cpu_fp32_upcast").fn(*args)
    flash = RUNTIME.registry.kernel("torch_sdpa.flash").fn(*args)
    assert got.dtype == torch.float16 and got.shape == want.shape
    err = (got.double() - want).abs().max().item()
    flash_err = (flash.double() - want).abs().max().item()
    assert err <= 2e-3
    assert err <= flash_err + 1e-3


# ------------------------------------------------------------------------ torch_sdpa.flash, AMX below AVX-512
@pytest.mark.parametrize(
    ("cap", "dtype", "isa", "refused"),
    [
        ("AVX2", torch.bfloat16, {"avx2", "avx512", "amx_bf16"}, True),
        ("DEFAULT", torch.bfloat16, {"avx2", "avx512", "amx_bf16"}, True),
        (
            "AVX512",
            torch.bfloat16,
            {"avx2", "avx512", "amx_bf16"},
            False,
        ),  # the CPU's own level: AMX packing works
        ("AVX2", torch.bfloat16, {"avx2", "avx512"}, False),  # no AMX: no AMX packing
        ("AVX2", torch.float16, {"avx2", "avx512", "amx_bf16"}, False),
    ],
)
def test_cpu_flash_refuses_bf16_on_an_amx_cpu_dispatched_below_avx512(monkeypatch, cap, dtype, isa, refused):
    """torch's bf16 CPU flash packs for AMX on an ``amx_bf16`` CPU, which raises 'pack_vnni2 is only supported
    when avx512 is supported' once ``ATEN_CPU_CAPABILITY`` lowers ATen below AVX-512 (seen on such a CI host):
    the flash kernel's check and the SDPA paged kernel's refuse exactly that combination, naming it."""
    from layerzero.backends.torch_sdpa import kernels as sk

    RUNTIME.ensure_ready()
    monkeypatch.setattr(sk, "aten_capability", lambda: cap)
    c = attn_ctx(isa, dtype)
    for kernel_id, ctx_ in (
        ("torch_sdpa.flash", c),
        ("torch_sdpa.paged_attention", dataclasses.replace(c, op="paged_attention")),
    ):
        reasons = RUNTIME.registry.kernel(kernel_id).check(ctx_)
        got = [r for r in reasons if r.code is R.PLATFORM_UNSUPPORTED]
        assert bool(got) == refused, (kernel_id, reasons)
        if refused:
            assert "pack_vnni2" in got[0].message and cap in got[0].message
    # with ALiBi the flash kernel runs in float32 (its bias would round in bfloat16): not affected
    alibi = RUNTIME.registry.kernel("torch_sdpa.flash").check(dataclasses.replace(c, has_alibi=True))
    assert not [r for r in alibi if r.code is R.PLATFORM_UNSUPPORTED]
