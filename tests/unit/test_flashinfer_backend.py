"""The ``flashinfer`` backend on a CPU machine without FlashInfer.

1. Availability: absent -> BACKEND_NOT_INSTALLED; broken import -> BACKEND_IMPORT_FAILED; old release ->
   BACKEND_VERSION_UNSUPPORTED; a fake module with the three wrappers -> available.
2. CSR conversion vs a hand-worked case (page size 16, seq_lens [1, 16, 17, 0]).
3. Routing on hand-built CUDA contexts: which reasons reject flashinfer kernels, and who wins by priority.
4. Calls through a fake ``flashinfer`` module whose wrappers record plan()/run() and compute float64 attention
   with plain torch from the CSR they were planned with: results vs an independent oracle.
5. Plan cache: one miss then hits, in-place update / new tensor / LRU eviction re-plan, stats.
"""

from __future__ import annotations

import math
import sys
import threading
import types

import pytest
import torch

from layerzero.backends import flashinfer as fib
from layerzero.backends.flashinfer import kernels as fik
from layerzero.backends.flashinfer.plan import PlanCache, paged_csr
from layerzero.core import errors as lz_errors
from layerzero.core.context import SelectionContext
from layerzero.core.device import DeviceSpec, gpu_generation_from_sm, tensor_core_generation
from layerzero.core.errors import BackendNotAvailableError
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import SelectionInputs, select
from layerzero.core.specs import Layout, MaskKind

pytestmark = pytest.mark.unit
F64 = torch.float64


# ------------------------------------------------------------------------------------------ fake flashinfer
def _attend(q, k, v, causal, scale):
    """float64 attention of one request: q [Lq, Hq, D], k/v [Lk, Hkv, D], causal bottom-right."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        s = s.masked_fill(torch.arange(lk)[None, :] > lk - lq + torch.arange(lq)[:, None], float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)


def _pages(kv, layout, indptr, indices, last, s):
    """Sequence s's K and V [L, Hkv, D] from a (k, v) tuple or a 5-D cache, by the CSR."""
    k, v = kv if isinstance(kv, tuple) else kv.unbind(1)
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    ids = indices[indptr[s] : indptr[s + 1]].tolist()
    if not ids:
        return k[:0, 0], v[:0, 0]
    n = (len(ids) - 1) * k.shape[1] + int(last[s])
    return k[ids].flatten(0, 1)[:n], v[ids].flatten(0, 1)[:n]


class _Wrapper:
    log: list = []

    def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False):
        self.layout, self.tc = kv_layout, use_tensor_cores
        _Wrapper.log.append(("init", type(self).__name__, kv_layout, use_tensor_cores))


class FakeDecode(_Wrapper):
    def plan(self, indptr, indices, last, hq, hkv, d, page, **kw):
        _Wrapper.log.append(
            ("plan", "decode", indptr.tolist(), indices.tolist(), last.tolist(), page, kw["sm_scale"])
        )
        self.csr, self.scale = (indptr.clone(), indices.clone(), last.clone()), kw["sm_scale"]

    def run(self, q, kv):
        _Wrapper.log.append(("run", "decode"))
        out = [
            _attend(
                q[s : s + 1].double(),
                *(t.double() for t in _pages(kv, self.layout, *self.csr, s)),
                False,
                self.scale,
            )
            for s in range(q.shape[0])
        ]
        return torch.cat(out).to(q.dtype)


class FakePagedPrefill(_Wrapper):
    def plan(self, qo, indptr, indices, last, hq, hkv, d, page, causal=False, sm_scale=None, **kw):
        _Wrapper.log.append(("plan", "prefill", qo.tolist(), indptr.tolist(), causal))
        self.qo, self.csr, self.causal, self.scale = qo.clone(), (indptr, indices, last), causal, sm_scale

    def run(self, q, kv):
        _Wrapper.log.append(("run", "prefill"))
        out = torch.zeros(q.shape, dtype=F64)
        for s in range(self.qo.shape[0] - 1):
            a, b = int(self.qo[s]), int(self.qo[s + 1])
            if b > a:
                k, v = _pages(kv, self.layout, *self.csr, s)
                out[a:b] = _attend(q[a:b].double(), k.double(), v.double(), self.causal, self.scale)
        return out.to(q.dtype)


