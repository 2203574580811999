"""What the custom-op modules of :mod:`layerzero.custom_ops` share: the namespace, :func:`eager` (an op's
eager function, from its :class:`~layerzero.core.opdef.OpDef`), layout strings and :func:`_owned` (fresh
contiguous outputs). Its own module so that each custom-op module imports on its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from layerzero.core.errors import ConfigurationError
from layerzero.core.opdef import get

NS = "layerzero"


def eager(op: str) -> Callable[..., Any]:
    """The eager ``lz.<op>`` function a custom op runs (validation, cache, kernel): the public function of
    ``op``'s :class:`~layerzero.core.opdef.OpDef`, looked up at call time (this package imports no op module:
    ops import it).

    Raises:
        UnknownOperationError: ``op`` is not defined (``layerzero`` was not imported: it defines the ops).
        ConfigurationError: ``op`` has no public function.
    """
    fn = get(op).public
    if fn is None:
        raise ConfigurationError(f"op {op!r} has no public function; its custom op cannot run it eagerly.")
    return fn


def _layout_str(layout: Any) -> str:
    """A layout argument (``"BHSD"``, ``Layout.BHSD``, ``KVLayout.NHD``, ...) as the string custom ops
    take."""
    return layout if isinstance(layout, str) else str(getattr(layout, "value", layout))


def _owned(out: torch.Tensor, *inputs: Any) -> torch.Tensor:
    """``out`` as a custom op's schema promises it: a tensor that shares no memory with any of ``inputs`` (the
    op's tensor arguments and its earlier outputs), laid out contiguously, as every fake implementation here
    allocates it (``x.new_empty(shape)``).

    Inductor plans memory from the schema and the fake outputs: it frees an op's output when its last reader
    ran, writes later results into it in place (``inplace_buffers``), hands it to another buffer
    (``allow_buffer_reuse``) and reads it with the fake's strides. An output that is an input (or a view of
    one) would be freed or overwritten while its input is still live, and one with other strides than the
    fake's fails Inductor's ``assert_size_stride``. Strides differ for strided inputs unless normalized:
    SDPA's output follows q's layout (a transposed q gives a non-contiguous output), while ``F.rms_norm`` /
    ``F.layer_norm`` return contiguous output for a transposed x (the fakes were ``torch.empty_like(x)``,
    which keeps x's permutation). Costs nothing when the kernel's output is already fresh and contiguous (the
    common case); else one copy."""
    if out.numel():
        ptr = out.untyped_storage().data_ptr()
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() == ptr:
                return out.clone(memory_format=torch.contiguous_format)
    elif any(out is t for t in inputs):
        return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()
