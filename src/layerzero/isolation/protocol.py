"""The wire format between an isolated backend's client and its worker process: JSON headers, never pickle.

This module imports only the standard library and torch, because the *worker* loads it by file path under an
interpreter that may not have LayerZero installed (another venv, built for another torch).

Frames: a 4-byte big-endian length, then that many bytes of UTF-8 JSON (at most :data:`MAX_FRAME` bytes), on
a ``SOCK_STREAM`` Unix socket pair. ``multiprocessing.Connection.send``/``recv`` pickle, and unpickling runs
arbitrary code, so neither side uses them. Tensor bytes never travel on the socket: they live in POSIX shared
memory (``multiprocessing.shared_memory.SharedMemory``) and a header carries only a descriptor.

Messages (every field listed; anything else is refused):

- worker -> client at start: ``{"op": "ready", "pid", "python", "torch"}`` or ``{"op": "error", ...}``;
- client -> worker: ``{"op": "call", "id", "target": "module:function", "arena": name | null, "args": [v...],
  "kwargs": {str: v}}``; ``{"op": "shutdown"}``;
- worker -> client: ``{"op": "result", "id", "value": v}`` or ``{"op": "error", "id", "type", "message",
  "traceback"}`` (the remote traceback as text, never a pickled exception).

A value ``v`` is ``None``, a bool, an int, a float (inf/nan allowed), a str, ``{"tuple": [v...]}``,
``{"list": [v...]}`` or ``{"tensor": descriptor}``; a descriptor is ``{"shm": segment name, "offset": bytes
(64-aligned), "shape": [int...], "strides": [int...] (elements), "dtype": one of DTYPES, "device":
"cpu"}`` for a CPU tensor, or for a CUDA tensor ``{"ipc": handles | null (an empty tensor), "offset": elements
into the storage, "shape", "strides", "dtype", "device": "cuda:N"}`` with ``handles`` = ``{"handle", "bytes",
"storage_offset", "ref", "ref_offset", "event", "event_sync"}``: the fields of PyTorch's own CUDA IPC
reduction (``torch.multiprocessing.reductions.reduce_tensor`` / ``rebuild_cuda_tensor``; byte strings
base64-encoded). CUDA tensors are shared, not copied: the receiver maps the sender's allocation
(``cudaIpcOpenMemHandle``), PyTorch's reference counter keeps that allocation alive until the receiver drops
its mapping, and the receiver's stream waits on an event the sender recorded when it shared the tensor. So a
worker writing an input in place writes the caller's tensor; results are cloned by the caller (they must not
outlive the worker), and the worker synchronizes its device before replying. Both processes need a CUDA build
of torch with the same IPC reduction (torch >= 1.x through 2.13 keep its signature).
"""

from __future__ import annotations

import base64
import json
import socket
import struct
from typing import Any

import torch

MAX_FRAME = 1 << 20
"""Largest header accepted (1 MiB): a header holds descriptors and scalars, never tensor data."""
ALIGN = 64
_LEN = struct.Struct(">I")

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
    )
}
"""The tensor dtypes the schema carries, by name."""
_NAMES = {dt: name for name, dt in DTYPES.items()}
_SCALARS = (bool, int, float, str)
MAX_DEPTH = 8


