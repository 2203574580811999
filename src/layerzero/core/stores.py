"""The runtime's measurement stores: the PerfDB and the quarantine store (both opened lazily, in one SQLite
file), and the measurement terms that selection reads from them or from shipped timing data.

:class:`MeasurementStores` is a part of :class:`~layerzero.core.dispatch.Runtime` (a base class of it): the
methods here use the Runtime's ``registry`` and nothing else of it. Opening a store is file I/O, so nothing is
opened before the first selection that needs it, and a CUDA-graph capture context never opens one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from . import config as _config
from . import shipped as _shipped
from .context import SelectionContext
from .device import DeviceSpec
from .errors import LayerZeroError
from .perfdb import PerfDB, fingerprint, perf_score
from .quarantine import QuarantineStore
from .registry import KernelRegistry
from .selection import Measurement
from .telemetry import TELEMETRY

__all__ = ["MeasurementStores", "device_fingerprint_parts"]

log = logging.getLogger("layerzero.dispatch")


class MeasurementStores:
    """The lazily opened PerfDB (:meth:`perfdb`) and quarantine store (:meth:`quarantine`) of a runtime, and
    the per-kernel measurement terms of a selection (:meth:`_perf_lookup`). State set by
    :meth:`_init_stores`."""

    registry: KernelRegistry  # the Runtime's (set in Runtime.__init__)

    def _init_stores(self) -> None:
        """Start with no store open (``Runtime.__init__`` calls this; cheap, no I/O)."""
        self._perfdb: PerfDB | None = None
        self._perfdb_path: str | None = None
        self._perfdb_failed = False
        self._quarantine: QuarantineStore | None = None

    def perfdb(self) -> PerfDB | None:
        """The PerfDB at the configured path (opened lazily), or None when disabled or unusable."""
        cfg = _config.get_config()
        if not cfg.use_perfdb:
            return None
        path = cfg.perfdb_path or _config.default_perfdb_path()
        if self._perfdb is not None and self._perfdb_path == path:
            return self._perfdb
        try:
            self._perfdb, self._perfdb_path, self._perfdb_failed = PerfDB(path), path, False
        except (LayerZeroError, OSError) as exc:
            if not self._perfdb_failed:
                log.warning(
                    "LayerZero PerfDB at %s is unusable (%s); selecting without measurements", path, exc
                )
            self._perfdb_failed = True
            return None
        return self._perfdb

    def quarantine(self) -> QuarantineStore | None:
        """The quarantine store in the PerfDB's file (None when the PerfDB is off or unusable)."""
        db = self.perfdb()
        if db is None:
            return None
        if self._quarantine is None or self._quarantine.path != self._perfdb_path:
            try:
                self._quarantine = QuarantineStore(self._perfdb_path or "")
            except LayerZeroError as exc:
                log.warning("LayerZero quarantine store unusable (%s); no canary quarantines", exc)
                return None
        return self._quarantine

    def _quarantine_if_open(self) -> QuarantineStore | None:
        """The quarantine store only when it is open already for the current PerfDB file, else None: what a
        capture-time choice reads (its entries are in memory; opening the store is file I/O)."""
        q = self._quarantine
        return q if q is not None and q.path == self._perfdb_path else None

    def _perf_lookup(self, ctx: SelectionContext) -> Callable[[str], Measurement]:
        """The measurement terms of ``ctx``'s kernels: from the PerfDB rows of the bucket when there are any,
        else from the timing data shipped for this device model and library versions (``core/shipped.py``;
        unless ``use_shipped_timings`` is off), else none. For a CUDA-graph capture context neither is read
        (no I/O inside a capture; and shipped data alone there would outrank the user's own measurements)."""
        nothing = Measurement()
        if ctx.graph_capture:
            return lambda _kid: nothing
        cfg = _config.get_config()
        db = self.perfdb()
        records = {}
        if db is not None:
            try:
                TELEMETRY.perfdb_reads += TELEMETRY.on
                fp = fingerprint(device_fingerprint_parts(ctx.device))
                records = db.for_bucket(ctx.op, ctx.bucket_key(), fp)
            except LayerZeroError as exc:
                log.warning("LayerZero PerfDB read failed (%s); selecting without its measurements", exc)
        weight = cfg.perf_weight
        if records:

            def lookup(kernel_id: str) -> Measurement:
                """The PerfDB terms of ``kernel_id`` (score; median µs, None when it has no row)."""
                rec = records.get(kernel_id)
                median = None if rec is None else rec.median_us
                return Measurement(perf_score(records, kernel_id, weight), median)

            return lookup
        if not cfg.use_shipped_timings:
            return lambda _kid: nothing
        reg = self.registry

        def version(kernel_id: str) -> tuple[str, str | None] | None:
            """``(backend id, its installed version)`` of ``kernel_id``; None for a kernel not registered."""
            if kernel_id not in reg.kernels:
                return None
            backend = reg.kernels.get(kernel_id).backend
            return backend, reg.backends.get(backend).version if backend in reg.backends else None

        match = _shipped.lookup(ctx, version, cfg.shipped_timings_dir)
        if match is None:
            return lambda _kid: nothing
        source = match.source
        margin = cfg.shipped_tie_margin
        if margin is None:
            margin = reg.ops.get(ctx.op).shipped_tie_margin if ctx.op in reg.ops else 0.0
        return lambda kid: Measurement(
            shipped=match.score(kid, weight, margin), shipped_us=match.median(kid), source=source
        )


def device_fingerprint_parts(device: DeviceSpec) -> dict[str, str]:
    """PerfDB fingerprint parts of ``device`` (name, SM, driver, CUDA, torch versions)."""
    return {k: str(v) for k, v in device.fingerprint_parts().items()}
