"""Shipped timing data (``core/shipped.py``) and its use by selection (``Runtime._perf_lookup``).

Oracles: hand-made data files whose fingerprint matches (or, changed in one part, does not match) a fake CUDA
device or this CPU; nearest-bucket distances worked out by hand below; the priority-only pick of the same
context (``torch_native.rms_norm`` 50 > ``triton.rms_norm`` 45 > reference 0) as the "before" state.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.core import shipped
from layerzero.core.context import SelectionContext
from layerzero.core.device import DeviceSpec
from layerzero.core.dispatch import device_fingerprint_parts
from layerzero.core.errors import ConfigurationError
from layerzero.core.perfdb import fingerprint
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import Layout
from layerzero.testing.devices import fake_cuda_device

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
GPU = fake_cuda_device((9, 0), name="Fake H100")


@pytest.fixture(autouse=True)
def _fresh_tables():
    shipped.clear_cache()
    yield
    shipped.clear_cache()


def versions() -> dict[str, str]:
    """Installed version of every registered backend (what a file measured here would list)."""
    RUNTIME.ensure_ready()
    reg = RUNTIME.registry
    return {b: reg.backends.get(b).version for b in reg.backends if reg.backends.get(b).version is not None}


def rms_ctx(device=GPU, hidden=4096, **kw) -> SelectionContext:
    return SelectionContext(
        op="rms_norm",
        device=device,
        dtype=torch.bfloat16 if device.device_type == "cuda" else torch.float32,
        hidden_size=hidden,
        param_dtype=torch.bfloat16 if device.device_type == "cuda" else torch.float32,
        **kw,
    )


def attn_ctx(batch=8, seq=2048, heads=32, kv_heads=8, dtype=torch.bfloat16, **kw) -> SelectionContext:
    return SelectionContext(
        op="attention",
        device=GPU,
        dtype=dtype,
        batch=batch,
        num_heads_q=heads,
        num_heads_kv=kv_heads,
        head_dim=128,
        head_dim_v=128,
        seq_len_q=seq,
        seq_len_kv=seq,
        layout=Layout.BHSD,
        is_causal=True,
        **kw,
    )


def write(directory: Path, records, *, fp=None, backends=None, name="fake.json", device=GPU) -> Path:
    """A data file: ``records`` = [(ctx, {kernel_id: median_us})]."""
    doc = {
        "schema": 1,
        "fingerprint": fp or shipped.device_fingerprint(device),
        "backends": versions() if backends is None else backends,
        "date": "2026-01-01",
        "records": [[ctx.op, shipped.bucket_fields(ctx), med] for ctx, med in records],
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(doc))
    return path


def use(directory: Path) -> None:
    lz.configure(use_shipped_timings=True, shipped_timings_dir=str(directory))


def version_of(kernel_id):
    spec = RUNTIME.registry.kernels.get(kernel_id)
    return spec.backend, RUNTIME.registry.backends.get(spec.backend).version


# ------------------------------------------------------------------------------------- file format
def test_record_fields_spell_the_bucket_key():
    ctx = attn_ctx()
    fields = shipped.bucket_fields(ctx)
    assert ";".join(f"{k}={v}" for k, v in sorted(fields.items())) == ctx.bucket_key()
    assert "device_name" not in fields and "window_left" not in fields and fields["gqa_ratio"] == 4


def test_parse_rejects_malformed_files_with_expected_and_got():
    with pytest.raises(ConfigurationError, match="schema: expected 1, got 2"):
        shipped.parse(json.dumps({"schema": 2}), "x.json")
    with pytest.raises(ConfigurationError, match="content: expected JSON"):
        shipped.parse("{", "x.json")
    bad = {"schema": 1, "fingerprint": {}, "records": [["rms_norm", {"op": "rms_norm"}, {"k": -1.0}]]}
    with pytest.raises(ConfigurationError, match=r"records\[0\] k: expected a median >= 0"):
        shipped.parse(json.dumps(bad), "x.json")
    defaults = {
        "schema": 1,
        "fingerprint": {},
        "defaults": {"rms_norm": {"op": "rms_norm", "tp_size": 1}},
        "records": [["rms_norm", {"hidden_size": 64, "tp_size": None}, {"k": 1.0}]],
    }
    (rec,) = shipped.parse(json.dumps(defaults)).records
    assert dict(rec.fields) == {"op": "rms_norm", "hidden_size": 64}  # null removes a default


def test_malformed_file_is_ignored_with_a_warning(tmp_path, caplog):
    (tmp_path / "broken.json").write_text("not json")
    write(tmp_path, [(rms_ctx(), {"triton.rms_norm": 10.0})])
    with caplog.at_level("WARNING", logger="layerzero.shipped"):
        match = shipped.lookup(rms_ctx(), version_of, str(tmp_path))
    assert match is not None and match.file == "fake.json"
    assert "broken.json is unusable" in caplog.text
    statuses = dict(shipped.describe(GPU, str(tmp_path)))
    assert statuses["broken.json"].startswith("unusable") and statuses["fake.json"].startswith(
        "used (1 buckets"
    )


def test_cpu_isa_level_and_fingerprint():
    assert shipped.cpu_isa_level({"avx", "avx2", "avx512", "fma"}) == "avx512"
    assert shipped.cpu_isa_level({"amx_bf16", "avx512"}) == "amx_bf16"
    assert shipped.cpu_isa_level({"neon", "sve"}) == "sve"
    host = DeviceSpec.detect("cpu")
    fp = shipped.device_fingerprint(host)
    assert set(fp) == {"device_type", "arch", "isa", "aten_isa", "torch"} and fp["torch"] == torch.__version__
    avx512 = shipped.device_fingerprint(dataclasses.replace(host, cpu_isa=frozenset({"avx2", "avx512"})))
    avx2 = shipped.device_fingerprint(dataclasses.replace(host, cpu_isa=frozenset({"avx2"})))
    assert avx512["isa"] == "avx512" and avx2["isa"] == "avx2"  # never share a file
    assert shipped.device_fingerprint(GPU) == {
        "device_type": "cuda",
        "name": "Fake H100",
        "sm": "9.0",
        "torch": torch.__version__,
        "cudnn": "none",
    }


# ----------------------------------------------------------------------------- selection uses it
def test_shipped_file_changes_the_default_pick(tmp_path):
    ctx = rms_ctx()
    assert RUNTIME.select_context(ctx)[0].kernel_id == "torch_native.rms_norm"  # priorities: 50 > 45
    write(
        tmp_path,
        [(ctx, {"torch_native.rms_norm": 100.0, "triton.rms_norm": 40.0, "reference.rms_norm": 400.0})],
    )
    use(tmp_path)
    plan, report = RUNTIME.select_context(ctx)
    assert plan.kernel_id == "triton.rms_norm"
    tri, nat = report.candidate("triton.rms_norm"), report.candidate("torch_native.rms_norm")
    assert tri.score.shipped == pytest.approx(1000.0) and nat.score.shipped == pytest.approx(
        400.0
    )  # 1000*40/100
    assert tri.score.total == pytest.approx(45 + 1000) and tri.shipped_us == 40.0 and tri.score.perf == 0.0
    assert report.shipped_source == "fake.json, exact bucket"
    d = report.to_dict()
    assert d["shipped_source"] == "fake.json, exact bucket"
    by_id = {c["kernel_id"]: c for c in d["candidates"]}
    assert (
        by_id["triton.rms_norm"]["shipped_us"] == 40.0
        and by_id["triton.rms_norm"]["score"]["shipped"] == 1000.0
    )
    text = str(report)
    assert "shipped timings: fake.json, exact bucket" in text and "+1000.0 (40.0 us)" in text
    lz.configure(use_shipped_timings=False)
    assert RUNTIME.select_context(ctx)[0].kernel_id == "torch_native.rms_norm"


def test_near_ties_in_shipped_data_go_to_the_priorities(tmp_path):
    """Worked by hand: triton.rms_norm 6% faster than torch_native at the grid point (100 vs 106 µs).
    rms_norm's own margin is 0 (strict: triton); with a 10% margin both score the full weight and the
    priorities (native 50 > triton 45) pick native; a 25% edge (100 vs 125) still wins. paged_attention's own
    margin is 10%."""
    from layerzero.ops.paged import SHIPPED_TIE_MARGIN

    ctx = rms_ctx()
    assert lz.get_config().shipped_tie_margin is None
    RUNTIME.ensure_ready()
    assert RUNTIME.registry.ops.get("rms_norm").shipped_tie_margin == 0.0
    assert RUNTIME.registry.ops.get("paged_attention").shipped_tie_margin == SHIPPED_TIE_MARGIN == 0.10
    write(tmp_path, [(ctx, {"torch_native.rms_norm": 106.0, "triton.rms_norm": 100.0})])
    use(tmp_path)
    plan, report = RUNTIME.select_context(ctx)
    assert plan.kernel_id == "triton.rms_norm"
    assert report.candidate("torch_native.rms_norm").score.shipped == pytest.approx(1000.0 * 100 / 106)
    lz.configure(shipped_tie_margin=0.10)
    plan, report = RUNTIME.select_context(ctx)
    assert plan.kernel_id == "torch_native.rms_norm"
    assert report.candidate("torch_native.rms_norm").score.shipped == pytest.approx(1000.0)
    assert report.candidate("torch_native.rms_norm").shipped_us == 106.0  # the report keeps the time
    write(tmp_path, [(ctx, {"torch_native.rms_norm": 125.0, "triton.rms_norm": 100.0})])
    shipped.clear_cache()
    lz.configure(shipped_tie_margin=0.10)  # a new generation
    assert RUNTIME.select_context(ctx)[0].kernel_id == "triton.rms_norm"
    m = shipped.lookup(ctx, version_of, str(tmp_path))
    assert m.score("torch_native.rms_norm", 1000, 0.25) == 1000.0  # at the edge: tied
    assert m.score("torch_native.rms_norm", 1000, 0.2) == pytest.approx(800.0)
    assert m.score("torch_native.rms_norm", 1000) == pytest.approx(800.0)  # no margin by default
    for bad in (-0.1, 1.0, "0.1", True, float("nan")):
        with pytest.raises(lz.ConfigurationError, match="shipped_tie_margin"):
            lz.configure(shipped_tie_margin=bad)
    lz.configure(shipped_tie_margin=None)


def test_env_switch(monkeypatch):
    from layerzero.core import config

    monkeypatch.setenv("LAYERZERO_SHIPPED_TIMINGS", "1")
    config.reset_for_tests()
    assert lz.get_config().use_shipped_timings is True
    monkeypatch.setenv("LAYERZERO_SHIPPED_TIMINGS", "off")
    config.reset_for_tests()
    assert lz.get_config().use_shipped_timings is False


@pytest.mark.parametrize(
    "part, value", [("name", "Fake H200"), ("sm", "8.0"), ("torch", "0.0.1"), ("cudnn", "90100")]
)
def test_another_device_torch_or_cudnn_ignores_the_whole_file(tmp_path, part, value, caplog):
    ctx = rms_ctx()
    fp = {**shipped.device_fingerprint(GPU), part: value}
    write(tmp_path, [(ctx, {"torch_native.rms_norm": 100.0, "triton.rms_norm": 40.0})], fp=fp)
    use(tmp_path)
    with caplog.at_level("DEBUG", logger="layerzero.shipped"):
        plan, report = RUNTIME.select_context(ctx)
    assert plan.kernel_id == "torch_native.rms_norm" and report.shipped_source is None
    assert all(c.score is None or c.score.shipped == 0.0 for c in report.candidates)
    (status,) = shipped.describe(GPU, str(tmp_path))
    assert status[1].startswith("ignored: measured with ") and f"{part} {value!r}" in status[1]
    assert "ignored for this device" in caplog.text


def test_a_kernel_of_another_backend_version_is_ignored(tmp_path):
    ctx = rms_ctx()
    write(
        tmp_path,
        [(ctx, {"torch_native.rms_norm": 100.0, "triton.rms_norm": 40.0})],
        backends={**versions(), "triton": "0.0.1"},
    )
    use(tmp_path)
    plan, report = RUNTIME.select_context(ctx)
    assert plan.kernel_id == "torch_native.rms_norm"
    assert report.candidate("triton.rms_norm").score.shipped == 0.0
    assert report.candidate("torch_native.rms_norm").score.shipped == pytest.approx(
        1000.0
    )  # the only one left
    backends = versions()
    del backends["triton"]  # not listed at all: ignored too
    write(tmp_path, [(ctx, {"torch_native.rms_norm": 100.0, "triton.rms_norm": 40.0})], backends=backends)
    shipped.clear_cache()
    assert RUNTIME.select_context(ctx)[0].kernel_id == "torch_native.rms_norm"


def test_user_perfdb_wins_over_shipped(tmp_path):
    ctx = rms_ctx()
    write(tmp_path, [(ctx, {"torch_native.rms_norm": 100.0, "triton.rms_norm": 40.0})])
    use(tmp_path)
    db = RUNTIME.perfdb()
    db.record(
        "torch_native.rms_norm",
        "rms_norm",
        ctx.bucket_key(),
        fingerprint(device_fingerprint_parts(GPU)),
        [10.0, 10.0, 10.0],
    )
    plan, report = RUNTIME.select_context(ctx)
    assert plan.kernel_id == "torch_native.rms_norm" and report.shipped_source is None
    nat, tri = report.candidate("torch_native.rms_norm"), report.candidate("triton.rms_norm")
    assert nat.score.perf == pytest.approx(1000.0) and nat.score.shipped == 0.0 and tri.score.shipped == 0.0


def test_capture_context_reads_no_shipped_data(tmp_path):
    ctx = rms_ctx()
    write(tmp_path, [(ctx, {"torch_native.rms_norm": 100.0, "triton.rms_norm": 40.0})])
    use(tmp_path)
    cap = rms_ctx(graph_capture=True)
    assert RUNTIME._perf_lookup(cap)("triton.rms_norm") == (0.0, None, 0.0, None, None)


# --------------------------------------------------------------------------------- nearest bucket
def _near_dir(tmp_path) -> Path:
    a = attn_ctx(batch=4, seq=2048)  # distance to (8, 2048): batch 1 -> 1.0
    b = attn_ctx(batch=8, seq=1024)  # seq_len_q and seq_len_kv 1 each -> 2.0
    c = attn_ctx(batch=8, seq=2048, dtype=torch.float16)  # exact numbers, other dtype: never a candidate
    write(
        tmp_path,
        [
            (a, {"torch_sdpa.cudnn": 10.0, "torch_sdpa.flash": 8.0}),
            (b, {"torch_sdpa.cudnn": 5.0, "torch_sdpa.flash": 9.0}),
            (c, {"torch_sdpa.cudnn": 1.0, "torch_sdpa.flash": 2.0}),
        ],
    )
    return tmp_path


def test_nearest_bucket_hand_worked(tmp_path):
    d = str(_near_dir(tmp_path))
    m = shipped.lookup(attn_ctx(batch=8, seq=2048), version_of, d)
    assert not m.exact and m.distance == pytest.approx(1.0) and m.fields["batch"] == 4
    assert dict(m.medians) == {"torch_sdpa.cudnn": 10.0, "torch_sdpa.flash": 8.0}
    assert m.score("torch_sdpa.flash", 1000) == 1000.0 and m.score("torch_sdpa.cudnn", 1000) == 800.0
    assert (
        m.source == "fake.json, nearest bucket (distance 1.00: batch 4, seq_len_q 2048, seq_len_kv 2048, "
        "num_heads_q 32, contiguous True, aligned_16 True)"
    )
    # 24 query heads (GQA 4 kept with 6 KV heads): + log2(32/24) = 0.415 to both -> still record a
    m = shipped.lookup(attn_ctx(batch=8, seq=2048, heads=24, kv_heads=6), version_of, d)
    assert m.fields["batch"] == 4 and m.distance == pytest.approx(1.0 + 0.41504, abs=1e-4)
    # a non-contiguous call: + SOFT_PENALTY (1.0)
    m = shipped.lookup(attn_ctx(batch=8, seq=2048, contiguous=False), version_of, d)
    assert m.fields["batch"] == 4 and m.distance == pytest.approx(2.0)
    # batch 2, seq 1024: a is 1 + 2 = 3 away, b 2 away -> b
    m = shipped.lookup(attn_ctx(batch=2, seq=1024), version_of, d)
    assert m.fields["batch"] == 8 and m.distance == pytest.approx(2.0)
    # exact
    m = shipped.lookup(attn_ctx(batch=4, seq=2048), version_of, d)
    assert m.exact and m.distance == 0.0 and m.source == "fake.json, exact bucket"


def test_nearest_bucket_refuses_beyond_max_distance_and_other_categories(tmp_path):
    d = str(_near_dir(tmp_path))
    assert shipped.MAX_DISTANCE == 3.0
    # batch 32: a is 3 + 0 = 3 away (allowed), b is 2 + 2 = 4 -> a at exactly the limit
    assert shipped.lookup(attn_ctx(batch=32, seq=2048), version_of, d).fields["batch"] == 4
    # batch 64: a 4 away, b 3 + 2 = 5 -> nothing
    assert shipped.lookup(attn_ctx(batch=64, seq=2048), version_of, d) is None
    # another GQA ratio, causal flag or head dim must match exactly
    assert shipped.lookup(attn_ctx(batch=4, seq=2048, kv_heads=4), version_of, d) is None
    nc = dataclasses.replace(attn_ctx(batch=4), is_causal=False)
    assert shipped.lookup(nc, version_of, d) is None


def test_equally_near_buckets_are_combined_by_geometric_mean(tmp_path):
    """Batch 8 lies between batches 4 and 16 (distance 1 each). Hand-worked from the H200 miss: flash wins the
    small side by 10%, cudnn the large side by 25%; the geometric means are flash sqrt(1.0 * 1.25) = 1.118 and
    cudnn sqrt(1.1 * 1.0) = 1.049, so cudnn (the kernel best across the interval) is picked, where the single
    nearest record used to pick flash."""
    small, large = attn_ctx(batch=4, seq=1024), attn_ctx(batch=16, seq=1024)
    write(
        tmp_path,
        [
            (small, {"torch_sdpa.cudnn": 1.1, "torch_sdpa.flash": 1.0, "torch_sdpa.math": 9.0}),
            (large, {"torch_sdpa.cudnn": 1.0, "torch_sdpa.flash": 1.25}),
        ],
    )
    m = shipped.lookup(attn_ctx(batch=8, seq=1024), version_of, str(tmp_path))
    assert m.distance == pytest.approx(1.0) and not m.exact and m.fields["batch"] == 16
    assert set(m.medians) == {"torch_sdpa.cudnn", "torch_sdpa.flash"}  # math: not in both
    assert m.medians["torch_sdpa.cudnn"] == pytest.approx(1.1**0.5)
    assert m.medians["torch_sdpa.flash"] == pytest.approx(1.25**0.5)
    assert m.score("torch_sdpa.cudnn", 1.0) == 1.0 and m.score("torch_sdpa.flash", 1.0) < 0.94
    assert "geometric mean of 2 equally near buckets, distance 1.00: batch 16 / 4, seq_len_q 1024" in m.source
    ctx = attn_ctx(batch=8, seq=1024)
    use(tmp_path)
    assert RUNTIME.select_context(ctx)[0].kernel_id == "torch_sdpa.cudnn"


def test_equally_near_buckets_without_a_common_kernel_prefer_more_kernels_then_the_larger(tmp_path):
    small, large = attn_ctx(batch=4, seq=1024), attn_ctx(batch=16, seq=1024)
    write(
        tmp_path,
        [(small, {"torch_sdpa.cudnn": 1.0, "torch_sdpa.flash": 2.0}), (large, {"torch_sdpa.math": 3.0})],
    )
    m = shipped.lookup(attn_ctx(batch=8, seq=1024), version_of, str(tmp_path))
    assert m.distance == pytest.approx(1.0) and m.fields["batch"] == 4 and not m.combined  # 2 kernels beat 1
    write(tmp_path, [(small, {"torch_sdpa.flash": 1.0}), (large, {"torch_sdpa.cudnn": 3.0})])
    shipped.clear_cache()
    m = shipped.lookup(attn_ctx(batch=8, seq=1024), version_of, str(tmp_path))
    assert m.fields["batch"] == 16 and dict(m.medians) == {"torch_sdpa.cudnn": 3.0}


# ------------------------------------------------------------------------------ public API on CPU
def test_explain_on_this_cpu_shows_the_shipped_term(tmp_path):
    x, w = torch.randn(4, 64), torch.randn(64)
    before = lz.explain("rms_norm", x, w)
    assert before.chosen == "torch_native.rms_norm" and before.shipped_source is None
    write(
        tmp_path,
        [(before.context, {"torch_native.rms_norm": 9.0, "reference.rms_norm": 3.0})],
        device=DeviceSpec.detect("cpu"),
        name="cpu-here.json",
    )
    use(tmp_path)
    after = lz.explain("rms_norm", x, w)
    assert after.chosen == "reference.rms_norm"  # 0 + 1000 beats 50 + 333.3
    assert after.candidate("torch_native.rms_norm").score.shipped == pytest.approx(1000 * 3 / 9)
    assert "shipped timings: cpu-here.json, exact bucket" in str(after)
    assert lz.which("rms_norm", x, w) == "reference.rms_norm"


def test_import_reads_no_timing_file():
    code = (
        "import sys\nseen = []\n"
        "sys.addaudithook(lambda ev, args: seen.append(str(args[0])) if ev == 'open' else None)\n"
        "import layerzero\nprint(sum('timings' in s for s in seen))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""},
    )
    assert out.stdout.strip() == "0"


def test_committed_files_parse_and_use_current_context_fields():
    known = (
        set(shipped.bucket_fields(attn_ctx()))
        | set(SelectionContext.__dataclass_fields__)
        | {"phase", "gqa_ratio"}
    )
    files = [p for p in (ROOT / "src" / "layerzero" / "data" / "timings").glob("*.json")]
    assert files, "no shipped timing file is committed"
    for path in files:
        f = shipped.parse(path.read_text(), path.name)
        assert f.records and set(f.fingerprint) >= {"device_type", "torch"}
        for rec in f.records:
            assert set(rec.fields) <= known, (path.name, set(rec.fields) - known)
