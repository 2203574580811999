"""Bad input across every op and the configuration API: each case must raise a *typed* LayerZero error
(which is also a ValueError or RuntimeError) whose message names what failed; nothing may escape as a bare
torch RuntimeError / IndexError / TypeError / AssertionError. Runs under ``python -O`` too (no assert-based
validation in src/).

The "meta" device supplies a second device on a CPU-only machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.unit

E = lz.InvalidInputError


def t(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.ones(*shape, dtype=dtype, device=device)


Q = t(1, 2, 4, 8)  # [B=1, H=2, S=4, D=8]
X = t(2, 8)  # [rows=2, H=8]
W = t(8)
COS = t(16, 8)  # rope table [max_pos=16, R=8]
LOGITS = t(2, 5)  # [B=2, V=5]


def _attn(**kw: Any) -> Callable[[], Any]:
    q = kw.pop("q", Q)
    k = kw.pop("k", Q)
    v = kw.pop("v", Q)
    return lambda: lz.attention(q, k, v, **kw)


def _rope(q=Q, k=Q, cos=COS, sin=COS, **kw: Any) -> Callable[[], Any]:
    return lambda: lz.rope(q, k, cos, sin, **kw)


def _qknr(q=Q, k=Q, qw=W, kw=W, cos=COS, sin=COS, **extra: Any) -> Callable[[], Any]:
    return lambda: lz.qk_norm_rope(q, k, qw, kw, cos, sin, **extra)


def _write(tmp_path, text: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    return path


CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    # ---- attention
    ("attn-rank-3", _attn(q=t(2, 4, 8)), E, r"lz\.attention: q rank: expected 4 dims, got 3 dims"),
    ("attn-rank-5", _attn(k=t(1, 1, 2, 4, 8)), E, r"k rank: expected 4 dims, got 5"),
    ("attn-not-tensor", lambda: lz.attention([[1.0]], Q, Q), E, r"q: expected a torch\.Tensor, got list"),
    (
        "attn-mixed-dtypes",
        _attn(k=t(1, 2, 4, 8, dtype=torch.float64)),
        E,
        r"k\.dtype: expected torch\.float32",
    ),
    ("attn-mixed-devices", _attn(v=t(1, 2, 4, 8, device="meta")), E, r"v\.device: expected cpu.*got meta"),
    (
        "attn-int-tensors",
        _attn(q=t(1, 2, 4, 8, dtype=torch.int64)),
        E,
        r"q\.dtype: expected one of float32/float64/float16/bfloat16, got torch\.int64",
    ),
    ("attn-bool-tensors", _attn(q=t(1, 2, 4, 8, dtype=torch.bool)), E, r"q\.dtype: expected one of float32"),
    (
        "attn-gqa-ratio",
        _attn(q=t(1, 3, 4, 8), k=t(1, 2, 4, 8), v=t(1, 2, 4, 8)),
        E,
        r"heads: expected Hq divisible by Hkv.*Hq=3, Hkv=2",
    ),
    (
        "attn-head-dim-qk",
        _attn(k=t(1, 2, 4, 16)),
        E,
        r"head_dim of k: expected equal to q's head_dim 8, got 16",
    ),
    (
        "attn-kv-seq",
        _attn(k=t(1, 2, 5, 8)),
        E,
        r"k/v shapes: expected k and v with the same heads and sequence",
    ),
    ("attn-kv-heads", _attn(v=t(1, 1, 4, 8)), E, r"k/v shapes"),
    (
        "attn-batch",
        _attn(k=t(2, 2, 4, 8), v=t(2, 2, 4, 8)),
        E,
        r"batch size: expected equal in q, k, v \(1\)",
    ),
    ("attn-layout-lower", _attn(layout="bhsd"), E, r"layout: expected 'BHSD'.*got 'bhsd'"),
    ("attn-layout-none", _attn(layout=None), E, r"layout: expected 'BHSD'"),
    ("attn-layout-list", _attn(layout=["BHSD"]), E, r"layout: expected 'BHSD'.*got \['BHSD'\]"),
    (
        "attn-mask-int",
        _attn(attn_mask=t(4, 4, dtype=torch.int32)),
        E,
        r"attn_mask\.dtype: expected torch\.bool or the query dtype",
    ),
    ("attn-mask-float64", _attn(attn_mask=t(4, 4, dtype=torch.float64)), E, r"attn_mask\.dtype"),
    (
        "attn-mask-shape",
        _attn(attn_mask=t(3, 4, dtype=torch.bool)),
        E,
        r"attn_mask shape: expected broadcastable to \[B, Hq, Sq, Sk\] = \[1, 2, 4, 4\], got \[3, 4\]",
    ),
    ("attn-mask-rank-5", _attn(attn_mask=t(1, 1, 1, 4, 4, dtype=torch.bool)), E, r"attn_mask shape"),
    ("attn-mask-0d", _attn(attn_mask=torch.tensor(True)), E, r"attn_mask shape"),
    (
        "attn-mask-device",
        _attn(attn_mask=t(4, 4, dtype=torch.bool, device="meta")),
        E,
        r"attn_mask\.device: expected cpu, got meta",
    ),
    ("attn-mask-not-tensor", _attn(attn_mask=[[True]]), E, r"attn_mask: expected a torch\.Tensor or None"),
    ("attn-dropout-1", _attn(dropout_p=1.0), E, r"dropout_p: expected a float in \[0, 1\), got 1\.0"),
    ("attn-dropout-neg", _attn(dropout_p=-0.1), E, r"dropout_p: expected a float in \[0, 1\), got -0\.1"),
    ("attn-dropout-bool", _attn(dropout_p=True), E, r"dropout_p: expected a float in \[0, 1\), got True"),
    ("attn-dropout-nan", _attn(dropout_p=math.nan), E, r"dropout_p: expected a float in \[0, 1\), got nan"),
    ("attn-scale-0", _attn(scale=0.0), E, r"scale: expected None or a finite float > 0, got 0\.0"),
    ("attn-scale-nan", _attn(scale=math.nan), E, r"scale: expected None or a finite float > 0, got nan"),
    ("attn-scale-neg", _attn(scale=-1), E, r"scale: expected None or a finite float > 0, got -1"),
    ("attn-scale-str", _attn(scale="0.5"), E, r"scale: expected None or a finite float > 0"),
    ("attn-causal-str", _attn(is_causal="yes"), E, r"is_causal: expected a bool, got 'yes'"),
    ("attn-causal-int", _attn(is_causal=1), E, r"is_causal: expected a bool, got 1"),
    (
        "attn-empty-seq",
        _attn(q=t(1, 2, 0, 8), k=t(1, 2, 0, 8), v=t(1, 2, 0, 8)),
        E,
        r"sizes: expected non-empty batch, sequences and head dims",
    ),
    (
        "attn-empty-batch",
        _attn(q=t(0, 2, 4, 8), k=t(0, 2, 4, 8), v=t(0, 2, 4, 8)),
        E,
        r"sizes: expected non-empty",
    ),
    (
        "attn-zero-kv-heads",
        _attn(k=t(1, 0, 4, 8), v=t(1, 0, 4, 8)),
        E,
        r"heads: expected Hq divisible by Hkv",
    ),
    # ---- rms_norm / layer_norm
    (
        "rms-weight-shape",
        lambda: lz.rms_norm(X, t(4)),
        E,
        r"lz\.rms_norm: weight shape: expected \[H\] with H = "
        r"x\.shape\[-1\] = 8, got \[4\]",
    ),
    ("rms-weight-rank", lambda: lz.rms_norm(X, t(1, 8)), E, r"weight rank: expected 1 dims, got 2 dims"),
    ("rms-x-0d", lambda: lz.rms_norm(torch.tensor(1.0), W), E, r"x rank: expected >= 1 dims"),
    (
        "rms-x-int",
        lambda: lz.rms_norm(t(2, 8, dtype=torch.int32), W),
        E,
        r"x\.dtype: expected one of float32",
    ),
    ("rms-weight-device", lambda: lz.rms_norm(X, t(8, device="meta")), E, r"weight\.device: expected cpu"),
    (
        "rms-residual-shape",
        lambda: lz.rms_norm(X, W, residual=t(3, 8)),
        E,
        r"residual shape: expected x's shape \[2, 8\], got \[3, 8\]",
    ),
    (
        "rms-residual-dtype",
        lambda: lz.rms_norm(X, W, residual=t(2, 8, dtype=torch.float16)),
        E,
        r"residual\.dtype: expected torch\.float32",
    ),
    ("rms-eps-0", lambda: lz.rms_norm(X, W, 0.0), E, r"eps: expected a finite float > 0, got 0\.0"),
    ("rms-eps-nan", lambda: lz.rms_norm(X, W, math.nan), E, r"eps: expected a finite float > 0, got nan"),
    ("rms-eps-str", lambda: lz.rms_norm(X, W, "x"), E, r"eps: expected a finite float > 0, got 'x'"),
    ("rms-eps-bool", lambda: lz.rms_norm(X, W, True), E, r"eps: expected a finite float > 0, got True"),
    (
        "ln-bias-shape",
        lambda: lz.layer_norm(X, W, t(7)),
        E,
        r"lz\.layer_norm: bias shape: expected \[H\].*got \[7\]",
    ),
    ("ln-weight-shape", lambda: lz.layer_norm(X, t(9)), E, r"weight shape: expected \[H\]"),
    ("ln-bias-device", lambda: lz.layer_norm(X, W, t(8, device="meta")), E, r"bias\.device: expected cpu"),
    ("ln-eps-neg", lambda: lz.layer_norm(X, W, None, -1e-5), E, r"eps: expected a finite float > 0"),
    (
        "ln-eps-inf",
        lambda: lz.layer_norm(X, W, None, math.inf),
        E,
        r"eps: expected a finite float > 0, got inf",
    ),
    # ---- rope
    (
        "rope-odd-rotary",
        _rope(cos=t(16, 7), sin=t(16, 7)),
        E,
        r"rotary dim \(cos\.shape\[-1\]\): expected an even number in 2\.\.8 \(head_dim\), got 7",
    ),
    ("rope-rotary-too-big", _rope(cos=t(16, 10), sin=t(16, 10)), E, r"rotary dim.*got 10"),
    (
        "rope-cos-sin-shape",
        _rope(sin=t(16, 6)),
        E,
        r"sin shape: expected cos's shape \[16, 8\], got \[16, 6\]",
    ),
    ("rope-cos-rank", _rope(cos=t(8), sin=t(8)), E, r"cos rank: expected \(2, 3\) dims, got 1 dims"),
    ("rope-q-rank", _rope(q=t(2, 4, 8)), E, r"lz\.rope: q rank: expected 4 dims"),
    ("rope-k-shape", _rope(k=t(1, 2, 5, 8)), E, r"k shape: expected the batch, sequence and head_dim of q"),
    (
        "rope-posids-with-gathered",
        _rope(cos=t(1, 4, 8), sin=t(1, 4, 8), position_ids=t(1, 4, dtype=torch.int64)),
        E,
        r"position_ids: expected None when cos/sin are already gathered",
    ),
    (
        "rope-gathered-shape",
        _rope(cos=t(1, 5, 8), sin=t(1, 5, 8)),
        E,
        r"cos shape: expected \[B or 1, S, R\]",
    ),
    (
        "rope-posids-range",
        _rope(position_ids=torch.tensor([[0, 1, 2, 16]])),
        E,
        r"position_ids values: expected in \[0, 16\).*got \[0, 16\]",
    ),
    ("rope-posids-negative", _rope(position_ids=torch.tensor([[0, -1, 2, 3]])), E, r"position_ids values"),
    (
        "rope-posids-float",
        _rope(position_ids=t(1, 4)),
        E,
        r"position_ids: expected an int64/int32 tensor \[B, S\], got torch\.float32",
    ),
    (
        "rope-posids-shape",
        _rope(position_ids=torch.zeros(1, 3, dtype=torch.int64)),
        E,
        r"position_ids shape: expected \[B or 1, S\] = \[1, 4\], got \[1, 3\]",
    ),
    (
        "rope-posids-device",
        _rope(position_ids=torch.zeros(1, 4, dtype=torch.int64, device="meta")),
        E,
        r"position_ids\.device: expected cpu, got meta",
    ),
    ("rope-table-too-short", _rope(cos=t(3, 8), sin=t(3, 8)), E, r"cos table rows: expected >= S = 4"),
    # ---- qk_norm_rope: rope's checks under its own name, then the weights and eps
    ("qknr-odd-rotary", _qknr(cos=t(16, 7), sin=t(16, 7)), E, r"lz\.qk_norm_rope: rotary dim .*got 7"),
    ("qknr-k-shape", _qknr(k=t(1, 2, 5, 8)), E, r"lz\.qk_norm_rope: k shape: expected the batch, sequence"),
    (
        "qknr-weight-shape",
        _qknr(qw=t(4)),
        E,
        r"lz\.qk_norm_rope: q_weight shape: expected \[D\] = \[8\] \(one weight per head dim.*got \[4\]",
    ),
    ("qknr-weight-rank", _qknr(kw=t(2, 8)), E, r"k_weight rank: expected 1 dims, got 2"),
    (
        "qknr-weight-dtype",
        _qknr(kw=t(8, dtype=torch.float16)),
        E,
        r"k_weight\.dtype: expected torch\.float32",
    ),
    (
        "qknr-weight-device",
        _qknr(qw=t(8, device="meta")),
        E,
        r"q_weight\.device: expected cpu \(like q\), got meta",
    ),
    ("qknr-weight-not-tensor", _qknr(qw=[1.0] * 8), E, r"q_weight: expected a torch\.Tensor, got list"),
    ("qknr-eps-zero", _qknr(eps=0.0), E, r"lz\.qk_norm_rope: eps: expected a finite float > 0, got 0\.0"),
    ("qknr-eps-nan", _qknr(eps=math.nan), E, r"eps: expected a finite float > 0"),
    (
        "qknr-posids-range",
        _qknr(position_ids=torch.tensor([[0, 1, 2, 16]])),
        E,
        r"lz\.qk_norm_rope: position_ids values",
    ),
    ("rope-interleaved-str", _rope(interleaved="yes"), E, r"interleaved: expected a bool, got 'yes'"),
    ("rope-layout", _rope(layout="SBHD"), E, r"layout: expected 'BHSD' or 'BSHD', got 'SBHD'"),
    (
        "rope-cos-device",
        _rope(cos=t(16, 8, device="meta"), sin=t(16, 8, device="meta")),
        E,
        r"cos\.device: expected cpu",
    ),
    # ---- sampling
    ("topk-k-0", lambda: lz.sample_topk(LOGITS, 0), E, r"lz\.sample_topk: k: expected an int >= 1, got 0"),
    ("topk-k-float", lambda: lz.sample_topk(LOGITS, 1.5), E, r"k: expected an int >= 1, got 1\.5"),
    ("topk-k-bool", lambda: lz.sample_topk(LOGITS, True), E, r"k: expected an int >= 1, got True"),
    (
        "topp-p-0",
        lambda: lz.sample_topp(LOGITS, 0.0),
        E,
        r"lz\.sample_topp: p: expected a float in \(0, 1\], got 0\.0",
    ),
    ("topp-p-1.5", lambda: lz.sample_topp(LOGITS, 1.5), E, r"p: expected a float in \(0, 1\], got 1\.5"),
    ("topp-p-nan", lambda: lz.sample_topp(LOGITS, math.nan), E, r"p: expected a float in \(0, 1\], got nan"),
    (
        "topk-temp-neg",
        lambda: lz.sample_topk(LOGITS, 2, temperature=-1.0),
        E,
        r"temperature: expected a finite float >= 0 \(0 means greedy\), got -1\.0",
    ),
    ("topk-temp-inf", lambda: lz.sample_topk(LOGITS, 2, temperature=math.inf), E, r"temperature:.*got inf"),
    ("topp-temp-nan", lambda: lz.sample_topp(LOGITS, 0.5, temperature=math.nan), E, r"temperature:.*got nan"),
    (
        "topk-generator-type",
        lambda: lz.sample_topk(LOGITS, 2, generator=42),
        E,
        r"generator: expected a torch\.Generator or None, got int",
    ),
    ("topk-logits-1d", lambda: lz.sample_topk(t(5), 2), E, r"logits rank: expected 2 dims, got 1 dims"),
    ("topp-logits-int", lambda: lz.sample_topp(t(2, 5, dtype=torch.int64), 0.5), E, r"logits\.dtype"),
    (
        "topk-logits-empty",
        lambda: lz.sample_topk(t(2, 0), 1),
        E,
        r"logits shape: expected \[B, V\] with B >= 1",
    ),
    (
        "sample-temp-shape",
        lambda: lz.sample(LOGITS, temperature=t(5)),
        E,
        r"lz\.sample: temperature shape: expected \[B\] = \[2\]",
    ),
    (
        "penalties-ids-range",
        lambda: lz.apply_penalties(LOGITS, torch.tensor([[6], [0]]), torch.zeros(2, 0).long()),
        E,
        r"lz\.apply_penalties: prompt_token_ids values: expected token ids in \[0, 5\]",
    ),
    # ---- rms_norm_linear: the linear's checks, then the norm weight, the residual and eps
    (
        "rnl-k-mismatch",
        lambda: lz.rms_norm_linear(X, W, t(4, 6)),
        E,
        r"lz\.rms_norm_linear: x\.shape\[-1\] \(in_features K\): expected 6 \(weight\.shape\[1\]",
    ),
    (
        "rnl-norm-weight-shape",
        lambda: lz.rms_norm_linear(X, t(4), t(3, 8)),
        E,
        r"lz\.rms_norm_linear: norm_weight shape: expected \[K\] = \[8\] \(x\.shape\[-1\]\), got \[4\]",
    ),
    (
        "rnl-residual-shape",
        lambda: lz.rms_norm_linear(X, W, t(3, 8), residual=t(1, 8)),
        E,
        r"lz\.rms_norm_linear: residual shape: expected x's shape \[2, 8\], got \[1, 8\]",
    ),
    (
        "rnl-residual-dtype",
        lambda: lz.rms_norm_linear(X, W, t(3, 8), residual=X.double()),
        E,
        r"lz\.rms_norm_linear: residual\.dtype: expected torch\.float32 \(like x\)",
    ),
    (
        "rnl-bias-shape",
        lambda: lz.rms_norm_linear(X, W, t(3, 8), t(4)),
        E,
        r"lz\.rms_norm_linear: bias shape: expected \[N\] = \[3\]",
    ),
    (
        "rnl-eps-nan",
        lambda: lz.rms_norm_linear(X, W, t(3, 8), eps=math.nan),
        E,
        r"lz\.rms_norm_linear: eps: expected a finite float > 0, got nan",
    ),
    (
        "rnl-x-int",
        lambda: lz.rms_norm_linear(t(2, 8, dtype=torch.int64), W, t(3, 8)),
        E,
        r"lz\.rms_norm_linear: x\.dtype",
    ),
    (
        "sgl-up-shape",
        lambda: lz.swiglu_linear(X, t(2, 4), t(3, 8)),
        E,
        r"lz\.swiglu_linear: up shape: expected gate's shape \[2, 8\], got \[2, 4\]",
    ),
    (
        "sgl-k-mismatch",
        lambda: lz.swiglu_linear(X, X, t(3, 6)),
        E,
        r"lz\.swiglu_linear: gate\.shape\[-1\] \(in_features K\): expected 6",
    ),
    (
        "sgl-up-device-dtype",
        lambda: lz.swiglu_linear(X, X.half(), t(3, 8)),
        E,
        r"lz\.swiglu_linear: up\.dtype: expected torch\.float32 \(like gate\)",
    ),
    # ---- API
    (
        "explain-unknown-op",
        lambda: lz.explain("attn", Q, Q, Q),
        lz.UnknownOperationError,
        r"unknown op 'attn'\. Known ops: \['all_gather', 'all_reduce', 'all_to_all', 'apply_penalties', "
        r"'apply_token_bitmask', 'attention'",
    ),
    ("which-unknown-op", lambda: lz.which(None, Q), lz.UnknownOperationError, r"unknown op None"),
    (
        "validate-unknown-kernel",
        lambda: lz.validate("torch_sdpa.flashy", "attention", Q, Q, Q),
        lz.UnknownKernelError,
        r"unknown kernel 'torch_sdpa\.flashy'\. Did you mean 'torch_sdpa\.flash'",
    ),
    (
        "configure-bad-option",
        lambda: lz.configure(cache=1),
        lz.ConfigurationError,
        r"unknown config option\(s\) \['cache'\]",
    ),
    (
        "configure-bad-value",
        lambda: lz.configure(cache_size=0),
        lz.ConfigurationError,
        r"cache_size: expected an int > 0, got 0",
    ),
    (
        "lock-unknown-kernel",
        lambda: lz.lock("attention", "flash.attn"),
        lz.UnknownKernelError,
        r"unknown kernel 'flash\.attn'",
    ),
    (
        "lock-unknown-op",
        lambda: lz.lock("paged", "torch_sdpa.math"),
        lz.UnknownOperationError,
        r"unknown op 'paged'",
    ),
    (
        "prefer-unknown",
        lambda: lz.prefer("nope").__enter__(),
        lz.UnknownKernelError,
        r"'nope' matches no kernel",
    ),
]


@pytest.mark.parametrize(("fn", "error", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_typed_error(fn, error, match):
    with pytest.raises(error, match=match) as info:
        fn()
    assert isinstance(info.value, lz.LayerZeroError)
    assert isinstance(info.value, (ValueError, RuntimeError))


def test_case_count_and_unique_ids():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(CASES) >= 40


def test_lock_that_cannot_run():
    lz.lock("attention", "torch_sdpa.cudnn")
    with pytest.raises(
        lz.NoKernelFoundError, match=r"locked to torch_sdpa\.cudnn.*DEVICE_TYPE_UNSUPPORTED"
    ) as info:
        lz.attention(Q, Q, Q)
    assert isinstance(info.value, RuntimeError)


def test_malformed_policy_yaml(tmp_path):
    path = _write(tmp_path, "version: 1\ndeny: [\n  - op: attention\n")
    with pytest.raises(lz.PolicyValidationError, match=r"not valid YAML") as info:
        lz.load_config(path)
    assert isinstance(info.value, ValueError)


def test_policy_yaml_with_python_object_tag_is_rejected(tmp_path):
    path = _write(tmp_path, "version: 1\nlocks: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(lz.PolicyValidationError, match=r"python/object"):
        lz.load_config(path)


def test_policy_yaml_bad_rule(tmp_path):
    path = _write(tmp_path, "version: 1\ndeny:\n  - op: attention\n    kernels: torch_sdpa.flash\n")
    with pytest.raises(
        lz.PolicyValidationError, match=r"deny\[0\]\.kernels: expected a list of kernel/backend globs"
    ):
        lz.load_config(path)


def test_bad_input_leaves_no_trace_in_the_cache():
    RUNTIME.ensure_ready()
    before = len(RUNTIME.cache)
    with pytest.raises(E):
        lz.attention(Q, t(1, 2, 4, 16), Q)
    assert len(RUNTIME.cache) == before
    assert lz.which("attention", Q, Q, Q) == "torch_sdpa.flash"


# ---------------------------------------------------------------------------------------- known bugs
def test_rope_unhashable_layout_is_a_typed_error():
    with pytest.raises(E, match="layout"):
        lz.rope(Q, Q, COS, COS, layout={"BHSD": 1})


@pytest.fixture
def reset_health():
    RUNTIME.ensure_ready()
    RUNTIME.health.reset()
    yield
    RUNTIME.health.reset()


def test_nan_logits_do_not_disable_the_reference_backend(reset_health):
    bad = torch.tensor([[math.nan, 1.0, 2.0]])
    for _ in range(lz.get_config().health_failure_threshold):
        with pytest.raises(lz.LayerZeroError):
            lz.sample_topk(bad, 2)
    token = lz.sample_topk(torch.tensor([[0.0, 9.0, 1.0]]), 1)  # valid input must still work
    assert token.tolist() == [1]


def test_mixed_dtype_layer_norm_weight_does_not_trip_torch_native(reset_health):
    x, w16 = t(2, 8), t(8, dtype=torch.float16)
    for _ in range(lz.get_config().health_failure_threshold):
        with lz.trace() as tr:
            try:
                lz.layer_norm(x, w16)
            except lz.InvalidInputError:
                pass  # rejecting the mix up front is an acceptable fix
        assert tr.fallbacks == []
    assert lz.which("rms_norm", x, t(8)) == "torch_native.rms_norm"


def test_rope_position_ids_on_meta_is_a_typed_error():
    q, table = t(1, 2, 4, 8, device="meta"), t(16, 8, device="meta")
    pid = torch.zeros(1, 4, dtype=torch.int64, device="meta")
    with pytest.raises(lz.LayerZeroError, match="meta|position_ids"):
        lz.rope(q, q, table, table, position_ids=pid)


def test_attention_tensor_dropout_is_a_typed_error():
    with pytest.raises(E, match="dropout_p"):
        lz.attention(Q, Q, Q, dropout_p=torch.zeros(2))
