"""The dispatch hot path: plain-tuple keys (equal to the ops' NamedTuple keys), the exact keys of
``lz.attention`` (``Runtime.run_hot``: a hit skips the shape checks) and the rms_norm kernel specialized per
hidden size. Every check still runs for inputs that could fail it, and a hit serves the same plan, trace
count, scope and fallback behaviour as the full path. No timings here (benchmarks/bench_dispatch.py)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import layerzero as lz
from layerzero.core.dispatch import MISS
from layerzero.core.errors import InvalidInputError
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import BackendSpec, KernelSpec, Layout

pytestmark = pytest.mark.unit

A = importlib.import_module("layerzero.ops.attention")
N = importlib.import_module("layerzero.ops.norms")


def _qkv(shape=(1, 4, 8, 16), dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=g, dtype=dtype) for _ in range(3))


def _exact_keys():
    return [key for key in RUNTIME.cache.hot if any(isinstance(f, torch.Size) for f in key)]


def test_plain_tuple_keys_equal_the_named_keys():
    q, k, v = _qkv()
    plain, _ = A._prepare(q, k, v, None, True, None, 0.0, "BHSD")
    named, _ = A.prepare(q, k, v, is_causal=True)
    assert type(plain) is tuple and type(named) is A.AttentionKey
    assert plain == named and hash(plain) == hash(named)
    x, w = torch.randn(3, 16), torch.ones(16)
    plain, _ = N._prepare_rms(x, w, 1e-6, None)
    named, _ = N.prepare_rms(x, w)
    assert type(plain) is tuple and type(named) is N.NormKey and plain == named and hash(plain) == hash(named)


def test_the_sharded_cache_holds_named_keys():
    RUNTIME.ensure_ready()
    q, k, v = _qkv()
    lz.attention(q, k, v)
    lz.rms_norm(torch.randn(2, 16), torch.ones(16))
    named, _ = A.prepare(q, k, v)
    stored = [key for shard in RUNTIME.cache._maps for key in shard]
    assert any(type(key) is A.AttentionKey and key == named for key in stored)
    ours = [key for key in stored if isinstance(key, tuple) and key and key[0] in ("attention", "rms_norm")]
    assert ours and all(type(key) is not tuple for key in ours)
    assert RUNTIME.named_key(("no_such_op", 1)) == ("no_such_op", 1)


def test_internal_entry_points_name_a_plain_tuple_key():
    """Under torch.compile, TorchDynamo can resume a frame with an op's NamedTuple key rebuilt as a plain
    tuple (seen on CUDA: it reached the attention context builder, which reads fields by name). resolve, the
    autotune hook and prepare_capture name the key again, so selecting from the plain form works and caches
    under the named key."""
    RUNTIME.ensure_ready()
    q, k, v = _qkv((1, 2, 5, 8))
    plain, args = A._prepare(q, k, v, None, False, None, 0.0, "BHSD")
    assert type(plain) is tuple
    RUNTIME.cache.invalidate()
    plan = RUNTIME.resolve(plain, A.context)
    assert plan.kernel_id == lz.which("attention", q, k, v)
    stored = [key for shard in RUNTIME.cache._maps for key in shard if key == plain]
    assert stored and all(type(key) is A.AttentionKey for key in stored)
    assert RUNTIME.prepare_capture(plain, A.context, args) is None  # a CPU key has no capture-time choice


def test_first_run_after_which_prepares_the_capture_time_choice(monkeypatch):
    """lz.which / lz.select cache the eager plan without running it; the first real call then hits the cache,
    and it (not only a miss) must prepare the capture-time choice, or a CUDA graph captured after ``lz.which``
    and one eager call raises CudaGraphUnsafeError (seen on an H200 with lz.qk_norm_rope). Once: later calls
    take the hot path."""
    RUNTIME.ensure_ready()
    RUNTIME.cache.invalidate()
    seen = []
    real = RUNTIME.prepare_capture
    monkeypatch.setattr(
        RUNTIME, "prepare_capture", lambda key, *a, **kw: seen.append(key.op) or real(key, *a, **kw)
    )
    q, k = _qkv((1, 2, 5, 8))[:2]
    cos = torch.randn(5, 8)
    assert lz.which("rope", q, k, cos, cos) == "torch_native.rope"
    assert seen == []
    for _ in range(3):
        lz.rope(q, k, cos, cos)
    assert seen == ["rope"]


def test_attention_files_an_exact_key_and_serves_it():
    q, k, v = _qkv()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for _ in range(3):
        torch.testing.assert_close(lz.attention(q, k, v, is_causal=True), want)
    (key,) = _exact_keys()
    assert key[3] == q.shape and key[6] == "BHSD"
    args = (q, k, v, None, True, None, 0.0)
    torch.testing.assert_close(RUNTIME.run_hot(key, args), want)
    assert RUNTIME.run_hot(("attention", "absent"), args) is MISS


def test_layout_enum_and_string_share_the_exact_key():
    q, k, v = (t.transpose(1, 2).contiguous() for t in _qkv())
    for layout in ("BSHD", Layout.BSHD, "BSHD"):
        lz.attention(q, k, v, layout=layout)
    assert len(_exact_keys()) == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"k": "float64"},
        {"v": "shape"},
        {"is_causal": 1},
        {"dropout_p": 1.5},
        {"layout": "bhsd"},
        {"attn_mask": "int"},
        {"scale": -1.0},
        {"window": (1.5, 0)},
        {"softcap": 0.0},
        {"q": "list"},
        {"all": "int32"},
        {"layout": "BSHD"},
        {"is_causal": None},
    ],
)
def test_warm_shapes_never_skip_a_check(bad):
    """After good calls of the same shapes filed an exact key, each bad input still raises the typed error."""
    q, k, v = _qkv()
    if bad.get("layout") == "BSHD":  # valid as BHSD (GQA 4/2), not as BSHD (Hq=6, Hkv=10)
        q, k, v = q[:, :, :6], *_qkv((1, 2, 10, 16))[1:]
    for _ in range(3):
        lz.attention(q, k, v)
    assert _exact_keys()
    kwargs = {}
    if bad.get("k") == "float64":
        k = k.double()
    elif bad.get("v") == "shape":
        v = v[:, :, :4]
    elif bad.get("attn_mask") == "int":
        kwargs["attn_mask"] = torch.ones(8, 8, dtype=torch.int32)
    elif bad.get("q") == "list":
        q = q.tolist()
    elif bad.get("all") == "int32":
        q, k, v = (t.to(torch.int32) for t in (q, k, v))
    else:
        kwargs.update(bad)
    with pytest.raises(InvalidInputError):
        lz.attention(q, k, v, **kwargs)


def test_hot_calls_are_traced_and_follow_the_scope():
    q, k, v = _qkv()
    for _ in range(3):
        lz.attention(q, k, v)
    default = lz.which("attention", q, k, v)
    with lz.trace() as t:
        lz.attention(q, k, v)
        lz.attention(q, k, v)
    assert t.counts[("attention", default)] == 2
    other = "reference.attention"
    with lz.prefer(other):
        for _ in range(3):
            with lz.trace() as t:
                lz.attention(q, k, v)
            assert t.kernels_for("attention") == [other]
    with lz.trace() as t:
        lz.attention(q, k, v)
    assert t.kernels_for("attention") == [default]


def _failing_backend(op: str, kernel_id: str, calls: list[int]) -> None:
    def boom(*args):
        calls.append(1)
        raise RuntimeError("simulated kernel crash")

    RUNTIME.registry.add_backend(
        BackendSpec(kernel_id.split(".")[0], None, "0.0", True, description="test"), replace=True
    )
    RUNTIME.registry.add_kernel(
        KernelSpec(
            kernel_id, op, boom, priority=1000, device_types=frozenset({"cpu"}), description="always raises"
        )
    )


def test_a_kernel_failing_on_the_hot_path_falls_back():
    RUNTIME.ensure_ready()
    calls: list[int] = []
    _failing_backend("attention", "lzhot.attention", calls)
    try:
        q, k, v = _qkv(dtype=torch.float64)
        want = F.scaled_dot_product_attention(q, k, v)
        threshold = RUNTIME.health.failure_threshold
        for _ in range(max(threshold - 1, 1)):
            with lz.trace() as t:
                torch.testing.assert_close(lz.attention(q, k, v), want)
            assert [f[1] for f in t.fallbacks] == ["lzhot.attention"]
        assert len(calls) == max(threshold - 1, 1)
    finally:
        RUNTIME.registry.remove_kernel("lzhot.attention")
        RUNTIME.registry.backends.remove("lzhot")
        RUNTIME.health.reset()


def test_rms_norm_specialized_kernel_matches_and_residual_keeps_the_generic_one():
    x, w, r = torch.randn(3, 16), torch.rand(16) + 0.5, torch.randn(3, 16)
    for _ in range(3):
        torch.testing.assert_close(lz.rms_norm(x, w), F.rms_norm(x, (16,), w, 1e-6))
    plan = lz.select("rms_norm", x, w)
    if plan.kernel_id == "torch_native.rms_norm":
        assert plan.call.__name__ == "rms_norm"
        torch.testing.assert_close(plan(x, w, 1e-6, None), F.rms_norm(x, (16,), w, 1e-6))
    out, h = lz.rms_norm(x, w, residual=r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(out, F.rms_norm(x + r, (16,), w, 1e-6))
    with pytest.raises(InvalidInputError):
        lz.rms_norm(torch.tensor(1.0), torch.tensor(1.0))


# ---------------------------------------------------------------- the inlined hit path (core/observers.py)


@pytest.mark.parametrize("op", ["attention", "rms_norm", "linear", "swiglu", "qk_norm_rope"])
def test_a_kernel_failing_on_the_inlined_hit_path_falls_back(op):
    """No trace, no telemetry: from the third call the op calls the hot plan itself (the first selects, the
    second files the hot keys); a failure there still retries on the next kernel (the right result), and a
    locked plan raises KernelExecutionError, as Runtime.run_hot does."""
    from layerzero.core.observers import OBSERVERS

    RUNTIME.ensure_ready()
    calls: list[int] = []
    kid = f"lzhot2.{op}"
    _failing_backend(op, kid, calls)
    try:
        if op == "attention":
            q, k, v = _qkv((1, 2, 5, 8), dtype=torch.float64)
            call, want = (lambda: lz.attention(q, k, v)), F.scaled_dot_product_attention(q, k, v)
        elif op == "rms_norm":
            x, w = torch.randn(3, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64) + 0.5
            call, want = (lambda: lz.rms_norm(x, w)), F.rms_norm(x, (8,), w, 1e-6)
        elif op == "linear":
            x, w = torch.randn(3, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
            call, want = (lambda: lz.linear(x, w)), x @ w.T
        elif op == "swiglu":
            gate, up = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
            call, want = (lambda: lz.swiglu(gate, up)), F.silu(gate) * up
        else:  # per-head RMSNorm, then the half rotation at each token's position, written out (float64)
            q, k = torch.randn(1, 3, 2, 8, dtype=torch.float64), torch.randn(1, 3, 1, 8, dtype=torch.float64)
            w, cos, sin = (
                torch.rand(8, dtype=torch.float64) + 0.5,
                torch.randn(16, 8, dtype=torch.float64),
                torch.randn(16, 8, dtype=torch.float64),
            )
            pos = torch.tensor([[0, 5, 9]])
            qn = F.rms_norm(q, (8,), w, 1e-6)
            want = (
                qn * cos[pos][:, :, None] + torch.cat((-qn[..., 4:], qn[..., :4]), -1) * sin[pos][:, :, None]
            )
            call = lambda: lz.qk_norm_rope(q, k, w, w, cos, sin, position_ids=pos, layout="BSHD")[0]  # noqa: E731
        assert OBSERVERS.none
        for _ in range(2):
            torch.testing.assert_close(call(), want)
        assert any(
            plan.kernel_id == kid for plan in RUNTIME.cache.hot.values()
        )  # the next call takes the hit path
        torch.testing.assert_close(call(), want)
        assert len(calls) == 3  # every call reached the failing plan first, then fell back
        RUNTIME.health.reset()
        lz.lock(op, kid)
        for i in range(3):
            if i == 2:
                assert any(plan.kernel_id == kid and plan.locked for plan in RUNTIME.cache.hot.values())
            with pytest.raises(lz.KernelExecutionError, match="simulated kernel crash"):
                call()
        lz.unlock(op)
    finally:
        RUNTIME.registry.remove_kernel(kid)
        RUNTIME.registry.backends.remove(kid.split(".")[0])
        RUNTIME.health.reset()


def test_observers_close_the_inlined_path_while_they_watch():
    import layerzero.telemetry as lzt
    from layerzero.core.observers import OBSERVERS

    assert OBSERVERS.none and OBSERVERS.count == 0
    with lz.trace():
        assert not OBSERVERS.none
        with lz.trace():
            assert OBSERVERS.count == 2
        assert OBSERVERS.count == 1
    assert OBSERVERS.none
    lzt.enable()
    try:
        assert not OBSERVERS.none
        lzt.enable()  # already on: counted once
        assert OBSERVERS.count == 1
    finally:
        lzt.disable()
    lzt.disable()
    assert OBSERVERS.none and OBSERVERS.count == 0
    with pytest.raises(RuntimeError, match="without a matching enter"):
        OBSERVERS.leave()


def test_warm_calls_are_counted_by_telemetry_and_recorded_by_a_dry_run():
    """Calls that hit the hot dict (exact attention key, rms_norm key) are still seen by every observer:
    telemetry counts them and a dry run records them instead of running a kernel (neither may be bypassed)."""
    import layerzero.telemetry as lzt
    from layerzero.core.telemetry import TELEMETRY

    q, k, v = _qkv()
    x, w = torch.randn(3, 16), torch.ones(16)
    for _ in range(3):
        lz.attention(q, k, v)
        lz.rms_norm(x, w)
    lzt.enable()
    try:
        TELEMETRY.reset()
        lz.attention(q, k, v)
        lz.rms_norm(x, w)
        assert sum(TELEMETRY.calls.values()) == 2
    finally:
        lzt.disable()
    ran: list[int] = []

    def model():
        ran.append(1)
        return lz.attention(q, k, v).sum() + lz.rms_norm(x, w).sum()

    report = lz.dry_run(model)
    assert [r.op for r in report.rows] == ["attention", "rms_norm"] and not any(r.ran for r in report.rows)


@pytest.mark.parametrize(
    "case", ["plain", "residual", "strided_x", "strided_weight", "strided_residual", "grad"]
)
def test_rms_fast_key_equals_the_full_checks_key(case):
    """The fast path's plain-tuple key (with and without a residual) equals the key the full checks build
    (``_key`` through ``flags``): a strided weight or residual is not filed as ``stride_last_1``."""
    g = torch.Generator().manual_seed(1)
    x, w, r = torch.randn(3, 16, generator=g), torch.rand(16, generator=g) + 0.5, None
    if case in ("residual", "strided_residual", "grad"):
        r = torch.randn(3, 16, generator=g)
    if case == "strided_x":
        x = torch.randn(3, 32, generator=g)[:, ::2]
    if case == "strided_weight":
        w = torch.rand(32, generator=g)[::2]
    if case == "strided_residual":
        r = torch.randn(3, 32, generator=g)[:, ::2]
    if case == "grad":
        w.requires_grad_(True)
    fast, args = N._prepare_rms(x, w, 1e-6, r)
    full = N._key("rms_norm", x, w, r is not None, r)
    assert type(fast) is tuple and fast == full and hash(fast) == hash(full)
    assert args == (x, w, 1e-6, r)
    assert fast[6] is (case not in ("strided_x", "strided_weight", "strided_residual"))
    out = lz.rms_norm(x, w, residual=r)
    want = F.rms_norm(x if r is None else x + r, (16,), w, 1e-6)
    torch.testing.assert_close(out if r is None else out[0], want)


def _rms_exact_keys():
    return [key for key in _exact_keys() if key[0] == "rms_norm"]


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_files_an_exact_key_and_serves_it(residual):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 5, 16, generator=g), torch.rand(16, generator=g) + 0.5
    r = torch.randn(3, 5, 16, generator=g) if residual else None
    want = F.rms_norm(x if r is None else x + r, (16,), w, 1e-5)
    for _ in range(3):
        out = lz.rms_norm(x, w, 1e-5, residual=r)
        torch.testing.assert_close(out if r is None else out[0], want)
    (key,) = _rms_exact_keys()
    assert key[4] == x.shape and key[5] == w.shape and key[6] == 1e-5
    hit = RUNTIME.run_hot(key, (x, w, 1e-5, r))
    torch.testing.assert_close(hit if r is None else hit[0], want)
    lz.rms_norm(x, w, 1e-6, residual=r)  # another eps: another exact key (the value passed its own check)
    lz.rms_norm(x, w, 1e-6, residual=r)
    assert len(_rms_exact_keys()) == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"eps": 0.0},
        {"eps": -1e-6},
        {"eps": float("nan")},
        {"eps": float("inf")},
        {"eps": True},
        {"w": "long"},
        {"w": "int"},
        {"w": "list"},
        {"x": "int"},
        {"x": "0-dim"},
        {"r": "shape"},
        {"r": "dtype"},
        {"r": "list"},
    ],
)
def test_rms_norm_warm_shapes_never_skip_a_check(bad):
    """After good calls (with and without a residual) filed exact keys, each bad input still raises the typed
    error."""
    x, w, r = torch.randn(4, 8), torch.rand(8) + 0.5, torch.randn(4, 8)
    for _ in range(3):
        lz.rms_norm(x, w)
        lz.rms_norm(x, w, residual=r)
    assert len(_rms_exact_keys()) == 2
    eps, residual = bad.get("eps", 1e-6), (r if "r" in bad else None)
    if bad.get("w") == "long":
        w = torch.rand(9)
    elif bad.get("w") == "int":
        w = torch.ones(8, dtype=torch.int32)
    elif bad.get("w") == "list":
        w = w.tolist()
    elif bad.get("x") == "int":
        x = x.to(torch.int64)
    elif bad.get("x") == "0-dim":
        x = torch.tensor(1.0)
    elif bad.get("r") == "shape":
        residual = r[:3]
    elif bad.get("r") == "dtype":
        residual = r.double()
    elif bad.get("r") == "list":
        residual = r.tolist()
    with pytest.raises(InvalidInputError):
        lz.rms_norm(x, w, eps, residual=residual)


def test_rms_norm_exact_key_tells_strides_apart():
    """Two non-contiguous x of one shape, one with a unit last stride and one without: different exact keys,
    so the second never gets the plan chosen for the first (kernels may require stride_last_1)."""
    base = torch.randn(4, 32)
    rows, cols = base[:, :16], base[:, ::2]  # both [4, 16] non-contiguous; stride(-1) 1 and 2
    w = torch.rand(16) + 0.5
    for t in (rows, cols):
        for _ in range(2):
            torch.testing.assert_close(lz.rms_norm(t, w), F.rms_norm(t, (16,), w, 1e-6))
    keys = _rms_exact_keys()
    assert len(keys) == 2 and {k[8] for k in keys} == {True, False}


# ---------------------------------------------------------------- lz.rope's exact key
def _rope_inputs(form: str):
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    f = torch.randn(12, 8, generator=g)
    cos, sin = torch.cat((f.cos(), f.cos()), -1), torch.cat((f.sin(), f.sin()), -1)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    if form == "gathered":
        return q, k, cos[pos], sin[pos], None
    return q, k, cos, sin, (pos if form == "indexed" else None)


@pytest.mark.parametrize("form", ["table", "indexed", "gathered"])
def test_rope_files_an_exact_key_and_serves_it(form):
    q, k, cos, sin, pos = _rope_inputs(form)
    with lz.disabled():
        want = lz.rope(q, k, cos, sin, position_ids=pos)
    for _ in range(3):
        for got, ref in zip(lz.rope(q, k, cos, sin, position_ids=pos), want, strict=True):
            torch.testing.assert_close(got, ref)
    keys = [key for key in _exact_keys() if key[0] == "rope"]
    assert len(keys) == 1 and keys[0][6] == q.shape and keys[0][8] == cos.shape
    assert (keys[0][10] is None) is (pos is None)


@pytest.mark.parametrize(
    "bad",
    [
        "pos_high",
        "pos_negative",
        "pos_with_gathered",
        "layout",
        "interleaved_int",
        "k_seq",
        "sin_shape",
        "pos_dtype",
    ],
)
def test_rope_warm_shapes_never_skip_a_check(bad):
    """After good calls filed exact keys, each bad input still raises the typed error; position values (which
    change per call) are checked on every hit of a CPU call."""
    q, k, cos, sin, pos = _rope_inputs("indexed")
    for _ in range(3):
        lz.rope(q, k, cos, sin, position_ids=pos)
        lz.rope(q, k, cos[pos], sin[pos])
    kwargs: dict = {"position_ids": pos}
    if bad == "pos_high":
        kwargs["position_ids"] = pos + 1  # 12 is past the 12-row table: same exact key as the warm call
    elif bad == "pos_negative":
        kwargs["position_ids"] = pos - 1
    elif bad == "pos_with_gathered":
        cos, sin = cos[pos], sin[pos]
    elif bad == "layout":
        kwargs["layout"] = "bhsd"
    elif bad == "interleaved_int":
        kwargs["interleaved"] = 1
    elif bad == "k_seq":
        k = k[:, :, :4]
    elif bad == "sin_shape":
        sin = sin[:, :6]
    elif bad == "pos_dtype":
        kwargs["position_ids"] = pos.float()
    with pytest.raises(InvalidInputError):
        lz.rope(q, k, cos, sin, **kwargs)


def test_qk_norm_rope_exact_key_keeps_every_check():
    """``lz.qk_norm_rope``'s exact key (rope's, plus both weights and eps): after warm calls, a weight of
    another width or dtype, a non-finite eps, a position outside the table (CPU: values checked per call) and
    another k are still refused; a strided q (same shape) computes what the full path computes."""
    q, k = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8)
    w, cos, sin = torch.rand(8) + 0.5, torch.randn(16, 8), torch.randn(16, 8)
    pos = torch.tensor([[0, 3, 7, 2, 15]])
    call = lz.qk_norm_rope
    want = call(q, k, w, w, cos, sin, eps=1e-6, position_ids=pos, layout="BSHD")
    call(q, k, w, w, cos, sin, eps=1e-6, position_ids=pos, layout="BSHD")
    for bad in (
        lambda: call(q, k, w[:4], w, cos, sin, eps=1e-6, position_ids=pos, layout="BSHD"),
        lambda: call(q, k, w, w.double(), cos, sin, eps=1e-6, position_ids=pos, layout="BSHD"),
        lambda: call(q, k, w, w, cos, sin, eps=float("inf"), position_ids=pos, layout="BSHD"),
        lambda: call(q, k, w, w, cos, sin, eps=1e-6, position_ids=pos + 1, layout="BSHD"),
        lambda: call(q, k[:, :4], w, w, cos, sin, eps=1e-6, position_ids=pos, layout="BSHD"),
    ):
        with pytest.raises(lz.InvalidInputError):
            bad()
    qs = torch.randn(1, 4, 5, 8).transpose(1, 2)
    qs.copy_(q)
    got = call(qs, k, w, w, cos, sin, eps=1e-6, position_ids=pos, layout="BSHD")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
