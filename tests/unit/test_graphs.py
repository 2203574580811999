"""CUDA-graph helpers on CPU: lz.is_graph_safe, lz.warmup, lz.validate_graph_capture's typed refusal, the
capture-time cache-miss guard in Runtime.resolve, and the capture-key derivation.

Oracles: the kernels' own ``graph_safe`` flags (SDPA and torch_native kernels are graph-safe, the reference
sampling kernels and both flex kernels are not), the selection cache read back directly, and hand-built keys.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import layerzero as lz
from layerzero import graphs
from layerzero.core.dispatch import capture_key
from layerzero.core.errors import CudaGraphUnsafeError, InvalidInputError, UnknownOperationError
from layerzero.core.runtime import RUNTIME
from layerzero.ops import OPS

pytestmark = pytest.mark.unit


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))


# ------------------------------------------------------------------------------------------ is_graph_safe
def test_attention_is_graph_safe_sampling_is_not():
    q, k, v = qkv()
    assert lz.is_graph_safe("attention", q, k, v, is_causal=True) is True
    x, w = torch.randn(3, 32), torch.ones(32)
    assert lz.is_graph_safe("rms_norm", x, w) is True
    logits = torch.randn(2, 50)
    assert lz.is_graph_safe("sample_topk", logits, 5) is False
    assert lz.is_graph_safe("sample_topp", logits, 0.9) is False


@pytest.mark.parametrize("bad", [{"is_casual": True}, {"args": 2}, {"args": 4}])
def test_is_graph_safe_refuses_arguments_that_do_not_bind(bad):
    """A misspelt keyword or a wrong number of positional arguments is an InvalidInputError naming
    lz.attention's signature (was a bare TypeError from the op's prepare), before anything is selected."""
    q, k, v = qkv()
    args = (q, k, v, None)[: bad.pop("args", 3)]
    with pytest.raises(lz.InvalidInputError, match=r"lz.is_graph_safe: arguments of lz.attention"):
        lz.is_graph_safe("attention", *args, **bad)


def test_is_graph_safe_follows_locks():
    """Locked to flex (not graph-safe) the answer becomes False; reference.attention is graph-safe."""
    q, k, v = qkv()
    RUNTIME.ensure_ready()
    assert RUNTIME.registry.kernel("reference.attention", "attention").graph_safe
    lz.lock("attention", "flex_attention.attention")
    assert lz.is_graph_safe("attention", q, k, v) is False
    lz.lock("attention", "reference.attention")
    assert lz.is_graph_safe("attention", q, k, v) is True


def test_is_graph_safe_when_preferred_kernel_is_unsafe():
    """Preferring flex (not graph-safe): it serves eager calls, the reference serves the capture."""
    q, k, v = qkv()
    mask = torch.rand(8, 8) < 0.7
    with lz.prefer("flex_attention"):
        assert lz.which("attention", q, k, v, attn_mask=mask, is_causal=True) == "flex_attention.attention"
        assert lz.is_graph_safe("attention", q, k, v, attn_mask=mask, is_causal=True) is True


def test_is_graph_safe_in_strict_mode_when_only_reference_remains():
    """Strict mode refuses a reference fallback with NoKernelFoundError; a graph-safe kernel is still
    eligible."""
    q, k, v = qkv()
    mask = torch.rand(8, 8) < 0.7
    lz.configure(strict=True)
    assert lz.is_graph_safe("attention", q, k, v, attn_mask=mask, is_causal=True) is True


def test_is_graph_safe_bad_inputs():
    with pytest.raises(UnknownOperationError, match="unknown op"):
        lz.is_graph_safe("attn", *qkv())
    with pytest.raises(InvalidInputError, match="head_dim"):
        q, k, v = qkv()
        lz.is_graph_safe("attention", q, k[..., :8], v)


# ------------------------------------------------------------------------------------------ warmup
def test_warmup_returns_kernels_and_fills_cache():
    q, k, v = qkv()
    x, w = torch.randn(4, 64), torch.ones(64)
    cases = [
        ((q, k, v), {"is_causal": True}),
        ((q, k, v), {"attn_mask": torch.rand(8, 8) < 0.5, "is_causal": True}),
    ]
    assert lz.warmup("attention", cases) == ["torch_sdpa.flash", "reference.attention"]
    for (args, kw), expect in zip(cases, ["torch_sdpa.flash", "reference.attention"], strict=True):
        key, _ = OPS["attention"][0](*args, **kw)
        plan = RUNTIME.cache.get(key)
        assert plan is not None and plan.kernel_id == expect
    assert lz.warmup("rms_norm", [((x, w), {})]) == ["torch_native.rms_norm"]
    key, _ = OPS["rms_norm"][0](x, w)
    assert RUNTIME.cache.get(key).kernel_id == "torch_native.rms_norm"


def test_warmup_then_call_is_a_cache_hit(monkeypatch):
    q, k, v = qkv()
    lz.warmup("attention", [((q, k, v), {})])
    calls = []
    real = RUNTIME.select_context
    monkeypatch.setattr(RUNTIME, "select_context", lambda ctx: calls.append(ctx) or real(ctx))
    lz.attention(q, k, v)
    assert calls == []


def test_warmup_bad_cases():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match=r"case 0.*\(args, kwargs\)"):
        lz.warmup("attention", [(q, k, v)])
    with pytest.raises(InvalidInputError, match="a list of"):
        lz.warmup("attention", {"args": (q, k, v)})
    with pytest.raises(UnknownOperationError):
        lz.warmup("nope", [])
    assert lz.warmup("attention", []) == []


# ------------------------------------------------------------------------------------- validate_graph_capture
def test_validate_graph_capture_needs_cuda():
    q, k, v = qkv()
    with pytest.raises(CudaGraphUnsafeError, match="CUDA graphs need a CUDA device"):
        lz.validate_graph_capture(lambda a, b, c: lz.attention(a, b, c), q, k, v)


def test_validate_graph_capture_bad_options():
    with pytest.raises(InvalidInputError, match="warmup"):
        lz.validate_graph_capture(lambda a: a, torch.ones(2), warmup=-1)
    with pytest.raises(InvalidInputError, match="atol"):
        lz.validate_graph_capture(lambda a: a, torch.ones(2), atol=float("nan"))


def test_compare_tolerances():
    a = torch.tensor([1.0, 2.0, float("nan")])
    assert graphs._compare(a, a.clone(), None, None) == (0.0, None)
    err, msg = graphs._compare(a + torch.tensor([0.0, 1e-3, 0.0]), a, None, None)
    assert msg is not None and "exceeds" in msg and err == pytest.approx(1e-3, rel=1e-3)
    assert graphs._compare((a.half(),), (a.half() + 5e-4,), None, None)[1] is None
    assert graphs._compare(torch.tensor([1, 2]), torch.tensor([1, 3]), None, None)[1] is not None
    assert graphs._compare((a, a), (a,), None, None)[1] is not None


# ------------------------------------------------------------------------------------------ the Runtime guard
def _capture_builder(build_ctx):
    return lambda key: replace(build_ctx(key[1]), graph_capture=True)  # key[0]: a test-only prefix


@pytest.fixture
def really_capturing(monkeypatch):
    """Make the dispatcher believe a CUDA graph is being captured now (a miss then raises, unlike the same
    key's miss under ``lz.capture_selection()`` outside a capture, which selects)."""
    from layerzero.core import selection_runtime  # Runtime.resolve's module

    monkeypatch.setattr(selection_runtime, "capturing_now", lambda: True)


def test_resolve_miss_under_capture_raises(really_capturing):
    q, k, v = qkv()
    prepare, build_ctx = OPS["attention"]
    key, _ = prepare(q, k, v)
    with pytest.raises(CudaGraphUnsafeError, match=r"lz\.warmup"):
        RUNTIME.resolve(("capture-test", key), _capture_builder(build_ctx))


def test_resolve_miss_under_capture_allowed_by_config():
    q, k, v = qkv()
    prepare, build_ctx = OPS["attention"]
    key, _ = prepare(q, k, v)
    lz.configure(allow_selection_in_capture=True)
    plan = RUNTIME.resolve(("capture-test-2", key), _capture_builder(build_ctx))
    assert RUNTIME.registry.kernel(plan.kernel_id, "attention").graph_safe


def test_resolve_hit_under_capture_does_not_select():
    """A key already cached (as lz.warmup leaves it) is served without building a context."""
    q, k, v = qkv()
    prepare, build_ctx = OPS["attention"]
    key, _ = prepare(q, k, v)
    first = RUNTIME.resolve(key, build_ctx)

    def no_build(_key):
        raise AssertionError("a hit must not build a context")

    assert RUNTIME.resolve(key, no_build) is first


def test_config_option_is_typed():
    with pytest.raises(lz.ConfigurationError, match="allow_selection_in_capture"):
        lz.configure(allow_selection_in_capture="yes")
    assert lz.get_config().allow_selection_in_capture is False


def test_capture_key_for_every_op():
    """Every op's key is a NamedTuple with a ``capture`` field; capture_key flips only it and the context
    agrees."""
    q, k, v = qkv()
    x, w = torch.randn(2, 16), torch.ones(16)
    cache = lz.allocate_kv_cache(4, 4, 2, 8, dtype=torch.float32)
    tables, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 7], dtype=torch.int32)
    kv, slots = torch.randn(2, 2, 8), torch.tensor([5, 6])
    gate = torch.randn(3, 10)
    cos = sin = torch.randn(32, 8)
    calls = {
        "attention": ((q, k, v), {}),
        "rms_norm": ((x, w), {}),
        "layer_norm": ((x, w), {}),
        "sample_topk": ((torch.randn(2, 10), 3), {}),
        "sample_topp": ((torch.randn(2, 10), 0.9), {}),
        "rope": ((q, k, cos, sin), {}),
        "qk_norm_rope": ((q, k, torch.ones(16), torch.ones(16), cos, sin), {}),
        "swiglu": ((gate, gate), {}),
        "geglu": ((gate, gate), {"approximate": "tanh"}),
        "reglu": ((gate, gate), {}),
        "paged_attention": ((torch.randn(2, 4, 8), cache, tables, lens), {}),
        "reshape_and_cache": ((kv, kv, cache, slots), {}),
        "paged_attention_lse": ((torch.randn(2, 4, 8), cache, tables, lens), {}),
        "merge_attention_states": (
            (q3 := torch.randn(2, 4, 8), torch.randn(2, 4), q3, torch.randn(2, 4)),
            {},
        ),
        "sample": ((torch.randn(2, 10),), {"temperature": torch.ones(2), "seeds": torch.tensor([1, -1])}),
        "sample_greedy": ((torch.randn(2, 10),), {}),
        "apply_penalties": (
            (torch.randn(2, 10), slots[None].expand(2, -1), slots[None].expand(2, -1)),
            {"repetition_penalty": torch.ones(2)},
        ),
        "apply_token_bitmask": (
            (torch.randn(3, 40), torch.ones(2, 2, dtype=torch.int32), torch.tensor([2, 0])),
            {},
        ),
        "fused_moe": (
            (
                x,
                torch.randn(4, 6, 16),
                torch.randn(4, 16, 3),
                torch.ones(2, 2),
                torch.tensor([[0, 1], [2, 3]]),
            ),
            {},
        ),
        "quantize": ((x, "nvfp4"), {}),
        "dequantize": ((lz.quantize(x, "int8", axis=0),), {}),
        "embedding": ((torch.tensor([[1, 0, 3]]), torch.randn(5, 16)), {}),
        "linear_cross_entropy": ((x, torch.randn(7, 16), torch.tensor([1, 6])), {}),
        "linear": ((x, torch.randn(7, 16)), {}),
        "rms_norm_linear": ((x, w, torch.randn(7, 16)), {"residual": x}),
        "swiglu_linear": ((gate, gate, torch.randn(7, 10)), {}),
        "qk_norm_rope_cache": (
            (q3[:, :2], kv, kv, torch.ones(8), torch.ones(8), cos, sin, cache, slots),
            {"position_ids": slots},
        ),
        "rope_paged_attention": (
            (torch.randn(2, 4, 8), kv, kv, cos, sin, cache, slots, tables, lens),
            {"position_ids": slots},
        ),
        "quantized_linear": ((x, lz.quantize(torch.randn(7, 16), "int4", group_size=16)), {}),
        "fp8_linear": ((x, lz.quantize(torch.randn(7, 16), "fp8_e4m3", axis=0)), {}),
    }
    # the collectives' prepare needs a process group: tests/distributed/test_collectives.py checks their keys
    collectives = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert set(calls) | collectives == set(OPS), "add the new op here"
    for op, (args, kw) in calls.items():
        prepare, build_ctx = OPS[op]
        key, _ = prepare(*args, **kw)
        cap = capture_key(key)
        assert (
            cap is not None and cap != key and cap.capture is True and cap._replace(capture=False) == key
        ), op
        assert build_ctx(cap).graph_capture and not build_ctx(key).graph_capture
    assert capture_key(("attention", 1)) is None


