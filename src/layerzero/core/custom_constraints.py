"""Constraint keywords of ``lz.register_kernel``: which :class:`KernelSpec` fields a custom kernel may set,
and their coercion from friendly spellings into the spec's types.

``layouts={"BSHD"}``, ``dtypes={"bfloat16"}``, ``sm_min="8.0"`` become ``frozenset({Layout.BSHD})``,
``frozenset({torch.bfloat16})``, ``(8, 0)``; every value is type-checked. ``None`` means "no constraint" as
in :class:`KernelSpec` (``mask_kinds=None``: every mask kind; ``generations`` / ``layouts`` / ``cpu_isa`` /
``sm_*`` / ``head_dim_*`` / ``max_seq_len`` / callables: none); ``device_types`` and ``dtypes`` have no "any"
value, so ``None`` or an empty set there is rejected, as is an empty set anywhere but ``cpu_isa``.

This is its own module because the coercion table is the bulk of the validation and is independent of the
kernel's callable and of the registry: :mod:`.custom` calls :func:`coerce_constraints` and re-exports
:data:`CONSTRAINT_FIELDS` and :data:`KNOWN_DEVICE_TYPES`. :func:`config_error` builds the
:class:`ConfigurationError` every check of the custom-kernel modules raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .device import GPUGeneration
from .errors import ConfigurationError, did_you_mean, expected_got
from .specs import CPU_ISA_NAMES, KernelSpec, Layout, MaskKind

CONSTRAINT_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(KernelSpec)) - {
    "kernel_id",
    "op",
    "fn",
    "priority",
    "is_reference",
}


def config_error(what: str, expected: Any, got: Any, fix: str | None = None) -> ConfigurationError:
    """A :class:`ConfigurationError` saying what failed, expected vs got, and the fix."""
    return ConfigurationError(expected_got(what, expected, got, fix))


def _enum_set(what: str, value: Any, parse: Callable[[Any], Any], choices: Iterable[Any]) -> frozenset[Any]:
    items = (
        [value] if isinstance(value, (str, torch.dtype)) or not isinstance(value, Iterable) else list(value)
    )
    if not items and what != "cpu_isa":
        raise config_error(
            f"register_kernel: {what}",
            f"at least one value from {sorted(map(str, choices))}",
            "an empty set",
            "An empty set would make the kernel never eligible; leave the constraint out for the default.",
        )
    out = set()
    for item in items:
        try:
            if item is None:
                raise TypeError(item)
            out.add(parse(item))
        except ConfigurationError:
            raise
        except (KeyError, ValueError, TypeError, AttributeError):
            raise config_error(
                f"register_kernel: {what}", f"values from {sorted(map(str, choices))}", repr(item)
            ) from None
    return frozenset(out)


def _dtype(x: Any) -> torch.dtype:
    if isinstance(x, torch.dtype):
        return x
    value = getattr(torch, str(x).removeprefix("torch."))
    if not isinstance(value, torch.dtype):
        raise TypeError(x)
    return value


KNOWN_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
"""Device types LayerZero's own kernels run on. ``device_types`` also accepts any other torch device type
(``torch.device(name).type == name``: ``hpu``, ``mtia``, ``privateuseone``, ...), case-insensitively."""


def _device_type(x: Any) -> str:
    name = x.lower() if isinstance(x, str) else None
    try:
        ok = name is not None and name != "hip" and torch.device(name).type == name
    except (RuntimeError, ValueError):
        ok = False
    if not ok:
        hint = (
            " AMD (ROCm) and NVIDIA GPUs are both 'cuda' in torch."
            if name in ("gpu", "hip", "rocm", "nvidia")
            else (did_you_mean(str(x), KNOWN_DEVICE_TYPES) if isinstance(x, str) else "")
        )
        raise config_error(
            "register_kernel: device_types",
            f"torch device types such as {list(KNOWN_DEVICE_TYPES)} "
            "(or another torch.device type: hpu, mtia, privateuseone, ...)",
            repr(x),
            hint.strip() or None,
        )
    return name


def _generation(x: Any) -> GPUGeneration:
    return x if isinstance(x, GPUGeneration) else GPUGeneration[str(x).upper()]


def _isa(x: Any) -> str:
    name = str(x).lower() if isinstance(x, str) else None
    if name not in CPU_ISA_NAMES:
        raise ValueError(x)
    return name


def _sm(what: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        major, _, minor = value.partition(".")
        if major.isdigit() and (minor or "0").isdigit():
            return int(major), int(minor or 0)
    elif (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        return value
    raise config_error(
        f"register_kernel: {what}", "(major, minor) like (8, 0), a string like '8.0', or None", repr(value)
    )


_SETS: dict[str, tuple[Callable[[Any], Any], Iterable[Any]]] = {
    "device_types": (_device_type, KNOWN_DEVICE_TYPES),
    "dtypes": (_dtype, ("float32", "float64", "float16", "bfloat16")),
    "kv_cache_dtypes": (_dtype, ("float8_e4m3fn", "int8")),
    "generations": (_generation, [g.name for g in GPUGeneration]),
    "cpu_isa": (_isa, sorted(CPU_ISA_NAMES)),
    "layouts": (
        lambda x: Layout(x.value if isinstance(x, Layout) else str(x).upper()),
        [m.value for m in Layout],
    ),
    "mask_kinds": (
        lambda x: MaskKind(x.value if isinstance(x, MaskKind) else str(x).lower()),
        [m.value for m in MaskKind],
    ),
}
_NO_CONSTRAINT: dict[str, frozenset[Any] | None] = {
    "generations": None,
    "layouts": None,
    "cpu_isa": None,
    "mask_kinds": frozenset(MaskKind),
}
"""What ``None`` means for set-valued constraints that have a "no constraint" value: every kind of mask for
``mask_kinds``, ``None`` (any) for the others. ``device_types`` and ``dtypes`` have none: ``None`` is
rejected."""
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KernelSpec)}
_INTS = ("head_dim_min", "head_dim_max", "head_dim_multiple", "max_seq_len")
_CALLABLES = ("check", "workspace", "specialize", "priority_for")


def coerce_constraints(constraints: Mapping[str, Any]) -> dict[str, Any]:
    """Validate constraint keywords against :class:`KernelSpec` and return them in its types.

    Raises:
        ConfigurationError: a name that is not a constraint field (the message lists them) or a value of the
            wrong type.
    """
    out: dict[str, Any] = {}
    for name, value in constraints.items():
        if name not in CONSTRAINT_FIELDS:
            raise config_error(
                "register_kernel: constraint name", f"one of {sorted(CONSTRAINT_FIELDS)}", repr(name)
            )
        if name in _SETS:
            parse, choices = _SETS[name]
            if value is None and name in _NO_CONSTRAINT:
                out[name] = _NO_CONSTRAINT[name]
            elif value is None:
                raise config_error(
                    f"register_kernel: {name}",
                    f"a set of values from {sorted(map(str, choices))}",
                    "None",
                    f"{name} has no 'any' value: list what the kernel supports, or leave it out for the "
                    f"default {sorted(str(d).removeprefix('torch.') for d in _DEFAULTS[name])}.",
                )
            else:
                out[name] = _enum_set(name, value, parse, choices)
        elif name in ("sm_min", "sm_max"):
            out[name] = _sm(name, value)
        elif name in _INTS:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise config_error(f"register_kernel: {name}", "an int >= 0 or None", repr(value))
            out[name] = value
        elif name in _CALLABLES:
            if value is not None and not callable(value):
                raise config_error(
                    f"register_kernel: {name}", "a callable taking a SelectionContext, or None", repr(value)
                )
            out[name] = value
        elif name == "description":
            if not isinstance(value, str):
                raise config_error("register_kernel: description", "a str", repr(value))
            out[name] = value
        else:
            if not isinstance(value, bool):
                raise config_error(f"register_kernel: {name}", "True or False", repr(value))
            out[name] = value
    return out


__all__ = ["CONSTRAINT_FIELDS", "KNOWN_DEVICE_TYPES", "coerce_constraints", "config_error"]
