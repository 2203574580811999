"""Compile one of our Triton kernels for an NVIDIA target on a machine with no GPU and report what the
compiler made of it: registers, spills (stack bytes), shared memory, whether a loop was software-pipelined
(async copies), and the global loads / stores / MMAs of the PTX in program order (runs of the same instruction
counted). Needs only the ``triton`` wheel (its bundled ``ptxas`` / ``cuobjdump``).

Why: Triton decides tiling, vectorization and pipelining at compile time, and those decide a latency-bound
kernel's speed (``benchmarks/results/engine/h200/2026-11-28f/README.md``: the batch-1 split kernel's tile loop
is pipelined, but a tile's K/V still wait for its block ids). Checking that before spending device time is
cheap.

Signatures are built from the argument names as our kernels use them; every pointer and stride is given the
16-byte divisibility a real launch specializes on (without it the loads do not vectorize and the register
counts mislead). Presets: ``paged_split`` (``_paged_kernels.paged_decode_split``), ``rope_paged_split``
(``_rope_paged_kernels.rope_paged_decode_split``), ``paged_merge`` (``_paged_kernels.paged_decode_merge``),
``gemv_prefetch`` (``_gemv_kernels._gemv_prefetch``).

Usage: ``PYTHONPATH=src python tools/kernel_ir.py paged_split BLOCK_N=32 CHUNKS=2 ONE_PASS=1 [--warps 4]
[--stages 3] [--arch 90] [--dump DIR]``; ``KEY=VALUE`` pairs override the preset's constexprs (ints; 0 / 1 for
flags). Prints one report; ``--dump`` also writes the TTGIR, PTX and cubin there.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

PRESETS: dict[str, tuple[str, str, dict[str, object], dict[str, str]]] = {
    # name: (module under layerzero.backends.triton, kernel, constexprs, pointer element types by argument
    # name)
    "paged_split": (
        "_paged_kernels",
        "paged_decode_split",
        dict(
            GROUP_PAD=16,
            HEAD_DIM=128,
            D_PAD=128,
            BLOCK_N=32,
            INTERPRET=False,
            TILES_PER_SPLIT=0,
            UPCAST=False,
            DIRECT=False,
            QUANT=False,
            K_PTR=False,
            V_PTR=False,
            WRITE_LSE=False,
            FUSED_MERGE=False,
            S_PAD=1,
            PDL=True,
            CHUNKS=1,
            ONE_PASS=False,
            EARLY=False,
            TRIGGER_FIRST=False,
        ),
        {
            "bt_ptr": "i32",
            "lens_ptr": "i32",
            "cnt_ptr": "i32",
            "ws_out_ptr": "fp32",
            "ws_lse_ptr": "fp32",
            "lse_out_ptr": "fp32",
        },
    ),
    "rope_paged_split": (
        "_rope_paged_kernels",
        "rope_paged_decode_split",
        dict(
            GROUP_PAD=16,
            HEAD_DIM=128,
            D_PAD=128,
            BLOCK_N=32,
            INTERPRET=False,
            TILES_PER_SPLIT=0,
            UPCAST=False,
            DIRECT=False,
            NORM=True,
            INTERLEAVED=False,
            PDL=True,
            CHUNKS=1,
            ONE_PASS=False,
        ),
        {
            "bt_ptr": "i32",
            "lens_ptr": "i32",
            "pos_ptr": "i64",
            "slot_ptr": "i64",
            "ws_out_ptr": "fp32",
            "ws_lse_ptr": "fp32",
        },
    ),
    "paged_merge": (
        "_paged_kernels",
        "paged_decode_merge",
        dict(HEAD_DIM=128, D_PAD=128, S_PAD=32, WRITE_LSE=False, PDL=True, TRIGGER_FIRST=False),
        {"ws_out_ptr": "fp32", "ws_lse_ptr": "fp32", "lse_out_ptr": "fp32"},
    ),
    "gemv_prefetch": (
        "_gemv_kernels",
        "_gemv_prefetch",
        dict(K=1024, KP=1024, HAS_BIAS=False, BM=1, BN=8, NORM=False, RESIDUAL=False, SWIGLU=False, PDL=True),
        {},
    ),
}
FLOAT_ARGS = {"qk_scale", "k_scale", "v_scale", "eps"}
PTR_NAMES = re.compile(r"(_ptr$|^(X|W|B|Out|NW|R|RO)$)")  # q_ptr ...; the GEMV's pointers
DTYPE = "bf16"


def _report_ptx(ptx: str) -> list[str]:
    """Global loads / stores, MMAs and branches in program order, runs of one opcode counted."""
    pat = re.compile(r"^\s*(?:@%p\d+\s+)?((?:ld|st)\.global\S*|mma\.sync\S*|wgmma\S*|cp\.async\S*|bra\S*)")
    runs: list[list] = []
    for line in ptx.splitlines():
        m = pat.match(line)
        if not m:
            continue
        op = m.group(1)
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return [f"  {n:4d} x {op}" for op, n in runs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE constexpr overrides (ints; 0 / 1 for flags)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    ap.add_argument("--dump", type=Path, default=None)
    a = ap.parse_args(argv)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod_name, fn_name, const, ptr_types = PRESETS[a.preset]
    const = dict(const)
    for kv in a.overrides:
        key, _, value = kv.partition("=")
        if key not in const:
            ap.error(f"{key}: not a constexpr of {fn_name} ({', '.join(const)})")
        const[key] = type(const[key])(int(value)) if isinstance(const[key], bool) else int(value)
    if a.preset == "gemv_prefetch" and "KP" not in {kv.partition("=")[0] for kv in a.overrides}:
        const["KP"] = 1 << (int(const["K"]) - 1).bit_length()
    fn = getattr(importlib.import_module(f"layerzero.backends.triton.{mod_name}"), fn_name)
    names = list(fn.arg_names)
    nospec = {names[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", ())}
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in const:
            sig[n] = "constexpr"
        elif PTR_NAMES.search(n):
            sig[n] = "*" + ptr_types.get(n, DTYPE)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in FLOAT_ARGS:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride") and n not in nospec:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(
        src, target=GPUTarget("cuda", a.arch, 32), options={"num_warps": a.warps, "num_stages": a.stages}
    )
    tools = Path(os.path.dirname(triton.__file__)) / "backends" / "nvidia" / "bin"
    out_dir = a.dump or Path(os.environ.get("TMPDIR", "/tmp")) / "kernel_ir"
    out_dir.mkdir(parents=True, exist_ok=True)
    cubin = out_dir / f"{fn_name}.cubin"
    cubin.write_bytes(k.asm["cubin"])
    if a.dump:
        (out_dir / f"{fn_name}.ttgir").write_text(k.asm["ttgir"])
        (out_dir / f"{fn_name}.ptx").write_text(k.asm["ptx"])
    usage = subprocess.run(
        [str(tools / "cuobjdump"), "--dump-resource-usage", str(cubin)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next((x.strip() for x in usage.splitlines() if "REG:" in x), "?")
    ttgir = k.asm["ttgir"]
    print(f"{fn_name} sm_{a.arch} warps {a.warps} stages {a.stages} {const}")
    print(f"  {line}; shared {k.metadata.shared} bytes")
    print(
        f"  loops {ttgir.count('scf.for')}, async copies (pipelined loads) "
        f"{ttgir.count('async_copy_global_to_local')}"
    )
    print("\n".join(_report_ptx(k.asm["ptx"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
