"""The FlashAttention 2/3/4 backends on a CPU machine without the libraries.

1. Absent libraries: the three backends are registered, unavailable with BACKEND_NOT_INSTALLED, and
   ``import layerzero`` imports none of them.
2. Detection with fakes: version checks and broken imports give the documented reason codes.
3. Routing: fake ``flash_attn`` / ``flash_attn_interface`` / ``flash_attn.cute`` modules in ``sys.modules``
   and hand-built CUDA :class:`DeviceSpec` contexts fed to ``core.selection.select`` show which kernel wins on
   each GPU generation and why the others are rejected. Expected winners are worked out by hand from the
   priorities (FA4 96, FA3 95, FA2 90, cuDNN 85, SDPA flash 80) minus the BHSD->BSHD transform cost (1).
4. Calls: the chosen plan runs the fake library function (which records its arguments and computes float64
   attention with plain torch ops) and the result matches an independent float64 oracle.
"""

from __future__ import annotations

import math
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

import layerzero as lz
from layerzero.backends import flash_attn as fa
from layerzero.backends.flash_attn import detect
from layerzero.core.capabilities import describe_backend
from layerzero.core.context import SelectionContext
from layerzero.core.errors import BackendNotAvailableError
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import SelectionInputs, select
from layerzero.core.specs import BackendSpec, Layout, MaskKind
from layerzero.testing.devices import fake_cuda_device

pytestmark = pytest.mark.unit

FA2, FA3, FA4 = "flash_attn2.attention", "flash_attn3.attention", "flash_attn4.attention"
ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- helpers