class FakeRagged(_Wrapper):
    def plan(self, qo, kvp, hq, hkv, d, causal=False, sm_scale=None, **kw):
        _Wrapper.log.append(("plan", "ragged", qo.tolist(), kvp.tolist(), causal))
        self.qo, self.kvp, self.causal, self.scale = qo, kvp, causal, sm_scale

    def run(self, q, k, v):
        _Wrapper.log.append(("run", "ragged"))
        out = torch.zeros(q.shape, dtype=F64)
        for s in range(self.qo.shape[0] - 1):
            a, b, c, e = int(self.qo[s]), int(self.qo[s + 1]), int(self.kvp[s]), int(self.kvp[s + 1])
            out[a:b] = _attend(q[a:b].double(), k[c:e].double(), v[c:e].double(), self.causal, self.scale)
        return out.to(q.dtype)


def fake_module(version="0.5.3"):
    m = types.ModuleType("flashinfer")
    m.__version__ = version
    m.BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    m.BatchPrefillWithPagedKVCacheWrapper = FakePagedPrefill
    m.BatchPrefillWithRaggedKVCacheWrapper = FakeRagged
    return m


@pytest.fixture
def log():
    _Wrapper.log = []
    return _Wrapper.log


@pytest.fixture
def kern(log):
    return fik.FlashInferKernels(fake_module(), capacity=3)


# ------------------------------------------------------------------------------------------ 1. availability
def test_absent_library_is_registered_unavailable():
    RUNTIME.ensure_ready()
    b = RUNTIME.registry.backend("flashinfer")
    if b.available:
        pytest.skip("flashinfer is installed here")
    assert [r.code for r in b.reasons] == [R.BACKEND_NOT_INSTALLED]
    assert {s.kernel_id for s in RUNTIME.registry.for_op("paged_attention")} >= {"flashinfer.paged_attention"}
    assert fib.plan_stats(RUNTIME.registry) is None
    with pytest.raises(BackendNotAvailableError, match="flashinfer.attention cannot run"):
        RUNTIME.registry.kernel("flashinfer.attention").fn(None)


def test_probe_reasons(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_module())
    p = fib.probe()
    assert p.backend.available and p.backend.version == "0.5.3" and p.module is sys.modules["flashinfer"]
    monkeypatch.setitem(sys.modules, "flashinfer", fake_module("0.1.6"))
    assert fib.probe().backend.reasons[0].code is R.BACKEND_VERSION_UNSUPPORTED
    partial = fake_module()
    del partial.BatchPrefillWithRaggedKVCacheWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", partial)
    assert "BatchPrefillWithRaggedKVCacheWrapper" in fib.probe().backend.reasons[0].message
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError (not ModuleNotFound)
    p = fib.probe()
    assert not p.backend.available and p.backend.reasons[0].code in (
        R.BACKEND_IMPORT_FAILED,
        R.BACKEND_NOT_INSTALLED,
    )


# ------------------------------------------------------------------------------------------ 2. CSR
def test_csr_hand_worked():
    bt = torch.tensor([[9, 4, 4], [2, -1, 7], [5, 6, 0], [3, 3, 3]], dtype=torch.int32)
    indptr, indices, last = paged_csr(bt, torch.tensor([1, 16, 17, 0], dtype=torch.int32), 16)
    assert indptr.tolist() == [0, 1, 2, 4, 4]
    assert indices.tolist() == [9, 2, 5, 6]
    assert last.tolist() == [1, 16, 1, 0]
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}


# ------------------------------------------------------------------------------------------ 3. routing
def cuda_ctx(op="attention", sm=(9, 0), dtype=torch.float16, d=128, sq=1024, sk=None, **kw):
    gen = gpu_generation_from_sm(*sm)
    dev = DeviceSpec(
        device_type="cuda",
        index=0,
        name="Fake",
        sm=sm,
        generation=gen,
        tensor_core_gen=tensor_core_generation(gen),
        supports_bf16=True,
        supports_fp8=False,
        total_memory_bytes=None,
        multiprocessor_count=None,
        torch_version=torch.__version__,
        cuda_version="12.8",
        driver_version=None,
        cudnn_version=None,
        cpu_vendor=None,
        cpu_isa=frozenset(),
    )
    sk = sq if sk is None else sk
    extra = dict(layout=Layout.BHSD) if op == "attention" else dict(kv_layout="NHD", page_size=16)
    return SelectionContext(
        op=op,
        device=dev,
        dtype=dtype,
        batch=4,
        num_heads_q=32,
        num_heads_kv=8,
        head_dim=d,
        head_dim_v=d,
        seq_len_q=sq,
        seq_len_kv=sk,
        seq_equal=sq == sk,
        **(extra | kw),
    )


@pytest.fixture
def registry(monkeypatch, log):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_module())
    RUNTIME.ensure_ready()
    reg = KernelRegistry()
    for op in ("attention", "paged_attention", "paged_attention_lse"):
        reg.add_op(RUNTIME.registry.ops.get(op))
        for spec in RUNTIME.registry.for_op(op):
            if spec.backend in ("reference", "torch_sdpa"):
                if spec.backend not in reg.backends:
                    reg.add_backend(RUNTIME.registry.backend(spec.backend))
                reg.add_kernel(spec)
    fib.register(reg)
    return reg


