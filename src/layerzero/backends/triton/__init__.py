"""The ``triton`` backend: LayerZero's own Triton kernels, CUDA only (SM >= 8.0).

Kernels: ``triton.rms_norm`` (fused residual add, ``norms.py``), ``triton.rope`` and ``triton.qk_norm_rope``
(``rope.py``), ``triton.swiglu`` (``swiglu.py``), ``triton.fused_moe`` (``moe.py``), ``triton.gemv``
(``lz.linear``, ``gemv.py``), ``triton.rms_norm_linear`` / ``triton.swiglu_linear`` (``gemv.py``),
``triton.quantized_linear`` (``lz.quantized_linear``, ``quantized_linear.py``), ``triton.sample_topk`` /
``triton.sample_topp`` / ``triton.sample`` / ``triton.sample_greedy`` (``sampling.py``),
``triton.reshape_and_cache`` (``cache.py``), ``triton.attention`` (``lz.attention`` with ALiBi computed in the
kernel, ``attention.py``), ``triton.apply_token_bitmask`` (``token_bitmask.py``) and the paged decode
attention kernels of ``paged.py``. Nothing is imported at ``import layerzero`` time: :func:`register` (run on
the first op call) calls :func:`probe`, which imports ``triton``; the ``@triton.jit`` modules
(``_*_kernels.py``) are imported on a kernel's first call. A missing triton leaves the backend registered and
unavailable with ``BACKEND_NOT_INSTALLED``; an import that raises anything else gives
``BACKEND_IMPORT_FAILED`` with the error text. Constraints, graph safety and what runs in Triton vs torch:
``docs/backends.md`` ("triton").
"""

from __future__ import annotations

import logging

from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec, KernelSpec

from .._optional import dist_version, import_modules, unavailable_backend, unavailable_why
from . import (
    attention,
    cache,
    gemv,
    moe,
    norms,
    quantized_linear,
    rope,
    rope_paged,
    sampling,
    swiglu,
    token_bitmask,
)
from ._common import INSTALL_HINT

log = logging.getLogger("layerzero.backends.triton")
BACKEND_ID = "triton"
MODULE = "triton"
_DESCRIPTION = (
    "LayerZero's own Triton kernels (RMSNorm + fused add, RoPE, q/k-norm + RoPE, SwiGLU, fused MoE, "
    "top-k/top-p sampling, lz.sample's fused race, greedy argmax, paged KV-cache write, paged decode, RoPE + "
    "KV write + paged decode, attention with in-kernel ALiBi, token bitmask)"
)
KERNEL_IDS = (
    norms.KERNEL_ID,
    rope.KERNEL_ID,
    rope.QK_NORM_KERNEL_ID,
    rope.QK_NORM_CACHE_KERNEL_ID,
    *sampling.KERNEL_IDS,
    swiglu.KERNEL_ID,
    moe.KERNEL_ID,
    cache.KERNEL_ID,
    gemv.KERNEL_ID,
    gemv.NORM_KERNEL_ID,
    gemv.SWIGLU_KERNEL_ID,
    quantized_linear.KERNEL_ID,
    rope_paged.KERNEL_ID,
    attention.KERNEL_ID,
    token_bitmask.KERNEL_ID,
)
"""Ids of this package's own op kernels (the paged kernels are listed by ``paged.kernel_specs``)."""


def probe() -> BackendSpec:
    """Import triton now and describe the backend (available, or not with one reason); never raises.

    ``BACKEND_NOT_INSTALLED`` when the ``triton`` module is not found; ``BACKEND_IMPORT_FAILED`` (with the
    exception text) when importing it raises anything else (a missing dependency of triton, a broken install).
    """
    modules, why = import_modules(MODULE, (MODULE,), INSTALL_HINT)
    if why is not None:
        return unavailable_backend(BACKEND_ID, MODULE, _DESCRIPTION, why)
    return BackendSpec(BACKEND_ID, MODULE, dist_version("triton", modules[0]), True, (), _DESCRIPTION)


def kernel_specs(available: bool, why: str = "triton is not available") -> list[KernelSpec]:
    """Every KernelSpec of the backend: rms_norm, rope, qk_norm_rope, sample_topk, sample_topp, sample,
    sample_greedy, swiglu, fused_moe, reshape_and_cache, linear (gemv), rms_norm_linear / swiglu_linear
    (gemv's prologues), quantized_linear, rope_paged_attention (``rope_paged``), attention (``attention``:
    ALiBi calls), apply_token_bitmask, then ``paged.kernel_specs``.

    Args:
        available: whether triton imported; when False the specs are still returned and their callables
            raise ``BackendNotAvailableError`` with ``why``.
        why: the unavailability reason, quoted by those callables.
    """
    from . import paged

    return [
        norms.kernel_spec(available, why),
        *rope.kernel_specs(available, why),
        *sampling.kernel_specs(available, why),
        swiglu.kernel_spec(available, why),
        moe.kernel_spec(available, why),
        cache.kernel_spec(available, why),
        gemv.kernel_spec(available, why),
        gemv.norm_kernel_spec(available, why),
        gemv.swiglu_kernel_spec(available, why),
        quantized_linear.kernel_spec(available, why),
        rope_paged.kernel_spec(available, why),
        attention.kernel_spec(available, why),
        token_bitmask.kernel_spec(available, why),
        *paged.kernel_specs(available, why),
    ]


def register(registry: KernelRegistry) -> None:
    """Add the ``triton`` backend (available or not, with reasons) and all its kernels to ``registry`` (the
    ``rms_norm``, ``rope``, ``qk_norm_rope``, ``sample_topk``, ``sample_topp``, ``sample``, ``sample_greedy``,
    ``swiglu``, ``fused_moe``, ``linear``, ``quantized_linear``, ``rope_paged_attention``, ``attention`` and
    ``paged_attention`` ops must be registered).

    Raises:
        ConfigurationError: the backend or one of its kernel ids is already registered.
    """
    backend = probe()
    registry.add_backend(backend)
    why = unavailable_why(backend, "triton is not available")
    for spec in kernel_specs(backend.available, why):
        registry.add_kernel(spec)


__all__ = ["BACKEND_ID", "KERNEL_IDS", "kernel_specs", "probe", "register"]
