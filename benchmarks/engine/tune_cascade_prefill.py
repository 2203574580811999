"""Launch-configuration search for ``triton.paged_prefill_lse`` at cascade attention's shared level, as the
engine's decode graphs call it: a bucket of 256 rows (``T = B = 256``), G groups of M members sharing a
2048-token prefix and the other 256 - G "groups" empty, block tables 153 wide (max_model_len 2448), Qwen3-0.6B
heads (16 q / 8 kv, D 128), bf16, page 16. GPU µs per call in a CUDA graph (``bench_in_graph.graph_us``).

Coordinate descent over rows per tile, num_warps, num_stages, block_n, programs per SM and the device-side
split sizing (``target`` items, ``min_split_tiles``), minimizing the sum over the cases (G x M = 64 x 4, the
benchmark's waves; 16 x 16; 32 x 8; 128 x 2; 4 x 64; 1 x 256: one system prompt for the whole batch); every
config's output is checked against the default's.

    PYTHONPATH=src python benchmarks/engine/tune_cascade_prefill.py [--passes 2]    # CUDA

Results: benchmarks/results/engine/h200/ (the session's folder).
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path

import torch

from layerzero.backends.triton.cascade import paged_prefill_lse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_in_graph's CUDA-graph timer
from bench_in_graph import graph_us  # noqa: E402

CASES = ((64, 4), (16, 16), (32, 8), (128, 2), (4, 64), (1, 256))
SPACE = {
    "rows": (16, 32),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3),
    "block_n": (32, 64, 128),
    "programs_per_sm": (4, 8, 16),
    "target": (None, 264, 528, 2112, 4224),
    "min_split_tiles": (1, 2, 4, 8, 16),
}
DEFAULT: dict = {}
"""The module's defaults (``layerzero.backends.triton.cascade``)."""


