"""A cheaper eager launch of our ``@triton.jit`` kernels: Triton's own argument binder, then the compiled
kernel's launcher, skipping the rest of ``JITFunction.run``.

Why: one ``kernel[grid](...)`` costs several times a ``torch.add``'s host time
(``benchmarks/bench_launch.py``; numbers: benchmarks/results/history.md), so a two-launch decode kernel is
host-bound in eager mode at small batches. Per call ``JITFunction.run`` reads several ``knobs``, formats the
options with ``str()`` for its cache key, checks the kernel's used globals and builds launch metadata; the
specialization itself (which integer arguments are 1 or divisible by 16, pointer alignment, dtypes,
constexprs) comes from a generated binder.

:class:`FastLaunch` keeps a dict from ``(device, specialization, options)`` — computed by that same binder, so
a call that Triton would compile differently never shares an entry — to the compiled kernel that
``JITFunction.run`` returned for the first such call, and launches it directly afterwards:
``kernel.run(grid..., stream, function, packed_metadata, None, None, None,
*args)``, the call ``JITFunction.run`` ends with.

It steps aside (plain ``fn[grid](...)``) when Triton runs in its interpreter (``TRITON_INTERPRET=1``, the CPU
tests), when a launch hook is installed (profilers such as Proton read launch metadata; Triton 3.6 keeps an
empty hook chain there by default, which counts as none), and for good after any error of its own machinery
(Triton internals differ from 3.6's; logged once). Toggling ``TRITON_DEBUG`` after a kernel's first launch is
not seen by the fast path (the compiled entry is reused).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core import knobs
from layerzero.core.capture import AS_CAPTURED
from layerzero.core.knobs import check_types, require

log = logging.getLogger("layerzero.triton")

__all__ = ["KNOBS", "FastLaunch", "LaunchKnobs", "launch", "launch_pinned", "launcher_of", "pdl_kwargs"]

_LAUNCHERS: dict[int, FastLaunch] = {}
PINS_MAX = 8192
"""Pinned entries kept per kernel (past this many the dict starts over)."""


class FastLaunch:
    """The launcher of one ``@triton.jit`` function ``fn``: ``FastLaunch(fn)(grid, *args, **kwargs)`` does
    what ``fn[grid](*args, **kwargs)`` does. ``hits`` / ``misses`` count fast launches and first launches per
    key."""

    __slots__ = ("broken", "fn", "hits", "kernels", "misses", "pins")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.kernels: dict[tuple[Any, ...], Any] = {}
        self.pins: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}
        self.broken = type(fn).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1: Triton's own path
        self.hits = self.misses = 0

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        self._launch(grid, args, kwargs)

    def pinned(self, pin: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """``fn[grid](*args, **kwargs)`` for a caller that promises: every argument that is not a tensor or a
        float (ints, constexprs, launch options: ``kwargs`` whole) is the same for every call with this
        hashable ``pin``, and ``args`` holds every non-constexpr parameter, in order. Then Triton's
        specialization of the call depends on ``pin`` and each tensor's dtype and 16-byte alignment only
        (floats are never specialized), so after the first call of ``(device, pin, tensor dtypes and
        alignments)`` the binder is skipped too: the compiled kernel's launcher is called with ``args`` and
        the constexpr tail that call bound. (``triton.paged_decode``'s plan per call signature is such a pin:
        ``backends/triton/paged.py``.)"""
        if self.broken:
            self.fn[grid](*args, **kwargs)
            return
        try:
            rt = _knobs_runtime()
            if _active(rt.launch_enter_hook) or _active(rt.launch_exit_hook):
                self.fn[grid](*args, **kwargs)  # a profiler's hook: Triton's own path calls it
                return
            device = torch._C._cuda_getDevice()
            key = (
                device,
                pin,
                tuple((a.dtype, a.data_ptr() & 15 == 0) for a in args if isinstance(a, torch.Tensor)),
            )
            hit = self.pins.get(key)
            if hit is not None:
                kernel, tail = hit
                self.hits += 1
                g = (tuple(grid) + (1, 1))[:3]
                kernel.run(
                    g[0],
                    g[1],
                    g[2],
                    torch._C._cuda_getCurrentRawStream(device),
                    kernel.function,
                    kernel.packed_metadata,
                    None,
                    None,
                    None,
                    *args,
                    *tail,
                )
                return
        except Exception as exc:  # noqa: BLE001 - as in _launch: Triton's public path from now on
            self._disable(exc)
            self.fn[grid](*args, **kwargs)
            return
        found = self._launch(grid, args, kwargs)  # errors of the launch itself (a compile error) propagate
        if found is not None:
            if len(self.pins) >= PINS_MAX:
                self.pins.clear()
            self.pins[key] = (found[0], tuple(found[1].values())[len(args) :])

    def _disable(self, exc: BaseException) -> None:
        self.broken = True
        log.warning(
            "LayerZero triton: fast launch of %s disabled (%s: %s); using kernel[grid](...)",
            getattr(self.fn, "__name__", self.fn),
            type(exc).__name__,
            exc,
        )

    def _launch(
        self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any] | None:
        """Launch once; returns ``(compiled kernel, bound arguments)`` when the fast path knows them (None
        when Triton's own path ran: interpreter, hooks, an asynchronous compile, an error)."""
        if self.broken:
            self.fn[grid](*args, **kwargs)
            return None
        key = bound = None
        try:
            rt = _knobs_runtime()
            if _active(rt.launch_enter_hook) or _active(rt.launch_exit_hook):
                self.fn[grid](*args, **kwargs)
                return None
            device = torch.cuda.current_device()
            caches = self.fn.device_caches.get(device)
            if caches is not None:
                key, bound = _key(device, caches, args, kwargs)
                kernel = self.kernels.get(key)
                if kernel is not None:
                    self.hits += 1
                    g = (tuple(grid) + (1, 1))[:3]
                    kernel.run(
                        g[0],
                        g[1],
                        g[2],
                        torch._C._cuda_getCurrentRawStream(device),
                        kernel.function,
                        kernel.packed_metadata,
                        None,
                        None,
                        None,
                        *bound.values(),
                    )
                    return kernel, bound
        except Exception as exc:  # noqa: BLE001 - any surprise in Triton's internals: use its public path from now on
            self._disable(exc)
            self.fn[grid](*args, **kwargs)
            return None
        kernel = self.fn.run(*args, grid=grid, warmup=False, **kwargs)  # compiles (or loads) and launches
        self.misses += 1
        if kernel is None or not hasattr(kernel, "run") or hasattr(kernel, "result"):
            return None  # warm-up only, or an asynchronous compile: Triton's own path next time too
        if key is None:  # the first launch on this device created its binder
            caches = self.fn.device_caches.get(device)
            if caches is None:
                return None
            key, bound = _key(device, caches, args, kwargs)
        self.kernels[key] = kernel
        return kernel, bound


def _key(
    device: int, caches: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], Any]:
    """``((device, specialization, options),
    bound_args)`` from Triton's own binder (``device_caches[device][4]``): the specialization holds what
    Triton compiles per (dtypes, alignment, integers equal to 1 or divisible by 16, constexprs), so two calls
    share a key only if ``JITFunction.run`` would launch the same kernel for both."""
    bound, spec, options = caches[4](*args, **kwargs)
    return (device, tuple(spec), tuple(options.items())), bound


