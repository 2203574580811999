"""Which compiled variants of ``triton.paged_prefill_lse``'s kernel the shared-prefix run launches, and in
which phase (start-up / the benchmark's warm-up / the timed run): every launch's compile-time constants
(``ROWS``, ``B_PAD``, ``SPLIT``, ``CAUSAL``, warps, stages) and the integer / pointer specialisation flags
Triton keys on. A variant first seen in the timed run was compiled there. Usage (CUDA): ``python
benchmarks/engine/prefill_variants.py [lpm]`` (``lpm``: ``cascade_attention=True, scheduling_policy="lpm"``;
else the engine's defaults). Results:
benchmarks/results/engine/h200/2026-11-25g/prefill_variants_before.txt."""

from __future__ import annotations

import collections
import sys

import layerzero.backends.triton.cascade as cascade
import layerzero.engine.tools.bench_prefix as bench_prefix

KEYS = ("ROWS", "B_PAD", "SPLIT", "CAUSAL", "num_warps", "num_stages")


def main(argv: list[str]) -> int:
    phase = ["start"]
    seen: dict[tuple, list] = collections.OrderedDict()
    real_launch, real_warm = cascade.launch, bench_prefix.warm_up

    def spy(fn, grid, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if "paged_prefill" in getattr(fn, "__name__", repr(fn)):
            ints = tuple(
                (a % 16 == 0, a == 1) for a in args if isinstance(a, int) and not isinstance(a, bool)
            )
            ptrs = tuple(a.data_ptr() % 16 == 0 for a in args if hasattr(a, "data_ptr"))
            seen.setdefault((tuple(kw.get(k) for k in KEYS), ints, ptrs), [phase[0], 0])[1] += 1
        return real_launch(fn, grid, *args, **kw)

    def warm(llm):  # noqa: ANN001, ANN202
        phase[0] = "warm_up"
        real_warm(llm)
        phase[0] = "timed"

    cascade.launch, bench_prefix.warm_up = spy, warm
    opts = dict(cascade_attention=True, scheduling_policy="lpm") if "lpm" in argv else {}
    took, stats = bench_prefix.run_shared_once(warm_run=False, **opts)
    print(
        f"{opts or 'default'}: {took:.2f} s, cascade steps {stats['cascade_steps']}, steps {stats['steps']}"
    )
    for (consts, ints, ptrs), (ph, n) in seen.items():
        print(f"  {ph:8s} x{n:6d} {dict(zip(KEYS, consts, strict=True))} ints16/1={ints} ptr16={ptrs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
