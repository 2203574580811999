"""Offline plans: ``lz.solve`` / ``DispatchTable`` save+load with fingerprints / ``lz.install_table`` /
``lz.dry_run`` / ``lz.readiness_check`` and the ``layerzero solve|dry-run|readiness`` commands.

Oracles: ``lz.which`` for solved kernels, ``lz.trace()`` counts for the kernel a compiled call used, a float64
RMSNorm for outputs, a counting registered kernel for "dry run runs nothing"."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import layerzero as lz
from layerzero.cli import main as cli_main
from layerzero.core.runtime import RUNTIME
from layerzero.planning import TableMissError
from layerzero.planning.warmup import WARMED


@pytest.fixture(autouse=True)
def _clean():
    lz.uninstall_table()
    WARMED.clear()
    yield
    lz.uninstall_table()
    WARMED.clear()


def _inputs():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 16, 64, generator=g), torch.randn(64, generator=g)
    q = torch.randn(1, 4, 16, 32, generator=g)
    gate, up = torch.randn(2, 16, 128, generator=g), torch.randn(2, 16, 128, generator=g)
    return x, w, q, gate, up


def _cases():
    x, w, q, gate, up = _inputs()
    return [
        ("rms_norm", (x, w), {}),
        ("attention", (q, q, q), {"is_causal": True}),
        ("swiglu", (gate, up), {}),
    ]


def test_solve_matches_which_with_reasons():
    cases = _cases()
    table = lz.solve(cases)
    assert len(table) == 3
    for (op, args, kwargs), entry in zip(cases, table.entries, strict=True):
        assert entry.op == op
        assert entry.kernel_id == lz.which(op, *args, **kwargs)
        assert "score" in entry.why and "eligible" in entry.why
        assert entry.rejected  # e.g. CUDA-only kernels with their reason codes
        assert all(isinstance(c, str) for codes in entry.rejected.values() for c in codes)
        assert entry.measured_us is None  # fresh PerfDB: nothing measured
    assert "rms_norm" in str(table)


def test_solve_same_bucket_once():
    x, w, *_ = _inputs()
    table = lz.solve([("rms_norm", (x, w), {}), ("rms_norm", (x[:, :15].contiguous(), w), {})])  # one bucket
    assert len(table) == 1


def test_save_load_round_trip(tmp_path):
    table = lz.solve(_cases())
    path = tmp_path / "t.json"
    table.save(path)
    loaded = lz.load_table(path)
    assert loaded.entries == table.entries
    assert loaded.fingerprint == table.fingerprint


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda fp: fp.__setitem__("torch", "1.0.0"), "torch"),
        (lambda fp: fp["devices"]["cpu"].__setitem__("isa", "avx1024"), "devices.cpu.isa"),
        (lambda fp: fp.__setitem__("policy_hash", "deadbeef"), "policy_hash"),
    ],
)
def test_fingerprint_mismatch_refused_naming_field(tmp_path, edit, field):
    path = tmp_path / "t.json"
    lz.solve(_cases()).save(path)
    data = json.loads(path.read_text())
    edit(data["fingerprint"])
    path.write_text(json.dumps(data))
    with pytest.raises(lz.TableMismatchError, match=field.replace(".", r"\.")) as info:
        lz.load_table(path)
    assert [f[0] for f in info.value.fields] == [field]
    assert isinstance(info.value, lz.ConfigurationError)
    table = lz.load_table(path, check=False)
    with pytest.raises(lz.TableMismatchError):
        lz.install_table(table)


def test_bad_table_file(tmp_path):
    from layerzero.planning import TableError

    path = tmp_path / "t.json"
    path.write_text('{"version": 99}')
    with pytest.raises(TableError, match="version"):
        lz.load_table(path)


def test_compile_uses_table_kernel_over_prefer():
    x, w, *_ = _inputs()
    table = lz.solve([("rms_norm", (x, w), {})])
    assert table.entries[0].kernel_id == "torch_native.rms_norm"
    with lz.prefer("reference.rms_norm"), lz.trace() as tr:  # without a table, the preference wins
        lz.rms_norm(x, w)
    assert tr.kernels_for("rms_norm") == ["reference.rms_norm"]
    lz.install_table(table)
    with lz.prefer("reference.rms_norm"), lz.trace() as tr:
        out = lz.rms_norm(x, w)
    assert tr.kernels_for("rms_norm") == ["torch_native.rms_norm"]
    x64, w64 = x.double(), w.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    report = lz.explain("rms_norm", x, w)
    assert report.chosen == "torch_native.rms_norm"
    assert any("compiled table" in n for n in report.notes)
    assert lz.uninstall_table() is True and lz.uninstall_table() is False


def test_compiled_outputs_match_float64_reference():
    x, w, q, gate, up = _inputs()
    lz.install_table(lz.solve(_cases()))
    with lz.trace() as tr:
        att = lz.attention(q, q, q, is_causal=True)
        sw = lz.swiglu(gate, up)
    assert not tr.fallbacks
    q64 = q.double()
    s = (q64 @ q64.transpose(-1, -2)) / 32**0.5
    s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(att.double(), s.softmax(-1) @ q64, rtol=1e-5, atol=1e-5)
    g64 = gate.double()
    torch.testing.assert_close(sw.double(), g64 * torch.sigmoid(g64) * up.double(), rtol=1e-5, atol=1e-5)


def test_missing_bucket_falls_back_with_log_or_raises_in_strict(caplog):
    x, w, *_ = _inputs()
    compiled = lz.install_table(lz.solve([("rms_norm", (x, w), {})]))
    other, w2 = (
        torch.randn(2, 16, 128),
        torch.randn(128),
    )  # rms_norm buckets by hidden size: 128 is not solved
    with caplog.at_level(logging.WARNING, logger="layerzero"):
        lz.rms_norm(other, w2)
        lz.rms_norm(torch.randn(4, 8, 128), w2)  # same bucket: logged once
    msgs = [r.getMessage() for r in caplog.records if "not in the compiled table" in r.getMessage()]
    assert len(msgs) == 1 and "rms_norm" in msgs[0]
    assert len(compiled.missed) == 1
    assert any("not in the table" in n for n in lz.explain("rms_norm", other, w2).notes)
    lz.install_table(lz.solve([("rms_norm", (x, w), {})]), strict=True)
    lz.rms_norm(x, w)
    with pytest.raises(TableMissError, match="not in the compiled dispatch table"):
        lz.rms_norm(other, w2)


def test_compile_refuses_other_coordinator():
    RUNTIME.ensure_ready()
    RUNTIME.coordinator = object()  # stands in for lz.distributed.sync_selection
    try:
        with pytest.raises(lz.ConfigurationError, match="cannot be combined"):
            lz.install_table(lz.solve(_cases()[:1]))
    finally:
        RUNTIME.coordinator = None


def test_compiled_kernel_that_cannot_run_falls_back(tmp_path):
    x, w, *_ = _inputs()
    path = tmp_path / "t.json"
    lz.solve([("rms_norm", (x, w), {})]).save(path)
    data = json.loads(path.read_text())
    data["entries"][0]["kernel_id"] = "triton.rms_norm"  # CUDA-only here
    path.write_text(json.dumps(data))
    compiled = lz.install_table(lz.load_table(path))
    with lz.trace() as tr:
        lz.rms_norm(x, w)
    assert tr.kernels_for("rms_norm") == ["torch_native.rms_norm"]
    assert compiled.missed


def _model(x, w, q, gate, up):
    h = lz.rms_norm(x, w)
    a = lz.attention(q, q, q, is_causal=True)
    return lz.swiglu(gate, up).sum() + h.sum() + a.sum()


def test_dry_run_reports_ops_and_runs_no_kernel():
    calls = []

    def counting(x, weight, eps, residual):
        calls.append(1)
        return x

    lz.register_kernel("rms_norm", "counting.rms", counting, priority=99, device_types={"cpu"})
    try:
        with lz.trace() as tr:
            report = lz.dry_run(_model, *_inputs())
        assert [r.op for r in report.rows] == ["rms_norm", "attention", "swiglu"]
        assert report.rows[0].kernel == "counting.rms"
        assert report.rows[1].kernel == lz.which("attention", *(_inputs()[2],) * 3, is_causal=True)
        assert not any(r.ran for r in report.rows)
        assert calls == [] and not tr.counts
        assert "run" not in vars(RUNTIME) and "run_hot" not in vars(
            RUNTIME
        )  # the hot path is restored as it was
        assert [c.op for c in report.manifest] == ["rms_norm", "attention", "swiglu"]
        assert "counting.rms" in str(report) and "float32[2,16,64]" in str(report)
        # the derived manifest solves to the same kernels
        table = lz.solve(report.manifest)
        assert [e.kernel_id for e in table.entries] == [r.kernel for r in report.rows]
        # after the dry run, ops run normally again
        x, w, *_ = _inputs()
        lz.rms_norm(x, w)
        assert calls == [1]
    finally:
        lz.unregister_kernel("counting.rms")


def test_readiness_ok_and_not_ok(tmp_path):
    report = lz.readiness_check()
    assert report.ok, str(report)
    assert {c.name for c in report.checks} == {"backends", "perfdb", "table", "warm", "graph_safe"}
    x, w, *_ = _inputs()
    lz.warmup(lz.Manifest().add("rms_norm", x, w))
    assert lz.readiness_check().check("warm").ok
    lz.configure(cache_size=1000)  # invalidates cached choices: the warmed key is cold again
    cold = lz.readiness_check()
    assert not cold.ok and not cold.check("warm").ok and "not cached" in cold.check("warm").detail
    WARMED.clear()
    path = tmp_path / "t.json"
    lz.solve(_cases()[:1]).save(path)
    data = json.loads(path.read_text())
    data["fingerprint"]["layerzero"] = "0.0.1"
    path.write_text(json.dumps(data))
    bad = lz.readiness_check(lz.load_table(path, check=False))
    assert not bad.ok and "layerzero" in bad.check("table").detail
    assert "NOT READY" in str(bad)


def test_cli_solve_dry_run_readiness(tmp_path, capsys):
    manifest = {
        "version": 1,
        "device": "cpu",
        "cases": [
            {
                "op": "rms_norm",
                "critical": True,
                "args": [{"shape": [2, 16, 64]}, {"shape": [64]}],
                "kwargs": {},
            },
            {"op": "attention", "args": [{"shape": [1, 4, 16, 32]}] * 3, "kwargs": {"is_causal": True}},
        ],
    }
    mpath, tpath = tmp_path / "m.json", tmp_path / "t.json"
    mpath.write_text(json.dumps(manifest))
    assert cli_main(["solve", "--manifest", str(mpath), "--out", str(tpath)]) == 0
    assert len(lz.load_table(tpath)) == 2
    assert cli_main(["dry-run", "--manifest", str(mpath)]) == 0
    out = capsys.readouterr().out
    assert "torch_native.rms_norm" in out and "attention" in out
    assert cli_main(["readiness", "--table", str(tpath)]) == 0
    data = json.loads(tpath.read_text())
    data["fingerprint"]["torch"] = "0.1"
    tpath.write_text(json.dumps(data))
    assert cli_main(["readiness", "--table", str(tpath)]) == 1


def test_manifest_errors():
    from layerzero.planning import ManifestError

    with pytest.raises(ManifestError, match="case 0"):
        lz.solve([("rms_norm", "not a tuple", {})])
    with pytest.raises(ManifestError, match=r"cases\[0\]\.args\[0\]\.dtype"):
        lz.planning.Manifest.from_dict(
            {"version": 1, "cases": [{"op": "rms_norm", "args": [{"shape": [2], "dtype": "nope"}]}]}
        )


def test_the_old_names_are_deprecated_aliases():
    """``lz.compile`` / ``lz.uncompile`` (issue 36: read like ``torch.compile``, shadowed the builtin) still
    work for one release, with a DeprecationWarning naming the new call."""
    x, w = torch.randn(3, 8), torch.ones(8)
    with pytest.warns(DeprecationWarning, match="install_table"):
        compiled = lz.compile(lz.solve([("rms_norm", (x, w), {})]))
    assert RUNTIME.coordinator is compiled
    with pytest.warns(DeprecationWarning, match="uninstall_table"):
        assert lz.uncompile() is True
    assert RUNTIME.coordinator is None
