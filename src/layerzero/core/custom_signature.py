"""How dispatch calls a custom kernel: the op's canonical positional arguments, the extra arguments some
kernels declare, and the Triton ``launch_config`` keyword; :func:`check_signature` checks a callable accepts
them.

The callable must accept the op's canonical positional arguments (:data:`CANONICAL_ARGS`, read from the ops'
definitions, the table of ``docs/architecture.md``), checked with :func:`inspect.signature`. Triton kernels
may pass ``launch_config`` (:class:`LaunchConfig`: ``num_warps`` a power of 2 in 1..32, ``num_stages`` 1..8,
``num_ctas`` a power of 2 in 1..16, ``BLOCK*`` sizes powers of 2 up to 2**20); the kernel is then called with
``launch_config=LaunchConfig(...)`` as a keyword.

This is its own module because the calling convention is shared knowledge (the op modules decide when the
extra arguments are passed) and is checked apart from the constraint keywords and from registration;
:mod:`.custom` re-exports every name.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .custom_constraints import config_error as _bad
from .errors import UnknownOperationError
from .opdef import defined, get

log = logging.getLogger("layerzero.custom")


class _CanonicalArgs(Mapping[str, tuple[str, ...]]):
    """Op id -> the canonical positional arguments its kernels are called with, read from the ops' definitions
    (:attr:`layerzero.core.opdef.OpDef.canonical_args`; an op defined later appears here then)."""

    def __getitem__(self, op: str) -> tuple[str, ...]:
        try:
            return get(op).canonical_args  # the registry's dict, not a scan of every definition
        except UnknownOperationError:
            raise KeyError(op) from None

    def __iter__(self) -> Iterator[str]:
        return iter([d.name for d in defined()])

    def __len__(self) -> int:
        return len(defined())


CANONICAL_ARGS: Mapping[str, tuple[str, ...]] = _CanonicalArgs()
"""The positional arguments dispatch passes to every kernel of an op (ops added later: extend this table)."""

_BLOCK_KEY = re.compile(r"BLOCK(?:_[A-Z0-9]+)*")
_MAX_BLOCK = 1 << 20  # Triton's TRITON_MAX_TENSOR_NUMEL


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


__all__ = [
    "ALIBI_EXTRA_ARGS",
    "ATTENTION_EXTRA_ARGS",
    "CANONICAL_ARGS",
    "KV_SCALE_ARGS",
    "LaunchConfig",
    "check_signature",
]