def case(groups: int, members: int, seed: int = 0) -> tuple:
    """Arguments of one shared-level call (see the module docstring)."""
    page, hkv, hq, d, b, width = 16, 8, 16, 128, 256, 153
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randn(groups * 128 + 16, 2, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    tables = torch.zeros(b, width, dtype=torch.int32, device="cuda")
    tables[:groups, :128] = (
        torch.randperm(groups * 128, device="cuda", generator=g).view(groups, 128).to(torch.int32)
    )
    lens = torch.zeros(b, dtype=torch.int32, device="cuda")
    lens[:groups] = 2048
    cu = torch.full((b + 1,), groups * members, dtype=torch.int32, device="cuda")
    cu[: groups + 1] = torch.arange(groups + 1, device="cuda") * members
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, cache, tables, lens, cu


def timed(args: tuple, cfg: dict, ref: torch.Tensor | None) -> tuple[float, float]:
    """(µs per call, max |out - ref|) of one config."""
    q, cache, tables, lens, cu = args

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return paged_prefill_lse(q, cache, tables, lens, cu, None, False, "NHD", **cfg)

    out, _ = call()
    err = 0.0 if ref is None else float((out.float() - ref.float()).abs().max())
    return graph_us(call, reps=30), err


def decode_order() -> None:
    """``triton.paged_decode``'s tile size and warps on three batch-256 decode shapes (the bandwidth a decode
    kernel reaches, for comparison with the shared level): distinct 2300-token sequences (no sharing), 64
    groups x 4 sharing a 2048-token prefix in arrival order (rows of one group 64 apart), and 250-token
    sequences (the cascade's unique level)."""
    from layerzero.backends.triton.paged import paged_decode

    page, hkv, hq, d, b = 16, 8, 16, 128, 256
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    distinct = torch.randperm(b * 150, device="cuda", generator=g).view(b, 150).to(torch.int32)
    shared = distinct.clone()
    shared[:, :128] = distinct[:64, :128].repeat(4, 1)  # row r in group r % 64
    cache = torch.randn(b * 150, 2, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((b,), 2300, dtype=torch.int32, device="cuda")
    short = torch.full((b,), 250, dtype=torch.int32, device="cuda")
    shapes = {
        "distinct 2300": (distinct, lens),
        "shared 64x4 interleaved": (shared, lens),
        "own 250": (distinct[:, :16].contiguous(), short),
    }
    for name, (tables, n) in shapes.items():
        for cfg in ({}, {"block_n": 64}, {"num_warps": 8}):
            us = graph_us(lambda t=tables, n=n, c=cfg: paged_decode(q, cache, t, n, **c), reps=30)
            gb = float(n.sum()) * hkv * d * 2 * 2 / 1e9
            print(f"decode {name}: {us:7.1f} us  {gb / us * 1e3:5.2f} TB/s addressed  {cfg}", flush=True)


def registers() -> str:
    """Registers / spills of the ``paged_prefill`` variants compiled so far (Triton's compiled-kernel
    attributes)."""
    from layerzero.backends.triton import _launch

    out = []
    for fl in _launch._LAUNCHERS.values():
        if getattr(fl.fn, "__name__", "") == "paged_prefill":
            out += [f"{getattr(k, 'n_regs', '?')}/{getattr(k, 'n_spills', '?')}" for k in fl.kernels.values()]
    return "regs/spills " + " ".join(out)


def compare(cfg: dict) -> None:
    """The same shared-prefix bytes through ``triton.paged_decode`` (one query per group: what the decode
    kernel reaches on this data) next to ``paged_prefill_lse`` with ``cfg``, and one-member groups."""
    from layerzero.backends.triton.paged import paged_decode

    for groups, members in ((64, 4), (64, 1), (256, 1)):
        q, cache, tables, lens, cu = case(groups, members)
        gb = groups * 2048 * 8 * 128 * 2 * 2 / 1e9
        qd, td, ld = q[:groups].contiguous(), tables[:groups].contiguous(), lens[:groups].contiguous()
        us = graph_us(lambda qd=qd, td=td, ld=ld, cache=cache: paged_decode(qd, cache, td, ld), reps=30)
        print(
            f"compare {groups}x{members}: decode (one query per group) {us:6.1f} us {gb / us * 1e3:4.2f} "
            "TB/s",
            flush=True,
        )
        for splits in (1, 2, 3, 4):
            c = {**cfg, "num_splits": splits}
            us = graph_us(
                lambda q=q, cache=cache, tables=tables, lens=lens, cu=cu, c=c: paged_prefill_lse(
                    q, cache, tables, lens, cu, None, False, "NHD", **c
                ),
                reps=30,
            )
            print(
                f"compare {groups}x{members}: prefill_lse {c} {us:6.1f} us {gb / us * 1e3:4.2f} TB/s",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop searching after this many seconds")
    ap.add_argument("--compare", action="store_true", help="only the decode-kernel comparison (compare())")
    ap.add_argument(
        "--configs", nargs="*", help="only these configs (dict literals over the defaults), no search"
    )
    a = ap.parse_args(argv)
    if a.compare:
        compare(DEFAULT)
        return 0
    if a.configs:
        cases = {c: case(*c) for c in CASES}
        for cfg in a.configs:
            cfg = {**DEFAULT, **ast.literal_eval(cfg)}  # a dict literal from the command line
            per = {
                c: graph_us(
                    lambda args=args, cfg=cfg: paged_prefill_lse(*args, None, False, "NHD", **cfg), reps=30
                )
                for c, args in cases.items()
            }
            print(
                f"  {sum(per.values()):8.1f} us  {' '.join(f'{k}={v:.1f}' for k, v in per.items())}  {cfg}  "
                f"{registers()}",
                flush=True,
            )
        return 0
    t_start = time.perf_counter()
    cases = {c: case(*c) for c in CASES}
    refs = {c: paged_prefill_lse(*args, None, False, "NHD", **DEFAULT)[0] for c, args in cases.items()}
    seen: dict[tuple, tuple[float, dict]] = {}

    def score(cfg: dict) -> float:
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            per, worst = {}, 0.0
            for c, args in cases.items():
                try:
                    per[c], err = timed(args, cfg, refs[c])
                except Exception as exc:  # noqa: BLE001 - a config Triton cannot compile (e.g. out of resources)
                    print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    seen[key] = (float("inf"), {})
                    return float("inf")
                worst = max(worst, err)
            total = sum(per.values()) if worst < 0.05 else float("inf")
            seen[key] = (total, per)
            print(
                f"  {total:8.1f} us  {' '.join(f'{k}={v:.1f}' for k, v in per.items())}  err {worst:.1e}  "
                f"{cfg}",
                flush=True,
            )
        return seen[key][0]

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; cases G x M: {CASES}")
    decode_order()
    best = dict(DEFAULT)
    print("default:")
    score(DEFAULT)
    for p in range(a.passes):
        for name, values in SPACE.items():
            if time.perf_counter() - t_start > a.budget_s:
                break
            print(f"pass {p + 1}, {name}:", flush=True)
            for v in values:
                score({**best, name: v})
            best = min(({**best, name: v} for v in values), key=score)
    total, per = seen[tuple(sorted(best.items()))]
    print(f"\nbest {best}: {total:.1f} us ({per})")
    dt, dper = seen[tuple(sorted(DEFAULT.items()))]
    print(f"default {DEFAULT}: {dt:.1f} us ({dper})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
