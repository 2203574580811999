"""Selection on CPU through the public API: which kernel wins for which inputs, every rejection reason,
layout transforms, policy deny/allow, the selection cache and PerfDB scoring.

Expectations are worked out by hand from the built-in KernelSpecs (priorities: torch_sdpa.flash 80,
torch_sdpa.math 20, reference 0, torch_native 50; BSHD->BHSD transform cost 1) and outputs are compared
with a float64 oracle written here, independent of the reference backend.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import layerzero as lz
from layerzero.core import config as lz_config
from layerzero.core.dispatch import device_fingerprint_parts
from layerzero.core.perfdb import PerfDB, fingerprint
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.unit

SDPA = ("torch_sdpa.flash", "torch_sdpa.cudnn", "torch_sdpa.efficient", "torch_sdpa.math")
ATTENTION_KERNELS = {"reference.attention", *SDPA}


def _rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _qkv(b=1, h=2, s=4, d=8, hkv=None, dv=None, dtype=torch.float32):
    hkv = h if hkv is None else hkv
    dv = d if dv is None else dv
    return (
        _rand(b, h, s, d, seed=1, dtype=dtype),
        _rand(b, hkv, s, d, seed=2, dtype=dtype),
        _rand(b, hkv, s, dv, seed=3, dtype=dtype),
    )


def oracle(q, k, v, mask=None, causal=False, scale=None):
    """float64 softmax(q k^T * scale + mask) v with GQA by repeat_interleave; BHSD in, BHSD out."""
    q, k, v = q.double(), k.double(), v.double()
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    if mask is not None:
        allowed = allowed & mask
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def codes(report, kernel_id):
    return [r.code for r in report.candidate(kernel_id).reasons]


# ------------------------------------------------------------------------------------------ attention
def test_plain_attention_picks_flash_with_hand_worked_scores():
    q, k, v = _qkv()
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    rep = lz.explain("attention", q, k, v)
    assert rep.chosen == "torch_sdpa.flash"
    totals = {c.kernel_id: c.score.total for c in rep.candidates if c.score is not None}
    assert totals == {
        "torch_sdpa.flash": 80.0,
        "torch_sdpa.math": 20.0,
        "reference.attention": 0.0,
        "flex_attention.attention": -1.0,
    }
    assert not rep.fell_back and rep.notes == ()
    torch.testing.assert_close(lz.attention(q, k, v).double(), oracle(q, k, v), atol=1e-5, rtol=1e-5)


def test_dropout_rejects_flash_and_math_serves():
    q, k, v = _qkv()
    rep = lz.explain("attention", q, k, v, dropout_p=0.25)
    assert codes(rep, "torch_sdpa.flash") == [R.DROPOUT_UNSUPPORTED]
    assert rep.chosen == "torch_sdpa.math"
    assert lz.which("attention", q, k, v, dropout_p=0.25) == "torch_sdpa.math"
    with lz.trace() as t:
        out = lz.attention(q, k, v, dropout_p=0.25)
    assert t.kernels_for("attention") == ["torch_sdpa.math"]
    assert out.shape == q.shape


def test_non_unit_last_stride_rejects_flash():
    q0, k, v = _qkv()
    q = q0.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, stride(-1) == S
    assert q.stride(-1) != 1 and torch.equal(q, q0)
    rep = lz.explain("attention", q, k, v)
    assert codes(rep, "torch_sdpa.flash") == [R.STRIDE_LAST_DIM_NOT_1]
    assert R.STRIDE_LAST_DIM_NOT_1 in codes(rep, "torch_sdpa.cudnn")
    assert rep.chosen == "torch_sdpa.math"
    torch.testing.assert_close(lz.attention(q, k, v).double(), oracle(q0, k, v), atol=1e-5, rtol=1e-5)


def test_mask_with_causal_rejects_every_sdpa_kernel_and_reference_serves(caplog):
    q, k, v = _qkv(s=5, dtype=torch.float64)
    mask = (_rand(5, 5, seed=9) > 0) | torch.eye(5, dtype=torch.bool)  # no fully masked row
    rep = lz.explain("attention", q, k, v, attn_mask=mask, is_causal=True)
    for kid in SDPA:
        assert R.MASK_WITH_CAUSAL in codes(rep, kid), kid
    assert rep.chosen == "reference.attention"
    assert rep.fell_back
    assert any("MASK_WITH_CAUSAL" in n for n in rep.notes)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="layerzero"):
        out = lz.attention(q, k, v, attn_mask=mask, is_causal=True)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("layerzero")]
    assert warnings and "MASK_WITH_CAUSAL" in warnings[0].getMessage()
    expected = oracle(q, k, v, mask=mask, causal=True)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    # the combination matters: causal alone or mask alone give other answers
    assert not torch.allclose(out, oracle(q, k, v, mask=mask))
    assert not torch.allclose(out, oracle(q, k, v, causal=True))


def test_bshd_layout_adds_a_transform_and_matches_bhsd():
    q, k, v = _qkv(s=6)
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    plan = lz.select("attention", qb, kb, vb, layout="BSHD")
    assert plan.kernel_id == "torch_sdpa.flash"
    assert plan.transforms and "BSHD->BHSD" in plan.transforms[0]
    assert lz.select("attention", q, k, v).transforms == ()
    rep = lz.explain("attention", qb, kb, vb, layout="BSHD")
    assert rep.candidate("torch_sdpa.flash").score.total == 79.0  # 80 - transform cost 1
    out = lz.attention(qb, kb, vb, layout="BSHD")
    assert out.shape == (1, 6, 2, 8)
    torch.testing.assert_close(out, lz.attention(q, k, v).transpose(1, 2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.double(), oracle(q, k, v).transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_gqa_runs_on_flash_and_matches_oracle():
    q, k, v = _qkv(h=4, hkv=2)
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    torch.testing.assert_close(lz.attention(q, k, v).double(), oracle(q, k, v), atol=1e-5, rtol=1e-5)


def test_value_head_dim_differs_rejects_flash():
    q, k, v = _qkv(d=8, dv=4)
    rep = lz.explain("attention", q, k, v)
    assert codes(rep, "torch_sdpa.flash") == [R.HEAD_DIM_MISMATCH]
    assert rep.chosen == "torch_sdpa.math"
    out = lz.attention(q, k, v)
    assert out.shape == (1, 2, 4, 4)
    torch.testing.assert_close(out.double(), oracle(q, k, v), atol=1e-5, rtol=1e-5)


def test_explain_lists_every_kernel_with_all_reasons():
    q, k, v = _qkv()
    rep = lz.explain("attention", q, k, v)
    registered = {d["kernel_id"] for d in lz.list_kernels("attention")}
    assert {c.kernel_id for c in rep.candidates} == registered  # every registered kernel is reported
    assert ATTENTION_KERNELS <= registered
    cudnn = codes(rep, "torch_sdpa.cudnn")
    assert len(cudnn) >= 2
    assert set(cudnn) == {R.DEVICE_TYPE_UNSUPPORTED, R.DTYPE_UNSUPPORTED}
    assert codes(rep, "torch_sdpa.efficient") == [R.DEVICE_TYPE_UNSUPPORTED]
    assert rep.candidate("torch_sdpa.math").reasons == ()


# ------------------------------------------------------------------------------------------ other ops
def test_norms_pick_torch_native_and_sampling_reference():
    x, w, b = _rand(3, 8), _rand(8, seed=5), _rand(8, seed=6)
    assert lz.which("rms_norm", x, w) == "torch_native.rms_norm"
    assert lz.which("layer_norm", x, w, b) == "torch_native.layer_norm"
    assert lz.which("sample_topk", x, 2) == "reference.sample_topk"
    assert lz.which("sample_topp", x, 0.5) == "reference.sample_topp"
    h = x.double()
    rms = h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(lz.rms_norm(x, w).double(), rms, atol=1e-5, rtol=1e-5)
    mean, var = h.mean(-1, keepdim=True), h.var(-1, unbiased=False, keepdim=True)
    ln = (h - mean) / torch.sqrt(var + 1e-5) * w.double() + b.double()
    torch.testing.assert_close(lz.layer_norm(x, w, b).double(), ln, atol=1e-5, rtol=1e-5)


def test_rope_choice_is_the_best_eligible_and_matches_oracle():
    q, k = _rand(1, 2, 5, 8, seed=1), _rand(1, 1, 5, 8, seed=2)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    freqs = torch.outer(torch.arange(7, dtype=torch.float64), inv)  # [max_pos=7, 4]
    emb = torch.cat([freqs, freqs], -1)  # NeoX / Llama layout
    cos, sin = emb.cos().float(), emb.sin().float()
    rep = lz.explain("rope", q, k, cos, sin)
    eligible = [c for c in rep.candidates if c.score is not None]
    assert rep.chosen == max(eligible, key=lambda c: c.score.total).kernel_id
    assert lz.which("rope", q, k, cos, sin) == rep.chosen
    with lz.disabled():
        assert lz.which("rope", q, k, cos, sin) == "reference.rope"

    def rot(x):  # x * cos + rotate_half(x) * sin, float64, positions 0..S-1
        x = x.double()
        half = torch.cat([-x[..., 4:], x[..., :4]], -1)
        return x * emb[:5].cos() + half * emb[:5].sin()

    oq, ok = lz.rope(q, k, cos, sin)
    torch.testing.assert_close(oq.double(), rot(q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok.double(), rot(k), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ policy
def _load_policy(tmp_path, text: str):
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return lz.load_config(path)


def test_deny_changes_the_choice(tmp_path):
    q, k, v = _qkv()
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    _load_policy(tmp_path, "version: 1\ndeny:\n  - op: attention\n    kernels: [torch_sdpa.flash]\n")
    assert lz.which("attention", q, k, v) == "torch_sdpa.math"
    assert codes(lz.explain("attention", q, k, v), "torch_sdpa.flash") == [R.POLICY_DENIED]


def test_allow_restricts_candidates(tmp_path):
    x, w = _rand(2, 8), torch.ones(8)
    q, k, v = _qkv()
    _load_policy(tmp_path, "version: 1\nallow:\n  - op: attention\n    kernels: [torch_sdpa.math]\n")
    rep = lz.explain("attention", q, k, v)
    assert rep.chosen == "torch_sdpa.math"
    assert R.POLICY_NOT_ALLOWED in codes(rep, "torch_sdpa.flash")
    assert lz.which("rms_norm", x, w) == "torch_native.rms_norm"  # the rule is scoped to attention


def test_deny_with_when_applies_only_where_it_matches(tmp_path):
    _load_policy(
        tmp_path,
        "version: 1\ndeny:\n  - op: attention\n    kernels: [torch_sdpa.flash]\n    when: {dtype: float64}\n",
    )
    assert lz.which("attention", *_qkv()) == "torch_sdpa.flash"
    assert lz.which("attention", *_qkv(dtype=torch.float64)) == "torch_sdpa.math"


def test_reference_kernel_survives_deny_all(tmp_path):
    q, k, v = _qkv()
    _load_policy(tmp_path, "version: 1\ndeny:\n  - op: '*'\n    kernels: ['*']\n")
    rep = lz.explain("attention", q, k, v)
    assert rep.chosen == "reference.attention"
    assert rep.candidate("reference.attention").reasons == ()
    for kid in ("torch_sdpa.flash", "torch_sdpa.math"):
        assert codes(rep, kid) == [R.POLICY_DENIED]
    assert lz.which("rms_norm", _rand(2, 8), torch.ones(8)) == "reference.rms_norm"
    torch.testing.assert_close(lz.attention(q, k, v).double(), oracle(q, k, v), atol=1e-5, rtol=1e-5)


def test_reference_survives_explicit_deny_of_reference(tmp_path):
    _load_policy(tmp_path, "version: 1\ndeny:\n  - op: attention\n    kernels: [reference, torch_sdpa]\n")
    assert lz.which("attention", *_qkv()) == "reference.attention"


# ------------------------------------------------------------------------------------------ cache
@pytest.fixture
def count_selections(monkeypatch):
    """Wrap RUNTIME.select_context and count calls (the cache must avoid them)."""
    RUNTIME.ensure_ready()
    real = RUNTIME.select_context
    calls: list[str] = []

    def counting(ctx, **kw):
        calls.append(ctx.op)
        return real(ctx, **kw)

    monkeypatch.setattr(RUNTIME, "select_context", counting)
    return calls


def _seq(s: int):
    return (_rand(1, 1, s, 8, seed=1), _rand(1, 1, s, 8, seed=2), _rand(1, 1, s, 8, seed=3))


def test_same_shapes_select_once(count_selections):
    q, k, v = _qkv()
    lz.attention(q, k, v)
    lz.attention(q, k, v)
    lz.attention(*_qkv())  # equal shapes, new tensors
    assert count_selections == ["attention"]


def test_seq_lengths_in_one_bucket_share_a_selection(count_selections):
    lz.attention(*_seq(600))
    lz.attention(*_seq(1000))  # 600 and 1000 both bucket to 1024
    assert len(count_selections) == 1
    lz.attention(*_seq(1100))  # 2048 bucket
    assert len(count_selections) == 2


def test_configure_invalidates_the_cache(count_selections):
    q, k, v = _qkv()
    lz.attention(q, k, v)
    lz.configure(cache_ttl_s=None)
    lz.attention(q, k, v)
    assert len(count_selections) == 2


def test_policy_change_invalidates_the_cache(count_selections, tmp_path):
    q, k, v = _qkv()
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    _load_policy(tmp_path, "version: 1\ndeny:\n  - op: attention\n    kernels: [torch_sdpa.flash]\n")
    assert lz.which("attention", q, k, v) == "torch_sdpa.math"
    assert len(count_selections) == 2


# ------------------------------------------------------------------------------------------ PerfDB
def _record_math_faster(q, k, v):
    ctx = lz.explain("attention", q, k, v).context
    path = lz_config.get_config().perfdb_path
    fp = fingerprint(device_fingerprint_parts(ctx.device))
    with PerfDB(path) as db:
        db.record("torch_sdpa.math", "attention", ctx.bucket_key(), fp, [2.0, 2.0, 2.0])
        db.record("torch_sdpa.flash", "attention", ctx.bucket_key(), fp, [200.0, 200.0, 200.0])


def test_perfdb_measurements_change_the_choice(tmp_path):
    q, k, v = _qkv()
    assert lz_config.get_config().perfdb_path == str(tmp_path / "perfdb.sqlite")  # conftest isolation
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    _record_math_faster(q, k, v)
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"  # cached until invalidated
    lz.configure(perf_weight=1000.0)
    assert lz.which("attention", q, k, v) == "torch_sdpa.math"
    rep = lz.explain("attention", q, k, v)
    math_c, flash_c = rep.candidate("torch_sdpa.math"), rep.candidate("torch_sdpa.flash")
    # perf = weight * fastest / this: math 1000 * 2/2, flash 1000 * 2/200
    assert math_c.score.perf == pytest.approx(1000.0) and math_c.score.perf > 0
    assert flash_c.score.perf == pytest.approx(10.0)
    assert math_c.measured_us == pytest.approx(2.0)
    assert math_c.score.total == pytest.approx(1020.0)
    assert rep.candidate("reference.attention").score.perf == 0.0


def test_perfdb_ignored_when_disabled():
    q, k, v = _qkv()
    _record_math_faster(q, k, v)
    lz.configure(use_perfdb=False)
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    rep = lz.explain("attention", q, k, v)
    assert rep.candidate("torch_sdpa.math").score.perf == 0.0
    assert rep.candidate("torch_sdpa.math").measured_us is None


def test_perfdb_of_another_bucket_does_not_apply():
    q, k, v = _qkv()
    _record_math_faster(q, k, v)  # recorded for S bucket 4
    assert lz.which("attention", *_qkv(s=16)) == "torch_sdpa.flash"
    assert lz.which("attention", q, k, v) == "torch_sdpa.math"
