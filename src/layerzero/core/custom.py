"""Custom kernels: validate a user's callable and constraints and register it as a :class:`KernelSpec`.

The public entry points are ``lz.register_kernel``, the ``@lz.kernel`` decorator and ``lz.unregister_kernel``
(``layerzero/api.py``), which call :func:`register_custom_kernel` / :func:`unregister_custom_kernel` on the
runtime's registry. Rules:

- the kernel id is ``"backend.name"``; an unknown backend id is auto-registered as an available *custom*
  backend (its ``BackendSpec.description`` is :data:`CUSTOM_BACKEND_DESCRIPTION`); built-in backend ids are
  reserved, so custom kernels never hide inside a built-in backend and ``unregister`` can tell them apart;
- the callable must accept the op's canonical positional arguments (:data:`CANONICAL_ARGS`, the table of
  ``docs/architecture.md``), checked with :func:`inspect.signature`;
- constraint keywords are :class:`KernelSpec` fields (:data:`CONSTRAINT_FIELDS`), coerced from friendly
  spellings (``layouts={"BSHD"}``, ``dtypes={"bfloat16"}``, ``sm_min="8.0"``) and type-checked; ``None`` means
  "no constraint" as in :class:`KernelSpec` (``mask_kinds=None``: every mask kind; ``generations`` /
  ``layouts`` / ``cpu_isa`` / ``sm_*`` / ``head_dim_*`` / ``max_seq_len`` / callables: none); ``device_types``
  and ``dtypes`` have no "any" value, so ``None`` or an empty set there is rejected, as is an empty set
  anywhere but ``cpu_isa``; ``device_types`` are torch device types (:data:`KNOWN_DEVICE_TYPES` or another
  ``torch.device`` type);
- Triton kernels may pass ``launch_config`` (``num_warps`` a power of 2 in 1..32, ``num_stages`` 1..8,
  ``num_ctas`` a power of 2 in 1..16, ``BLOCK*`` sizes powers of 2 up to 2**20); the kernel is then called
  with ``launch_config=LaunchConfig(...)`` as a keyword. Compile caching is Triton's own: it caches each
  compiled binary on disk keyed by the constexpr values (block sizes), ``num_warps``/``num_stages`` and the
  argument specialization, so LayerZero adds no cache of its own and never compiles inside selection.

Every error is a :class:`ConfigurationError` (``UnknownOperationError`` for an unknown op,
``UnknownKernelError`` for unregistering an unknown id) saying what failed, expected vs got, and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .device import GPUGeneration
from .errors import ConfigurationError, did_you_mean, expected_got
from .opdef import defined
from .registry import KernelRegistry
from .specs import CPU_ISA_NAMES, BackendSpec, KernelSpec, Layout, MaskKind

log = logging.getLogger("layerzero.custom")


class _CanonicalArgs(Mapping[str, tuple[str, ...]]):
    """Op id -> the canonical positional arguments its kernels are called with, read from the ops' definitions
    (:attr:`layerzero.core.opdef.OpDef.canonical_args`; an op defined later appears here then)."""

    def __getitem__(self, op: str) -> tuple[str, ...]:
        for d in defined():
            if d.name == op:
                return d.canonical_args
        raise KeyError(op)

    def __iter__(self) -> Iterator[str]:
        return iter([d.name for d in defined()])

    def __len__(self) -> int:
        return len(defined())


CANONICAL_ARGS: Mapping[str, tuple[str, ...]] = _CanonicalArgs()
"""The positional arguments dispatch passes to every kernel of an op (ops added later: extend this table)."""

CUSTOM_BACKEND_DESCRIPTION = "custom kernels registered with lz.register_kernel"
DEFAULT_PRIORITY = 50
"""Above SDPA math (20) and the reference (0), below the fused SDPA/FlashAttention kernels (70-96)."""

CONSTRAINT_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(KernelSpec)) - {
    "kernel_id",
    "op",
    "fn",
    "priority",
    "is_reference",
}

_KERNEL_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z0-9_]+(?:[.\-][A-Za-z0-9_]+)*")
_BLOCK_KEY = re.compile(r"BLOCK(?:_[A-Z0-9]+)*")
_MAX_BLOCK = 1 << 20  # Triton's TRITON_MAX_TENSOR_NUMEL


def _bad(what: str, expected: Any, got: Any, fix: str | None = None) -> ConfigurationError:
    return ConfigurationError(expected_got(what, expected, got, fix))


def _pow2(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchConfig:
    """A validated Triton launch configuration (data only; LayerZero never compiles).

    Fields: ``num_warps`` (warps of 32 threads per program, power of 2 in 1..32), ``num_stages`` (software
    pipelining stages, 1..8), ``num_ctas`` (CTAs per cluster on Hopper+, power of 2 in 1..16), ``blocks``
    (``(name, size)`` pairs of ``BLOCK*`` constexprs, sizes powers of 2 up to 2**20 elements).

    Raises:
        ConfigurationError: any value outside those ranges.
    """

    num_warps: int = 4
    num_stages: int = 3
    num_ctas: int = 1
    blocks: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not _pow2(self.num_warps) or self.num_warps > 32:
            raise _bad("launch_config num_warps", "a power of 2 in 1..32", repr(self.num_warps))
        if (
            isinstance(self.num_stages, bool)
            or not isinstance(self.num_stages, int)
            or not 1 <= self.num_stages <= 8
        ):
            raise _bad("launch_config num_stages", "an int in 1..8", repr(self.num_stages))
        if not _pow2(self.num_ctas) or self.num_ctas > 16:
            raise _bad("launch_config num_ctas", "a power of 2 in 1..16", repr(self.num_ctas))
        for name, size in self.blocks:
            if not isinstance(name, str) or not _BLOCK_KEY.fullmatch(name):
                raise _bad("launch_config block name", "BLOCK or BLOCK_<NAME> (e.g. BLOCK_M)", repr(name))
            if not _pow2(size) or size > _MAX_BLOCK:
                raise _bad(
                    f"launch_config {name}",
                    f"a power of 2 in 1..{_MAX_BLOCK}",
                    repr(size),
                    "Triton block sizes (tl.arange extents) must be powers of 2.",
                )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LaunchConfig:
        """Parse ``{"num_warps": 4, "num_stages": 2, "BLOCK_M": 64, ...}``; raises ConfigurationError for an
        unknown key (listing the valid ones) or a bad value."""
        if not isinstance(data, Mapping):
            raise _bad("launch_config", "a dict like {'num_warps': 4, 'BLOCK_M': 64}", type(data).__name__)
        known = {"num_warps", "num_stages", "num_ctas"}
        bad = sorted(
            str(k) for k in data if k not in known and not (isinstance(k, str) and _BLOCK_KEY.fullmatch(k))
        )
        if bad:
            raise _bad("launch_config keys", f"{sorted(known)} or BLOCK* constexpr names", bad)
        blocks = tuple(sorted((k, v) for k, v in data.items() if k not in known))
        return cls(**{k: data[k] for k in known if k in data}, blocks=blocks)

    def as_kwargs(self) -> dict[str, int]:
        """The keyword arguments of a Triton launch: ``kernel[grid](..., **cfg.as_kwargs())``."""
        return {
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "num_ctas": self.num_ctas,
            **dict(self.blocks),
        }


def _enum_set(what: str, value: Any, parse: Callable[[Any], Any], choices: Iterable[Any]) -> frozenset[Any]:
    items = (
        [value] if isinstance(value, (str, torch.dtype)) or not isinstance(value, Iterable) else list(value)
    )
    if not items and what != "cpu_isa":
        raise _bad(
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
            raise _bad(
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
        raise _bad(
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
    raise _bad(
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
            raise _bad("register_kernel: constraint name", f"one of {sorted(CONSTRAINT_FIELDS)}", repr(name))
        if name in _SETS:
            parse, choices = _SETS[name]
            if value is None and name in _NO_CONSTRAINT:
                out[name] = _NO_CONSTRAINT[name]
            elif value is None:
                raise _bad(
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
                raise _bad(f"register_kernel: {name}", "an int >= 0 or None", repr(value))
            out[name] = value
        elif name in _CALLABLES:
            if value is not None and not callable(value):
                raise _bad(
                    f"register_kernel: {name}", "a callable taking a SelectionContext, or None", repr(value)
                )
            out[name] = value
        elif name == "description":
            if not isinstance(value, str):
                raise _bad("register_kernel: description", "a str", repr(value))
            out[name] = value
        else:
            if not isinstance(value, bool):
                raise _bad(f"register_kernel: {name}", "True or False", repr(value))
            out[name] = value
    return out


ATTENTION_EXTRA_ARGS = ("window", "softcap")
"""Attention kernels that declare ``supports_window`` or ``supports_softcap`` are called with these two extra
positional arguments whenever a call sets either (``ops/attention.py``); others keep the 7-argument call."""
ALIBI_EXTRA_ARGS = ("window", "softcap", "alibi_slopes")
"""Attention kernels that declare ``supports_alibi`` are called with these three extra positional arguments
when a call passes ``alibi_slopes`` (window and softcap may then be None), and with the two of
:data:`ATTENTION_EXTRA_ARGS` or none otherwise: ``alibi_slopes=None`` needs a default."""
KV_SCALE_ARGS = ("k_scale", "v_scale")
"""Paged kernels that declare ``kv_cache_dtypes`` (quantized caches they read or write) are called with these
two extra positional arguments when the cache is quantized (``ops/paged.py``); others keep their canonical
call."""


def check_signature(
    op: str,
    fn: Callable[..., Any],
    launch_config: LaunchConfig | None = None,
    extra_args: tuple[str, ...] = (),
) -> None:
    """``fn`` accepts ``op``'s canonical positional arguments, with and without ``extra_args`` after them
    (dispatch passes the extra ones only when a call sets them, so they need defaults), and ``launch_config=``
    when given.

    An op missing from :data:`CANONICAL_ARGS` or a callable without an inspectable signature (some C
    extensions) is not checked; a WARNING says so.

    Raises:
        ConfigurationError: ``fn`` is not callable or cannot bind those arguments.
    """
    if not callable(fn):
        raise _bad("register_kernel: fn", "a callable", type(fn).__name__)
    names = CANONICAL_ARGS.get(op)
    if names is None:
        log.warning(
            "LayerZero register_kernel: no canonical argument table for op %r; the signature of %r "
            "is not checked (give its OpDef kernel_args)",
            op,
            fn,
        )
        return
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        log.warning(
            "LayerZero register_kernel: cannot inspect the signature of %r (%s); not checked", fn, exc
        )
        return
    extra = {} if launch_config is None else {"launch_config": launch_config}
    for args in (names, names + extra_args) if extra_args else (names,):
        try:
            sig.bind(*args, **extra)
        except TypeError as exc:
            want = f"{len(args)} positional args ({', '.join(args)})" + (", launch_config=" if extra else "")
            if extra_args:
                want += (
                    f", and {len(names)} as well: {', '.join(f'{a}=None' for a in extra_args)} need defaults "
                    "(they are passed only when a call sets them)"
                )
            raise _bad(
                f"register_kernel: signature of {getattr(fn, '__name__', fn)!r} for op {op!r}",
                want,
                f"{sig} ({exc})",
                "Dispatch calls kernels with the op's canonical positional arguments "
                "(docs/architecture.md, 'Adding a kernel').",
            ) from None


def is_custom_backend(registry: KernelRegistry, backend_id: str) -> bool:
    """True when ``backend_id`` was auto-registered by :func:`register_custom_kernel`."""
    return (
        backend_id in registry.backends
        and registry.backend(backend_id).description == CUSTOM_BACKEND_DESCRIPTION
    )


def build_kernel_spec(
    registry: KernelRegistry,
    op: str,
    kernel_id: str,
    fn: Callable[..., Any],
    *,
    priority: int = DEFAULT_PRIORITY,
    launch_config: Mapping[str, Any] | LaunchConfig | None = None,
    **constraints: Any,
) -> KernelSpec:
    """Validate everything and return the :class:`KernelSpec` (nothing is registered).

    Raises:
        UnknownOperationError: ``op`` is not registered.
        ConfigurationError: malformed ``kernel_id``, a built-in backend id, bad ``priority``, signature,
            constraint or ``launch_config``.
    """
    registry.ops.get(op)
    if not isinstance(kernel_id, str) or not _KERNEL_ID.fullmatch(kernel_id):
        raise _bad(
            "register_kernel: kernel_id",
            "'backend.name' (letters, digits, '_'; e.g. 'mylib.attention')",
            repr(kernel_id),
        )
    backend = kernel_id.split(".", 1)[0]
    if backend in registry.backends and not is_custom_backend(registry, backend):
        raise _bad(
            "register_kernel: backend of kernel_id",
            "a backend id that is not built in",
            repr(backend),
            "Use your own prefix, e.g. 'mylib.flash'; built-in backend ids are reserved.",
        )
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise _bad("register_kernel: priority", "an int (built-ins use 0..96)", repr(priority))
    cfg = (
        launch_config
        if isinstance(launch_config, LaunchConfig) or launch_config is None
        else (LaunchConfig.from_dict(launch_config))
    )
    fields = coerce_constraints(constraints)
    windowed = op == "attention" and (fields.get("supports_window") or fields.get("supports_softcap"))
    quant_kv = op in ("paged_attention", "reshape_and_cache") and bool(fields.get("kv_cache_dtypes"))
    alibi = op == "attention" and fields.get("supports_alibi")
    check_signature(
        op,
        fn,
        cfg,
        ALIBI_EXTRA_ARGS
        if alibi
        else ATTENTION_EXTRA_ARGS
        if windowed
        else KV_SCALE_ARGS
        if quant_kv
        else (),
    )
    call = fn if cfg is None else functools.partial(fn, launch_config=cfg)
    fields.setdefault("description", (inspect.getdoc(fn) or "custom kernel").splitlines()[0])
    return KernelSpec(kernel_id, op, call, priority=priority, **fields)


def register_custom_kernel(
    registry: KernelRegistry,
    op: str,
    kernel_id: str,
    fn: Callable[..., Any],
    *,
    priority: int = DEFAULT_PRIORITY,
    replace: bool = False,
    launch_config: Mapping[str, Any] | LaunchConfig | None = None,
    **constraints: Any,
) -> KernelSpec:
    """Validate and register a custom kernel (see the module docstring); returns its :class:`KernelSpec`.

    Raises:
        UnknownOperationError: unknown op. ConfigurationError: see :func:`build_kernel_spec`, or
        ``kernel_id`` is already registered and ``replace`` is False.
    """
    spec = build_kernel_spec(
        registry, op, kernel_id, fn, priority=priority, launch_config=launch_config, **constraints
    )
    if kernel_id in registry.kernels and not replace:
        raise _bad(
            "register_kernel: kernel_id",
            "an id not registered yet",
            repr(kernel_id),
            "Pick another id, pass replace=True, or lz.unregister_kernel() it first.",
        )
    if spec.backend not in registry.backends:
        registry.add_backend(BackendSpec(spec.backend, None, None, True, (), CUSTOM_BACKEND_DESCRIPTION))
    registry.add_kernel(spec, replace=replace)
    log.info("LayerZero custom kernel %s registered for op %s (priority %d)", kernel_id, op, priority)
    return spec


def unregister_custom_kernel(registry: KernelRegistry, kernel_id: str) -> KernelSpec:
    """Remove a custom kernel (and its custom backend once empty); returns the removed spec.

    Raises:
        UnknownKernelError: unknown id. ConfigurationError: a built-in kernel (deny it with a policy instead).
    """
    spec = registry.kernel(kernel_id)
    if not is_custom_backend(registry, spec.backend):
        raise _bad(
            "unregister_kernel: kernel_id",
            "a kernel registered with lz.register_kernel",
            repr(kernel_id),
            "Built-in kernels stay registered; disable one with a policy deny rule or lz.prefer another.",
        )
    registry.remove_kernel(kernel_id)
    if not any(s.backend == spec.backend for s in registry.kernels.values()):
        registry.backends.remove(spec.backend)
    log.info("LayerZero custom kernel %s unregistered", kernel_id)
    return spec
