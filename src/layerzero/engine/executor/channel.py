"""The executor's control channel between rank 0 and the other ranks: length-prefixed msgpack frames over TCP
(no pickle), authenticated by a shared random key. Rank 0 listens; every other rank connects, sends the key
and its rank. Step messages carry the plain :class:`~layerzero.engine.core.sched.output.SchedulerOutput`
(:mod:`.step_codec`); workers answer only at start-up (ready / failed) and when they fail.

Message kinds (rank 0 -> workers): ``["step", ...]`` (:mod:`.step_codec`), ``["reset"]``, ``["report",
buckets]`` (kernel_report: every rank dry-runs the same forwards), ``["shutdown"]``; workers -> rank 0:
``["ready", rank]``, ``["failed", rank, error_type, message, traceback]``."""

from __future__ import annotations

import contextlib
import hmac
import socket
import struct
from typing import Any

__all__ = ["Channel", "accept", "connect", "pack", "unpack"]

_HEADER = struct.Struct("!Q")
KEY_BYTES = 32


def pack(obj: Any) -> bytes:
    """msgpack of plain data (ints, floats, str, bytes, lists, dicts)."""
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    import msgpack

    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


class Channel:
    """One connected socket: :meth:`send` / :meth:`recv` whole frames (``TCP_NODELAY``: a step's frame leaves
    at once)."""

    def __init__(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):  # (not TCP: a Unix socket)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(_HEADER.pack(len(data)) + data)

    def send(self, obj: Any) -> None:
        self.send_bytes(pack(obj))

    def recv_bytes(self) -> bytes:
        (n,) = _HEADER.unpack(self._exact(_HEADER.size))
        return self._exact(n)

    def recv(self) -> Any:
        return unpack(self.recv_bytes())

    def _exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError("executor channel: the other end closed")
            got += k
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def accept(server: socket.socket, key: bytes, timeout_s: float) -> tuple[int, Channel]:
    """Accept one rank on ``server`` (waiting at most ``timeout_s``), check its key; returns (its rank, the
    channel).


    Raises:
        TimeoutError: no connection in time. ConnectionError: a wrong key.
    """
    server.settimeout(timeout_s)
    sock, _ = server.accept()
    sock.settimeout(timeout_s)
    got = _recv_exact(sock, KEY_BYTES + 4)
    sock.settimeout(None)
    if not hmac.compare_digest(got[:KEY_BYTES], key):
        sock.close()
        raise ConnectionError("executor channel: a connection with a wrong key")
    return struct.unpack("!i", got[KEY_BYTES:])[0], Channel(sock)


def connect(host: str, port: int, key: bytes, rank: int, timeout_s: float) -> Channel:
    """Connect rank ``rank`` to rank 0's channel at ``host:port``."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.settimeout(None)
    sock.sendall(key + struct.pack("!i", rank))
    return Channel(sock)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError("executor channel: the other end closed during the handshake")
        buf += part
    return buf
