"""Layouts of a paged KV cache and the one helper that reads its dims: shared by the paged ops and every paged
kernel (backends import core, so the dims are derived here once instead of in each backend).

A paged KV cache (vLLM's PagedAttention, Kwon et al. 2023) is ONE rank-5 tensor holding K and V, shaped per
:class:`KVLayout`:

- ``NHD`` (vLLM FlashAttention backend / FlashInfer default): ``[num_blocks, 2, block_size, Hkv, D]``;
- ``HND`` (FlashInfer ``kv_layout="HND"``): ``[num_blocks, 2, Hkv, block_size, D]``.

Index 0 of dim 1 is K, index 1 is V. Kernels that want one index order whatever the layout read the cache
through :func:`nhd_view` (a view, never a copy).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from .errors import InvalidInputError, expected_got


class KVLayout(str, enum.Enum):
    """Layout of a paged KV cache tensor: ``NHD`` = ``[num_blocks, 2, block_size, Hkv, D]``, ``HND`` =
    ``[num_blocks, 2, Hkv, block_size, D]``. A ``str`` enum: it compares equal to ``"NHD"`` / ``"HND"``."""

    NHD = "NHD"
    HND = "HND"

    @property
    def shape(self) -> str:
        """The named shape of a cache in this layout, e.g. ``"[num_blocks, 2, block_size, Hkv, D]"``."""
        return _SHAPES[self]


_SHAPES = {
    KVLayout.NHD: "[num_blocks, 2, block_size, Hkv, D]",
    KVLayout.HND: "[num_blocks, 2, Hkv, block_size, D]",
}
_LAYOUTS: dict[Any, KVLayout] = {
    "NHD": KVLayout.NHD,
    "HND": KVLayout.HND,
    KVLayout.NHD: KVLayout.NHD,
    KVLayout.HND: KVLayout.HND,
}
KV_LAYOUTS = frozenset(lay.value for lay in KVLayout)
"""The layout names (``{"NHD", "HND"}``): what a paged kernel's check compares ``ctx.kv_layout`` with."""


def parse_kv_layout(value: Any, what: str = "kv_layout") -> KVLayout:
    """``"NHD"`` / ``"HND"`` (or a :class:`KVLayout`) -> :class:`KVLayout`; ``what`` names the argument in the
    error.

    Raises:
        InvalidInputError: anything else (names both layouts and their shapes).
    """
    lay = _LAYOUTS.get(value) if isinstance(value, str) else None
    if lay is None:
        raise InvalidInputError(
            expected_got(
                what,
                f"'NHD' ({_SHAPES[KVLayout.NHD]}) or 'HND' ({_SHAPES[KVLayout.HND]})",
                repr(value),
                "Pass the layout the cache was allocated with.",
            )
        )
    return lay


def cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, layout: KVLayout | str
) -> tuple[int, int, int, int, int]:
    """The rank-5 shape of a cache of these dims in ``layout`` (see the module docstring)."""
    if parse_kv_layout(layout) is KVLayout.HND:
        return (num_blocks, 2, num_kv_heads, block_size, head_dim)
    return (num_blocks, 2, block_size, num_kv_heads, head_dim)


def cache_dims(kv_cache: torch.Tensor, layout: KVLayout | str) -> tuple[int, int, int, int]:
    """``(num_blocks, block_size, Hkv, D)`` of a rank-5 cache in ``layout`` (shape unchecked: the ops check
    it).

    Raises:
        InvalidInputError: ``layout`` is not ``"NHD"`` / ``"HND"``.
    """
    nb, _, a, b, d = kv_cache.shape
    return (nb, b, a, d) if parse_kv_layout(layout) is KVLayout.HND else (nb, a, b, d)


def nhd_view(kv_cache: torch.Tensor, layout: KVLayout | str) -> torch.Tensor:
    """The cache as a ``[num_blocks, 2, block_size, Hkv, D]`` VIEW whatever its layout (the HND cache with
    dims 2 and 3 swapped; no copy, writes through it land in the cache).

    Raises:
        InvalidInputError: ``layout`` is not ``"NHD"`` / ``"HND"``.
    """
    return kv_cache.transpose(2, 3) if parse_kv_layout(layout) is KVLayout.HND else kv_cache
