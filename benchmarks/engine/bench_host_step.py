"""Host time of a decode step's metadata (CPU only, no model): the block tables of B sequences of L tokens
turned into a ``ForwardBatch``, side by side in one process:

- ``lists``: a copy of every request's table (``KVCacheManager.block_table``) and ``build_forward_batch``
  converting them row by row (the engine until 2026-11-25);
- ``matrix``: one gather from the KV manager's numpy mirror (``KVCacheManager.block_tables``) passed as
  ``tables=`` (the engine now);
- ``allocate_slots``: B calls on tables that already hold the tokens (15 of 16 decode steps; returns at once);
- ``mixed``: ``build_forward_batch`` of mixed steps (decode rows with pending ids beside prefill chunks) and
  of one short prompt's prefill (``--mixed`` only: the table ``mixed_table`` prints; run it on two commits to
  compare them).

Usage: ``PYTHONPATH=src python benchmarks/engine/bench_host_step.py [--seqs 256 --tokens 2176] [--out
FILE.md]``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import timeit
from pathlib import Path

import torch
from bench_quantization import cpu_flags

from layerzero.engine.core.kv import KVCacheManager
from layerzero.engine.worker.input_batch import ScheduledChunk, build_forward_batch


def measure(
    seqs: int, tokens: int, block_size: int = 16, number: int = 50, repeat: int = 7
) -> dict[str, float]:
    """Best-of-``repeat`` ms per call of each variant (see the module docstring); both table paths give equal
    batches (checked)."""
    kv = KVCacheManager(seqs * (tokens // block_size + 2), block_size, enable_prefix_caching=False)
    rng = random.Random(0)
    ids = [[rng.randrange(10000) for _ in range(tokens + 1)] for _ in range(seqs)]
    for i in range(seqs):
        kv.allocate_slots(i, tokens + 1)
    cpu = torch.device("cpu")

    def lists():  # noqa: ANN202
        chunks = [ScheduledChunk(ids[i], tokens, 1, kv.block_table(i), True) for i in range(seqs)]
        return build_forward_batch(chunks, block_size, cpu)

    def matrix():  # noqa: ANN202
        chunks = [ScheduledChunk(ids[i], tokens, 1, (), True) for i in range(seqs)]
        return build_forward_batch(chunks, block_size, cpu, tables=kv.block_tables(list(range(seqs))))

    def allocate():  # noqa: ANN202
        for i in range(seqs):
            kv.allocate_slots(i, tokens + 1)

    a, b = lists(), matrix()
    for f in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "logits_indices"):
        if not torch.equal(getattr(a, f), getattr(b, f)):
            raise RuntimeError(f"bench_host_step: the two table paths differ in {f}")
    return {
        name: 1e3 * min(timeit.repeat(fn, number=number, repeat=repeat)) / number
        for name, fn in (("lists", lists), ("matrix", matrix), ("allocate_slots", allocate))
    }


MIXED = ((255, 1, 256), (248, 8, 256), (64, 1, 512), (0, 1, 32), (0, 1, 1024))
"""(decode rows, prefill chunks, prompt tokens per chunk) of the mixed-step cases."""


def mixed_step(decode: int, prefills: int, prompt: int, block_size: int = 16, seed: int = 0):  # noqa: ANN201
    """The chunks and block-table matrix of one mixed step: ``decode`` rows (contexts of 600-799 tokens,
    each last id pending from row i of the previous step, only the chunk's ids sent, as the scheduler sends
    them) then ``prefills`` first chunks of ``prompt`` tokens."""
    import numpy as np

    rng = random.Random(seed)
    chunks, tables = [], []
    for i in range(decode):
        n = 600 + rng.randrange(200)
        tables.append(range(i * 64, i * 64 + n // block_size + 1))
        chunks.append(ScheduledChunk([rng.randrange(10000)], n, 1, (), True, pending_src=i, offset=n))
    for j in range(prefills):
        tables.append(range(10**6 + j * 64, 10**6 + j * 64 + prompt // block_size + 1))
        chunks.append(ScheduledChunk([rng.randrange(10000) for _ in range(prompt)], 0, prompt, (), True))
    matrix = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
    for i, t in enumerate(tables):
        matrix[i, : len(t)] = t
    return chunks, matrix


def mixed_table(number: int = 50, repeat: int = 7) -> str:
    """Best-of-``repeat`` ms per ``build_forward_batch`` call of each :data:`MIXED` case, as a markdown table
    with the machine and commit."""
    import subprocess

    prev = torch.arange(512)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    lines = [
        f"- {datetime.date.today()}, commit {commit.strip()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {platform.machine()}, {cpu_flags()}",
        "",
        "| decode rows | prefill chunks x tokens | ms per build |",
        "| ---: | --- | ---: |",
    ]
    for d, p, n in MIXED:
        chunks, tables = mixed_step(d, p, n)

        def build(chunks=chunks, tables=tables):  # noqa: ANN202
            return build_forward_batch(chunks, 16, torch.device("cpu"), prev, None, tables)

        ms = 1e3 * min(timeit.repeat(build, number=number, repeat=repeat)) / number
        lines.append(f"| {d} | {p} x {n} | {ms:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2176)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--mixed", action="store_true", help="time the mixed steps instead (see the docstring)")
    a = ap.parse_args(argv)
    if a.mixed:
        text = mixed_table()
        print(text)
        if a.out:
            a.out.write_text(text)
        return 0
    r = measure(a.seqs, a.tokens)
    lines = [
        f"# Host time of a decode step's metadata ({a.seqs} sequences x {a.tokens} tokens, blocks of 16)",
        "",
        f"- date: {datetime.date.today()}; torch {torch.__version__}; {torch.get_num_threads()} threads",
        f"- machine: {platform.machine()}, {cpu_flags()}",
        "- command: `PYTHONPATH=src python benchmarks/engine/bench_host_step.py --out ...` (best of 7 x 50)",
        "",
        "| variant | ms per step |",
        "| --- | ---: |",
        f"| block tables as lists, converted row by row (before) | {r['lists']:.3f} |",
        f"| one gather from the numpy mirror (now) | {r['matrix']:.3f} |",
        f"| `allocate_slots` x {a.seqs}, tables already full (now) | {r['allocate_slots']:.3f} |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
