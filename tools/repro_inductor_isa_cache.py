"""Reproducer of a TorchInductor cache bug (not LayerZero's): the on-disk cache key ignores
``ATEN_CPU_CAPABILITY``. Compile under ``ATEN_CPU_CAPABILITY=avx2``, then run the same function without it on
an AVX-512 CPU, one shared cache directory: the second process aborts with "double free or corruption"; the
reverse order returns NaN. Seen with torch 2.13.0+cpu (docs/torch_compile.md, "History"). Plain torch ops
only.

Usage::

    d=$(mktemp -d)
    ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CACHE_DIR=$d python tools/repro_inductor_isa_cache.py   # ok
    TORCHINDUCTOR_CACHE_DIR=$d python tools/repro_inductor_isa_cache.py                            # aborts
"""

import torch
import torch.nn.functional as F


def f(x, w, g, u, q, k, v):
    """RMSNorm, LayerNorm, SiLU-gated product and causal SDPA: one compiled graph."""
    h = F.rms_norm(x, (64,), w)
    h2 = F.layer_norm(h + x, (64,), w)
    return h2, F.silu(g) * u, F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    compiled = torch.compile(f, fullgraph=True)
    for rows in (4, 4, 3):
        args = (
            torch.randn(rows, 64, generator=gen),
            torch.rand(64, generator=gen) + 0.5,
            torch.randn(rows, 96, generator=gen),
            torch.randn(rows, 96, generator=gen),
            *(torch.randn(2, 4, 16, 32, generator=gen) for _ in range(3)),
        )
        for got, want in zip(compiled(*args), f(*args), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    print("ok")


if __name__ == "__main__":
    main()
