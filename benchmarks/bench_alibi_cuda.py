"""ALiBi attention on CUDA: ``triton.attention`` (FlashAttention-2 forward with the bias computed in the
kernel; the CUDA default for ``lz.attention(alibi_slopes=...)`` without FlashAttention 2) against
``torch_sdpa.math`` (an explicit float32 ``[B, Hq, Sq, Sk]`` bias, attention in float32: the default before)
and ``reference.attention``, each locked, through ``lz.attention`` in bfloat16; and, for scale,
``torch_sdpa.flash`` on the same shape without ALiBi. Times are µs per call from CUDA events (median of
``--reps`` calls after warm-up, compiles excluded); peak memory is the largest allocation above the inputs
during one call; ``max |Δ|`` is the largest difference between the Triton and SDPA math outputs (a sanity
check, not an accuracy test: tests/gpu/test_gpu_triton_attention.py is).

Usage: ``PYTHONPATH=src python benchmarks/bench_alibi_cuda.py [--reps 20] [--out FILE]`` (CUDA). Records the
GPU, torch / Triton / CUDA versions and the date.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from gemv_prefetch import run_info, save_report

import layerzero as lz

# (label, B, Hq, Hkv, Sq, Sk, D, causal)
SHAPES = [
    ("B1 H32 S2048 D128 causal", 1, 32, 32, 2048, 2048, 128, True),
    ("B4 H16 S1024 D64", 4, 16, 16, 1024, 1024, 64, False),
    ("B4 H32 Sq1 Sk4096 D128 (decode)", 4, 32, 32, 1, 4096, 128, False),
    ("B8 H32/Hkv8 Sq1 Sk4096 D128 (decode, GQA)", 8, 32, 8, 1, 4096, 128, False),
]
ALIBI_KERNELS = ("triton.attention", "torch_sdpa.math", "reference.attention")


def slopes_for(h: int) -> torch.Tensor:
    """Press et al. 2022's slopes ``2**(-8 (i + 1) / H)``, float32 on the GPU."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32, device="cuda")


def time_us(fn: Callable[[], torch.Tensor], reps: int) -> tuple[float, float, torch.Tensor]:
    """``(median µs per call, peak MiB allocated above the start, last output)`` of ``fn`` (3 warm-up
    calls)."""
    for _ in range(3):
        out = fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times), peak, out


def locked(
    kernel: str, fn: Callable[[], torch.Tensor], reps: int
) -> tuple[float, float, torch.Tensor] | None:
    """:func:`time_us` of ``fn`` with ``attention`` locked to ``kernel``; None when the kernel refuses the
    call."""
    lz.lock("attention", kernel)
    try:
        return time_us(fn, reps)
    except (lz.NoKernelFoundError, lz.KernelExecutionError) as exc:  # refused here, or failed (printed)
        print(f"  {kernel}: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
        return None
    finally:
        lz.unlock("attention")


def _fmt(r: tuple[float, float, torch.Tensor] | None) -> str:
    return "n/a" if r is None else f"{r[0]:.1f}"


def row(label: str, b: int, hq: int, hkv: int, sq: int, sk: int, d: int, causal: bool, *, reps: int) -> str:
    """One table row: every kernel on one shape (random bf16 q, k, v; slopes for Hq heads)."""
    g = torch.Generator(device="cuda").manual_seed(sq + sk)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    slopes = slopes_for(hq)

    def alibi() -> torch.Tensor:
        return lz.attention(q, k, v, is_causal=causal, alibi_slopes=slopes)

    def plain() -> torch.Tensor:
        return lz.attention(q, k, v, is_causal=causal)

    res = {
        kid: locked(kid, alibi, reps if kid != "reference.attention" else max(3, reps // 4))
        for kid in ALIBI_KERNELS
    }
    flash = locked("torch_sdpa.flash", plain, reps)
    tri, math_ = res["triton.attention"], res["torch_sdpa.math"]
    ratio = f"{math_[0] / tri[0]:.2f}" if tri and math_ else "n/a"
    vs_flash = f"{tri[0] / flash[0]:.2f}" if tri and flash else "n/a"
    diff = f"{float((tri[2].float() - math_[2].float()).abs().max()):.2e}" if tri and math_ else "n/a"
    cells = [f"{_fmt(r)} ({r[1]:.0f})" if r else "n/a" for r in (tri, math_, res["reference.attention"])]
    pick = lz.which("attention", q, k, v, is_causal=causal, alibi_slopes=slopes)
    return f"| {label} | {' | '.join(cells)} | {ratio} | {_fmt(flash)} | {vs_flash} | {diff} | {pick} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_alibi_cuda needs a CUDA GPU")
    import triton

    props = torch.cuda.get_device_properties(0)
    lines = [
        f"# ALiBi attention on CUDA ({run_info()})",
        "",
        f"SM {props.major}.{props.minor}, {props.multi_processor_count} SMs; CUDA {torch.version.cuda}, "
        f"Triton {triton.__version__}. bfloat16, Press et al. slopes [Hq]; µs per lz.attention call (median "
        f"of {a.reps}, CUDA events), each kernel locked; peak MiB above the inputs in parentheses. SDPA "
        "flash runs the same shape without ALiBi (for scale).",
        "",
        "| shape | triton.attention | torch_sdpa.math | reference | math / triton | SDPA flash, no ALiBi | "
        "triton / flash | max abs diff triton vs math | default pick |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for shape in SHAPES:
        lines.append(row(*shape, reps=a.reps))
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    save_report(lines, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