def oracle_bshd(q, k, v, causal=False, scale=None, window=None, softcap=None):
    """float64 attention on BSHD tensors, GQA by repeat_interleave, top-left causal (Sq == Sk here);
    ``window`` is FlashAttention's ``window_size`` (-1 or None = unbounded side), ``softcap`` Gemma 2's tanh
    cap."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if window is not None:
        rel = torch.arange(s.shape[-1])[None, :] - torch.arange(s.shape[-2])[:, None]  # j - i
        left, right = (-1 if w is None else w for w in window)
        s = s.masked_fill(((rel < -left) & (left >= 0)) | ((rel > right) & (right >= 0)), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


class FakeFlash:
    """A stand-in ``flash_attn_func``: records every call and returns float64 attention (as the real one
    returns its input dtype, the tests use float64 tensors so the comparison is exact)."""

    def __init__(self, returns_tuple: bool) -> None:
        self.calls: list[dict] = []
        self.returns_tuple = returns_tuple

    def __call__(self, q, k, v, *args, softmax_scale=None, causal=False, **kwargs):
        self.calls.append(
            {
                "shapes": (tuple(q.shape), tuple(k.shape)),
                "args": args,
                "scale": softmax_scale,
                "causal": causal,
                **kwargs,
            }
        )
        out = oracle_bshd(
            q, k, v, causal, softmax_scale, kwargs.get("window_size"), kwargs.get("softcap")
        ).to(q.dtype)
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
        return (out, lse) if self.returns_tuple else out


@pytest.fixture
def fakes(monkeypatch):
    """Fake FA2 (2.7.4), FA3 (returns (out, lse)) and FA4 (returns (out, lse)) modules in sys.modules."""
    funcs = {"fa2": FakeFlash(False), "fa3": FakeFlash(True), "fa4": FakeFlash(True)}
    fa2 = types.ModuleType("flash_attn")
    fa2.__version__, fa2.flash_attn_func = "2.7.4.post1", funcs["fa2"]
    fa3 = types.ModuleType("flash_attn_interface")
    fa3.flash_attn_func = funcs["fa3"]
    fa4 = types.ModuleType("flash_attn.cute")
    fa4.__version__, fa4.flash_attn_func = "0.1.0", funcs["fa4"]
    monkeypatch.setitem(sys.modules, "flash_attn", fa2)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fa4)
    return funcs


@pytest.fixture
def registry(fakes):
    """A fresh registry: the attention op, reference + torch_sdpa attention kernels, and the FA backends
    registered while the fakes are importable."""
    RUNTIME.ensure_ready()
    reg = KernelRegistry()
    reg.add_op(RUNTIME.registry.ops.get("attention"))
    for spec in RUNTIME.registry.for_op("attention"):
        if spec.backend in ("reference", "torch_sdpa"):
            if spec.backend not in reg.backends:
                reg.add_backend(RUNTIME.registry.backend(spec.backend))
            reg.add_kernel(spec)
    fa.register(reg)
    return reg


cuda_device = fake_cuda_device


def ctx_for(
    sm=(9, 0), *, layout=Layout.BSHD, dtype=torch.float16, d=128, dv=None, hq=8, hkv=2, sq=1024, sk=None, **kw
) -> SelectionContext:
    sk = sq if sk is None else sk
    return SelectionContext(
        op="attention",
        device=cuda_device(sm),
        dtype=dtype,
        batch=2,
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim=d,
        head_dim_v=d if dv is None else dv,
        seq_len_q=sq,
        seq_len_kv=sk,
        seq_equal=sq == sk,
        layout=layout,
        **kw,
    )


def run_select(reg, ctx):
    inputs = SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False)
    return select(reg, ctx, inputs)


def codes(report, kernel_id):
    return {r.code for r in report.candidate(kernel_id).reasons}


# ----------------------------------------------------------------------------- 1. absent libraries


def test_backends_registered_and_unavailable_without_the_libraries():
    RUNTIME.ensure_ready()
    reg = RUNTIME.registry
    for backend, module in (
        ("flash_attn2", "flash_attn"),
        ("flash_attn3", "flash_attn_interface"),
        ("flash_attn4", "flash_attn.cute"),
    ):
        spec = reg.backend(backend)
        assert not spec.available and spec.import_name == module
        assert [r.code for r in spec.reasons] == [R.BACKEND_NOT_INSTALLED]
        assert "No module named" in spec.reasons[0].message and "install" in spec.reasons[0].message
        assert reg.kernel(f"{backend}.attention").op == "attention"


def test_cpu_selection_unchanged_and_explain_lists_fa_reasons():
    q = k = v = torch.randn(1, 2, 4, 8)
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    report = lz.explain("attention", q, k, v)
    for kid in (FA2, FA3, FA4):
        assert {R.BACKEND_NOT_INSTALLED, R.DEVICE_TYPE_UNSUPPORTED} <= codes(report, kid)
    assert not report.notes  # unavailable backends are not "fallback" reasons


def test_doctor_shows_each_library_with_its_reason():
    rows = {b["backend"]: b for b in lz.doctor(print_report=False).to_dict()["backends"]}
    for backend in fa.BACKEND_IDS:
        assert rows[backend]["available"] is False
        assert rows[backend]["reasons"][0].startswith("BACKEND_NOT_INSTALLED")


def test_import_layerzero_imports_no_flash_library():
    code = (
        "import sys, layerzero; mods = [m for m in sys.modules if m.startswith(('flash_attn', "
        "'layerzero.backends'))]; print(mods)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""},
    ).stdout
    assert out.strip() == "[]"


def test_missing_kernel_callable_raises_typed_error():
    spec = fa.kernel_specs({})[1]
    with pytest.raises(BackendNotAvailableError, match="flash_attn_interface"):
        spec.fn(None, None, None, None, False, None, 0.0)


@pytest.mark.parametrize("backend", fa.BACKEND_IDS)
def test_capability_descriptors_match_code(backend):
    RUNTIME.ensure_ready()
    on_disk = yaml.safe_load((ROOT / "capabilities" / f"{backend}.yaml").read_text())
    assert on_disk == describe_backend(RUNTIME.registry, backend)


# ----------------------------------------------------------------------------- 2. detection


def test_probe_reads_versions_of_fakes(fakes):
    probes = fa.probe_all()
    assert {v: (p.backend.available, p.backend.version) for v, p in probes.items()} == {
        detect.FlashVersion.FA2: (True, "2.7.4.post1"),
        detect.FlashVersion.FA3: (True, None),
        detect.FlashVersion.FA4: (True, "0.1.0"),
    }
    assert probes[detect.FlashVersion.FA3].function is fakes["fa3"]


def test_probe_rejects_old_fa2_and_missing_function(monkeypatch):
    old = types.ModuleType("flash_attn")
    old.__version__, old.flash_attn_func = "2.0.9", FakeFlash(False)
    monkeypatch.setitem(sys.modules, "flash_attn", old)
    p = detect.probe(detect.FlashVersion.FA2)
    assert not p.backend.available and p.function is None
    assert [r.code for r in p.backend.reasons] == [R.BACKEND_VERSION_UNSUPPORTED]
    assert "2.0.9" in p.backend.reasons[0].message
    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.ModuleType("flash_attn_interface"))
    p3 = detect.probe(detect.FlashVersion.FA3)
    assert [r.code for r in p3.backend.reasons] == [R.BACKEND_IMPORT_FAILED]
    assert "no callable flash_attn_func" in p3.backend.reasons[0].message


def test_probe_reports_a_broken_build_without_raising():
    def importer(name):
        raise OSError("libcudart.so.12: cannot open shared object file")

    p = detect.probe(detect.FlashVersion.FA2, importer=importer)
    assert [r.code for r in p.backend.reasons] == [R.BACKEND_IMPORT_FAILED]
    assert "OSError: libcudart.so.12" in p.backend.reasons[0].message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.7.4.post1", (2, 7, 4)),
        ("2.1", (2, 1)),
        ("3.0.0b1", (3, 0, 0)),
        (None, None),
        ("dev", None),
        ("10.2rc1", (10, 2)),
    ],
)
def test_version_tuple(text, expected):
    assert detect._version_tuple(text) == expected


# ----------------------------------------------------------------------------- 3. routing


@pytest.mark.parametrize(
    ("sm", "winner"),
    [((8, 0), FA2), ((8, 6), FA2), ((8, 9), FA2), ((9, 0), FA3), ((10, 0), FA4), ((10, 3), FA4)],
)
def test_winner_per_generation(registry, sm, winner):
    plan, report = run_select(registry, ctx_for(sm, is_causal=True))
    assert plan.kernel_id == winner
    if sm < (9, 0):
        assert codes(report, FA3) == {R.GPU_GENERATION_UNSUPPORTED}
        assert codes(report, FA4) == {R.GPU_GENERATION_UNSUPPORTED, R.SM_TOO_OLD}
    elif sm == (9, 0):
        assert report.candidate(FA2).status.value == "eligible"
        assert codes(report, FA4) == {R.GPU_GENERATION_UNSUPPORTED, R.SM_TOO_OLD}
    else:
        assert codes(report, FA3) == {R.GPU_GENERATION_UNSUPPORTED}


def test_turing_and_consumer_blackwell_and_unknown_future_sm(registry):
    plan, report = run_select(registry, ctx_for((7, 5)))  # Turing: FlashAttention-1 territory
    assert codes(report, FA2) == {R.SM_TOO_OLD} and plan.kernel_id == "torch_sdpa.math"
    # SM 12.0 (RTX 50xx): BLACKWELL generation but not FA4's SM100 path; FA2 (sm_max 12.1) serves it.
    plan, report = run_select(registry, ctx_for((12, 0)))
    assert plan.kernel_id == FA2 and codes(report, FA4) == {R.SM_TOO_NEW}
    # SM 13.0 maps to BLACKWELL (device.py) but no FlashAttention build is known to run there.
    ctx = ctx_for((13, 0))
    assert ctx.device.generation.name == "BLACKWELL"
    plan, report = run_select(registry, ctx)
    assert codes(report, FA4) == {R.SM_TOO_NEW} and codes(report, FA2) == {R.SM_TOO_NEW}
    assert codes(report, FA3) == {R.GPU_GENERATION_UNSUPPORTED}
    assert plan.kernel_id == "torch_sdpa.math"


def test_bhsd_inputs_pay_the_transform(registry):
    _, bshd = run_select(registry, ctx_for((9, 0)))
    plan, bhsd = run_select(registry, ctx_for((9, 0), layout=Layout.BHSD))
    assert bshd.candidate(FA3).score.total == 95.0 and bshd.candidate(FA3).transforms == ()
    assert bhsd.candidate(FA3).score.total == 94.0
    assert bhsd.candidate(FA3).transforms == ("BHSD->BSHD (transpose views)",)
    assert plan.kernel_id == FA3 and plan.transforms == ("BHSD->BSHD (transpose views)",)


@pytest.mark.parametrize("mask", [MaskKind.BOOL, MaskKind.FLOAT])
def test_masks_are_refused(registry, mask):
    plan, report = run_select(registry, ctx_for((9, 0), mask=mask))
    for kid in (FA2, FA3):
        assert codes(report, kid) == {R.MASK_UNSUPPORTED}
    assert plan.kernel_id not in (FA2, FA3, FA4)


def test_causal_with_unequal_lengths_is_refused_with_the_reason(registry):
    plan, report = run_select(registry, ctx_for((9, 0), sq=16, sk=1024, is_causal=True))
    for kid in (FA2, FA3):
        assert codes(report, kid) == {R.CAUSAL_SEQ_MISMATCH}
        assert "bottom-right" in str(report.candidate(kid).reasons[0])
    assert plan.kernel_id not in (FA2, FA3, FA4)
    plan, _ = run_select(registry, ctx_for((9, 0), sq=16, sk=1024, is_causal=False))
    assert plan.kernel_id == FA3  # non-causal cross-attention has no alignment question


def test_dropout_only_fa2(registry):
    plan, report = run_select(registry, ctx_for((9, 0), dropout=True))
    assert codes(report, FA3) == {R.DROPOUT_UNSUPPORTED}
    assert plan.kernel_id == FA2
    _, report = run_select(registry, ctx_for((10, 0), dropout=True))
    assert codes(report, FA4) == {R.DROPOUT_UNSUPPORTED}


@pytest.mark.parametrize(
    ("sm", "d", "dv", "fa2", "fa3", "fa4"),
    [
        ((9, 0), 80, None, set(), {R.HEAD_DIM_INVALID}, None),
        ((9, 0), 264, None, {R.HEAD_DIM_TOO_LARGE}, {R.HEAD_DIM_TOO_LARGE, R.HEAD_DIM_INVALID}, None),
        ((9, 0), 60, None, {R.HEAD_DIM_NOT_ALIGNED}, {R.HEAD_DIM_NOT_ALIGNED, R.HEAD_DIM_INVALID}, None),
        ((9, 0), 192, 128, {R.HEAD_DIM_MISMATCH}, {R.HEAD_DIM_MISMATCH}, None),
        ((10, 0), 192, 128, None, None, set()),
        ((10, 0), 256, None, None, None, {R.HEAD_DIM_TOO_LARGE, R.HEAD_DIM_INVALID}),
        ((10, 0), 80, None, None, None, {R.HEAD_DIM_INVALID}),
    ],
)
def test_head_dim_rules(registry, sm, d, dv, fa2, fa3, fa4):
    _, report = run_select(registry, ctx_for(sm, d=d, dv=dv))
    for kid, want in ((FA2, fa2), (FA3, fa3), (FA4, fa4)):
        if want is not None:
            assert codes(report, kid) - {R.GPU_GENERATION_UNSUPPORTED, R.SM_TOO_OLD} == want, kid


def test_dtype_stride_alignment_graph_and_determinism(registry):
    _, report = run_select(registry, ctx_for((9, 0), dtype=torch.float32))
    assert codes(report, FA3) == {R.DTYPE_UNSUPPORTED}
    _, report = run_select(registry, ctx_for((9, 0), stride_last_1=False, aligned_16=False))
    assert codes(report, FA2) == {R.STRIDE_LAST_DIM_NOT_1, R.ALIGNMENT_INVALID}
    plan, report = run_select(registry, ctx_for((10, 0), graph_capture=True))
    assert codes(report, FA4) == {R.CUDA_GRAPH_UNSAFE} and plan.kernel_id == FA2
    _, report = run_select(registry, ctx_for((10, 0), deterministic=True, requires_grad=True))
    assert codes(report, FA4) == {R.NON_DETERMINISTIC}


def test_policy_can_deny_one_library(registry):
    policy = Policy.from_dict({"version": 1, "deny": [{"kernels": ["flash_attn3"]}]})
    inputs = SelectionInputs(policy, lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False)
    plan, report = select(registry, ctx_for((9, 0)), inputs)
    assert plan.kernel_id == FA2 and codes(report, FA3) == {R.POLICY_DENIED}


def test_unavailable_backend_rejects_even_with_fakes_for_others(registry):
    registry.add_backend(BackendSpec("flash_attn3", "flash_attn_interface", None, False), replace=True)
    plan, report = run_select(registry, ctx_for((9, 0)))
    assert codes(report, FA3) == {R.BACKEND_NOT_INSTALLED} and plan.kernel_id == FA2


# ----------------------------------------------------------------------------- 4. calls


def _bhsd(b=2, h=4, hkv=2, s=8, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h, s, d, generator=g, dtype=torch.float64),
        torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64),
        torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64),
    )


@pytest.mark.parametrize(
    ("sm", "lib", "kid"), [((8, 0), "fa2", FA2), ((9, 0), "fa3", FA3), ((10, 0), "fa4", FA4)]
)
def test_plan_calls_library_in_bshd_and_matches_oracle(registry, fakes, sm, lib, kid):
    q, k, v = _bhsd()
    plan, _ = run_select(registry, ctx_for(sm, layout=Layout.BHSD, d=64, hq=4, hkv=2, sq=8, is_causal=True))
    assert plan.kernel_id == kid
    out = plan(q, k, v, None, True, 0.3, 0.0)
    expected = oracle_bshd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True, 0.3).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    (call,) = fakes[lib].calls
    assert call["shapes"] == ((2, 8, 4, 16), (2, 8, 2, 16))  # BSHD views
    assert call["causal"] is True and call["scale"] == 0.3
    assert call["args"] == ((0.0,) if lib == "fa2" else ())


def test_fa2_passes_dropout_and_deterministic_backward(registry, fakes):
    q, k, v = _bhsd()
    plan, _ = run_select(
        registry, ctx_for((8, 0), layout=Layout.BHSD, deterministic=True, requires_grad=True)
    )
    plan(q, k, v, None, False, None, 0.0)
    assert fakes["fa2"].calls[-1]["deterministic"] is True
    plan, _ = run_select(registry, ctx_for((8, 0), layout=Layout.BHSD, dropout=True))
    plan(q, k, v, None, False, None, 0.25)
    assert fakes["fa2"].calls[-1]["args"] == (0.25,) and "deterministic" not in fakes["fa2"].calls[-1]


def test_workspace_is_the_lse_buffer(registry):
    ctx = ctx_for((9, 0))
    assert registry.kernel(FA3).workspace_bytes(ctx) == 4 * 2 * 8 * 1024  # fp32 x B x Hq x Sq
    assert registry.kernel(FA3).workspace_bytes(replace(ctx, batch=4)) == 4 * 4 * 8 * 1024


# ----------------------------------------------------------------------------- 5. sliding window and softcap


@pytest.mark.parametrize(("sm", "winner"), [((8, 0), FA2), ((9, 0), FA3), ((10, 0), FA4)])
def test_window_and_softcap_route_to_flash_attn_and_sdpa_refuses(registry, sm, winner):
    plan, report = run_select(
        registry, ctx_for(sm, is_causal=True, window_left=127, window_right=0, has_softcap=True)
    )
    assert plan.kernel_id == winner
    for kid in ("torch_sdpa.flash", "torch_sdpa.cudnn", "torch_sdpa.efficient", "torch_sdpa.math"):
        if report.candidate(kid) is not None:
            assert {R.SLIDING_WINDOW_UNSUPPORTED, R.SOFTCAP_UNSUPPORTED} <= codes(report, kid)


def test_window_with_unequal_lengths_is_refused_by_every_flash_attn(registry):
    plan, report = run_select(registry, ctx_for((9, 0), sq=1, sk=1024, window_left=127, window_right=3))
    assert plan.kernel_id == "reference.attention"
    for kid in (FA2, FA3, FA4):
        assert R.SLIDING_WINDOW_UNSUPPORTED in codes(report, kid)
    # softcap alone is fine with Sq != Sk (no alignment question): FA3 serves it on Hopper
    plan, _ = run_select(registry, ctx_for((9, 0), sq=1, sk=1024, has_softcap=True))
    assert plan.kernel_id == FA3


@pytest.mark.parametrize(
    ("sm", "lib", "kid", "unbounded"),
    [((8, 0), "fa2", FA2, -1), ((9, 0), "fa3", FA3, -1), ((10, 0), "fa4", FA4, None)],
)
def test_plan_passes_window_size_and_softcap(registry, fakes, sm, lib, kid, unbounded):
    q, k, v = _bhsd(s=9, d=64)
    plan, _ = run_select(
        registry,
        ctx_for(
            sm, layout=Layout.BHSD, d=64, hq=4, hkv=2, sq=16, window_left=2, window_right=-1, has_softcap=True
        ),
    )
    assert plan.kernel_id == kid
    out = plan(q, k, v, None, False, None, 0.0, (2, -1), 1.5)
    (call,) = fakes[lib].calls
    assert call["window_size"] == (2, unbounded) and call["softcap"] == 1.5
    # independent oracle: hand-built band mask j >= i - 2 on top of a softcapped float64 softmax
    qd, kd, vd = q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    sc = qd @ kd.transpose(-1, -2) / 8.0
    sc = 1.5 * torch.tanh(sc / 1.5)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    sc = sc.masked_fill(j < i - 2, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(sc, -1) @ vd, atol=1e-12, rtol=1e-12)


def test_plain_calls_pass_no_window_or_softcap_kwargs(registry, fakes):
    q, k, v = _bhsd()
    plan, _ = run_select(registry, ctx_for((9, 0), layout=Layout.BHSD, d=64, hq=4, hkv=2, sq=8))
    plan(q, k, v, None, False, None, 0.0)
    assert "window_size" not in fakes["fa3"].calls[-1] and "softcap" not in fakes["fa3"].calls[-1]
