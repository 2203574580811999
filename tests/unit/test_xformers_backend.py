"""The xFormers backend on a CPU machine without xformers.

1. Absent library: ``xformers`` registered, unavailable with BACKEND_NOT_INSTALLED.
2. Detection with fakes: the C++ library not loading, no forward operator loading and a failing
   ``xformers.ops.fmha`` import all give BACKEND_IMPORT_FAILED with the concrete reason.
3. Routing: fake ``xformers.ops.fmha`` in ``sys.modules`` and hand-built CUDA contexts: BSHD is native (BHSD
   pays the transform cost 1), the flash/cutlass split decides causal Sq != Sk, fp32 and float masks per SM.
   Scores by hand: xformers 75, SDPA flash 80, cuDNN 85, SDPA efficient 70.
4. Calls: the fake ``memory_efficient_attention`` records what it receives (5-D GQA tensors, stride-0 expanded
   k/v, aligned biases) and computes float64 attention; outputs match SDPA / a float64 oracle.
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from layerzero.backends import xformers as xfb
from layerzero.backends.xformers.kernels import XformersOps, aligned_bias, kernel_spec
from layerzero.core.capabilities import describe_backend
from layerzero.core.context import SelectionContext
from layerzero.core.errors import BackendNotAvailableError
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import SelectionInputs, select
from layerzero.core.specs import Layout, MaskKind
from layerzero.testing.devices import fake_cuda_device

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
XF = "xformers.attention"


# ----------------------------------------------------------------------------- fakes and helpers


class LowerTriangularMask:
    """Stand-in for xformers.ops.fmha.attn_bias.LowerTriangularMask (top-left causal)."""


def bmhk_oracle(q, k, v, bias, scale):
    """float64 attention on [B, M, H, K] tensors; bias None, LowerTriangularMask or [B, H, Mq, Mkv]."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if isinstance(bias, LowerTriangularMask):
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    elif bias is not None:
        s = s + bias.double()
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


class FakeMEA:
    """Stand-in for memory_efficient_attention: checks xFormers' input rules, records, computes float64."""

    def __init__(self):
        self.calls = []

    def __call__(self, query, key, value, attn_bias=None, p=0.0, scale=None):
        self.calls.append({"q": query, "k": key, "v": value, "bias": attn_bias, "p": p, "scale": scale})
        if query.ndim == 5:  # BMGHK: no broadcasting, shapes must match exactly
            b, mq, g, h, kd = query.shape
            if key.shape[:1] + key.shape[2:4] != (b, g, h) or value.shape[2:4] != (g, h):
                raise ValueError("xFormers does not broadcast: k/v must be expanded to [B, M, G, H, K]")
            bias = attn_bias.flatten(1, 2) if isinstance(attn_bias, torch.Tensor) else attn_bias
            out = bmhk_oracle(query.flatten(2, 3), key.flatten(2, 3), value.flatten(2, 3), bias, scale)
            return out.unflatten(2, (g, h)).to(query.dtype)
        return bmhk_oracle(query, key, value, attn_bias, scale).to(query.dtype)