def run_select(reg, ctx):
    return select(
        reg,
        ctx,
        SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False),
    )


def codes(report, kid):
    return {r.code for r in report.candidate(kid).reasons}


def test_paged_routing_prefers_flashinfer_on_cuda(registry):
    plan, report = run_select(registry, cuda_ctx("paged_attention", sq=1))
    assert plan.kernel_id == "flashinfer.paged_attention"
    _, report = run_select(registry, cuda_ctx("paged_attention", sm=(7, 5), d=96, dtype=torch.float32))
    assert codes(report, "flashinfer.paged_attention") >= {
        R.SM_TOO_OLD,
        R.HEAD_DIM_INVALID,
        R.DTYPE_UNSUPPORTED,
    }
    with pytest.raises(lz_errors.NoKernelFoundError, match="CUDA_GRAPH_UNSAFE") as info:
        run_select(registry, cuda_ctx("paged_attention", graph_capture=True))
    assert R.CUDA_GRAPH_UNSAFE in codes(info.value.report, "flashinfer.paged_attention")


def test_attention_routing_reasons_and_priority(registry):
    plan, report = run_select(registry, cuda_ctx(sq=1, sk=4096, is_causal=False))
    cand = report.candidate("flashinfer.attention")
    assert not cand.reasons and cand.score.total == fik.PRIORITY_ATTENTION - 1  # BHSD -> BSHD transform
    assert plan.kernel_id == "torch_sdpa.cudnn"  # 85 > 55: lz.tune decides where FlashInfer is faster
    _, report = run_select(registry, cuda_ctx(sq=8, sk=16, is_causal=True))
    assert R.CAUSAL_SEQ_MISMATCH in codes(report, "flashinfer.attention")
    for mask in (MaskKind.BOOL, MaskKind.FLOAT):
        _, report = run_select(registry, cuda_ctx(mask=mask))
        assert R.MASK_UNSUPPORTED in codes(report, "flashinfer.attention")
    _, report = run_select(registry, cuda_ctx(dropout=True, requires_grad=True, d=80))
    assert codes(report, "flashinfer.attention") >= {
        R.DROPOUT_UNSUPPORTED,
        R.BACKWARD_UNSUPPORTED,
        R.HEAD_DIM_INVALID,
    }


