"""Hugging Face Transformers integration: ``attn_implementation="layerzero"`` and :func:`patch_model`.

Importing this package does not import ``transformers``; :func:`register`, :func:`from_pretrained` and
:func:`patch_model` do, when called. See ``docs/transformers.md``.

>>> from layerzero.integrations.transformers import from_pretrained, patch_model  # doctest: +SKIP
>>> model = from_pretrained(AutoModelForCausalLM, "path/to/llama")                  # doctest: +SKIP
>>> with patch_model(model):                                                        # doctest: +SKIP
...     model.generate(**inputs)
"""

from __future__ import annotations

from .attention import (
    ATTN_IMPLEMENTATION,
    MIN_TRANSFORMERS_VERSION,
    check_transformers_version,
    from_pretrained,
    is_registered,
    layerzero_attention_forward,
    register,
)
from .patch import (
    DEFAULT_OPS,
    MODEL_PATCH_TABLE,
    SUPPORTED_MODEL_TYPES,
    ModelPatchSpec,
    PatchHandle,
    PatchOp,
    PatchRecord,
    lz_apply_rotary_pos_emb,
    patch_model,
    rope_refcount,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DEFAULT_OPS",
    "MIN_TRANSFORMERS_VERSION",
    "MODEL_PATCH_TABLE",
    "SUPPORTED_MODEL_TYPES",
    "ModelPatchSpec",
    "PatchHandle",
    "PatchOp",
    "PatchRecord",
    "check_transformers_version",
    "from_pretrained",
    "is_registered",
    "layerzero_attention_forward",
    "lz_apply_rotary_pos_emb",
    "patch_model",
    "register",
    "rope_refcount",
]
