"""``patch_diffusers``: route every attention processor of a diffusers model through LayerZero, undoably."""

from __future__ import annotations

from typing import Any

from layerzero.core.errors import ConfigurationError

from .processor import LayerZeroAttnProcessor

SUPPORTED_PROCESSORS: frozenset[str] = frozenset(
    {
        "AttnProcessor2_0",
        "AttnProcessor",
        "XFormersAttnProcessor",
        "AttnProcessorNPU",
        "LayerZeroAttnProcessor",
    }
)
"""Processor classes with the ``AttnProcessor2_0`` semantics, which :class:`LayerZeroAttnProcessor` replaces
exactly. Others (joint attention of SD3/Flux, IP-Adapter, added-KV, LoRA-fused ...) compute something else."""

_MARKER = "_layerzero_diffusers_patch"


class DiffusersPatchHandle:
    """Undo handle returned by :func:`patch_diffusers`; also a context manager (undo on exit).

    Attributes:
        model: the patched model.
        previous: ``(module name, Attention module, previous processor)`` per patched module.
        active: False once :meth:`undo` ran.
    """

    def __init__(self, model: Any, previous: list[tuple[str, Any, Any]]) -> None:
        self.model = model
        self.previous = previous
        self.active = True

    @property
    def count(self) -> int:
        """Number of attention processors replaced (one per ``Attention`` module)."""
        return len(self.previous)

    def undo(self) -> None:
        """Put each module's previous processor back (``module.set_processor(old)``). A second call is a
        no-op.

        Raises:
            ConfigurationError: restoring some module failed (the others are still restored), first error
                chained.
        """
        if not self.active:
            return
        self.active = False
        if self.model.__dict__.get(_MARKER) is self:
            del self.model.__dict__[_MARKER]
        errors: list[tuple[str, Exception]] = []
        for name, module, old in self.previous:
            try:
                module.set_processor(old)
            except Exception as exc:  # keep restoring the rest; report at the end
                errors.append((name, exc))
        if errors:
            raise ConfigurationError(
                f"patch_diffusers undo: {len(errors)} processor(s) not restored, first "
                f"{errors[0][0]}: {errors[0][1]!r}"
            ) from errors[0][1]

    def __enter__(self) -> DiffusersPatchHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"DiffusersPatchHandle(active={self.active}, processors={self.count})"


def attention_modules(model: Any) -> list[tuple[str, Any]]:
    """``(qualified name, module)`` for every diffusers attention module in ``model`` (anything with
    ``set_processor`` and a ``processor``: ``Attention``, ``AttentionModuleMixin``), in ``named_modules``
    order. Walks modules rather than using ``model.attn_processors``, which some models
    (``DiTTransformer2DModel``) lack."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return []
    return [
        (name, m)
        for name, m in model.named_modules()
        if callable(getattr(m, "set_processor", None)) and getattr(m, "processor", None) is not None
    ]


def is_diffusers_model(model: Any) -> bool:
    """True if ``model`` is a ``torch.nn.Module`` holding at least one diffusers attention module."""
    return bool(attention_modules(model))


def patch_diffusers(model: Any, *, processor: Any = None) -> DiffusersPatchHandle:
    """Set a :class:`LayerZeroAttnProcessor` on every ``Attention`` module of a diffusers model
    (``UNet2DConditionModel``, ``DiTTransformer2DModel``, ``PixArtTransformer2DModel``, ...) and return an
    undo handle that restores the previous processors. Also reachable as ``lz.patch_model(model)`` and
    ``lz.patch_diffusers(model)``.

    Args:
        model: a ``torch.nn.Module`` containing diffusers ``Attention`` modules (a ``ModelMixin``, or a
            block).
        processor: the processor to install (default: a new :class:`LayerZeroAttnProcessor`, shared by all
            layers).

    Raises:
        ConfigurationError: ``model`` holds no diffusers attention module; it is already patched (undo first);
            or
        one of its processors is not an ``AttnProcessor2_0``-style processor (``SUPPORTED_PROCESSORS``): the
        message names the layers and classes (e.g. ``JointAttnProcessor2_0`` of SD3), and nothing is replaced.

    >>> handle = lz.patch_model(unet)           # doctest: +SKIP
    >>> out = unet(sample, t, encoder_hidden_states=ehs).sample   # attention through lz.attention
    >>> handle.undo()                           # stock processors back
    """
    modules = attention_modules(model)
    if not modules:
        raise ConfigurationError(
            f"patch_diffusers: expected a torch.nn.Module holding diffusers Attention modules, got "
            f"{type(model).__name__} with none; for Hugging Face Transformers models use "
            "layerzero.integrations.transformers.patch_model"
        )
    if model.__dict__.get(_MARKER) is not None:
        raise ConfigurationError("patch_diffusers: this model is already patched; call handle.undo() first")
    unsupported = {
        name: type(m.processor).__name__
        for name, m in modules
        if type(m.processor).__name__ not in SUPPORTED_PROCESSORS
    }
    if unsupported:
        shown = ", ".join(f"{n}: {c}" for n, c in list(unsupported.items())[:4])
        raise ConfigurationError(
            f"patch_diffusers: {len(unsupported)} attention processor(s) are not AttnProcessor2_0-style "
            f"({shown}{', ...' if len(unsupported) > 4 else ''}); expected one of "
            f"{sorted(SUPPORTED_PROCESSORS)}. Call model.set_default_attn_processor() first, or set "
            "LayerZeroAttnProcessor on the supported layers yourself"
        )
    new = processor if processor is not None else LayerZeroAttnProcessor()
    previous = [(name, m, m.processor) for name, m in modules]
    for _, m in modules:
        m.set_processor(new)
    handle = DiffusersPatchHandle(model, previous)
    model.__dict__[_MARKER] = handle
    return handle
