"""One ``layerzero bench-engine`` run (full scale on CUDA by default; ``--scale cpu --device cpu`` for the CPU
one) under kernel locks, printing one line: output tok/s, batch-1 tok/s and the engine's time split. Run it
once per variant in one device call to compare kernel choices side by side on one machine (the 2026-11-25 A/B
in ``benchmarks/results/engine/h200/README.md``; its "before" row ran the previous commit's ``src`` the same
way).

Usage: ``PYTHONPATH=src python benchmarks/engine/bench_variant.py NAME [--lock linear=torch_native.linear ...]
[--opt async_scheduling=False ...] [--prefer triton.gemv] [--count-compiles] [--workload
prefix]``. ``--workload prefix`` times one run of the shared-prefix workload instead
(``bench_prefix.run_shared_once``: prefix caching on, ``--opt`` passed to ``LLM``, e.g. ``--opt
cascade_attention=True --opt scheduling_policy="'lpm'"``) and prints its seconds, steps and hit rate
(``--opt warm_run=False`` skips the untimed run that precedes the timed one on CUDA). ``--count-compiles``
prints, per ``generate`` call, the Triton kernels compiled during it (new entries of ``TRITON_CACHE_DIR``, by
name) and the FlashInfer modules built: a compile inside the timed run shows there.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
from collections import Counter
from pathlib import Path

import layerzero as lz
from layerzero.engine.tools.bench import run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name")
    ap.add_argument("--lock", action="append", default=[], help="op=kernel_id (repeatable)")
    ap.add_argument("--scale", choices=("full", "cpu"), default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--opt", action="append", default=[], help="LLM option key=python-literal (repeatable)")
    ap.add_argument("--count-compiles", action="store_true")
    ap.add_argument(
        "--prefer", action="append", default=[], help="kernel id to prefer where it can run (lz.prefer)"
    )
    ap.add_argument("--workload", choices=("nano-vllm", "prefix"), default="nano-vllm")
    a = ap.parse_args(argv)
    opts = {k: ast.literal_eval(v) for k, _, v in (o.partition("=") for o in a.opt)}
    if a.count_compiles:
        _count_compiles()
    for item in a.lock:
        op, _, kernel = item.partition("=")
        lz.lock(op, kernel)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    with contextlib.ExitStack() as stack:
        if a.prefer:
            stack.enter_context(lz.prefer(*a.prefer))
        if a.workload == "prefix":
            from layerzero.engine.tools.bench_prefix import run_shared_once

            took, st = run_shared_once(scale=a.scale, device=a.device, **opts)
            print(
                f"{a.name} shared prefix {took:.2f} s, {st['steps']} steps ({st.get('cascade_steps', 0)} "
                f"cascade), hit rate {st['prefix_hit_rate']:.1%}",
                flush=True,
            )
            return 0
        # no engine_options when none are given: an older checkout's run() (a "before" variant) lacks it
        r = run(scale=a.scale, device=a.device, hf_batch=0, **({"engine_options": opts} if opts else {}))
    split = {k: round(v, 2) for k, v in r["engine_stats"]["time_s"].items()}
    print(
        f"{a.name} tok/s {r['output_tokens_per_s']:.0f} b1 {r['batch1']['output_tokens_per_s']:.0f} {split}",
        flush=True,
    )
    return 0


def _count_compiles() -> None:
    """Print, per ``generate`` call, the Triton kernels compiled during it (new entries of
    ``TRITON_CACHE_DIR``, by kernel name) and the FlashInfer JIT modules built (new ``*.so`` under
    ``FLASHINFER_WORKSPACE_BASE``)."""
    from layerzero.engine import LLM

    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    fi = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home() / ".cache" / "flashinfer"))
    generate = LLM.generate

    def seen() -> tuple[set[Path], set[Path]]:
        return (
            set(cache.iterdir()) if cache.is_dir() else set(),
            set(fi.rglob("*.so")) if fi.is_dir() else set(),
        )

    def counted(self, prompts, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        before_t, before_f = seen()
        out = generate(self, prompts, *args, **kwargs)
        new_t, new_f = (now - then for now, then in zip(seen(), (before_t, before_f), strict=True))
        names = Counter(j.stem for d in new_t for j in d.glob("*.json") if not j.stem.startswith("__grp__"))
        print(
            f"  generate of {len(prompts)} prompts: {len(new_t)} Triton cache entries {dict(names)}, "
            f"{len(new_f)} FlashInfer modules {sorted(f.stem for f in new_f)}",
            flush=True,
        )
        return out

    LLM.generate = counted


if __name__ == "__main__":
    raise SystemExit(main())
