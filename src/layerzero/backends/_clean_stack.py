"""Running a backend's probe on a clean stack, so a library's kept exceptions cannot pin the caller's frames.

Some libraries keep an exception raised while they load: xFormers keeps the ``OSError`` of its C++ extension
(``xformers._cpp_lib._cpp_library_load_exception``). A traceback's frames link to their callers (``f_back``),
so such an exception keeps every frame that was on the stack when the import ran, with their locals, for as
long as the library lives. LayerZero probes its backends on the first selection, which is usually inside a
model's first forward: on CUDA that pinned an engine's model, KV cache and CUDA graphs after the engine was
deleted (benchmarks/results/history.md). A probe run in a short-lived thread has only that thread's frames
above it.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["on_clean_stack"]


def on_clean_stack(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, run in a new thread that the caller waits for, under a copy of the caller's context
    variables and on the caller's current CUDA device (when CUDA is initialised; the current device is per
    thread).

    Returns what ``fn`` returns. Raises what ``fn`` raises (re-raised in the caller's thread)."""
    import torch

    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    ctx = contextvars.copy_context()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            box["value"] = ctx.run(fn, *args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which re-raises it
            box["error"] = exc

    worker = threading.Thread(target=run, name="layerzero-probe", daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        error = box.pop("error")
        raise error
    return box["value"]
