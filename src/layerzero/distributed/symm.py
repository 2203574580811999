"""Symmetric memory for ``lz.all_reduce``'s ``symm_mem.*`` kernels: :func:`enable_symm_mem` allocates a
group's buffer (collectively, explicitly: selection never allocates), with NVLink multicast off."""

from __future__ import annotations

from typing import Any

__all__ = ["disable_symm_mem", "enable_symm_mem"]


def enable_symm_mem(group: Any = None, *, max_bytes: int = 8 << 20) -> Any:
    """Allocate ``group``'s symmetric buffer so that ``lz.all_reduce`` may pick ``symm_mem.one_shot`` /
    ``symm_mem.two_shot`` for messages up to ``max_bytes`` (bytes of one rank's input; default 8 MiB), and,
    when Triton imports on every rank, the push buffer of ``symm_mem.one_shot_push`` (messages up to 1 MiB;
    ``2 * world_size`` MiB per GPU).

    A collective: every rank of ``group`` (None: the default group, an NCCL group on one host's GPUs) calls
    it, before the all-reduces that should use it (and before ``lz.distributed.sync_selection``, whose kept
    decisions it would not change). Sets ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` when unset (NVLink multicast
    stays off). Checks CUDA peer access between every pair of the group's GPUs on every rank; where one pair
    lacks it no buffer is allocated and the kernels are refused with ``P2P_UNAVAILABLE``. Invalidates cached
    selections. Returns the buffer's record (``group_name``, ``max_bytes``, ``p2p``, ``why_not``).

    Raises:
        ConfigurationError: no initialised process group, a group that is not NCCL on CUDA, ``max_bytes`` not
            a positive int, or ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` set to anything but ``"1"``.
    """
    from layerzero.backends.symm_mem import buffers

    return buffers.enable(group, max_bytes)


def disable_symm_mem(group: Any = None) -> bool:
    """Forget ``group``'s symmetric buffer (its all-reduces go back to NCCL); True when there was one."""
    from layerzero.backends.symm_mem import buffers

    return buffers.disable(group)
