"""Configuration: ``lz.configure`` / ``lz.get_config`` / ``lz.load_config`` / ``lz.reload``, their typed
errors, the env layer, the epoch that invalidates cached selections, and the conftest isolation."""

from __future__ import annotations

import math

import pytest
import torch

import layerzero as lz
from layerzero.core import config as lz_config
from layerzero.core.config import CONFIG_OPTIONS, Config

pytestmark = pytest.mark.unit

DEFAULTS = {
    "strict": False,
    "cache_size": 4096,
    "cache_ttl_s": None,
    "use_perfdb": True,
    "perf_weight": 1000.0,
    "log_fallbacks": True,
    "selection_timeout_s": 30.0,
    "health_failure_threshold": 3,
    "health_cooldown_s": 30.0,
}


def _qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))


def test_defaults_and_isolated_perfdb(tmp_path):
    cfg = lz.get_config()
    assert isinstance(cfg, Config)
    d = cfg.to_dict()
    assert {k: d[k] for k in DEFAULTS} == DEFAULTS
    assert d["perfdb_path"] == str(tmp_path / "perfdb.sqlite")
    assert set(d) == set(CONFIG_OPTIONS)


def test_configure_changes_and_get_config_reflects():
    new = lz.configure(strict=True, cache_size=8, perf_weight=5.0, cache_ttl_s=2.5)
    assert new is lz.get_config()
    assert (new.strict, new.cache_size, new.perf_weight, new.cache_ttl_s) == (True, 8, 5.0, 2.5)
    assert lz.get_config().use_perfdb is True  # untouched options keep their value


def test_configure_is_reset_between_tests_part1():
    lz.configure(strict=True)
    lz.lock("attention", "torch_sdpa.math")


def test_configure_is_reset_between_tests_part2():
    assert lz.get_config().strict is False
    assert lz.get_locks() == {}


def test_configure_unknown_option_lists_known_ones():
    with pytest.raises(lz.ConfigurationError, match=r"unknown config option\(s\) \['stirct'\]") as info:
        lz.configure(stirct=True)
    for name in CONFIG_OPTIONS:
        assert name in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("cache_size", 0, "cache_size: expected an int > 0, got 0"),
        ("cache_size", -5, "cache_size: expected an int > 0"),
        ("cache_size", 2.5, "cache_size: expected an int > 0"),
        ("cache_size", True, "cache_size: expected an int > 0, got True"),
        ("strict", "yes", "strict: expected a bool, got 'yes'"),
        ("strict", 1, "strict: expected a bool"),
        ("use_perfdb", None, "use_perfdb: expected a bool"),
        ("log_fallbacks", "no", "log_fallbacks: expected a bool"),
        ("perf_weight", math.nan, "perf_weight: expected a finite number > 0"),
        ("perf_weight", -1.0, "perf_weight: expected a finite number > 0"),
        ("selection_timeout_s", math.inf, "selection_timeout_s: expected a finite number > 0"),
        ("health_cooldown_s", 0, "health_cooldown_s: expected a finite number > 0"),
        ("health_failure_threshold", 0, "health_failure_threshold: expected an int > 0"),
        ("cache_ttl_s", -1, "cache_ttl_s: expected a finite number > 0"),
        ("perfdb_path", 42, "perfdb_path: expected a str path or None"),
    ],
)
def test_configure_bad_values_rejected(option, value, match):
    before = lz.get_config()
    with pytest.raises(lz.ConfigurationError, match=match):
        lz.configure(**{option: value})
    assert lz.get_config() == before  # a rejected change leaves the config as it was


def test_configure_bumps_epoch():
    e0 = lz_config.epoch()
    lz.configure(strict=False)
    assert lz_config.epoch() > e0


def test_load_config_with_config_section(tmp_path):
    path = tmp_path / "lz.yaml"
    path.write_text(
        "version: 1\n"
        "deny:\n  - op: attention\n    kernels: [torch_sdpa.flash]\n"
        "config:\n  cache_size: 17\n  perf_weight: 3.5\n  log_fallbacks: false\n",
        encoding="utf-8",
    )
    cfg = lz.load_config(path)
    assert (cfg.cache_size, cfg.perf_weight, cfg.log_fallbacks) == (17, 3.5, False)
    assert lz.get_config() == cfg
    assert lz.which("attention", *_qkv()) == "torch_sdpa.math"


