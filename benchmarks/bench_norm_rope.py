"""Norm, RoPE and sampling kernels side by side on one device, through ``lz.tune`` (every eligible kernel
checked against the reference, then timed with CUDA events), plus the default pick's end-to-end ``lz`` call.

Usage: ``PYTHONPATH=src python benchmarks/bench_norm_rope.py --device cuda --out results.md``. The PerfDB is a
temporary file (the run does not change the caller's choices). Shapes: rms_norm (plain and fused residual) for
decode-sized ``[1..64, 4096]`` and prefill-sized ``[8192, 4096]`` rows, rope on
``[1 or 8, 32/8 heads, S, 128]``, top-k/top-p over a 151,936-token vocabulary (Qwen3) for 1 and 64 rows;
bfloat16.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
import time
from pathlib import Path

import torch

import layerzero as lz


def _cases(device: str) -> dict[str, list]:
    g = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16

    def rn(*s, dtype=bf):
        return torch.randn(*s, generator=g, device=device, dtype=dtype)

    norm = [((rn(rows, 4096), rn(4096)), {}) for rows in (1, 64, 8192)]
    norm += [((rn(rows, 4096), rn(4096)), {"residual": rn(rows, 4096)}) for rows in (1, 8192)]
    rope = []
    for b, s in ((1, 1), (8, 1), (1, 4096)):
        inv = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, device=device, dtype=torch.float32) / 128))
        ang = torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv  # [S, 64]
        emb = torch.cat((ang, ang), dim=-1)[None]  # [1, S, 128], the HF cat(f, f) layout lz.rope expects
        cos, sin = emb.cos().to(bf), emb.sin().to(bf)
        rope.append(((rn(b, 32, s, 128), rn(b, 8, s, 128), cos, sin), {}))
    samp_k, samp_p = [], []
    for rows in (1, 64):
        logits = rn(rows, 151936, dtype=torch.float32)
        samp_k.append(((logits, 50), {"generator": torch.Generator(device=device).manual_seed(1)}))
        samp_p.append(((logits, 0.9), {"generator": torch.Generator(device=device).manual_seed(1)}))
    return {"rms_norm": norm, "rope": rope, "sample_topk": samp_k, "sample_topp": samp_p}


def _lz_call_us(op: str, case, device: str, n: int = 200) -> tuple[str, float]:
    fn = getattr(lz, op)
    args, kwargs = case
    kernel = lz.which(op, *args, **kwargs)
    for _ in range(10):
        fn(*args, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(*args, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    return kernel, (time.perf_counter() - t) / n * 1e6


def main() -> None:
    """Run the measurements and write the markdown report to ``--out`` (and stdout)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    lines = [
        f"# rms_norm / rope / sampling kernels on {a.device}",
        "",
        f"- date: {datetime.date.today()}; torch {torch.__version__}; python {platform.python_version()}",
        f"- device: {torch.cuda.get_device_name() if a.device == 'cuda' else platform.processor()}",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        lz.configure(perfdb_path=str(Path(tmp) / "perf.sqlite"))
        cases = _cases(a.device)
        defaults = {op: [_lz_call_us(op, c, a.device) for c in cs] for op, cs in cases.items()}
        for op, cs in cases.items():
            report = lz.tune(op, cs, progress=False)
            lines += [
                f"## {op}",
                "",
                "```",
                str(report),
                "```",
                "",
                "default pick (priorities only) and its end-to-end lz call, µs:",
                "",
            ]
            lines += [f"- case {i}: {k} {us:.1f} µs" for i, (k, us) in enumerate(defaults[op])] + [""]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
