"""Build the FlashInfer JIT modules that LayerZero's FlashInfer kernels load, all in one ninja run.

``flashinfer.attention`` / ``flashinfer.paged_attention`` (``layerzero/backends/flashinfer/kernels.py``) use
three FlashInfer modules per (dtype, head dim): the CUDA-core batch decode module, the FA2 batch prefill
module (decode with tensor cores, Hq/Hkv > 4) and, on SM 9.0, the FA3 batch prefill module (ragged dense
prefill, paged append; FlashInfer's ``backend="auto"`` picks it there). Each prefill module is ~10 heavy
translation units (4 mask modes x paged/ragged); built one at a time on first use they took 45-110 s each on a
16-core device machine, and one ninja run over all of them keeps every core busy instead. The arguments mirror
what the wrappers' ``plan()`` passes (flashinfer 0.5.3 ``decode.py`` / ``prefill.py``): int32 indices, no
positional encoding, no sliding window, no soft cap, no fp16 QK reduction. A kernel whose module is missing
still compiles it on first use; this only moves the cost.

Usage (on the device machine, with flashinfer importable)::

    python tools/fi_prebuild.py --dtypes bfloat16 --head-dims 64 128 256
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def specs(dtypes: list[str], head_dims: list[int], sm90: bool) -> list:
    """The JitSpecs of the decode / FA2 prefill / FA3 prefill (``sm90``) modules of every dtype x head dim."""
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module

    out = []
    for name in dtypes:
        dt = getattr(torch, name)
        for d in head_dims:
            out.append(gen_batch_decode_module(dt, dt, dt, torch.int32, d, d, 0, False, False))
            for backend in ("fa2", "fa3") if sm90 else ("fa2",):
                out.append(
                    gen_batch_prefill_module(backend, dt, dt, dt, torch.int32, d, d, 0, False, False, False)
                )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=("bfloat16", "float16"))
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    args = p.parse_args(argv)
    from flashinfer.jit.core import build_jit_specs

    sm90 = torch.cuda.get_device_capability() == (9, 0)
    todo = specs(args.dtypes, args.head_dims, sm90)
    t0 = time.perf_counter()
    build_jit_specs(todo, verbose=False)
    took = time.perf_counter() - t0
    print(f"fi_prebuild: {len(todo)} modules ({', '.join(s.name for s in todo)}) in {took:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