class SchemaError(TypeError):
    """A value or message outside the schema (the client turns it into a typed LayerZero error)."""


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    """Send one JSON message (raises SchemaError when it is not JSON or over :data:`MAX_FRAME`)."""
    try:
        data = json.dumps(msg, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"message is not JSON-serializable: {exc}") from None
    if len(data) > MAX_FRAME:
        raise SchemaError(f"message of {len(data)} bytes exceeds the {MAX_FRAME}-byte header limit")
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> dict[str, Any] | None:
    """Receive one message; ``None`` at end of stream (the peer closed or died). Raises SchemaError for a
    frame over the limit or not a JSON object, ``socket.timeout`` when the socket's timeout passes."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise SchemaError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte header limit")
    body = _recv_exact(sock, n)
    if body is None:
        return None
    msg = json.loads(body)
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise SchemaError(f"expected a JSON object with a str 'op', got {type(msg).__name__}")
    return msg


def check_tensor(t: torch.Tensor, where: str) -> None:
    if t.dtype not in _NAMES:
        raise SchemaError(f"{where}: dtype {t.dtype} is not carried (supported: {sorted(DTYPES)})")
    if t.device.type not in ("cpu", "cuda"):
        raise SchemaError(
            f"{where}: device {t.device} is not carried (CPU tensors through shared memory, CUDA "
            "tensors through CUDA IPC)"
        )
    if t.requires_grad:
        raise SchemaError(
            f"{where}: a tensor that requires grad (autograd does not cross the process boundary)"
        )


def collect(value: Any, out: list[torch.Tensor], where: str, depth: int = 0) -> None:
    """Check ``value`` against the schema and append its tensors to ``out`` (before any byte is sent)."""
    if depth > MAX_DEPTH:
        raise SchemaError(f"{where}: nested deeper than {MAX_DEPTH}")
    if value is None or type(value) in _SCALARS:
        return
    if isinstance(value, torch.Tensor):
        check_tensor(value, where)
        out.append(value)
    elif type(value) in (tuple, list):
        for i, v in enumerate(value):
            collect(v, out, f"{where}[{i}]", depth + 1)
    else:
        raise SchemaError(
            f"{where}: {type(value).__name__} is not in the schema (tensors, None, bool, int, float, "
            "str, tuples and lists of those)"
        )


def encode(value: Any, place: dict[int, dict[str, Any]]) -> Any:
    """``value`` as JSON; ``place`` maps ``id(tensor)`` to its descriptor (written by the sender)."""
    if value is None or type(value) in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):
        return {"tensor": place[id(value)]}
    return {type(value).__name__: [encode(v, place) for v in value]}


def decode(value: Any, tensor_of: Any, depth: int = 0) -> Any:
    """The inverse of :func:`encode`; ``tensor_of(descriptor)`` rebuilds a tensor. Raises SchemaError."""
    if depth > MAX_DEPTH:
        raise SchemaError(f"value nested deeper than {MAX_DEPTH}")
    if value is None or type(value) in _SCALARS:
        return value
    if isinstance(value, dict) and len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == "tensor" and isinstance(inner, dict):
            return tensor_of(check_descriptor(inner))
        if tag in ("tuple", "list") and isinstance(inner, list):
            items = [decode(v, tensor_of, depth + 1) for v in inner]
            return tuple(items) if tag == "tuple" else items
    raise SchemaError(f"value {str(value)[:80]!r} is not in the schema")


_IPC_FIELDS = {
    "handle": str,
    "bytes": int,
    "storage_offset": int,
    "ref": str,
    "ref_offset": int,
    "event": (str, type(None)),
    "event_sync": bool,
}


def check_descriptor(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` if it is a well-formed CPU or CUDA descriptor (see the module docstring); raises SchemaError."""
    ok = (
        isinstance(d.get("shape"), list)
        and isinstance(d.get("strides"), list)
        and len(d["shape"]) == len(d["strides"])
        and all(type(n) is int and n >= 0 for n in d["shape"] + d["strides"])
        and d.get("dtype") in DTYPES
        and type(d.get("offset")) is int
        and d["offset"] >= 0
    )
    if ok and "shm" in d:
        ok = (
            set(d) == {"shm", "offset", "shape", "strides", "dtype", "device"}
            and isinstance(d["shm"], str)
            and d["device"] == "cpu"
            and d["offset"] % ALIGN == 0
        )
    elif ok:
        ipc, dev = d.get("ipc"), d.get("device")
        ok = (
            set(d) == {"ipc", "offset", "shape", "strides", "dtype", "device"}
            and isinstance(dev, str)
            and dev.startswith("cuda:")
            and dev[5:].isdigit()
            and (
                ipc is None
                or isinstance(ipc, dict)
                and set(ipc) == set(_IPC_FIELDS)
                and all(
                    isinstance(ipc[k], t) and (t is not int or type(ipc[k]) is int and ipc[k] >= 0)
                    for k, t in _IPC_FIELDS.items()
                )
            )
        )
    if not ok:
        raise SchemaError(f"malformed tensor descriptor {str(d)[:160]}")
    return d


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(bytes(b)).decode("ascii")


def _unb64(s: str | None) -> bytes | None:
    if s is None:
        return None
    try:
        return base64.b64decode(s.encode("ascii"), validate=True)
    except ValueError as exc:
        raise SchemaError(f"malformed CUDA IPC handle: {exc}") from None


def ipc_descriptor(t: torch.Tensor) -> dict[str, Any]:
    """The descriptor of CUDA tensor ``t``, shared through PyTorch's CUDA IPC reduction (no copy; see the
    module docstring). The sender keeps nothing: PyTorch's reference counter keeps the allocation until the
    receiver drops its mapping."""
    base = {
        "offset": 0,
        "shape": list(t.shape),
        "strides": list(t.stride()),
        "dtype": _NAMES[t.dtype],
        "device": f"cuda:{t.device.index if t.device.index is not None else torch.cuda.current_device()}",
    }
    if t.numel() == 0:
        return {**base, "ipc": None, "strides": [0] * t.dim()}
    from torch.multiprocessing.reductions import reduce_tensor

    (
        _,
        size,
        stride,
        offset,
        _,
        _,
        device,
        handle,
        nbytes,
        storage_offset,
        _,
        ref,
        ref_offset,
        event,
        event_sync,
    ) = reduce_tensor(t.detach())[1]
    return {
        **base,
        "offset": int(offset),
        "device": f"cuda:{int(device)}",
        "ipc": {
            "handle": _b64(handle),
            "bytes": int(nbytes),
            "storage_offset": int(storage_offset),
            "ref": _b64(ref),
            "ref_offset": int(ref_offset),
            "event": _b64(event),
            "event_sync": bool(event_sync),
        },
    }


