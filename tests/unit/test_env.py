"""Unit tests of layerzero.core.env: every LAYERZERO_* variable parsed to its type, every malformed value
rejected with a ConfigurationError naming the variable, unknown names warned about."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from layerzero.core.env import ENV_VARS, EnvSettings, LogLevel, read_env
from layerzero.core.errors import ConfigurationError

pytestmark = pytest.mark.unit


def test_empty_environment_gives_all_unset() -> None:
    s = read_env({"PATH": "/usr/bin", "HOME": "/root"})
    assert s == EnvSettings()
    assert s.strict is None and s.cache_size is None and s.locks == () and s.unknown == ()


def test_every_variable_parsed(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\n")
    s = read_env(
        {
            "LAYERZERO_POLICY": str(policy),
            "LAYERZERO_LOCK": "attention=torch_sdpa.math, rms_norm = torch_native.rms_norm",
            "LAYERZERO_ALLOW": "torch_sdpa.*,reference",
            "LAYERZERO_DENY": " torch_sdpa.cudnn ",
            "LAYERZERO_PREFER": "liger,liger",
            "LAYERZERO_STRICT": "Yes",
            "LAYERZERO_DISABLED": "off",
            "LAYERZERO_LOG_LEVEL": "debug",
            "LAYERZERO_PERFDB": "~/lz.sqlite",
            "LAYERZERO_USE_PERFDB": "0",
            "LAYERZERO_CACHE_SIZE": "512",
            "LAYERZERO_CACHE_TTL_S": "2.5",
            "LAYERZERO_SHIPPED_TIMINGS": "off",
            "LAYERZERO_AUTOTUNE": "1",
        }
    )
    assert s.policy_path == str(policy)
    assert s.locks == (("attention", "torch_sdpa.math"), ("rms_norm", "torch_native.rms_norm"))
    assert (
        s.allow == ("torch_sdpa.*", "reference")
        and s.deny == ("torch_sdpa.cudnn",)
        and s.prefer == ("liger",)
    )
    assert s.strict is True and s.disabled is False and s.use_perfdb is False
    assert s.log_level is LogLevel.DEBUG and s.log_level.level == logging.DEBUG
    assert s.perfdb_path is not None and s.perfdb_path.endswith("lz.sqlite") and "~" not in s.perfdb_path
    assert s.cache_size == 512 and s.cache_ttl_s == 2.5
    assert s.use_shipped_timings is False and s.autotune is True
    d = s.to_dict()
    assert d["log_level"] == "DEBUG" and d["locks"][0] == ["attention", "torch_sdpa.math"]
    assert set(d) == {
        "policy_path",
        "locks",
        "allow",
        "deny",
        "prefer",
        "strict",
        "disabled",
        "log_level",
        "perfdb_path",
        "use_perfdb",
        "cache_size",
        "cache_ttl_s",
        "capabilities_path",
        "use_shipped_timings",
        "autotune",
        "unknown",
    }


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("on", True),
        (" On ", True),
        ("0", False),
        ("false", False),
        ("False", False),
        ("no", False),
        ("OFF", False),
    ],
)
def test_bool_spellings(raw: str, expected: bool) -> None:
    assert read_env({"LAYERZERO_STRICT": raw}).strict is expected


@pytest.mark.parametrize(
    ("raw", "expected"), [("none", None), ("NONE", None), ("0.001", 0.001), ("60", 60.0)]
)
def test_ttl(raw: str, expected: float | None) -> None:
    assert read_env({"LAYERZERO_CACHE_TTL_S": raw}).cache_ttl_s == expected


def test_empty_value_means_unset() -> None:
    assert (
        read_env({"LAYERZERO_STRICT": "", "LAYERZERO_CACHE_SIZE": "   ", "LAYERZERO_LOCK": ""})
        == EnvSettings()
    )


@pytest.mark.parametrize(
    ("name", "raw", "match"),
    [
        (
            "LAYERZERO_STRICT",
            "maybe",
            r"LAYERZERO_STRICT: expected a bool \(1/0/true/false/yes/no/on/off\), got 'maybe'",
        ),
        ("LAYERZERO_DISABLED", "2", "LAYERZERO_DISABLED: expected a bool"),
        ("LAYERZERO_USE_PERFDB", "y", "LAYERZERO_USE_PERFDB: expected a bool"),
        ("LAYERZERO_CACHE_SIZE", "0", r"LAYERZERO_CACHE_SIZE: expected an integer > 0, got '0'"),
        ("LAYERZERO_CACHE_SIZE", "-3", "LAYERZERO_CACHE_SIZE: expected an integer > 0"),
        ("LAYERZERO_CACHE_SIZE", "1.5", "LAYERZERO_CACHE_SIZE"),
        ("LAYERZERO_CACHE_SIZE", "1e3", "LAYERZERO_CACHE_SIZE"),
        ("LAYERZERO_CACHE_SIZE", "9" * 40, "LAYERZERO_CACHE_SIZE"),
        ("LAYERZERO_CACHE_TTL_S", "0", "LAYERZERO_CACHE_TTL_S: expected seconds"),
        ("LAYERZERO_CACHE_TTL_S", "-1", "LAYERZERO_CACHE_TTL_S"),
        ("LAYERZERO_CACHE_TTL_S", "inf", "LAYERZERO_CACHE_TTL_S"),
        ("LAYERZERO_CACHE_TTL_S", "nan", "LAYERZERO_CACHE_TTL_S"),
        ("LAYERZERO_CACHE_TTL_S", "soon", "LAYERZERO_CACHE_TTL_S"),
        (
            "LAYERZERO_LOG_LEVEL",
            "TRACE",
            r"LAYERZERO_LOG_LEVEL: expected one of \['DEBUG', 'INFO', 'WARNING', 'ERROR'\]",
        ),
        (
            "LAYERZERO_POLICY",
            "/nonexistent/p.yaml",
            "LAYERZERO_POLICY: expected the path of an existing YAML",
        ),
        ("LAYERZERO_PERFDB", "a\0b", "LAYERZERO_PERFDB: expected a file path"),
        ("LAYERZERO_LOCK", "attention", "LAYERZERO_LOCK: expected op=kernel_id pairs"),
        ("LAYERZERO_LOCK", "=torch_sdpa.math", "LAYERZERO_LOCK: expected op=kernel_id pairs"),
        ("LAYERZERO_LOCK", "atten tion=a.b", "LAYERZERO_LOCK"),
        ("LAYERZERO_LOCK", "attention=torch_sdpa", r"LAYERZERO_LOCK: expected an exact kernel id"),
        ("LAYERZERO_LOCK", "attention=torch_sdpa.*", "LAYERZERO_LOCK: expected an exact kernel id"),
        ("LAYERZERO_LOCK", "attention=a.b,attention=a.c", "at most one lock per op"),
        ("LAYERZERO_LOCK", "attention=a.b,", "Item 1 is empty"),
        ("LAYERZERO_DENY", "a,,b", "LAYERZERO_DENY: expected a comma-separated list"),
        ("LAYERZERO_ALLOW", "torch sdpa", "LAYERZERO_ALLOW: expected a kernel or backend glob"),
        ("LAYERZERO_PREFER", "a;b", "LAYERZERO_PREFER"),
    ],
)
def test_malformed_values_rejected(name: str, raw: str, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match) as info:
        read_env({name: raw})
    assert isinstance(info.value, ValueError)


def test_non_string_value_rejected() -> None:
    with pytest.raises(ConfigurationError, match="LAYERZERO_STRICT: expected a string value, got int"):
        read_env({"LAYERZERO_STRICT": 1})  # type: ignore[dict-item]


def test_unknown_variables_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="layerzero.env"):
        s = read_env({"LAYERZERO_STRIKT": "1", "LAYERZERO_POLICY_X": "", "OTHER": "x"})
    assert s.unknown == ("LAYERZERO_POLICY_X", "LAYERZERO_STRIKT")
    assert "Did you mean 'LAYERZERO_STRICT'" in caplog.text


def test_reads_nothing_at_import_and_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERZERO_CACHE_SIZE", "77")
    assert read_env().cache_size == 77
    monkeypatch.setenv("LAYERZERO_CACHE_SIZE", "78")
    assert read_env().cache_size == 78  # read on each call, not cached


def test_env_vars_table_is_complete() -> None:
    assert set(ENV_VARS) == {
        "LAYERZERO_POLICY",
        "LAYERZERO_LOCK",
        "LAYERZERO_ALLOW",
        "LAYERZERO_DENY",
        "LAYERZERO_PREFER",
        "LAYERZERO_STRICT",
        "LAYERZERO_DISABLED",
        "LAYERZERO_LOG_LEVEL",
        "LAYERZERO_PERFDB",
        "LAYERZERO_USE_PERFDB",
        "LAYERZERO_CACHE_SIZE",
        "LAYERZERO_CACHE_TTL_S",
        "LAYERZERO_CAPABILITIES",
        "LAYERZERO_SHIPPED_TIMINGS",
        "LAYERZERO_AUTOTUNE",
        "LAYERZERO_API_KEY",
        "LAYERZERO_SYMM_MEM",
        "LAYERZERO_WORKER_PROFILE",
        "LAYERZERO_PIECEWISE_MAX_TOKENS",
    }
    doc = EnvSettings.__doc__ or ""
    assert all(name in doc for name in ENV_VARS)
    docs = Path(__file__).resolve().parents[2] / "docs" / "policies.md"
    text = docs.read_text()
    assert all(f"`{name}`" in text for name in ENV_VARS)
