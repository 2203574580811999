"""Seeded cases of ``lz.quantize`` shared by tests/correctness/test_quantize_*.py: odd sizes, 0-3 leading
dims, every granularity of each format, rows spread over 6 decades, some zero rows, one outlier per tensor."""

from __future__ import annotations

import random

import torch

F64 = torch.float64
KERNELS = ("reference", "torch_native")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2", "mxfp4", "nvfp4", "int4")


def quant_case(seed: int, fmt: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """A seeded x and the format's options: odd sizes, rows spread over 6 decades, some zero rows, an
    outlier."""
    rng = random.Random(seed)
    lead = [rng.choice((1, 2, 3, 5, 7)) for _ in range(rng.randint(0, 3))]
    kind = (
        rng.choice(("tensor", "channel", "group", "block"))
        if fmt in ("int8", "fp8_e4m3", "fp8_e5m2")
        else "group"
    )
    g = {"mxfp4": 32, "nvfp4": 16}.get(fmt) or rng.choice(
        (1, 2, 3, 5, 16, 32) if fmt != "int4" else (2, 8, 32, 128)
    )
    k = g * rng.choice((1, 3, 5, 7)) * (2 if fmt == "int4" and g % 2 else 1)
    kw: dict = {}
    if kind == "block":
        bm = rng.choice((1, 2, 3))
        lead = [*lead[:-1], bm * rng.choice((1, 3))] if lead else [bm]
        kw["group_size"] = (bm, g)
    elif kind == "channel":
        kw["axis"] = rng.randrange(-len(lead) - 1, len(lead) + 1)
    elif kind == "group" or fmt == "int4":
        kw["group_size"] = g
    if kind == "tensor" and rng.random() < 0.5:
        k = rng.choice((1, 7, 123))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=gen, dtype=F64)
    x = x * torch.logspace(-3, 3, x.shape[-2] if x.dim() > 1 else 1, dtype=F64).reshape(
        *([-1, 1] if x.dim() > 1 else [1])
    )
    if x.dim() > 1 and rng.random() < 0.3:
        x[..., 0, :] = 0.0
    x.view(-1)[rng.randrange(x.numel())] *= 50.0
    return x.clamp(-6e4, 6e4).to(dtype), kw  # float16's max is 65504
