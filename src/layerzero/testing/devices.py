"""Hand-built :class:`DeviceSpec` objects for routing tests and "what would LayerZero pick on that GPU?"
questions.

Selection reads the device only through ``SelectionContext.device``, so a fake spec answers routing questions
for hardware that is not present: ``lz``'s own tests use it for Ampere/Ada/Hopper/Blackwell/future-SM
contexts.
"""

from __future__ import annotations

import torch

from layerzero.core.device import DeviceSpec, gpu_generation_from_sm, tensor_core_generation

__all__ = ["fake_cuda_device"]


def fake_cuda_device(
    sm: tuple[int, int] = (9, 0),
    *,
    sms: int | None = None,
    name: str | None = None,
    cuda_version: str = "12.8",
) -> DeviceSpec:
    """A CUDA :class:`DeviceSpec` for compute capability ``sm`` (generation, tensor-core generation, bf16 from
    SM 8.0, fp8 from SM 8.9 derived as :meth:`DeviceSpec.detect` derives them), ``sms`` multiprocessors (None
    = unknown), this process's torch version, no driver/cuDNN/CPU details. Raises nothing.

    >>> fake_cuda_device((8, 0)).generation.name
    'AMPERE'
    """
    gen = gpu_generation_from_sm(*sm)
    return DeviceSpec(
        device_type="cuda",
        index=0,
        name=name or f"Fake SM {sm[0]}.{sm[1]}",
        sm=sm,
        generation=gen,
        tensor_core_gen=tensor_core_generation(gen),
        supports_bf16=sm >= (8, 0),
        supports_fp8=sm >= (8, 9),
        total_memory_bytes=None,
        multiprocessor_count=sms,
        torch_version=torch.__version__,
        cuda_version=cuda_version,
        driver_version=None,
        cudnn_version=None,
        cpu_vendor=None,
        cpu_isa=frozenset(),
    )
