"""Hugging Face diffusers integration: :class:`LayerZeroAttnProcessor` and :func:`patch_diffusers`.

Importing this package does not import ``diffusers`` (the processor only calls methods of the ``Attention``
module it is given). See ``docs/diffusers.md``.

>>> from layerzero.integrations.diffusers import patch_diffusers   # doctest: +SKIP
>>> with patch_diffusers(unet):                                    # doctest: +SKIP
...     image = pipe(prompt).images[0]
"""

from __future__ import annotations

from .patch import (
    SUPPORTED_PROCESSORS,
    DiffusersPatchHandle,
    attention_modules,
    is_diffusers_model,
    patch_diffusers,
)
from .processor import LayerZeroAttnProcessor

__all__ = [
    "SUPPORTED_PROCESSORS",
    "DiffusersPatchHandle",
    "LayerZeroAttnProcessor",
    "attention_modules",
    "is_diffusers_model",
    "patch_diffusers",
]