# ------------------------------------------------------------------------------------------ 4. calls
def _oracle_bhsd(q, k, v, causal, scale):
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize(
    "sq,sk,hq,causal,scale",
    [(1, 37, 8, False, None), (1, 9, 24, False, 0.3), (13, 13, 8, True, None), (5, 11, 4, False, 0.2)],
)
def test_attention_kernel_vs_oracle(kern, log, sq, sk, hq, causal, scale):
    g = torch.Generator().manual_seed(sq * 100 + sk)
    q = torch.randn(3, hq, sq, 64, generator=g, dtype=F64)
    k, v = (torch.randn(3, 4, sk, 64, generator=g, dtype=F64) for _ in range(2))
    out = kern.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, causal, scale, 0.0)
    torch.testing.assert_close(out.transpose(1, 2), _oracle_bhsd(q, k, v, causal, scale))
    plan = next(e for e in log if e[0] == "plan")
    if sq == 1:
        assert plan[1:6] == ("decode", [0, 1, 2, 3], [0, 1, 2], [sk] * 3, sk)
        assert log[0][3] is (hq // 4 > 4)  # tensor cores only for GQA groups > 4
    else:
        assert plan[1:] == ("ragged", [0, sq, 2 * sq, 3 * sq], [0, sk, 2 * sk, 3 * sk], causal)


def _paged_setup(layout, decode=True):
    g = torch.Generator().manual_seed(7)
    p, hkv, d = 4, 2, 64
    lens = [5, 1, 9] if decode else [6, 0, 3]
    qlens = [1, 1, 1] if decode else [2, 0, 3]
    cache = torch.full((10, 2, p, hkv, d), float("nan"), dtype=F64)
    table = torch.tensor([[7, 2, 9], [4, -1, 99], [0, 3, 5]], dtype=torch.int32)
    ks, vs = [], []
    for s, n in enumerate(lens):
        k, v = torch.randn(n, hkv, d, generator=g, dtype=F64), torch.randn(n, hkv, d, generator=g, dtype=F64)
        for t in range(n):
            cache[table[s, t // p], 0, t % p], cache[table[s, t // p], 1, t % p] = k[t], v[t]
        ks.append(k)
        vs.append(v)
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    q = torch.randn(sum(qlens), 4, d, generator=g, dtype=F64)
    cu = None if decode else torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    ref, a = torch.zeros_like(q), 0
    for ql, k, v in zip(qlens, ks, vs, strict=True):
        if ql:
            ref[a : a + ql] = _attend(q[a : a + ql], k, v, True, None)
        a += ql
    return q, cache, table, torch.tensor(lens, dtype=torch.int32), cu, ref


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("decode", [True, False])
def test_paged_kernel_vs_oracle_with_nan_in_unused_slots(kern, log, layout, decode):
    q, cache, table, lens, cu, ref = _paged_setup(layout, decode)
    out = kern.paged_attention(q, cache, table, lens, cu, None, True, layout)
    torch.testing.assert_close(out, ref)
    plan = next(e for e in log if e[0] == "plan")
    assert plan[1] == ("decode" if decode else "prefill")
    assert log[0][1:3] == (("FakeDecode" if decode else "FakePagedPrefill"), layout)


def test_paged_empty_batch_returns_empty(kern, log):
    q = torch.zeros(0, 4, 64, dtype=torch.float16)
    assert kern.paged_attention(q, None, None, None, None, None, True, "NHD").shape == (0, 4, 64)
    assert log == []


# ------------------------------------------------------------------------------------------ 5. plan cache
def test_plan_cache_hits_per_layer_and_replans_on_updates(kern, log):
    q, cache, table, lens, _, ref = _paged_setup("NHD")
    for _ in range(4):  # four layers of one step
        kern.paged_attention(q, cache, table, lens, None, None, True, "NHD")
    s = kern.plan_stats()
    assert (s.misses, s.hits, s.size) == (1, 3, 1)
    lens.add_(0)  # in-place op bumps _version -> re-plan
    kern.paged_attention(q, cache, table, lens, None, None, True, "NHD")
    table2 = table.clone()  # new tensor, same values -> re-plan
    kern.paged_attention(q, cache, table2, lens, None, None, True, "NHD")
    kern.paged_attention(q, cache, table2, lens, None, 0.5, True, "NHD")  # other scale -> re-plan
    s = kern.plan_stats()
    assert (s.misses, s.hits, s.size, s.evictions) == (4, 3, 3, 1)
    assert (
        sum(1 for e in log if e[0] == "init") == 3
    )  # the evicted decode wrapper was re-planned, not rebuilt
    assert sum(1 for e in log if e[0] == "plan") == 4


def test_inference_tensors_replan_every_call_and_warn_once(kern, log, caplog):
    """Inference tensors have no version counter (``_version`` raises): an in-place update could not be seen,
    so every call plans (never a stale plan, never an error), with one warning that says how to reuse
    plans."""
    import layerzero.backends.flashinfer.plan as plan_mod

    plan_mod._warned_inference = False
    with torch.inference_mode():
        q, cache, table, lens, _, ref = _paged_setup("NHD")
        with caplog.at_level("WARNING", logger="layerzero.flashinfer"):
            first = kern.paged_attention(q, cache, table, lens, None, None, True, "NHD")
            lens[0] -= 1  # untracked in-place update: must take effect
            second = kern.paged_attention(q, cache, table, lens, None, None, True, "NHD")
    assert sum(1 for e in log if e[0] == "plan") == 2 and kern.plan_stats().hits == 0
    assert [e[4] for e in log if e[0] == "plan"] == [
        [1, 1, 1],
        [4, 1, 1],
    ]  # last-page lengths: 5 then 4 tokens
    assert sum("torch.no_grad()" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(first, ref)
    assert not torch.equal(first, second)


def test_plan_cache_key_checks_tensor_objects_not_just_addresses():
    cache = PlanCache(2)
    plans = []
    t = torch.arange(4)

    def run(x):
        return cache.run(("k", x.data_ptr(), x._version), "kind", (x,), object, plans.append, lambda w: w)

    run(t)
    run(t)
    alias = t.view(4)  # same address, shape and version, another object: treated as a miss
    run(alias)
    assert len(plans) == 2 and cache.stats().hits == 1


def test_plan_cache_thread_safe():
    cache = PlanCache(2)
    errors = []

    def worker(i):
        try:
            for j in range(200):
                key = (i + j) % 5
                got = cache.run(
                    key, "k", (), lambda: {}, lambda w, key=key: w.update(key=key), lambda w: w["key"]
                )
                if got != key:
                    errors.append((key, got))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    s = cache.stats()
    assert s.hits + s.misses == 800 and s.size <= 2


def test_plan_cache_capacity_validated():
    with pytest.raises(ValueError, match="capacity"):
        PlanCache(0)
