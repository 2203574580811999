"""The symmetric buffers of the ``symm_mem`` all-reduces: one per process group, allocated collectively by
``lz.distributed.enable_symm_mem`` (never implicitly by a kernel or by selection), with NVLink multicast off.

A table of this process's buffers keyed by group name (a registry, like the kernel registry): the kernels'
check reads it, so enabling or dropping a buffer invalidates cached selections (``notify_change``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core.config import notify_change
from layerzero.core.errors import ConfigurationError, expected_got

MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
"""PyTorch's switch for NVLink multicast (NVLS) in symmetric memory; LayerZero requires it to be ``"1"``."""
PAD = 16
"""Bytes each rank's share of a message is padded to (the symm_mem kernels read 16-byte vectors)."""


@dataclass(frozen=True, slots=True)
class SymmBuffer:
    """One group's symmetric buffer: ``max_bytes`` usable message bytes on ``device``; ``p2p`` whether every
    rank's GPU reaches every other's by CUDA peer access (NVLink P2P), ``why_not`` the pairs that do not;
    ``push`` the push buffer of ``symm_mem.one_shot_push`` (:class:`.push.PushState`; None without peer
    access or Triton, ``push_why_not`` says why)."""

    group_name: str
    world_size: int
    device: torch.device
    max_bytes: int
    p2p: bool
    why_not: str
    buf: torch.Tensor | None
    handle: Any = None
    push: Any = None
    push_why_not: str = ""


_BUFFERS: dict[str, SymmBuffer] = {}


def get(group_name: str | None) -> SymmBuffer | None:
    """The buffer of ``group_name`` (None: none allocated)."""
    return _BUFFERS.get(group_name) if group_name is not None else None


def multicast_off() -> bool:
    """True when NVLink multicast is switched off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``)."""
    return os.environ.get(MULTICAST_ENV) == "1"


def require_multicast_off() -> None:
    """Set ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` when unset, before any symmetric allocation.

    Raises:
        ConfigurationError: the variable is set to anything but ``"1"`` (multicast would be used).
    """
    value = os.environ.get(MULTICAST_ENV)
    if value is None:
        os.environ[MULTICAST_ENV] = "1"
    elif value != "1":
        raise ConfigurationError(
            expected_got(
                f"lz.distributed.enable_symm_mem: {MULTICAST_ENV}",
                "'1' (NVLink multicast off: LayerZero never uses it)",
                repr(value),
                f"Unset it or export {MULTICAST_ENV}=1 before the first symmetric allocation.",
            )
        )


def enable(group: Any = None, max_bytes: int = 8 << 20) -> SymmBuffer:
    """Allocate and rendezvous ``group``'s symmetric buffer (a collective: every rank of the group calls it).

    Raises:
        ConfigurationError: see :func:`layerzero.distributed.enable_symm_mem`.
    """
    import torch.distributed as dist

    def bad(what: str, expected: Any, got: Any, fix: str) -> ConfigurationError:
        return ConfigurationError(expected_got(f"lz.distributed.enable_symm_mem: {what}", expected, got, fix))

    if not dist.is_available() or not dist.is_initialized():
        raise bad("process group", "an initialised one", None, "Call torch.distributed.init_process_group.")
    if max_bytes.__class__ is not int or max_bytes <= 0:
        raise bad("max_bytes", "an int > 0 (bytes)", repr(max_bytes), "Pass e.g. 8 << 20.")
    pg = dist.group.WORLD if group is None else group
    backend = str(dist.get_backend(pg))
    if backend != "nccl" or not torch.cuda.is_available():
        raise bad("group transport", "NCCL on CUDA", backend, "Symmetric memory needs GPUs; Gloo has none.")
    require_multicast_off()
    world = dist.get_world_size(pg)
    me = torch.cuda.current_device()
    devices: list[Any] = [None] * world
    dist.all_gather_object(devices, me, group=pg)
    bad_pairs = [
        f"cuda:{me}->cuda:{d}" for d in devices if d != me and not torch.cuda.can_device_access_peer(me, d)
    ]
    flags: list[Any] = [None] * world
    dist.all_gather_object(flags, bad_pairs, group=pg)
    why_not = "; ".join(f"rank {r}: {', '.join(p)}" for r, p in enumerate(flags) if p)
    name = str(pg.group_name)
    buf = handle = None
    if not why_not:
        import torch.distributed._symmetric_memory as symm

        if hasattr(symm, "enable_symm_mem_for_group"):  # needed before torch 2.11, a no-op (deprecated) since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm.enable_symm_mem_for_group(name)
        buf = symm.empty(max_bytes + PAD * world, dtype=torch.uint8, device=f"cuda:{me}")
        handle = symm.rendezvous(buf, pg)
    push_state, push_why_not = _push_buffer(pg, torch.device("cuda", me), why_not)
    entry = SymmBuffer(
        name,
        world,
        torch.device("cuda", me),
        max_bytes,
        not why_not,
        why_not,
        buf,
        handle,
        push_state,
        push_why_not,
    )
    _BUFFERS[name] = entry
    notify_change()
    return entry


def _push_buffer(pg: Any, device: torch.device, why_not: str) -> tuple[Any, str]:
    """The push buffer of ``symm_mem.one_shot_push`` (a collective), or (None, why not): no peer access, or
    Triton missing on some rank (every rank agrees, so none allocates alone)."""
    import torch.distributed as dist

    from . import push

    if why_not:
        return None, f"no CUDA peer access: {why_not}"
    missing: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(missing, push.triton_missing(), group=pg)
    reasons = "; ".join(f"rank {r}: {m}" for r, m in enumerate(missing) if m)
    if reasons:
        return None, reasons
    return push.allocate(pg, device), ""


def disable(group: Any = None) -> bool:
    """Drop ``group``'s buffer from the table (True when there was one); cached selections are invalidated."""
    import torch.distributed as dist

    pg = dist.group.WORLD if group is None else group
    gone = _BUFFERS.pop(str(pg.group_name), None) is not None
    notify_change()
    return gone
