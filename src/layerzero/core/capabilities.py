"""Capability descriptors: kernel constraints as versioned, schema-checked data.

``describe_backend`` writes a backend's KernelSpec constraints as plain YAML-ready data (the files under
``capabilities/`` are these descriptors, and a test keeps them equal to the code). ``load_overrides`` reads
a descriptor (or a partial one) and ``apply_overrides`` replaces the named fields of registered kernels —
for example to widen ``torch_sdpa.cudnn``'s head-dim limit on a newer cuDNN without a release:

.. code-block:: yaml

    version: 1
    kernels:
      torch_sdpa.cudnn: {head_dim_max: 256}

Only constraint fields can be overridden, never the callable. Errors are ``ConfigurationError`` naming the
file, the kernel and the field with expected vs got.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from .arguments import check_path
from .errors import ConfigurationError, expected_got
from .kv_quant import KV_QUANT_DTYPES
from .policy import safe_load_yaml
from .registry import KernelRegistry
from .specs import CPU_ISA_NAMES, KernelSpec, MaskKind

CAPABILITY_SCHEMA_VERSION = 1
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        getattr(torch, "float8_e4m3fn", torch.float16),
    )
}
_KV_DTYPES = {str(d).removeprefix("torch."): d for d in KV_QUANT_DTYPES}
"""Names of the quantized paged-KV-cache dtypes a kernel may declare (``kv_cache_dtypes``)."""


def _bool(where: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigurationError(expected_got(where, "true or false", repr(v)))
    return v


def _opt_int(where: str, v: Any) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise ConfigurationError(expected_got(where, "an int >= 0 or null", repr(v)))
    return v


def _int(where: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigurationError(expected_got(where, "an int", repr(v)))
    return v


def _sm(where: str, v: Any) -> tuple[int, int] | None:
    if v is None:
        return None
    text = str(v)
    major, _, minor = text.partition(".")
    if not (major.isdigit() and (minor or "0").isdigit()):
        raise ConfigurationError(expected_got(where, "an SM version like '8.0' or null", repr(v)))
    return int(major), int(minor or 0)


def _str_set(choices: Mapping[str, Any] | None) -> Callable[[str, Any], frozenset[Any]]:
    def parse(where: str, v: Any) -> frozenset[Any]:
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ConfigurationError(expected_got(where, "a list of strings", repr(v)))
        if choices is None:
            return frozenset(v)
        bad = [x for x in v if x not in choices]
        if bad:
            raise ConfigurationError(expected_got(where, f"values from {sorted(choices)}", bad))
        return frozenset(choices[x] for x in v)

    return parse


def _opt_isa(where: str, v: Any) -> frozenset[str] | None:
    """``cpu_isa``: null or a list of names from ``CPU_ISA_NAMES``."""
    return None if v is None else _str_set({n: n for n in CPU_ISA_NAMES})(where, v)


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "priority": _int,
    "capture_priority": _opt_int,
    "device_types": _str_set(None),
    "dtypes": _str_set(_DTYPES),
    "sm_min": _sm,
    "sm_max": _sm,
    "head_dim_min": _opt_int,
    "head_dim_max": _opt_int,
    "head_dim_multiple": _opt_int,
    "max_seq_len": _opt_int,
    "mask_kinds": _str_set({m.value: m for m in MaskKind}),
    "cpu_isa": _opt_isa,
    **{
        name: _bool
        for name in (
            "head_dims_equal",
            "supports_gqa",
            "mask_with_causal",
            "supports_causal",
            "supports_dropout",
            "supports_backward",
            "requires_stride_last_1",
            "requires_aligned_16",
            "deterministic",
            "graph_safe",
            "supports_window",
            "supports_softcap",
            "supports_alibi",
        )
    },
    "kv_cache_dtypes": _str_set(_KV_DTYPES),
}
OVERRIDABLE_FIELDS = frozenset(_PARSERS)


def describe(spec: KernelSpec) -> dict[str, Any]:
    """The overridable constraint fields of ``spec`` as YAML-ready values."""
    data = spec.constraints()
    out = {k: data[k] for k in sorted(OVERRIDABLE_FIELDS)}
    for name in ("sm_min", "sm_max"):
        if out[name] is not None:
            out[name] = f"{out[name][0]}.{out[name][1]}"
    return out


def describe_backend(registry: KernelRegistry, backend_id: str) -> dict[str, Any]:
    """A versioned descriptor of every kernel of ``backend_id`` (what ``capabilities/<backend>.yaml``
    holds)."""
    registry.backend(backend_id)
    kernels = {s.kernel_id: describe(s) for s in registry.kernels.values() if s.backend == backend_id}
    return {"version": CAPABILITY_SCHEMA_VERSION, "backend": backend_id, "kernels": kernels}


def load_overrides(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Parse a descriptor file into ``{kernel_id: {field: typed value}}`` (schema-checked).

    Raises ``ConfigurationError`` for a ``path`` that is not a str / os.PathLike naming an existing file, an
    unknown version, an unknown field, or a value of the wrong type; ``PolicyValidationError`` for unsafe or
    malformed YAML.
    """
    check_path("capability overrides path", path)
    if not os.path.isfile(path):
        raise ConfigurationError(
            expected_got(
                "capability overrides path",
                "an existing YAML file",
                repr(os.fspath(path)),
                "Check the path (LAYERZERO_CAPABILITIES or lz.load_capabilities).",
            )
        )
    data, source = safe_load_yaml(pathlib.Path(path))
    if not isinstance(data, dict):
        raise ConfigurationError(expected_got(f"{source}: top level", "a mapping", type(data).__name__))
    if data.get("version") != CAPABILITY_SCHEMA_VERSION:
        raise ConfigurationError(
            expected_got(f"{source}: version", CAPABILITY_SCHEMA_VERSION, data.get("version"))
        )
    unknown_top = set(data) - {"version", "backend", "kernels"}
    if unknown_top:
        raise ConfigurationError(
            expected_got(f"{source}: keys", "version, backend, kernels", sorted(unknown_top))
        )
    kernels = data.get("kernels") or {}
    if not isinstance(kernels, dict):
        raise ConfigurationError(
            expected_got(f"{source}: kernels", "a mapping of kernel id -> fields", kernels)
        )
    out: dict[str, dict[str, Any]] = {}
    for kernel_id, fields in kernels.items():
        if not isinstance(fields, dict):
            raise ConfigurationError(
                expected_got(f"{source}: kernels.{kernel_id}", "a mapping", repr(fields))
            )
        parsed = {}
        for name, value in fields.items():
            where = f"{source}: kernels.{kernel_id}.{name}"
            if name not in _PARSERS:
                raise ConfigurationError(
                    expected_got(where, f"one of {sorted(OVERRIDABLE_FIELDS)}", repr(name))
                )
            parsed[name] = _PARSERS[name](where, value)
        out[str(kernel_id)] = parsed
    return out


def apply_overrides(registry: KernelRegistry, overrides: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Replace the named constraint fields of registered kernels; returns the kernel ids changed.

    Raises ``UnknownKernelError`` for a kernel id that is not registered (nothing is changed then).
    """
    specs = {kid: registry.kernel(kid) for kid in overrides}
    for kid, fields in overrides.items():
        if fields:
            registry.add_kernel(replace(specs[kid], **fields), replace=True)
    return [kid for kid, fields in overrides.items() if fields]
