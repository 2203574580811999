"""The IPEX backend on a machine without intel_extension_for_pytorch (it cannot be installed with torch 2.13).

1. Availability: absent -> BACKEND_NOT_INSTALLED; an installed IPEX built for another torch minor ->
   BACKEND_IMPORT_FAILED with IPEX's mismatch message, without importing it; an import that exits (no AVX2) or
   raises -> BACKEND_IMPORT_FAILED with the text; an IPEX without the APIs -> BACKEND_VERSION_UNSUPPORTED.
2. Routing with a fake ``intel_extension_for_pytorch`` in ``sys.modules`` and hand-built CPU DeviceSpecs fed
   to ``core.selection.select``: ipex wins on CPUs with AVX-512 and is rejected with CPU_ISA_MISSING on
   AVX2-only CPUs; the paged kernel's own rules (HND + causal + fp32/bf16 for prefill, GQA <= 16).
3. Calls: the adapters run the fakes (which compute in float64 from the cache views they are handed, as the
   C++ kernels address them through strides) and match the reference kernels / a float64 oracle.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from layerzero.backends import ipex
from layerzero.core.capabilities import describe_backend
from layerzero.core.context import SelectionContext
from layerzero.core.device import DeviceSpec
from layerzero.core.errors import BackendNotAvailableError
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import SelectionInputs, select

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
TORCH_MINOR = ".".join(torch.__version__.split(".")[:2])
AVX512 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512"})
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})


# ----------------------------------------------------------------------------- fakes and helpers


def rms_oracle(x, w, eps):
    x64 = x.double()
    return x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w.double()


class FakeFunctional:
    """Stand-in for ipex.llm.functional: records calls; fp32-style math in float64, weight multiply before the
    cast; ``add_back`` writes x + residual into ``residual`` like torch_ipex::add_rmsnorm."""

    calls: list = []

    @classmethod
    def rms_norm(cls, x, w, eps):
        cls.calls.append(("rms_norm", eps))
        return rms_oracle(x, w, eps).to(x.dtype)

    @classmethod
    def add_rms_norm(cls, residual, x, w, bias, eps, add_back=False):
        cls.calls.append(("add_rms_norm", bias, eps, add_back, residual.is_contiguous()))
        h = x + residual
        if add_back:
            residual.copy_(h)
        return rms_oracle(h, w, eps).to(x.dtype)


def _gather(cache, row, n, bs):
    """Tokens 0..n-1 of one sequence from a ``[num_blocks, Hkv, block_size, D]`` view -> ``[n, Hkv, D]``."""
    idx = torch.arange(n)
    return cache[row[idx // bs].long(), :, idx % bs, :].double()


def _attend(q, k, v, scale, causal):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] float64; bottom-right causal."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal:
        tq, tk = q.shape[0], k.shape[0]
        keep = torch.arange(tk)[None, :] <= tk - tq + torch.arange(tq)[:, None]
        s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


class FakePaged:
    """Stand-in for ipex.llm.modules.PagedAttention with the C++ kernels' argument contracts."""

    calls: list = []

    @classmethod
    def single_query_cached_kv_attention(
        cls,
        out,
        q,
        kc,
        vc,
        head_mapping,
        scale,
        block_tables,
        context_lens,
        block_size,
        max_context_len,
        alibi_slopes,
    ):
        cls.calls.append(
            (
                "decode",
                kc.shape,
                block_tables.dtype,
                context_lens.dtype,
                block_size,
                max_context_len,
                head_mapping.tolist(),
            )
        )
        assert alibi_slopes is None and kc.shape[2] == block_size
        for i in range(q.shape[0]):
            n = int(context_lens[i])
            k, v = _gather(kc, block_tables[i], n, block_size), _gather(vc, block_tables[i], n, block_size)
            out[i] = _attend(q[i : i + 1], k, v, scale, False)[0].to(out.dtype)

    @classmethod
    def flash_attn_varlen_func(
        cls, out, q, kc, vc, cu_q, cu_k, max_q, max_k, scale, is_causal, block_tables, alibi_slopes
    ):
        cls.calls.append(("varlen", cu_k.tolist(), max_q, max_k, is_causal, kc.stride(2)))
        if kc.stride(2) != kc.shape[-1] or not is_causal or q.dtype == torch.float16:
            raise RuntimeError("flash_attn_varlen: needs HND pages, is_causal=True, float32/bfloat16")
        bs = kc.shape[2]
        for i in range(cu_q.shape[0] - 1):
            q0, q1, n = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i + 1] - cu_k[i])
            if q1 > q0:
                k, v = _gather(kc, block_tables[i], n, bs), _gather(vc, block_tables[i], n, bs)
                out[q0:q1] = _attend(q[q0:q1], k, v, scale, True).to(out.dtype)