_RUNTIME_KNOBS: list[Any] = []


def _knobs_runtime() -> Any:
    """``triton.knobs.runtime``, imported on the first launch (``import layerzero`` never imports triton)."""
    if not _RUNTIME_KNOBS:
        from triton import knobs

        _RUNTIME_KNOBS.append(knobs.runtime)
    return _RUNTIME_KNOBS[0]


def _active(hook: Any) -> bool:
    """Whether a Triton launch hook would do anything: Triton 3.6 keeps an empty ``HookChain`` (``.calls``)
    there by default; older versions keep None or a function."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launcher_of(fn: Any) -> FastLaunch:
    """``fn``'s :class:`FastLaunch` (created on first use)."""
    launcher = _LAUNCHERS.get(id(fn))
    if launcher is None or launcher.fn is not fn:
        launcher = _LAUNCHERS[id(fn)] = FastLaunch(fn)
    return launcher


def launch(fn: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``fn[grid](*args, **kwargs)`` through ``fn``'s :class:`FastLaunch` (created on first use)."""
    launcher_of(fn)(grid, *args, **kwargs)


def launch_pinned(fn: Any, pin: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """:meth:`FastLaunch.pinned` of ``fn`` (the caller's promise about ``pin`` is written there)."""
    launcher_of(fn).pinned(pin, grid, *args, **kwargs)


KNOBS = "triton.launch"
"""The name :class:`LaunchKnobs` is registered under (``layerzero.core.knobs``)."""


@dataclass(frozen=True, slots=True)
class LaunchKnobs:
    """Programmatic dependent launch (PDL) of our decode kernels inside CUDA graphs (``_gdc_kernels``),
    registered as ``"triton.launch"``; read per launch by :func:`pdl_kwargs` (measurements:
    ``benchmarks/results/knobs/triton_launch.md``). Raises ``ConfigurationError`` for a field of the wrong
    type or out of range."""

    pdl: bool = True
    """PDL on; the registered default is False when ``LAYERZERO_TRITON_PDL=0`` (read at import)."""
    pdl_max_rows: int = 16
    """Largest batch (tokens / sequences of a launch) PDL-launched: on the H200 PDL sped up batch-1 decode and
    slowed a 256-request throughput run (waiting programs hold SM slots a many-wave kernel needs); small
    batches are the latency-bound case PDL is for."""

    def __post_init__(self) -> None:
        check_types(self)
        require(self.pdl_max_rows >= 0, self, "pdl_max_rows", "an int >= 0")


knobs.register(KNOBS, LaunchKnobs(pdl=os.environ.get("LAYERZERO_TRITON_PDL", "1") != "0"))

_PDL_ON: dict[str, bool] = {"PDL": True, "launch_pdl": True}
_PDL_OFF: dict[str, bool] = {}
_SM90: dict[int, bool] = {}


def pdl_kwargs(t: torch.Tensor, rows: int, captured: bool | None = None) -> dict[str, bool]:
    """The launch keywords that make a kernel PDL-launched (its ``PDL`` constexpr and Triton's ``launch_pdl``
    option) for a launch on ``t``'s device over ``rows`` tokens (or sequences): on a CUDA device of compute
    capability >= 9.0, for at most the knobs' ``pdl_max_rows`` rows, while a CUDA graph is captured on the
    current stream or under ``lz.capture_selection()`` (the warm-up that compiles what the capture runs);
    ``{}`` otherwise (eager calls, large batches, the interpreter, older GPUs, the knobs' ``pdl`` off).
    ``captured``: the caller's answer to "is this call captured or selected as captured", when it has one (not
    asked again). The dicts returned are shared: do not change them."""
    kn = knobs.get(KNOBS)
    if not kn.pdl or rows > kn.pdl_max_rows or not t.is_cuda:
        return _PDL_OFF
    if not (
        captured if captured is not None else AS_CAPTURED.get() or torch._C._cuda_isCurrentStreamCapturing()
    ):
        return _PDL_OFF
    idx = t.get_device()
    ok = _SM90.get(idx)
    if ok is None:
        ok = _SM90[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL_ON if ok else _PDL_OFF
