"""``MultiprocExecutor``: tensor parallelism over one process per rank (nano-vllm's layout). Rank 0's
:class:`~layerzero.engine.worker.worker.Worker` runs in the engine core's own process and thread; ranks
1..N-1 are spawned worker processes (device ``cuda:i`` on CUDA, the CPU on CPU), or, under ``torchrun``, the
processes ``torchrun`` started (their ``LLM(...)`` call serves rank 0 and exits). ``torch.distributed`` is
initialised through ``env://`` (NCCL on CUDA, Gloo on CPU, bounded by
:data:`~..parallel.launch.PROCESS_GROUP_TIMEOUT_S`).

Each step rank 0 sends the plain :class:`~layerzero.engine.core.sched.output.SchedulerOutput` (msgpack, no
pickle: :mod:`.channel`) to every other rank, then runs it itself. Every rank runs the forward and its own
sampler (same seed, same full logits: the TP model all-gathers them), so all draw the same tokens; rank 0's
are what the engine core reads. A monitor thread watches the workers (process sentinels, channel EOF, their
failure reports): a worker that dies or fails makes the next (or the blocked) call raise
:class:`~layerzero.engine.core.errors.WorkerFailedError` naming the rank, and the other workers are stopped.
See docs/parallel.md, "Processes and launch"."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

import layerzero as lz

from ..config import EngineConfig, ModelConfig
from ..core.errors import WorkerFailedError
from ..core.sched.output import SchedulerOutput
from ..parallel.launch import enable_symm_all_reduce, free_port, init_distributed, leave_group, set_comm_env
from ..parallel.state import ParallelState
from ..worker.model_runner import ModelRunner
from ..worker.sampler import SamplingError
from ..worker.warmup import WarmupReport
from ..worker.worker import ModelRunnerOutput, Worker
from .channel import Channel, accept, pack
from .rank_worker import broadcast_address, rank_device, run_rank, worker_main
from .step_codec import StepEncoder

__all__ = ["STARTUP_TIMEOUT_S", "MultiprocExecutor", "torchrun_rank"]

log = logging.getLogger("layerzero.engine")

STARTUP_TIMEOUT_S = 600.0
"""How long rank 0 waits for every worker to connect and to report its model built."""


def torchrun_rank(world_size: int) -> tuple[int, int] | None:
    """(rank, local rank) when this process was started by ``torchrun`` for ``world_size`` ranks (``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK`` in the environment, ``WORLD_SIZE == world_size``); None otherwise (the
    executor spawns the other ranks itself)."""
    env = os.environ
    if "RANK" in env and "LOCAL_RANK" in env and env.get("WORLD_SIZE") == str(world_size):
        return int(env["RANK"]), int(env["LOCAL_RANK"])
    return None


class MultiprocExecutor:
    """The :class:`~.abstract.Executor` of ``ec.tensor_parallel_size`` ranks (see the module docstring).

    Raises:
        WorkerFailedError: a worker failed to start (its error type and message, the rank named), exited, or
            did not report within :data:`STARTUP_TIMEOUT_S`.
        ConfigurationError: what rank 0's :class:`~layerzero.engine.worker.model_runner.ModelRunner` raises.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ec: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.world = ec.tensor_parallel_size
        self.worker: Worker | None = None
        self._procs: dict[int, Any] = {}
        self._chans: dict[int, Channel] = {}
        self._encoder = StepEncoder(capacity=max(4096, 4 * ec.max_num_seqs))
        self._ready: set[int] = set()
        self._failure: WorkerFailedError | None = None
        self._closing = threading.Event()
        self._changed = threading.Condition()
        self._server: socket.socket | None = None
        self._monitor: threading.Thread | None = None
        self._owns_group = not dist.is_initialized()
        launched = torchrun_rank(self.world)
        args = (ec, dtype, max_model_len, max_num_batched_tokens)
        if launched is not None and launched[0] != 0:  # a torchrun rank: serve rank 0, then end the process
            code = run_rank(launched[0], self.world, rank_device(device, launched[1]), *args)
            raise SystemExit(code)
        self._finalizer = weakref.finalize(
            self, _finalize, self._procs, self._chans, self._closing, self._owns_group
        )
        try:
            self._start(cfg, ec, device, dtype, max_model_len, max_num_batched_tokens, launched)
        except BaseException as exc:
            failure = self._await_failure(exc)
            self.shutdown()
            if failure is not None:
                raise failure from exc
            raise

    def _start(
        self,
        cfg: ModelConfig,
        ec: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        budget: int,
        launched: tuple[int, int] | None,
    ) -> None:
        set_comm_env()
        device = rank_device(device, 0 if launched is None else launched[1])
        if launched is None:  # spawn ranks 1..N-1 on this node, rendezvous through env:// on loopback
            addr, port = "127.0.0.1", free_port()
            with _env(MASTER_ADDR=addr, MASTER_PORT=str(port)):
                spawn = multiprocessing.get_context("spawn")
                for rank in range(1, self.world):
                    p = spawn.Process(
                        target=worker_main,
                        args=(rank, self.world, addr, port, _ec_bytes(ec), dtype, max_model_len, budget),
                        name=f"LayerZeroWorker-{rank}",
                        daemon=True,
                    )
                    p.start()
                    self._procs[rank] = p
                parallel = self._init_group(device)
        else:
            parallel = self._init_group(device)
        parallel = dataclasses.replace(parallel, ep=ec.enable_expert_parallel)
        self._accept(parallel, device, multi_node=launched is not None and _multi_node())
        self._monitor = threading.Thread(target=self._watch, name="LayerZeroExecutorMonitor", daemon=True)
        self._monitor.start()
        enable_symm_all_reduce(parallel, device)
        lz.distributed.sync_selection(device=device)
        self.worker = Worker(cfg, ec, device, dtype, max_model_len, budget, parallel)
        self.num_kv_blocks = self.worker.runner.num_blocks
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with self._changed:
            while self._failure is None and len(self._ready) < self.world - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.world)) - self._ready)
                    raise WorkerFailedError(
                        f"tensor-parallel worker(s) {missing}: expected ready within {STARTUP_TIMEOUT_S:.0f} "
                        "s, got nothing",
                        missing[0],
                    )
                self._changed.wait(min(left, 0.5))
        self._raise_if_failed()
        log.info("tensor parallel: %d ranks, %d KV blocks each", self.world, self.num_kv_blocks)

    def _init_group(self, device: torch.device) -> ParallelState:
        try:
            return init_distributed(0, self.world, device)
        except Exception:
            if self._procs:  # a worker that died before the rendezvous: name it
                time.sleep(0.2)
                self._check_procs()
            raise

    def _accept(self, parallel: ParallelState, device: torch.device, multi_node: bool) -> None:
        """Listen, tell every rank where (a broadcast of host, port, key), accept each rank's connection."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1") if multi_node else "127.0.0.1"
        server = self._server = socket.create_server(("0.0.0.0" if multi_node else host, 0))
        key = secrets.token_bytes(32)
        broadcast_address(parallel, device, [host, server.getsockname()[1], key])
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(self._chans) < self.world - 1:
            self._check_procs()
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.world)) - set(self._chans))
                raise WorkerFailedError(
                    f"tensor-parallel worker(s) {missing}: expected to connect within "
                    f"{STARTUP_TIMEOUT_S:.0f} s, got nothing",
                    missing[0],
                )
            try:
                rank, chan = accept(server, key, 0.5)
            except TimeoutError:
                continue
            self._chans[rank] = chan

    # ------------------------------------------------------------------------------------------ monitor
    def _watch(self) -> None:
        """Read the workers' reports and watch their processes until shutdown; a failure is recorded once and
        the other workers stopped."""
        rank_of = {c.fileno(): r for r, c in self._chans.items()}
        proc_of = {p.sentinel: r for r, p in self._procs.items()}
        live = [*self._chans.values(), *(p.sentinel for p in self._procs.values())]
        while live and not self._closing.is_set():
            for obj in multiprocessing.connection.wait(live, timeout=0.5):
                if self._closing.is_set():
                    return
                if isinstance(obj, Channel):
                    rank = rank_of[obj.fileno()]
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError) as exc:
                        live.remove(obj)
                        self._fail(WorkerFailedError(f"tensor-parallel worker {rank}: exited ({exc})", rank))
                        continue
                    if msg[0] == "ready":
                        with self._changed:
                            self._ready.add(rank)
                            self._changed.notify_all()
                    elif msg[0] == "failed":
                        _, rank, etype, message, tb = msg
                        log.error("tensor-parallel worker %d failed:\n%s", rank, tb)
                        self._fail(
                            WorkerFailedError(
                                f"tensor-parallel worker {rank}: {etype}: {message}", rank, etype
                            )
                        )
                else:
                    live.remove(obj)
                    rank = proc_of[obj]
                    time.sleep(0.1)  # its failure report, if it sent one, is read first
                    if self._failure is None and not self._closing.is_set():
                        code = self._procs[rank].exitcode
                        self._fail(
                            WorkerFailedError(
                                f"tensor-parallel worker {rank}: exited with code {code}", rank, exitcode=code
                            )
                        )

    def _fail(self, err: WorkerFailedError) -> None:
        with self._changed:
            if self._failure is not None or self._closing.is_set():
                return
            self._failure = err
            self._changed.notify_all()
        log.error("%s; stopping the other workers", err)
        _stop_processes(self._procs, {}, grace_s=0.0)
        if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            # rank 0 may be blocked in a collective the dead rank never joins: NCCL would wait for the
            # group's timeout; aborting the communicators makes it raise now (Gloo raises on the closed peer)
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()

    def _check_procs(self) -> None:
        for rank, p in self._procs.items():
            if p.exitcode is not None:
                raise WorkerFailedError(
                    f"tensor-parallel worker {rank}: exited with code {p.exitcode} during start-up (its "
                    "stderr says more)",
                    rank,
                    exitcode=p.exitcode,
                )

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _await_failure(self, exc: BaseException, wait_s: float = 3.0) -> WorkerFailedError | None:
        """The recorded worker failure behind ``exc`` (waiting up to ``wait_s`` for the monitor to see it: a
        collective or a send fails as soon as the peer is gone), else None."""
        if isinstance(exc, WorkerFailedError):
            return exc
        deadline = time.monotonic() + wait_s
        with self._changed:
            while self._failure is None and self._monitor is not None and time.monotonic() < deadline:
                self._changed.wait(0.05)
        return self._failure

    # ------------------------------------------------------------------------------------------ protocol
    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner."""
        return self.worker.runner

    @property
    def warmup(self) -> WarmupReport | None:
        return self.worker.warmup if self.worker is not None else None

    def _broadcast(self, data: bytes) -> None:
        for chan in self._chans.values():
            chan.send_bytes(data)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._raise_if_failed()
        try:
            self._broadcast(self._encoder.encode(scheduler_output))
            return self.worker.execute_model(scheduler_output)
        except SamplingError:  # every rank drew the same rows and raised alike: the core fails those rows
            raise
        except Exception as exc:
            failure = self._await_failure(exc)
            if failure is not None:
                raise failure from exc
            raise

    def reset(self) -> None:
        if self._failure is not None or self.worker is None:
            return
        with contextlib.suppress(OSError):
            self._broadcast(pack(["reset"]))
        self.worker.reset()

    def kernel_report(self, buckets: list[tuple[str, int]]) -> dict[str, Any]:
        """Rank 0's ``ModelRunner.kernel_report``; every rank dry-runs the same forwards (selection is
        collective under ``lz.distributed.sync_selection``)."""
        self._raise_if_failed()
        self._broadcast(pack(["report", [list(b) for b in buckets]]))
        return self.worker.runner.kernel_report(buckets)

    def shutdown(self) -> None:
        """Tell the workers to exit, wait for them (then terminate / kill), close the channels, leave the
        process group. Idempotent."""
        self._closing.set()
        if self._failure is None:
            with contextlib.suppress(OSError):
                self._broadcast(pack(["shutdown"]))
        _stop_processes(self._procs, self._chans, grace_s=5.0 if self._failure is None else 0.0)
        if self._server is not None:
            self._server.close()
            self._server = None
        self.worker = None
        if self._owns_group:
            leave_group()
            self._owns_group = False

    @property
    def cascade_steps(self) -> int:
        return self.worker.runner.cascade_steps

    @property
    def cascade_saved_tokens(self) -> int:
        return self.worker.runner.cascade_saved_tokens