# -------------------------------------------------------------------------- capture prepared by an eager call


@pytest.fixture
def capture_kernels():
    """Two custom CUDA rms_norm kernels: a faster non-graph-safe one (the eager pick) and a graph-safe one
    that draws from a generator passed in the args (to see that the warm-up run leaves random state alone)."""
    calls: list[str] = []

    def eager(x, weight, eps, residual):
        calls.append("eager")
        return x * 2

    def safe(x, weight, eps, residual):
        calls.append("safe")
        if isinstance(eps, torch.Generator):
            torch.rand(3, generator=eps)
        return x * 2

    lz.register_kernel(
        "rms_norm", "captest.eager", eager, priority=10_000, device_types={"cuda"}, graph_safe=False
    )
    lz.register_kernel(
        "rms_norm", "captest.safe", safe, priority=9_000, device_types={"cuda"}, graph_safe=True
    )
    yield calls
    for kid in ("captest.eager", "captest.safe"):
        lz.unregister_kernel(kid)


def _fake_cuda_call(tag: str):
    """A CPU rms_norm key made unique by its scope token, and a context builder that places it on a fake
    H100."""
    from layerzero.testing.devices import fake_cuda_device

    prepare, build_ctx = OPS["rms_norm"]
    x, w = torch.randn(2, 16), torch.ones(16)
    key, _ = prepare(x, w)
    key = key._replace(scope=(tag,))
    return key, (lambda k: replace(build_ctx(k), device=fake_cuda_device((9, 0)))), x, w


