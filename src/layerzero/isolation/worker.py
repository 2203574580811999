"""The worker process of an isolated backend: ``python worker.py --fd N [--path DIR ...]``.

Started by :class:`layerzero.isolation.client.IsolatedBackend` under any Python interpreter that has torch
(another venv's, built for another torch, is the point); it needs neither LayerZero nor anything but the
standard library, torch and :mod:`protocol` (loaded from this file's directory by path). It serves calls on
the inherited Unix socket ``N`` one at a time until the client sends ``shutdown`` or closes the socket:

1. attach the client's input arena (a shared-memory segment, re-attached only when its name changes) and view
   the CPU argument tensors in it (zero-copy); map the CUDA ones from the client's allocations (CUDA IPC);
2. import ``module`` and look ``function`` up for the call's ``"module:function"`` target (cached), call it
   under ``torch.no_grad()``;
3. copy the result's CPU tensors into the worker's own output arena (grown by doubling, a new segment each
   time), share its CUDA ones (CUDA IPC; the client clones them), synchronize the device when any CUDA tensor
   took part (so the client sees in-place writes and finished results), and reply with their descriptors; an
   exception is replied as its type name, message and traceback text.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import sys
import traceback
from typing import Any

if __package__:
    from . import protocol as P
else:  # run as a script under another interpreter: load the sibling module by path, under a private name
    import importlib.util

    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # this directory's client.py/protocol.py must not shadow the target's imports

    _spec = importlib.util.spec_from_file_location(
        "_layerzero_isolation_protocol",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.py"),
    )
    P = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = P
    _spec.loader.exec_module(P)

import torch  # noqa: E402


def resolve(target: str, cache: dict[str, Any]) -> Any:
    fn = cache.get(target)
    if fn is None:
        module, sep, attr = target.partition(":")
        if not sep or not module or not attr:
            raise P.SchemaError(f"target {target!r}: expected 'module:function'")
        fn = importlib.import_module(module)
        for part in attr.split("."):
            fn = getattr(fn, part)
        if not callable(fn):
            raise P.SchemaError(f"target {target!r} is a {type(fn).__name__}, not a callable")
        cache[target] = fn
    return fn


class Worker:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inp: P.Segment | None = None
        self.out: P.Segment | None = None
        self.fns: dict[str, Any] = {}

    def arena_tensor(self, name: Any) -> torch.Tensor:
        if not isinstance(name, str):
            raise P.SchemaError("call without an input arena carries tensors")
        if self.inp is None or self.inp.name != name:
            if self.inp is not None:
                self.inp.close()
            self.inp = P.Segment.attach(name)
        return self.inp.tensor

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        if (
            set(msg) != {"op", "id", "target", "arena", "args", "kwargs"}
            or not isinstance(msg["args"], list)
            or not isinstance(msg["kwargs"], dict)
            or not isinstance(msg["target"], str)
        ):
            raise P.SchemaError(f"malformed call message with fields {sorted(msg)}")

        mapped: list[torch.Tensor] = []  # the client's CUDA tensors (CUDA IPC), at any nesting depth

        def tensor_of(d: dict[str, Any]) -> torch.Tensor:
            if "ipc" in d:
                mapped.append(P.ipc_tensor(d))
                return mapped[-1]
            return P.view(self.arena_tensor(msg["arena"]), d)

        args = [P.decode(v, tensor_of) for v in msg["args"]]
        kwargs = {str(k): P.decode(v, tensor_of) for k, v in msg["kwargs"].items()}
        fn = resolve(msg["target"], self.fns)
        with torch.no_grad():
            result = fn(*args, **kwargs)
        tensors: list[torch.Tensor] = []
        P.collect(result, tensors, "result")
        # A result on the client's own memory (an input returned, or a view of one) cannot be shared back:
        # CUDA IPC refuses to re-export a received allocation. It goes back as a copy, as every result does on
        # the client.
        borrowed = {m.untyped_storage().data_ptr() for m in mapped if m.numel()}
        copies = {
            id(t): t.clone() for t in tensors if t.is_cuda and t.untyped_storage().data_ptr() in borrowed
        }
        if mapped or any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()  # in-place writes to the client's tensors and the results are complete
        need = P.nbytes_needed(tensors)
        if self.out is None or self.out.size < need:
            if self.out is not None:
                self.out.close()
            self.out = P.Segment.create(max(need, 2 * (self.out.size if self.out else 0), 1 << 16), "lzw")
        place = P.pack(self.out.tensor, self.out.name, [copies.get(id(t), t) for t in tensors])
        place.update({i: place[id(c)] for i, c in copies.items()})
        return {"op": "result", "id": msg["id"], "value": P.encode(result, place)}

    def serve(self) -> None:
        while True:
            msg = P.recv(self.sock)
            if msg is None or msg["op"] == "shutdown":
                return
            try:
                if msg["op"] != "call":
                    raise P.SchemaError(f"unknown op {msg['op']!r}")
                reply = self.call(msg)
            except Exception as exc:  # noqa: BLE001 - every failure goes back as text; the worker keeps serving
                reply = {
                    "op": "error",
                    "id": msg.get("id"),
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "traceback": traceback.format_exc(),
                }
            P.send(self.sock, reply)

    def close(self) -> None:
        for seg in (self.inp, self.out):
            if seg is not None:
                seg.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--path", action="append", default=[])
    ns = ap.parse_args(argv)
    for p in reversed(ns.path):
        sys.path.insert(0, p)
    sock = socket.socket(fileno=ns.fd)
    P.send(
        sock,
        {"op": "ready", "pid": os.getpid(), "python": sys.version.split()[0], "torch": torch.__version__},
    )
    worker = Worker(sock)
    try:
        worker.serve()
    finally:
        worker.close()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