def install(monkeypatch, *, version=f"{TORCH_MINOR}.0+cpu", paged=True):
    FakeFunctional.calls, FakePaged.calls = [], []
    names = (
        "intel_extension_for_pytorch",
        "intel_extension_for_pytorch.llm",
        "intel_extension_for_pytorch.llm.functional",
        "intel_extension_for_pytorch.llm.modules",
    )
    mods = {n: types.ModuleType(n) for n in names}
    mods[names[0]].__version__ = version
    mods[names[2]].rms_norm = FakeFunctional.rms_norm
    mods[names[2]].add_rms_norm = FakeFunctional.add_rms_norm
    if paged:
        mods[names[3]].PagedAttention = FakePaged
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    monkeypatch.setattr(ipex, "_dist_version", lambda: None)


def make_registry():
    RUNTIME.ensure_ready()
    reg = KernelRegistry()
    for op in ("rms_norm", "paged_attention"):
        reg.add_op(RUNTIME.registry.ops.get(op))
        for spec in RUNTIME.registry.for_op(op):
            if spec.backend in ("reference", "torch_native", "torch_sdpa"):
                if spec.backend not in reg.backends:
                    reg.add_backend(RUNTIME.registry.backend(spec.backend))
                reg.add_kernel(spec)
    ipex.register(reg)
    return reg


@pytest.fixture
def reg(monkeypatch):
    install(monkeypatch)
    return make_registry()


def cpu_device(isa=AVX512) -> DeviceSpec:
    return dataclasses.replace(DeviceSpec.detect("cpu"), cpu_isa=frozenset(isa))


def rms_ctx(isa=AVX512, dtype=torch.bfloat16, **kw):
    return SelectionContext(
        op="rms_norm", device=cpu_device(isa), dtype=dtype, hidden_size=4096, param_dtype=dtype, **kw
    )


def paged_ctx(isa=AVX512, dtype=torch.bfloat16, decode=True, layout="NHD", hq=8, hkv=2, causal=True):
    return SelectionContext(
        op="paged_attention",
        device=cpu_device(isa),
        dtype=dtype,
        batch=4,
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim=64,
        head_dim_v=64,
        seq_len_q=1 if decode else 64,
        seq_len_kv=256,
        seq_equal=False,
        is_causal=causal,
        kv_layout=layout,
        page_size=16,
    )


def run_select(reg, ctx):
    inputs = SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False)
    return select(reg, ctx, inputs)


def codes(report, kernel_id):
    return {r.code for r in report.candidate(kernel_id).reasons}


# ----------------------------------------------------------------------------- 1. availability


def test_registered_and_unavailable_without_the_library():
    RUNTIME.ensure_ready()
    spec = RUNTIME.registry.backend("ipex")
    assert not spec.available and spec.import_name == "intel_extension_for_pytorch"
    assert [r.code for r in spec.reasons] == [R.BACKEND_NOT_INSTALLED]
    assert {k.kernel_id for k in RUNTIME.registry.kernels.values() if k.backend == "ipex"} == set(
        ipex.KERNEL_IDS
    )


def test_missing_kernel_callable_raises_typed_error():
    for spec in ipex.kernel_specs(None, "module 'intel_extension_for_pytorch' not found"):
        with pytest.raises(BackendNotAvailableError, match="intel_extension_for_pytorch"):
            spec.fn(torch.ones(2), torch.ones(2), 1e-6, None)


def test_torch_mismatch_is_reported_without_importing(monkeypatch):
    monkeypatch.setattr(ipex, "_dist_version", lambda: "2.8.0+cpu")
    real = importlib.import_module

    def guard(name, package=None):
        if name.startswith("intel_extension_for_pytorch"):
            raise AssertionError("the probe must not import a mismatched IPEX")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", guard)
    spec = ipex.probe().backend
    assert not spec.available and spec.version == "2.8.0+cpu"
    assert [r.code for r in spec.reasons] == [R.BACKEND_IMPORT_FAILED]
    assert "needs to work with PyTorch 2.8.*" in spec.reasons[0].message
    assert torch.__version__ in spec.reasons[0].message


def test_fake_with_other_torch_minor_is_import_failed(monkeypatch):
    install(monkeypatch, version="2.8.0+cpu")
    spec = ipex.probe().backend
    assert [r.code for r in spec.reasons] == [R.BACKEND_IMPORT_FAILED] and "2.8.*" in spec.reasons[0].message


