"""``symm_mem.one_shot_push``'s protocol with real concurrency: two and three processes on CPU, each running
the kernel in Triton's interpreter over "symmetric buffers" in shared memory (each process maps every rank's
buffer and passes its own addresses, as GPUs do with symmetric memory), several calls back to back with sizes
and dtypes changing, so the ranks race: a rank reads only after every peer's flag said its push landed, and
the two parities keep a fast rank's next push off the buffer a slow rank still reads. Checked: every rank's
output is bitwise the same and within a per-dtype tolerance of the float64 sum. The GPUs run
tests/gpu/test_gpu_collectives.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from _triton_interp import needs_interpreter  # noqa: E402 - the interpreter's skip mark lives there

pytestmark = [pytest.mark.distributed, needs_interpreter("tests/gpu/test_gpu_collectives.py")]

CALLS = [
    (torch.bfloat16, 4096),
    (torch.float32, 3001),
    (torch.float16, 9000),
    (torch.bfloat16, 1),
    (torch.float32, 2049),
]
LIMIT_S = 120.0
"""Seconds for every rank's results (a few on an idle CPU; a rank that never saw a flag hangs)."""
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _inputs(rank: int, call: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * call + rank)).to(dtype)


def _rank(rank: int, world: int, bufs: list[torch.Tensor], results: mp.Queue) -> None:
    from layerzero.backends.symm_mem import push

    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)  # this process's mappings
    state = push.PushState(bufs[rank], None, bases, torch.zeros(push.GRID, dtype=torch.int32), rank, world)
    outs = [push.launch(_inputs(rank, i, dt, n), state) for i, (dt, n) in enumerate(CALLS)]
    results.put((rank, [o.view(torch.uint8).numpy().tobytes() for o in outs]))  # by value, not shared memory


@pytest.mark.parametrize(
    "world", [3]
)  # three ranks: two peers per rank (W = 2 runs in-process and on the GPUs)
def test_every_rank_gets_the_same_sum_while_the_ranks_race(world):
    from layerzero.backends.symm_mem import push

    bufs = [torch.zeros(push.buffer_bytes(world), dtype=torch.uint8).share_memory_() for _ in range(world)]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, bufs, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=LIMIT_S) for _ in range(world))  # queue.Empty: a stalled wait
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for i, (dtype, n) in enumerate(CALLS):
        want = sum(_inputs(r, i, dtype, n).double() for r in range(world))
        out = torch.frombuffer(bytearray(got[0][i]), dtype=dtype)
        assert out.shape == (n,)
        for r in range(1, world):
            assert got[r][i] == got[0][i], (i, r)  # bitwise
        assert (out.double() - want).abs().max() <= TOL[dtype] * want.abs().max() + 1e-6, i
