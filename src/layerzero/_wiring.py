"""Connects ``core``'s dispatch runtime to the layers above it (imported once, by ``layerzero/__init__.py``).

``core`` imports nothing above it, so it cannot name the module that registers the built-in ops and backends,
nor the tuning package. Instead :data:`~layerzero.core.runtime.RUNTIME` takes them as hooks
(:meth:`~layerzero.core.dispatch.Runtime.install_hooks`), installed here: ``layerzero.ops.register_builtin``
as the loader it runs on first use, the import of the knob-registering kernel modules as the knobs' loader (a
change of any knob invalidates cached selections, as ``lz.configure`` does), and two thin wrappers that import
``layerzero.tuning.autotune`` / ``layerzero.tuning.canary`` only when first called
(``lz.configure(autotune=True)`` / ``canaries=True``), so that ``import layerzero`` does not load them. No I/O
and nothing else at import.
"""

from __future__ import annotations

from typing import Any

from layerzero.core import knobs
from layerzero.core.config import notify_change
from layerzero.core.context import SelectionContext
from layerzero.core.dispatch import Runtime
from layerzero.core.runtime import RUNTIME
from layerzero.ops import register_builtin

__all__: list[str] = []


def _autotune(runtime: Runtime, ctx: SelectionContext, args: tuple[Any, ...]) -> None:
    """The online autotuner (``lz.configure(autotune=True)``): measures ``ctx``'s eligible kernels on ``args``
    into the PerfDB before the first selection (``layerzero.tuning.autotune.autotune_context``, imported here
    on first use)."""
    from layerzero.tuning.autotune import autotune_context

    autotune_context(runtime, ctx, args)


def _canary(runtime: Runtime, ctx: SelectionContext, args: tuple[Any, ...], out: Any) -> str | None:
    """The canary check (``lz.configure(canaries=True)``): None when ``out`` agrees with the reference kernel
    on ``args``, else why not (``layerzero.tuning.canary.check``, imported here on first use)."""
    from layerzero.tuning.canary import check

    return check(runtime, ctx, args, out)


def _load_knobs() -> None:
    """Import the modules that register tuning knobs, the kernel modules (Triton's and the chunked
    ``linear_cross_entropy``) and the autotuner (``lz.configure_knobs`` before any op call); importing them
    imports no Triton."""
    from layerzero.backends.torch_native import linear_ce  # noqa: F401
    from layerzero.backends.triton import (  # noqa: F401
        attention,
        cascade,
        gemv,
        norms,
        paged,
        quantized_linear,
        rope,
        rope_paged,
        sampling,
        swiglu,
    )
    from layerzero.tuning import autotune  # noqa: F401


RUNTIME.install_hooks(loader=register_builtin, autotuner=_autotune, canary=_canary)
knobs.install_loader(_load_knobs)
knobs.subscribe(
    knobs.ANY, notify_change
)  # a knob may decide a selection check (gemv's max_rows): cached ones go