@pytest.mark.parametrize(
    "exc",
    [
        SystemExit(
            "ERROR! Intel Extension for PyTorch only works on machines with "
            "instruction sets equal or newer than AVX2"
        ),
        AttributeError("module 'os' has no attribute 'exit'"),
    ],
)
def test_import_that_exits_or_raises_is_import_failed(monkeypatch, exc):
    monkeypatch.setattr(ipex, "_dist_version", lambda: None)
    real = importlib.import_module

    def fake_import(name, package=None):
        if name.startswith("intel_extension_for_pytorch"):
            print("ERROR! printed by the library")
            raise exc
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    spec = ipex.probe().backend
    assert not spec.available and [r.code for r in spec.reasons] == [R.BACKEND_IMPORT_FAILED]
    assert str(exc) in spec.reasons[0].message and "printed by the library" in spec.reasons[0].message


def test_old_ipex_without_paged_attention(monkeypatch):
    install(monkeypatch, paged=False)
    spec = ipex.probe().backend
    assert [r.code for r in spec.reasons] == [R.BACKEND_VERSION_UNSUPPORTED]
    assert "PagedAttention" in spec.reasons[0].message


def test_probe_with_fakes(monkeypatch):
    install(monkeypatch)
    p = ipex.probe()
    assert p.backend.available and p.backend.version == f"{TORCH_MINOR}.0+cpu"
    assert p.api["paged"] is FakePaged


def test_capability_descriptor_matches_code():
    RUNTIME.ensure_ready()
    on_disk = yaml.safe_load((ROOT / "capabilities" / "ipex.yaml").read_text())
    assert on_disk == describe_backend(RUNTIME.registry, "ipex")
    assert sorted(on_disk["kernels"]["ipex.rms_norm"]["cpu_isa"]) == ["avx2", "avx512"]


# ----------------------------------------------------------------------------- 2. routing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ipex_rms_norm_wins_on_avx512(reg, dtype):
    plan, report = run_select(reg, rms_ctx(dtype=dtype))
    assert plan.kernel_id == "ipex.rms_norm"
    plan, _ = run_select(reg, rms_ctx(dtype=dtype, fused_residual=True))
    assert plan.kernel_id == "ipex.rms_norm"


def test_avx2_only_cpu_routes_to_torch_native(reg):
    plan, report = run_select(reg, rms_ctx(isa=AVX2))
    assert plan.kernel_id == "torch_native.rms_norm"
    (reason,) = report.candidate("ipex.rms_norm").reasons
    assert reason.code is R.CPU_ISA_MISSING
    assert "missing ['avx512']" in reason.message and "avx2" in reason.message


def test_no_isa_detected_and_cuda_contexts(reg):
    _, report = run_select(reg, rms_ctx(isa=()))
    assert "missing ['avx2', 'avx512']" in report.candidate("ipex.rms_norm").reasons[0].message
    cuda = dataclasses.replace(cpu_device(), device_type="cuda", index=0, cpu_isa=frozenset())
    _, report = run_select(
        reg, SelectionContext(op="rms_norm", device=cuda, dtype=torch.float16, hidden_size=64)
    )
    assert codes(report, "ipex.rms_norm") == {R.DEVICE_TYPE_UNSUPPORTED}  # cpu_isa is not checked off-CPU


def test_float64_and_float64_weight_rejected(reg):
    _, report = run_select(reg, rms_ctx(dtype=torch.float64))
    assert R.DTYPE_UNSUPPORTED in codes(report, "ipex.rms_norm")
    ctx = dataclasses.replace(rms_ctx(dtype=torch.float32), param_dtype=torch.float64)
    assert R.DTYPE_UNSUPPORTED in codes(run_select(reg, ctx)[1], "ipex.rms_norm")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_decode_both_layouts(reg, layout):
    assert run_select(reg, paged_ctx(layout=layout))[0].kernel_id == "ipex.paged_attention"


@pytest.mark.parametrize(
    ("kw", "code"),
    [
        (dict(decode=False, layout="NHD"), R.KV_LAYOUT_UNSUPPORTED),
        (dict(decode=False, layout="HND", dtype=torch.float16), R.DTYPE_UNSUPPORTED),
        (dict(decode=False, layout="HND", causal=False), R.CAUSAL_UNSUPPORTED),
        (dict(hq=64, hkv=2), R.GQA_RATIO_INVALID),
        (dict(isa=AVX2), R.CPU_ISA_MISSING),
        (dict(dtype=torch.float64), R.DTYPE_UNSUPPORTED),
    ],
)
def test_paged_rejections_fall_back_to_sdpa(reg, kw, code):
    plan, report = run_select(reg, paged_ctx(**kw))
    assert code in codes(report, "ipex.paged_attention")
    assert plan.kernel_id == "torch_sdpa.paged_attention"