def test_first_eager_cuda_call_prepares_the_capture_choice(capture_kernels):
    """The standard PyTorch recipe needs no lz.warmup: the first eager call of a CUDA key also selects (and
    runs once) the graph-safe kernel a capture of the same inputs gets; later eager calls do neither."""
    key, build, x, w = _fake_cuda_call("prep-1")
    gen = torch.Generator().manual_seed(5)
    before = gen.get_state()
    out = RUNTIME.run(key, build, (x, w, gen, None))
    assert torch.equal(out, x * 2)
    assert capture_kernels == ["eager", "safe"]
    cap = RUNTIME.cache.get(capture_key(key))
    assert cap is not None and cap.kernel_id == "captest.safe"
    assert torch.equal(gen.get_state(), before), (
        "the warm-up run of the capture kernel consumed random numbers"
    )
    RUNTIME.run(key, build, (x, w, 1e-6, None))
    assert capture_kernels == ["eager", "safe", "eager"]

    # under capture the prepared plan is a cache hit: no selection (a builder that raises proves it)
    def no_build(_key):
        raise AssertionError("selection ran under capture")

    assert RUNTIME.run(capture_key(key), no_build, (x, w, 1e-6, None)) is not None
    assert capture_kernels[-1] == "safe"


def test_capture_choice_is_not_rerun_when_the_eager_kernel_is_graph_safe(capture_kernels):
    key, build, x, w = _fake_cuda_call("prep-2")
    lz.lock("rms_norm", "captest.safe")
    try:
        RUNTIME.run(key, build, (x, w, 1e-6, None))
    finally:
        lz.unlock("rms_norm")
    assert capture_kernels == ["safe"]