def install(monkeypatch, *, flash=True, cutlass=True, cpp_error=None, built_with_cuda=True):
    mea = FakeMEA()
    xf = types.ModuleType("xformers")
    xf.__version__ = "0.0.35"
    xf._cpp_lib = types.SimpleNamespace(
        _cpp_library_load_exception=cpp_error, _built_with_cuda=built_with_cuda
    )
    fmha = types.ModuleType("xformers.ops.fmha")
    fmha.memory_efficient_attention = mea
    fmha.attn_bias = types.SimpleNamespace(LowerTriangularMask=LowerTriangularMask)

    def op(ok):
        return types.SimpleNamespace(FwOp=types.SimpleNamespace(is_available=lambda: ok))

    fmha.flash, fmha.cutlass, fmha.flash3 = op(flash), op(cutlass), op(False)
    for name, mod in (
        ("xformers", xf),
        ("xformers.ops", types.ModuleType("xformers.ops")),
        ("xformers.ops.fmha", fmha),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    return mea


def make_registry():
    RUNTIME.ensure_ready()
    reg = KernelRegistry()
    reg.add_op(RUNTIME.registry.ops.get("attention"))
    for spec in RUNTIME.registry.for_op("attention"):
        if spec.backend in ("reference", "torch_sdpa"):
            if spec.backend not in reg.backends:
                reg.add_backend(RUNTIME.registry.backend(spec.backend))
            reg.add_kernel(spec)
    xfb.register(reg)
    return reg


@pytest.fixture
def mea(monkeypatch):
    return install(monkeypatch)


@pytest.fixture
def reg(mea):
    return make_registry()


cuda_device = fake_cuda_device


def ctx_for(
    sm=(9, 0), *, layout=Layout.BSHD, dtype=torch.float16, d=128, hq=8, hkv=8, sq=1024, sk=None, **kw
):
    sk = sq if sk is None else sk
    return SelectionContext(
        op="attention",
        device=cuda_device(sm),
        dtype=dtype,
        batch=2,
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim=d,
        head_dim_v=d,
        seq_len_q=sq,
        seq_len_kv=sk,
        seq_equal=sq == sk,
        layout=layout,
        **kw,
    )


def run_select(reg, ctx, policy=None):
    inputs = SelectionInputs(
        policy or Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False
    )
    return select(reg, ctx, inputs)


def codes(report):
    return {r.code for r in report.candidate(XF).reasons}


# ----------------------------------------------------------------------------- 1-2. availability


def test_registered_and_unavailable_without_the_library():
    RUNTIME.ensure_ready()
    spec = RUNTIME.registry.backend("xformers")
    assert not spec.available and spec.import_name == "xformers"
    assert [r.code for r in spec.reasons] == [R.BACKEND_NOT_INSTALLED]
    assert RUNTIME.registry.kernel(XF).op == "attention"


def test_capability_descriptor_matches_code():
    RUNTIME.ensure_ready()
    on_disk = yaml.safe_load((ROOT / "capabilities" / "xformers.yaml").read_text())
    assert on_disk == describe_backend(RUNTIME.registry, "xformers")


def test_probe_with_working_fakes(monkeypatch):
    install(monkeypatch, flash=False, cutlass=True)
    p = xfb.probe()
    assert p.backend.available and p.backend.version == "0.0.35"
    assert p.ops == XformersOps(flash=False, cutlass=True, flash3=False)


def test_cpp_library_not_loading_is_import_failed(monkeypatch):
    install(
        monkeypatch,
        cpp_error=RuntimeError("xFormers can't load C++/CUDA extensions. built for PyTorch 2.10"),
        built_with_cuda=False,
    )
    reg = make_registry()
    spec = reg.backend("xformers")
    assert not spec.available and [r.code for r in spec.reasons] == [R.BACKEND_IMPORT_FAILED]
    assert "can't load C++/CUDA extensions" in spec.reasons[0].message
    plan, report = run_select(reg, ctx_for())
    assert plan.kernel_id != XF and R.BACKEND_IMPORT_FAILED in codes(report)
    with pytest.raises(BackendNotAvailableError, match="C\\+\\+/CUDA"):
        reg.kernel(XF).fn(None, None, None, None, False, None, 0.0)


def test_no_forward_operator_is_import_failed(monkeypatch):
    install(monkeypatch, flash=False, cutlass=False)
    spec = xfb.probe().backend
    assert [r.code for r in spec.reasons] == [R.BACKEND_IMPORT_FAILED]
    assert "flash.FwOp" in spec.reasons[0].message and "cutlass.FwOp" in spec.reasons[0].message


def test_fmha_import_error_is_import_failed(monkeypatch):
    install(monkeypatch)
    monkeypatch.setitem(sys.modules, "xformers.ops.fmha", None)  # import raises ImportError
    spec = xfb.probe().backend
    assert [r.code for r in spec.reasons] == [R.BACKEND_IMPORT_FAILED]
    assert "xformers.ops.fmha" in spec.reasons[0].message


# ----------------------------------------------------------------------------- 3. routing


@pytest.mark.parametrize(("layout", "cost"), [(Layout.BSHD, 0.0), (Layout.BHSD, 1.0)])
def test_bshd_native_bhsd_pays_transform(reg, layout, cost):
    _, report = run_select(reg, ctx_for(layout=layout))
    cand = report.candidate(XF)
    assert cand.score.transform_cost == cost and cand.score.total == 75 - cost
    assert bool(cand.transforms) == (layout is Layout.BHSD)


def test_fp32_on_hopper_goes_to_xformers_over_sdpa_efficient(reg):
    plan, report = run_select(reg, ctx_for(dtype=torch.float32, layout=Layout.BHSD))
    assert plan.kernel_id == XF  # 75 - 1 > efficient 70; flash/cuDNN take no fp32
    assert report.candidate("torch_sdpa.efficient").score.total == 70


def test_fp16_prefers_sdpa_kernels(reg):
    assert run_select(reg, ctx_for())[0].kernel_id != XF  # cuDNN 85 / SDPA flash 80 outrank 75


@pytest.mark.parametrize(
    ("sm", "ops", "expected"),
    [
        ((9, 0), dict(flash=True, cutlass=True), set()),
        ((8, 0), dict(flash=True, cutlass=True), set()),
        ((10, 0), dict(flash=True, cutlass=True), {R.CAUSAL_SEQ_MISMATCH, R.SM_TOO_NEW}),
        ((9, 0), dict(flash=True, cutlass=False), {R.CAUSAL_SEQ_MISMATCH, R.BACKEND_IMPORT_FAILED}),
    ],
)
def test_causal_sq_ne_sk_needs_cutlass(monkeypatch, sm, ops, expected):
    install(monkeypatch, **ops)
    _, report = run_select(make_registry(), ctx_for(sm=sm, is_causal=True, sq=16, sk=64))
    assert codes(report) == expected


def test_fp32_and_float_mask_rejected_where_cutlass_cannot_run(reg):
    _, report = run_select(reg, ctx_for(sm=(10, 0), dtype=torch.float32))
    assert codes(report) == {R.DTYPE_UNSUPPORTED, R.SM_TOO_NEW}
    _, report = run_select(reg, ctx_for(sm=(10, 0), mask=MaskKind.FLOAT))
    assert codes(report) == {R.MASK_UNSUPPORTED, R.SM_TOO_NEW}
    _, report = run_select(reg, ctx_for(sm=(9, 0), mask=MaskKind.FLOAT))
    assert codes(report) == set()


def test_fp32_not_claimed_without_cutlass(monkeypatch):
    install(monkeypatch, cutlass=False)
    _, report = run_select(make_registry(), ctx_for(dtype=torch.float32))
    assert R.DTYPE_UNSUPPORTED in codes(report)


def test_bool_mask_and_mask_with_causal_rejected(reg):
    _, report = run_select(reg, ctx_for(mask=MaskKind.BOOL))
    assert R.MASK_UNSUPPORTED in codes(report)
    _, report = run_select(reg, ctx_for(mask=MaskKind.FLOAT, is_causal=True))
    assert R.MASK_WITH_CAUSAL in codes(report)


def test_gqa_limits(reg):
    assert codes(run_select(reg, ctx_for(hq=8, hkv=2))[1]) == set()
    assert codes(run_select(reg, ctx_for(hq=8, hkv=2, requires_grad=True))[1]) == {R.BACKWARD_UNSUPPORTED}
    assert codes(run_select(reg, ctx_for(hq=8, hkv=2, graph_capture=True))[1]) == {R.CUDA_GRAPH_UNSAFE}
    assert codes(run_select(reg, ctx_for(hq=8, hkv=8, graph_capture=True))[1]) == set()


def test_data_constraints(reg):
    assert R.SM_TOO_OLD in codes(run_select(reg, ctx_for(sm=(7, 5)))[1])
    assert R.HEAD_DIM_NOT_ALIGNED in codes(run_select(reg, ctx_for(d=60))[1])
    assert R.HEAD_DIM_TOO_LARGE in codes(run_select(reg, ctx_for(sm=(10, 0), d=512))[1])
    assert codes(run_select(reg, ctx_for(sm=(9, 0), d=512))[1]) == set()  # cutlass takes any K


# ----------------------------------------------------------------------------- 4. calls


def sdpa64(q, k, v, mask=None, causal=False, scale=None):
    """SDPA in float64 on BSHD tensors with GQA (the independent oracle)."""
    out = F.scaled_dot_product_attention(
        q.double().transpose(1, 2),
        k.double().transpose(1, 2),
        v.double().transpose(1, 2),
        attn_mask=None if mask is None else mask.double(),
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def test_gqa_call_reshapes_to_bmghk(reg, mea):
    plan, _ = run_select(reg, ctx_for(hq=6, hkv=2, d=8, sq=4, sk=8, dtype=torch.float32))
    b, sq, sk, d = 2, 3, 7, 8
    q, k, v = rand(b, sq, 6, d, seed=1), rand(b, sk, 2, d, seed=2), rand(b, sk, 2, d, seed=3)
    out = plan(q, k, v, None, False, 0.3, 0.0)
    call = mea.calls[-1]
    assert call["q"].shape == (b, sq, 2, 3, d)
    assert call["k"].shape == (b, sk, 2, 3, d) and call["k"].stride(3) == 0 and call["v"].stride(3) == 0
    assert call["scale"] == 0.3 and call["p"] == 0.0 and call["bias"] is None
    assert out.shape == (b, sq, 6, d)
    torch.testing.assert_close(out.double(), sdpa64(q, k, v, scale=0.3))


def test_bhsd_gqa_call_through_transpose_views(reg, mea):
    plan, _ = run_select(reg, ctx_for(hq=4, hkv=1, d=8, sq=4, layout=Layout.BHSD, dtype=torch.float32))
    q, k, v = rand(1, 4, 5, 8, seed=4), rand(1, 1, 5, 8, seed=5), rand(1, 1, 5, 8, seed=6)
    out = plan(q, k, v, None, True, None, 0.0)
    assert isinstance(mea.calls[-1]["bias"], LowerTriangularMask)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mask_shape", [(5,), (3, 5), (1, 1, 3, 5), (2, 4, 3, 5), (2, 1, 1, 5), (3, 1)])
def test_aligned_bias(dtype, mask_shape):
    m = rand(*mask_shape, seed=7).to(dtype)
    out = aligned_bias(m, 2, 4, 3, 5)
    align = 16 // m.element_size()
    assert out.shape == (2, 4, 3, 5) and out.stride(-1) == 1
    assert all(st % align == 0 for st in out.stride()[:-1]) and out.data_ptr() % 16 == 0
    assert torch.equal(out, m.expand(2, 4, 3, 5))


def test_aligned_bias_keeps_aligned_masks_without_copy():
    m = torch.zeros(2, 4, 3, 8, dtype=torch.float16)
    assert aligned_bias(m, 2, 4, 3, 8).data_ptr() == m.data_ptr()


def test_float_mask_call_with_gqa(reg, mea):
    plan, _ = run_select(reg, ctx_for(hq=4, hkv=2, d=8, sq=4, mask=MaskKind.FLOAT, dtype=torch.float32))
    q, k, v = rand(2, 3, 4, 8, seed=8), rand(2, 5, 2, 8, seed=9), rand(2, 5, 2, 8, seed=10)
    mask = rand(1, 4, 3, 5, seed=11)
    mask[0, 1, 2, :3] = float("-inf")
    out = plan(q, k, v, mask, False, None, 0.0)
    assert mea.calls[-1]["bias"].shape == (2, 2, 2, 3, 5)
    torch.testing.assert_close(out.double(), sdpa64(q, k, v, mask))


def test_dropout_passed_through(reg, mea):
    plan, _ = run_select(reg, ctx_for(d=8, dropout=True, dtype=torch.float32))
    assert plan.kernel_id == XF
    plan(rand(1, 2, 8, 8), rand(1, 2, 8, 8), rand(1, 2, 8, 8), None, False, None, 0.25)
    assert mea.calls[-1]["p"] == 0.25


def test_kernel_spec_without_library_raises():
    spec = kernel_spec(None, None, None, "module 'xformers' not found")
    with pytest.raises(BackendNotAvailableError, match="xformers"):
        spec.fn(None, None, None, None, False, None, 0.0)