def test_load_config_only_config_section(tmp_path):
    path = tmp_path / "only.yaml"
    path.write_text("config:\n  strict: true\n", encoding="utf-8")
    assert lz.load_config(path).strict is True
    assert lz.which("attention", *_qkv()) == "torch_sdpa.flash"


def test_load_config_replaces_previous_file_policy(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("version: 1\ndeny:\n  - op: attention\n    kernels: [torch_sdpa.flash]\n", encoding="utf-8")
    b.write_text("version: 1\n", encoding="utf-8")
    lz.load_config(a)
    assert lz.which("attention", *_qkv()) == "torch_sdpa.math"
    lz.load_config(b)
    assert lz.which("attention", *_qkv()) == "torch_sdpa.flash"


def test_load_config_keeps_code_locks(tmp_path):
    lz.lock("attention", "reference.attention")
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\n", encoding="utf-8")
    lz.load_config(path)
    assert lz.which("attention", *_qkv()) == "reference.attention"


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        ("config:\n  bogus: 1\n", lz.ConfigurationError, r"unknown config option\(s\) \['bogus'\]"),
        ("config:\n  cache_size: 0\n", lz.ConfigurationError, "cache_size: expected an int > 0"),
        ("config: [1, 2]\n", lz.ConfigurationError, "config: expected a mapping of options"),
        ("- 1\n- 2\n", lz.PolicyValidationError, "top level: expected a mapping"),
        ("version: 2\n", lz.PolicyValidationError, "version: expected 1"),
        ("version: 1\ndenny: []\n", lz.PolicyValidationError, "Did you mean 'deny'"),
        ("version: 1\nlocks: [\n", lz.PolicyValidationError, "not valid YAML"),
    ],
)
def test_load_config_bad_files(tmp_path, text, error, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    before = lz.get_config()
    with pytest.raises(error, match=match):
        lz.load_config(path)
    assert lz.get_config() == before


def test_load_config_missing_file(tmp_path):
    with pytest.raises(lz.ConfigurationError, match="expected an existing YAML file"):
        lz.load_config(tmp_path / "nope.yaml")


def test_load_config_rejects_duplicate_keys(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(
        "version: 1\ndeny:\n  - op: attention\n    kernels: [torch_sdpa.flash]\ndeny: []\n", encoding="utf-8"
    )
    with pytest.raises(lz.PolicyValidationError, match="duplicate key"):
        lz.load_config(path)


def test_env_strict_and_cache_size_read_on_reload(monkeypatch):
    monkeypatch.setenv("LAYERZERO_STRICT", "1")
    monkeypatch.setenv("LAYERZERO_CACHE_SIZE", "33")
    assert lz.get_config().strict is False  # read once; the conftest loaded the env before these were set
    lz.reload()
    assert lz.get_config().strict is True and lz.get_config().cache_size == 33


def test_env_malformed_value_raises_on_reload(monkeypatch):
    monkeypatch.setenv("LAYERZERO_CACHE_SIZE", "-3")
    with pytest.raises(
        lz.ConfigurationError, match="LAYERZERO_CACHE_SIZE: expected an integer > 0, got '-3'"
    ):
        lz.reload()


def test_env_disabled_means_reference_only(monkeypatch):
    monkeypatch.setenv("LAYERZERO_DISABLED", "true")
    lz.reload()
    assert lz.which("attention", *_qkv()) == "reference.attention"
    assert lz.which("rms_norm", torch.ones(2, 8), torch.ones(8)) == "reference.rms_norm"


def test_env_deny_and_prefer(monkeypatch):
    monkeypatch.setenv("LAYERZERO_DENY", "torch_sdpa.flash")
    lz.reload()
    assert lz.which("attention", *_qkv()) == "torch_sdpa.math"
    monkeypatch.delenv("LAYERZERO_DENY")
    monkeypatch.setenv("LAYERZERO_PREFER", "reference")
    lz.reload()
    assert lz.which("attention", *_qkv()) == "reference.attention"


def test_config_is_frozen():
    cfg = lz.get_config()
    with pytest.raises(AttributeError):
        cfg.strict = True  # type: ignore[misc]


def test_config_direct_construction_validates():
    with pytest.raises(lz.ConfigurationError, match="cache_size"):
        Config(cache_size=0)