def ipc_tensor(d: dict[str, Any]) -> torch.Tensor:
    """The CUDA tensor a (checked) CUDA descriptor names, mapped from the sender's allocation (zero-copy)."""
    dtype, device = DTYPES[d["dtype"]], int(d["device"][5:])
    ipc = d["ipc"]
    if ipc is None:
        return torch.empty(d["shape"], dtype=dtype, device=f"cuda:{device}")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(d["shape"]),
        tuple(d["strides"]),
        d["offset"],
        torch.storage.TypedStorage,
        dtype,
        device,
        _unb64(ipc["handle"]),
        ipc["bytes"],
        ipc["storage_offset"],
        False,
        _unb64(ipc["ref"]),
        ipc["ref_offset"],
        _unb64(ipc["event"]),
        ipc["event_sync"],
    )


def descriptor(name: str, offset: int, t: torch.Tensor) -> dict[str, Any]:
    return {
        "shm": name,
        "offset": offset,
        "shape": list(t.shape),
        "strides": list(t.stride()),
        "dtype": _NAMES[t.dtype],
        "device": "cpu",
    }


def extent(d: dict[str, Any]) -> int:
    """Bytes a descriptor spans from its offset (0 for an empty tensor)."""
    if any(n == 0 for n in d["shape"]):
        return 0
    elems = 1 + sum((n - 1) * s for n, s in zip(d["shape"], d["strides"], strict=True))
    return elems * torch.empty((), dtype=DTYPES[d["dtype"]]).element_size()


def view(arena: torch.Tensor, d: dict[str, Any]) -> torch.Tensor:
    """The tensor a descriptor names inside ``arena`` (a flat uint8 tensor over the segment), zero-copy.
    Raises SchemaError when it does not fit."""
    n = extent(d)
    if d["offset"] + n > arena.numel():
        raise SchemaError(
            f"descriptor spans bytes {d['offset']}..{d['offset'] + n} of a {arena.numel()}-byte segment"
        )
    dtype = DTYPES[d["dtype"]]
    if n == 0:
        return torch.empty(d["shape"], dtype=dtype)
    flat = arena[d["offset"] : d["offset"] + n].view(dtype)
    return flat.as_strided(d["shape"], d["strides"])


def pack(arena: torch.Tensor, name: str, tensors: list[torch.Tensor]) -> dict[int, dict[str, Any]]:
    """Copy the CPU ``tensors`` into ``arena`` (contiguous, 64-aligned, in order) and share the CUDA ones
    (:func:`ipc_descriptor`); returns ``id -> descriptor``."""
    place: dict[int, dict[str, Any]] = {}
    offset = 0
    for t in tensors:
        if id(t) in place:
            continue
        if t.device.type == "cuda":
            place[id(t)] = ipc_descriptor(t)
            continue
        nbytes = t.numel() * t.element_size()
        dst = (
            arena[offset : offset + nbytes].view(t.dtype).view(t.shape)
            if nbytes
            else torch.empty(0, dtype=t.dtype)
        )
        if nbytes:
            dst.copy_(t)
        place[id(t)] = (
            descriptor(name, offset, dst)
            if nbytes
            else {
                "shm": name,
                "offset": 0,
                "shape": list(t.shape),
                "strides": [0] * t.dim(),
                "dtype": _NAMES[t.dtype],
                "device": "cpu",
            }
        )
        offset = align(offset + nbytes)
    return place


def nbytes_needed(tensors: list[torch.Tensor]) -> int:
    """Shared-memory bytes :func:`pack` needs for the CPU tensors of ``tensors``."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen and t.device.type == "cpu":
            seen.add(id(t))
            total = align(total + t.numel() * t.element_size())
    return total


class Segment:
    """A POSIX shared-memory segment with a flat ``uint8`` tensor over it (``torch.frombuffer``: zero-copy).

    ``Segment.create(size)`` owns the segment (unlinks it on :meth:`close`; Python's resource tracker unlinks
    it if this process dies first). ``Segment.attach(name)`` maps a peer's segment without tracking it, so
    this process never unlinks what it does not own."""

    def __init__(self, shm: Any, owner: bool) -> None:
        self.shm, self.owner, self.name, self.size = shm, owner, shm.name, shm.size
        self.tensor = (
            torch.frombuffer(shm.buf, dtype=torch.uint8) if shm.size else torch.empty(0, dtype=torch.uint8)
        )

    @classmethod
    def create(cls, size: int, prefix: str) -> Segment:
        import os
        import secrets
        from multiprocessing import shared_memory

        name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
        return cls(shared_memory.SharedMemory(name=name, create=True, size=max(size, ALIGN)), True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        from multiprocessing import resource_tracker, shared_memory

        try:
            shm = shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
        except TypeError:
            shm = shared_memory.SharedMemory(name=name)
            resource_tracker.unregister(shm._name, "shared_memory")  # 3.8-3.12 track attachments too
        return cls(shm, False)

    def close(self) -> None:
        self.tensor = None  # drop the exported buffer before closing the mapping
        try:
            self.shm.close()
        except BufferError:  # a kernel kept a view: leave the mapping, it goes with the process
            pass
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