def test_capture_miss_error_says_an_eager_call_prepares_it(really_capturing):
    key, build, x, w = _fake_cuda_call("prep-3")
    with pytest.raises(CudaGraphUnsafeError, match="first eager call prepares"):
        RUNTIME.resolve(capture_key(key), build)


def test_cpu_calls_prepare_no_capture_entry():
    prepare, build_ctx = OPS["rms_norm"]
    x, w = torch.randn(2, 16), torch.ones(16)
    key, args = prepare(x, w)
    key = key._replace(scope=("prep-cpu",))
    RUNTIME.run(key, build_ctx, args)
    assert RUNTIME.cache.get(capture_key(key)) is None


def test_preparing_the_capture_choice_logs_no_fallback(capture_kernels, caplog):
    """Under lz.prefer of a kernel that is not graph-safe, the eager call serves it; the capture-time choice
    prepared next to it falls back to a graph-safe kernel, which is only a WARNING when a capture really
    asks."""
    key, build, x, w = _fake_cuda_call("prep-quiet")
    with lz.prefer("captest.eager"):
        key = key._replace(scope=("prep-quiet", *key.scope))
        RUNTIME.run(key, build, (x, w, 1e-6, None))
    assert RUNTIME.cache.get(capture_key(key)).kernel_id == "captest.safe"
    assert "fallback" not in caplog.text


def test_causal_attention_prepares_the_masked_capture_variant():
    """A tracer such as transformers materializes the causal mask while capturing; preparing the capture
    choice of an unmasked causal call also prepares that bool-mask variant (selection only), on a fake
    H100."""
    import importlib

    from layerzero.testing.devices import fake_cuda_device

    att = importlib.import_module("layerzero.ops.attention")
    q = torch.randn(2, 4, 16, 32, dtype=torch.bfloat16)
    key, _ = att.prepare(q, q[:, :2], q[:, :2], is_causal=True)
    key = key._replace(scope=("variant-test",))
    (variant,) = att.capture_variants(capture_key(key))
    assert variant.capture and variant.mask.value == "bool" and not variant.is_causal
    assert variant._replace(mask=key.mask, is_causal=True, capture=False) == key
    assert att.capture_variants(key._replace(is_causal=False)) == ()

    def build(k):
        return replace(att.context(k), device=fake_cuda_device((9, 0)))

    RUNTIME._prepare_variants(capture_key(key), build)
    plan = RUNTIME.cache.get(variant)
    assert plan is not None and RUNTIME.registry.kernel(plan.kernel_id, "attention").graph_safe
    assert "bool" in {m.value for m in RUNTIME.registry.kernel(plan.kernel_id, "attention").mask_kinds}
