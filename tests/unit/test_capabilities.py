"""Capability descriptors: the files under capabilities/ equal the code, and overrides change selection."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import layerzero as lz
from layerzero.core.capabilities import describe_backend, load_overrides
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2] / "capabilities"


@pytest.mark.parametrize("backend", ["reference", "torch_sdpa", "torch_native"])
def test_descriptor_files_match_registered_specs(backend):
    RUNTIME.ensure_ready()
    on_disk = yaml.safe_load((ROOT / f"{backend}.yaml").read_text())
    assert on_disk == describe_backend(RUNTIME.registry, backend), (
        "capabilities/ drifted from the code: run `layerzero capabilities --write capabilities`"
    )


def test_override_changes_selection_and_is_undone(tmp_path):
    q = k = v = torch.randn(1, 2, 4, 8)
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"
    original = RUNTIME.registry.kernel("torch_sdpa.flash")
    path = tmp_path / "o.yaml"
    path.write_text("version: 1\nkernels:\n  torch_sdpa.flash: {head_dim_max: 4}\n")
    try:
        assert lz.load_capabilities(str(path)) == ["torch_sdpa.flash"]
        assert lz.which("attention", q, k, v) == "torch_sdpa.math"
        reasons = lz.validate("torch_sdpa.flash", "attention", q, k, v)
        assert [r.code for r in reasons] == [lz.ReasonCode.HEAD_DIM_TOO_LARGE]
    finally:
        RUNTIME.registry.add_kernel(original, replace=True)
    assert lz.which("attention", q, k, v) == "torch_sdpa.flash"


def test_alibi_and_kv_cache_dtype_overrides_change_selection(tmp_path):
    """``supports_alibi`` and ``kv_cache_dtypes`` are overridable (a kernel that gains the feature in a new
    release): turning ALiBi off for the CPU default moves the call to SDPA math; the parsed kv dtypes are
    torch dtypes."""
    q = k = v = torch.randn(1, 2, 4, 8)
    slopes = torch.tensor([0.5, 0.25])
    before = lz.which("attention", q, k, v, alibi_slopes=slopes)
    assert RUNTIME.registry.kernel(before).supports_alibi
    original = RUNTIME.registry.kernel(before)
    path = tmp_path / "o.yaml"
    path.write_text(f"version: 1\nkernels:\n  {before}: {{supports_alibi: false, kv_cache_dtypes: [int8]}}\n")
    assert load_overrides(path)[before] == {
        "supports_alibi": False,
        "kv_cache_dtypes": frozenset({torch.int8}),
    }
    try:
        lz.load_capabilities(str(path))
        after = lz.which("attention", q, k, v, alibi_slopes=slopes)
        assert after != before and RUNTIME.registry.kernel(after).supports_alibi
        reasons = lz.validate(before, "attention", q, k, v, alibi_slopes=slopes)
        assert lz.ReasonCode.ALIBI_UNSUPPORTED in [r.code for r in reasons]
    finally:
        RUNTIME.registry.add_kernel(original, replace=True)
    assert lz.which("attention", q, k, v, alibi_slopes=slopes) == before


@pytest.mark.parametrize(
    "text, match",
    [
        ("version: 2\nkernels: {}\n", "version"),
        ("version: 1\nkernels:\n  torch_sdpa.flash: {kv_cache_dtypes: [float16]}\n", "values from"),
        ("version: 1\nkernels:\n  torch_sdpa.flash: {supports_alibi: 1}\n", "true or false"),
        ("version: 1\nkernels:\n  torch_sdpa.flash: {fn: 1}\n", "one of"),
        ("version: 1\nkernels:\n  torch_sdpa.flash: {head_dim_max: big}\n", "an int"),
        ("version: 1\nkernels:\n  torch_sdpa.flash: {dtypes: [int8]}\n", "values from"),
        ("version: 1\nkernels:\n  torch_sdpa.flash: {sm_min: nine}\n", "SM version"),
        ("version: 1\nextra: 1\n", "keys"),
    ],
)
def test_bad_override_files_are_rejected(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(lz.ConfigurationError, match=match):
        load_overrides(path)


def test_override_of_unknown_kernel_is_rejected(tmp_path):
    path = tmp_path / "u.yaml"
    path.write_text("version: 1\nkernels:\n  nope.kernel: {priority: 1}\n")
    with pytest.raises(lz.UnknownKernelError, match="nope.kernel"):
        lz.load_capabilities(str(path))