def test_paged_prefill_hnd_causal_accepted(reg):
    assert run_select(reg, paged_ctx(decode=False, layout="HND"))[0].kernel_id == "ipex.paged_attention"


# ----------------------------------------------------------------------------- 3. calls through the adapters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_adapter_plain_and_fused(reg, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 96, generator=g).to(dtype)
    r = torch.randn(3, 5, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    r_before = r.clone()
    fn = reg.kernel("ipex.rms_norm").fn
    tol = dict(atol=1e-2, rtol=1e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fn(x, w, 1e-6, None).double(), rms_oracle(x, w, 1e-6), **tol)
    y, h = fn(x, w, 1e-6, r)
    torch.testing.assert_close(h, x + r, atol=0, rtol=0)
    torch.testing.assert_close(y.double(), rms_oracle(x + r, w, 1e-6), **tol)
    assert torch.equal(r, r_before)  # add_back wrote into a copy
    assert FakeFunctional.calls == [("rms_norm", 1e-6), ("add_rms_norm", None, 1e-6, True, True)]


def _paged_inputs(layout, dtype, lens, hq=8, hkv=2, d=64, bs=16, seed=0):
    """A cache with NaN in every unused slot, shuffled block tables, int32 indices."""
    g = torch.Generator().manual_seed(seed)
    nblk = [max(1, -(-n // bs)) for n in lens]
    nb = sum(nblk) + 3
    shape = (nb, 2, bs, hkv, d) if layout == "NHD" else (nb, 2, hkv, bs, d)
    cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        for j in range(nblk[s]):
            b = int(perm[used])
            used += 1
            tables[s, j] = b
            rows = min(bs, n - j * bs)
            if rows > 0:
                kv = torch.randn(2, rows, hkv, d, generator=g).to(dtype)
                if layout == "NHD":
                    cache[b, :, :rows] = kv
                else:
                    cache[b, :, :, :rows] = kv.transpose(1, 2)
    return cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_decode_adapter_matches_reference(reg, layout, dtype):
    lens = [1, 17, 40, 16]
    cache, tables, seq_lens = _paged_inputs(layout, dtype, lens)
    q = torch.randn(len(lens), 8, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = (q, cache, tables, seq_lens, None, None, True, layout)
    got = reg.kernel("ipex.paged_attention").fn(*args)
    want = reg.kernel("reference.paged_attention").fn(*args)
    assert got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    call = FakePaged.calls[-1]
    assert call[0] == "decode" and call[2] == call[3] == torch.int32 and call[5] == 40
    assert call[6] == [0, 0, 0, 0, 1, 1, 1, 1]  # head_mapping for 8 query heads over 2 KV heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_paged_prefill_adapter_matches_reference(reg, dtype, scale):
    lens, qlens = [20, 0, 33, 5], [4, 0, 33, 1]
    cache, tables, seq_lens = _paged_inputs("HND", dtype, lens)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(qlens), 8, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    args = (q, cache, tables, seq_lens, cu, scale, True, "HND")
    got = reg.kernel("ipex.paged_attention").fn(*args)
    want = reg.kernel("reference.paged_attention").fn(*args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert FakePaged.calls[-1][:5] == ("varlen", [0, 20, 20, 53, 58], 33, 33, True)


def test_prefill_with_one_query_token_uses_the_decode_kernel(reg):
    """T == 1 looks like decode to selection (bucket 1); the adapter runs it as a decode of that sequence, so
    NHD caches and is_causal=False are both exact there."""
    cache, tables, seq_lens = _paged_inputs("NHD", torch.float32, [7, 12, 3])
    cu = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    q = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(3))
    for causal in (True, False):
        args = (q, cache, tables, seq_lens, cu, None, causal, "NHD")
        got = reg.kernel("ipex.paged_attention").fn(*args)
        torch.testing.assert_close(
            got, reg.kernel("reference.paged_attention").fn(*args), atol=1e-5, rtol=1e-5
        )
        assert FakePaged.calls[-1][0] == "decode" and FakePaged.calls[-1][5] == 12


def test_paged_adapter_empty_batch(reg):
    cache, tables, seq_lens = _paged_inputs("HND", torch.float32, [3])
    out = reg.kernel("ipex.paged_attention").fn(
        torch.empty(0, 8, 64),
        cache,
        tables,
        seq_lens,
        torch.tensor([0, 0], dtype=torch.int32),
        None,
        True,
        "HND",
    )
    assert out.shape == (0, 8, 64) and FakePaged.calls == []
