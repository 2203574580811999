"""Executors: how the engine core runs a step on its workers (:class:`~.abstract.Executor`); in-process now
(:class:`~.in_process.InProcessExecutor`), one worker process per GPU with tensor parallelism later."""

from .abstract import Executor
from .in_process import InProcessExecutor

__all__ = ["Executor", "InProcessExecutor"]
