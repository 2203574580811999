"""Kernel-hub (``kernels`` package) kernels as LayerZero kernels: a fake local kernel, float64 oracle, no
network."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

kernels = pytest.importorskip("kernels", reason="kernels not installed (pip install 'layerzero[kernels]')")

import layerzero as lz  # noqa: E402
from layerzero.integrations.hub_kernels import load_hub_module, register_hub_kernel  # noqa: E402

_SOURCE = """
import torch

def rms_norm(x, weight, eps):
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight

def rms_norm_out(out, x, weight, eps):
    out.copy_(rms_norm(x, weight, eps))

def silu_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])
"""


def _fake_kernel(root: Path, name: str) -> Path:
    """A pure-Python local kernel repo in the layout ``kernels.get_local_kernel`` resolves: one noarch variant
    per backend this machine may select (``torch-cpu``, ``torch-cuda``), each ``metadata.json`` +
    ``<name>/__init__.py``."""
    for backend in ("cpu", "cuda"):
        variant = root / "build" / f"torch-{backend}"
        (variant / name).mkdir(parents=True)
        (variant / "metadata.json").write_text(
            json.dumps(
                {
                    "id": f"{name}_{backend}_{root.name}",
                    "name": name.replace("_", "-"),
                    "version": 1,
                    "license": "Apache-2.0",
                    "python-depends": [],
                    "backend": {"type": backend},
                }
            )
        )
        (variant / name / "__init__.py").write_text(_SOURCE)
    return root


@pytest.fixture()
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture()
def cleanup() -> list[str]:
    ids: list[str] = []
    yield ids
    for kid in ids:
        lz.unregister_kernel(kid)


def _oracle(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("adapter,fn", [("functional", "rms_norm"), ("out", "rms_norm_out")])
def test_rms_norm_from_local_kernel_matches_oracle(
    tmp_path: Path, no_network: None, cleanup: list[str], adapter: str, fn: str
) -> None:
    root = _fake_kernel(tmp_path / f"k_{adapter}", "fake_rms")
    kid = f"hub_fake_{adapter}.rms_norm"
    spec = lz.register_hub_kernel(
        "rms_norm",
        kid,
        root,
        fn,
        adapter=adapter,
        priority=1000,
        device_types={"cpu"},
        dtypes={"float32", "float64"},
    )
    cleanup.append(kid)
    assert spec.kernel_id == kid
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, 123, generator=g), torch.randn(123, generator=g)
    report = lz.explain("rms_norm", x, w, 1e-6)
    assert report.chosen == kid and kid in str(report)
    with lz.trace() as t:
        y = lz.rms_norm(x, w, 1e-6)
    assert t.kernels_for("rms_norm") == [kid]
    torch.testing.assert_close(y.double(), _oracle(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    # fused residual through the built-in adapter: (norm(x + r), x + r)
    r = torch.randn(5, 3, 123, generator=g, dtype=torch.float64)
    x64, w64 = x.double(), w.double()
    y2, h = lz.rms_norm(x64, w64, 1e-5, residual=r)
    torch.testing.assert_close(h, x64 + r, rtol=0, atol=0)
    torch.testing.assert_close(y2, _oracle(x64 + r, w64, 1e-5), rtol=1e-12, atol=1e-12)


def test_swiglu_silu_and_mul_adapter(tmp_path: Path, no_network: None, cleanup: list[str]) -> None:
    root = _fake_kernel(tmp_path / "act", "fake_act")
    register_hub_kernel(
        "swiglu",
        "hub_fake_act.silu_and_mul",
        str(root),
        "silu_and_mul",
        priority=1000,
        device_types={"cpu"},
        dtypes={"float64"},
    )
    cleanup.append("hub_fake_act.silu_and_mul")
    g = torch.Generator().manual_seed(1)
    gate, up = (
        torch.randn(4, 7, 33, generator=g, dtype=torch.float64),
        torch.randn(4, 7, 33, generator=g, dtype=torch.float64),
    )
    with lz.trace() as t:
        out = lz.swiglu(gate, up)
    assert t.kernels_for("swiglu") == ["hub_fake_act.silu_and_mul"]
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-12, atol=1e-12)


def test_custom_adapter_callable(tmp_path: Path, no_network: None, cleanup: list[str]) -> None:
    root = _fake_kernel(tmp_path / "custom", "fake_custom")
    calls: list[int] = []

    def adapter(hub_fn, x, weight, eps, residual):  # noqa: ANN001, ANN202
        calls.append(1)
        return hub_fn(x, weight, eps)

    register_hub_kernel(
        "rms_norm",
        "hub_custom.rms",
        root,
        "rms_norm",
        adapter=adapter,
        priority=1000,
        device_types={"cpu"},
        dtypes={"float64"},
    )
    cleanup.append("hub_custom.rms")
    x, w = torch.randn(2, 16, dtype=torch.float64), torch.ones(16, dtype=torch.float64)
    torch.testing.assert_close(lz.rms_norm(x, w, 1e-6), _oracle(x, w, 1e-6))
    assert calls


def test_missing_directory_is_typed_error_without_network(tmp_path: Path, no_network: None) -> None:
    with pytest.raises(lz.BackendNotAvailableError, match="does not exist"):
        lz.register_hub_kernel("rms_norm", "hub_missing.rms", tmp_path / "nope", "rms_norm")
    empty = tmp_path / "empty"
    (empty / "build").mkdir(parents=True)
    with pytest.raises(lz.BackendNotAvailableError, match="cannot load local kernel"):
        register_hub_kernel("rms_norm", "hub_empty.rms", empty, "rms_norm")
    assert "hub_missing.rms" not in str(lz.explain("rms_norm", torch.randn(2, 8), torch.ones(8), 1e-6))


def test_repo_id_not_in_local_cache_is_typed_error_without_network(
    tmp_path: Path, no_network: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(lz.BackendNotAvailableError, match="locally"):
        load_hub_module("kernels-community/definitely-not-cached", version=1)
    with pytest.raises(lz.ConfigurationError, match="revision= or version="):
        load_hub_module("kernels-community/activation")


def test_bad_function_and_adapter_are_configuration_errors(tmp_path: Path, no_network: None) -> None:
    root = _fake_kernel(tmp_path / "bad", "fake_bad")
    with pytest.raises(lz.ConfigurationError, match="has no function 'nope'.*rms_norm"):
        register_hub_kernel("rms_norm", "hub_bad.rms", root, "nope")
    with pytest.raises(lz.ConfigurationError, match="adapter"):
        register_hub_kernel("rms_norm", "hub_bad.rms", root, "rms_norm", adapter="sideways")
    with pytest.raises(lz.ConfigurationError, match="adapter"):
        register_hub_kernel(
            "attention", "hub_bad.attn", root, "rms_norm"
        )  # no built-in adapter for attention


def test_missing_kernels_package_is_typed_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "kernels", None)  # import kernels -> ImportError
    with pytest.raises(lz.BackendNotAvailableError, match="not installed"):
        register_hub_kernel("rms_norm", "hub_x.rms", tmp_path, "rms_norm")


def test_import_layerzero_does_not_import_kernels() -> None:
    code = (
        "import sys, layerzero, layerzero.integrations.hub_kernels; "
        "assert 'kernels' not in sys.modules, 'kernels imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