# ---------------------------------------------------------------------------------------------- workers
def _ec_bytes(ec: EngineConfig) -> bytes:
    from ..core.serial import encode_config

    return encode_config(ec)


def _finalize(
    procs: dict[int, Any], chans: dict[int, Channel], closing: threading.Event, owns_group: bool
) -> None:
    """An executor collected or left at interpreter exit without :meth:`MultiprocExecutor.shutdown`: the
    same clean stop (the monitor told first, so a closing channel is not reported as a failed worker), and
    the process group left when this executor made it (no "destroy_process_group() was not called")."""
    if closing.is_set():  # shutdown() ran: it left the group itself
        return
    closing.set()
    data = pack(["shutdown"])
    for chan in chans.values():
        with contextlib.suppress(OSError):
            chan.send_bytes(data)
    _stop_processes(procs, chans)
    if owns_group:
        leave_group()


def _stop_processes(procs: dict[int, Any], chans: dict[int, Channel], grace_s: float = 5.0) -> None:
    """Wait ``grace_s`` for the workers to exit, terminate the rest (then kill), close the channels."""
    deadline = time.monotonic() + grace_s
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs.values():
        if p.exitcode is None:
            p.terminate()
    for p in procs.values():
        p.join(2.0)
        if p.exitcode is None:
            p.kill()
            p.join(2.0)
    for c in chans.values():
        c.close()


@contextlib.contextmanager
def _env(**values: str) -> Any:
    """Set environment variables for the block (restored after it)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _multi_node() -> bool:
    return os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE")) != os.environ.get("WORLD_SIZE")
