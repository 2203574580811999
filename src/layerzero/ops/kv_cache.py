"""The paged KV cache: ``lz.allocate_kv_cache`` and the checks shared by the paged ops.

A paged KV cache (vLLM's PagedAttention, Kwon et al. 2023) stores keys and values in fixed-size blocks
("pages") of ``block_size`` tokens; a sequence owns a list of block ids (a row of ``block_tables``) and its
token ``t`` lives at slot ``block_tables[seq, t // block_size] * block_size + t % block_size``. One tensor
holds both K and V, shaped per :class:`~layerzero.core.kv_layout.KVLayout` (defined in core, with
:func:`~layerzero.core.kv_layout.cache_dims`, so the paged kernels share them; re-exported here as
``layerzero.ops.kv_cache.KVLayout``):

- ``NHD`` (vLLM FlashAttention backend / FlashInfer default): ``[num_blocks, 2, block_size, Hkv, D]``;
- ``HND`` (FlashInfer ``kv_layout="HND"``): ``[num_blocks, 2, Hkv, block_size, D]``.

Index 0 of dim 1 is K, index 1 is V.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch

from layerzero.core import config as _config
from layerzero.core.errors import BackendNotAvailableError, InvalidInputError, expected_got
from layerzero.core.kv_layout import KVLayout, cache_dims, cache_shape, parse_kv_layout
from layerzero.core.kv_quant import KV_CACHE_DTYPES, KV_QUANT_DTYPES

__all__ = [
    "INDEX_DTYPES",
    "KVLayout",
    "allocate_kv_cache",
    "cache_dims",
    "check_cache",
    "check_index",
    "check_kv_scale",
    "check_values",
    "parse_layout",
]

log = logging.getLogger("layerzero.ops.kv_cache")

INDEX_DTYPES = frozenset({torch.int32, torch.int64})
_INT64_MAX = 2**63 - 1
_CACHE_DTYPE_NAMES = "one of float32/float64/float16/bfloat16, or float8_e4m3fn/int8 (quantized)"
_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError  # torch < 2.5: cuda only


def _fail(op: str, what: str, expected: Any, got: Any, fix: str | None = None) -> InvalidInputError:
    return InvalidInputError(expected_got(f"lz.{op}: {what}", expected, got, fix))


def parse_layout(op: str, layout: Any, name: str = "kv_layout") -> KVLayout:
    """``"NHD"`` / ``"HND"`` (or a :class:`KVLayout`) -> :class:`KVLayout`.

    Raises:
        InvalidInputError: anything else (names the two layouts and their shapes).
    """
    return parse_kv_layout(layout, f"lz.{op}: {name}")


def check_cache(op: str, kv_cache: Any, layout: KVLayout) -> tuple[int, int, int, int]:
    """``kv_cache`` is a rank-5 tensor of a cache dtype (a float dtype, or float8_e4m3fn/int8: quantized) with
    2 at dim 1 and non-empty block/head/head-dim dims; returns ``(num_blocks, block_size, Hkv, D)``.

    Raises:
        InvalidInputError: not a tensor, not floating, wrong rank, dim 1 != 2, a zero block_size/Hkv/D.
    """
    want = layout.shape
    if not isinstance(kv_cache, torch.Tensor):
        raise _fail(op, "kv_cache", f"a torch.Tensor {want}", type(kv_cache).__name__)
    if kv_cache.dtype not in KV_CACHE_DTYPES:
        raise _fail(
            op,
            "kv_cache.dtype",
            _CACHE_DTYPE_NAMES,
            kv_cache.dtype,
            "Allocate it with lz.allocate_kv_cache(..., dtype=q.dtype), or float8_e4m3fn/int8 for a "
            "quantized cache.",
        )
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise _fail(
            op,
            f"kv_cache shape ({layout.value})",
            want,
            list(kv_cache.shape),
            "Dim 1 holds K (0) and V (1); see lz.allocate_kv_cache.",
        )
    nb, bs, hkv, d = cache_dims(kv_cache, layout)
    if bs == 0 or hkv == 0 or d == 0:
        raise _fail(
            op,
            f"kv_cache shape ({layout.value})",
            "block_size, Hkv and D >= 1",
            f"block_size={bs}, Hkv={hkv}, D={d} (shape {list(kv_cache.shape)})",
            "Check kv_layout: NHD puts block_size before Hkv, HND after.",
        )
    return nb, bs, hkv, d


def check_index(
    op: str,
    name: str,
    t: Any,
    ndim: int,
    device: torch.device,
    dtypes: frozenset[torch.dtype] = frozenset({torch.int32}),
) -> None:
    """``t`` is an integer tensor of rank ``ndim`` with a dtype in ``dtypes`` on ``device``.

    Raises:
        InvalidInputError: not a tensor, wrong dtype, rank or device.
    """
    names = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    if not isinstance(t, torch.Tensor):
        raise _fail(op, name, f"a {names} torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        raise _fail(op, f"{name}.dtype", names, t.dtype, f"Cast it with {name}.to(torch.int32).")
    if t.dim() != ndim:
        raise _fail(op, f"{name} rank", f"{ndim} dims", f"{t.dim()} dims (shape {list(t.shape)})")
    if t.device != device:
        raise _fail(op, f"{name}.device", device, t.device, f"Move it with {name}.to(q.device).")


def check_values(t: torch.Tensor) -> bool:
    """Whether the ops read index *values* of ``t`` to validate them: always for CPU tensors; for other
    devices only when ``lz.get_config().strict`` is True, because reading values costs a device sync, and
    never while a CUDA graph is being captured (a sync is illegal there: the eager calls before capture are
    checked)."""
    if t.device.type == "cpu":
        return True
    return _config.get_config().strict and not (
        t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    )


def _check_device(op: str, device: Any) -> torch.device:
    """``device`` as a :class:`torch.device` this process can allocate on; no memory is allocated for CPU,
    CUDA and meta (other types are probed with a 0-element tensor).

    Raises:
        InvalidInputError: not a device (string), an unknown device type, a CUDA ordinal past the visible
            devices.
        BackendNotAvailableError: a device type this torch build or machine lacks (CUDA on a CPU-only build or
            without a GPU, MPS off Apple silicon, ...).
    """
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise _fail(
            op,
            "device",
            "a torch.device, a device string like 'cpu' or 'cuda:0', or an int CUDA ordinal",
            f"{type(device).__name__} {device!r}",
        )
    if isinstance(device, int):
        if device < 0:
            raise _fail(op, "device (CUDA ordinal)", "an int >= 0", device, "Pass 0 for the first GPU.")
        device = f"cuda:{device}"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _fail(
            op,
            "device",
            "a torch device string such as 'cpu', 'cuda', 'cuda:1' or 'meta'",
            repr(device),
            f"torch said: {str(exc)[:160]}",
        ) from exc
    if dev.type in ("cpu", "meta"):
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendNotAvailableError(
                expected_got(
                    f"lz.{op}: device {str(dev)!r}",
                    "a usable CUDA device (torch.cuda.is_available() == True)",
                    f"none (torch {torch.__version__}, built with CUDA {torch.version.cuda})",
                    "Install a CUDA build of torch and a driver, check CUDA_VISIBLE_DEVICES, or pass "
                    "device='cpu'.",
                )
            )
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise _fail(
                op,
                "device (CUDA ordinal)",
                f"0 <= index < {count} (visible CUDA devices)",
                dev.index,
                "Use an ordinal below torch.cuda.device_count() or check CUDA_VISIBLE_DEVICES.",
            )
        return dev
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as exc:  # torch raises either for a device type it cannot use
        said = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise BackendNotAvailableError(
            expected_got(
                f"lz.{op}: device {str(dev)!r}",
                f"a usable {dev.type} device in this torch build",
                "none",
                f"torch said: {said}. Pass device='cpu' or a device this machine has.",
            )
        ) from exc
    return dev


def _device_memory(dev: torch.device) -> int | None:
    """Total bytes of ``dev``'s memory (physical RAM for CPU), or None when unknown (meta, other types)."""
    try:
        if dev.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if dev.type == "cuda":
            return int(torch.cuda.get_device_properties(dev).total_memory)
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None
    return None


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    layout: str | KVLayout = "NHD",
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Allocate a zeroed paged KV cache for :func:`lz.paged_attention` and :func:`lz.reshape_and_cache`.

    Shape per ``layout`` (vLLM / FlashInfer conventions): ``"NHD"`` -> ``[num_blocks, 2, block_size,
    num_kv_heads, head_dim]``, ``"HND"`` -> ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``; index 0
    of dim 1 holds keys, index 1 values. Size in bytes = ``2 * num_blocks * block_size * num_kv_heads *
    head_dim * dtype.itemsize`` (e.g. 1024 blocks x 16 tokens x 8 heads x 128 x bf16 = 64 MiB). One cache
    serves one layer; a model allocates one per layer.

    Args:
        num_blocks: blocks (pages), >= 0. block_size: tokens per block, >= 1. num_kv_heads: Hkv, >= 1.
        head_dim: D, >= 1. dtype: float32/float64/float16/bfloat16 (the dtype of q), or
            ``torch.float8_e4m3fn``
        / ``torch.int8`` for a quantized cache (1 byte per element; pass ``k_scale``/``v_scale`` to
        :func:`lz.reshape_and_cache` and :func:`lz.paged_attention`, docs/paged_attention.md). layout:
        ``"NHD"`` or ``"HND"``. device: where to allocate (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a
        :class:`torch.device`, an int CUDA ordinal; ``"meta"`` allocates nothing).

    Raises:
        InvalidInputError: a size that is not an int in range, a non-float dtype, an unknown layout, a device
            that is not one, a CUDA ordinal past the visible devices, a size whose element count or bytes
            overflow int64 or exceed the device's total memory (physical RAM for CPU), or an allocation the
            device cannot serve now (out of memory; nothing is allocated). All checked before allocating.
        BackendNotAvailableError: a device type this machine or torch build lacks (e.g. ``device="cuda"`` on a
            CPU-only torch).

    >>> import torch, layerzero as lz
    >>> lz.allocate_kv_cache(4, 16, 2, 64, torch.float32).shape
    torch.Size([4, 2, 16, 2, 64])
    """
    op = "allocate_kv_cache"
    for name, value, low in (
        ("num_blocks", num_blocks, 0),
        ("block_size", block_size, 1),
        ("num_kv_heads", num_kv_heads, 1),
        ("head_dim", head_dim, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _fail(op, name, f"an int >= {low}", repr(value))
    if dtype not in KV_CACHE_DTYPES:
        raise _fail(
            op,
            "dtype",
            "one of torch.float32/float64/float16/bfloat16, or torch.float8_e4m3fn/int8 (quantized)",
            repr(dtype),
            "Use the dtype of the model's q/k/v, or float8_e4m3fn for an fp8 cache.",
        )
    lay = parse_layout(op, layout, "layout")
    dev = _check_device(op, device)
    shape = cache_shape(num_blocks, block_size, num_kv_heads, head_dim, lay)
    numel = 2 * num_blocks * block_size * num_kv_heads * head_dim
    nbytes = numel * dtype.itemsize
    size = (
        f"{nbytes} bytes = 2 * {num_blocks} blocks * {block_size} tokens * {num_kv_heads} heads * {head_dim} "
        f"* {dtype.itemsize} bytes"
    )
    if nbytes > _INT64_MAX:
        raise _fail(
            op,
            "cache size",
            f"at most {_INT64_MAX} bytes (int64)",
            size,
            "Check the arguments: num_blocks * block_size * num_kv_heads * head_dim overflows.",
        )
    total = _device_memory(dev)
    if total is not None and nbytes > total:
        raise _fail(
            op,
            "cache size",
            f"at most the {dev.type} device's total memory ({total} bytes)",
            size,
            "Allocate fewer blocks (num_blocks), or shard the KV heads across devices.",
        )
    try:
        return torch.zeros(shape, dtype=dtype, device=dev)
    except RuntimeError as exc:  # torch.OutOfMemoryError (CUDA), "can't allocate memory" (CPU)
        if not isinstance(exc, _OOM) and "allocate memory" not in str(exc):
            raise
        raise _fail(
            op,
            "cache size",
            f"what the {dev} device can allocate now",
            size,
            f"Allocate fewer blocks or free memory first (torch said: {str(exc).strip()[:160]}).",
        ) from exc


def check_kv_scale(op: str, name: str, scale: Any, kv_cache: torch.Tensor) -> Any:
    """A quantized cache's ``k_scale`` / ``v_scale``: None -> 1.0 (vLLM's default), a positive finite number
    -> float, a 0-d or 1-element float32 tensor on the cache's device -> itself (its value is checked when
    :func:`check_values` says so: always on CPU, on CUDA only in strict mode). A scale with an unquantized
    cache is refused (it would be ignored).

    Raises:
        InvalidInputError: a scale with an unquantized cache, a non-positive/non-finite value, a tensor that
            is not float32, has more than one element or lives on another device.
    """
    if kv_cache.dtype not in KV_QUANT_DTYPES:
        if scale is None:
            return None
        raise _fail(
            op,
            name,
            f"None: the cache is {kv_cache.dtype} (unquantized)",
            repr(scale),
            "Scales apply to float8_e4m3fn/int8 caches only; drop the argument or quantize the cache.",
        )
    if scale is None:
        return 1.0
    want = "a finite float > 0 or a 0-d/1-element float32 tensor on the cache's device"
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32 or scale.numel() != 1 or scale.dim() > 1:
            raise _fail(
                op,
                name,
                want,
                f"tensor {scale.dtype} shape {list(scale.shape)}",
                "Pass torch.tensor(s, dtype=torch.float32, device=kv_cache.device).",
            )
        if scale.device != kv_cache.device:
            raise _fail(
                op,
                f"{name}.device",
                f"{kv_cache.device} (like kv_cache)",
                scale.device,
                f"Move it with {name}.to(kv_cache.device).",
            )
        if check_values(scale):
            value = float(scale.reshape(()))
            if not (value > 0 and math.isfinite(value)):
                raise _fail(op, f"{name} value", "a finite float > 0", value)
        return scale
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise _fail(op, name, want, repr(scale))
    return float(scale)
