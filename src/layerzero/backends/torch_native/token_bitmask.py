"""``torch_native.apply_token_bitmask``: the packed token bitmask unpacked on the device with vectorized torch
ops (one ``[R, 32 W]`` bool tensor), then ``masked_fill_`` of the rows (through ``index_select`` /
``index_copy_`` when only some rows are masked). No host sync: CUDA-graph safe; every device torch runs on."""

from __future__ import annotations

import torch

from layerzero.core.specs import KernelSpec

__all__ = ["apply_token_bitmask", "kernel_spec"]

FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    """``lz.apply_token_bitmask`` (see its docstring for shapes): the words shifted by ``0..31`` and masked to
    one bit (an arithmetic shift: the sign bit is token ``32 w + 31``), flattened to ``[R, 32 W]`` allowed
    flags, cut or padded with False (banned) to V columns, then -inf where banned. Returns None."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).to(torch.bool).flatten(1)
    n = allowed.shape[1]
    if n >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - n), value=False)
    banned = ~allowed
    if indices is None:
        logits.masked_fill_(banned, float("-inf"))
        return
    idx = indices if indices.dtype == torch.int64 else indices.long()
    sub = logits.index_select(0, idx).masked_fill_(banned, float("-inf"))
    logits.index_copy_(0, idx, sub)


def kernel_spec() -> KernelSpec:
    """The KernelSpec: priority 10 (above the reference's 0), every device and float dtype, graph-safe."""
    return KernelSpec(
        "torch_native.apply_token_bitmask",
        "apply_token_bitmask",
        apply_token_bitmask,
        priority=10,
        description="vectorized unpack to a [R, 32W] bool mask, masked_fill_ (index_select/index_copy_ rows)",
        device_types=frozenset({"cpu", "cuda", "mps", "xpu"}),
        dtypes=FLOATS,
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
    )
