"""``symm_mem.one_shot_push`` (LayerZero's one-shot all-reduce: x pushed into every rank's symmetric buffer,
one flag per call, two parities) on CPU through the Triton interpreter, W ranks simulated in one process: each
rank's "symmetric buffer" is a CPU tensor and the kernel gets every rank's address, as on GPUs. Ranks W-1 .. 1
run first, each with the flags of the ranks not yet run set by hand (as if they had arrived); rank 0 runs
last and sees every peer's real push and flag. Checked: rank 0's output is bitwise the float32 sum in rank
order (the kernel's contract, the same on every rank) and within a per-dtype tolerance of the float64 sum;
the parity and the per-program call counters advance as the protocol says; a peer one call ahead does not
stall the kernel. The real GPUs run tests/gpu/test_gpu_collectives.py."""

from __future__ import annotations

import pytest
import torch
from _triton_interp import needs_interpreter

from layerzero.backends.symm_mem import push

pytestmark = [pytest.mark.correctness, needs_interpreter("tests/gpu/test_gpu_collectives.py")]

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # relative to max |sum|


class Ranks:
    """W simulated ranks: a push buffer per rank (CPU), every rank's :class:`push.PushState`."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.bufs = [torch.zeros(push.buffer_bytes(world), dtype=torch.uint8) for _ in range(world)]
        bases = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64)
        self.states = [
            push.PushState(self.bufs[r], None, bases, torch.zeros(push.GRID, dtype=torch.int32), r, world)
            for r in range(world)
        ]

    def flags(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s flags ``[GRID, W]`` (int32 view of its buffer): ``[pid, src]``."""
        off = self.states[rank].flags_offset
        return self.bufs[rank][off:].view(torch.int32).view(push.GRID, self.world)

    def slot(self, rank: int, parity: int, src: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The first n elements of slot ``src`` of parity ``parity`` in rank ``rank``'s buffer."""
        start = (parity * self.world + src) * push.SLOT_BYTES
        return self.bufs[rank][start : start + push.SLOT_BYTES].view(dtype)[:n]

    def all_reduce(self, xs: list[torch.Tensor], ahead: int = 1) -> torch.Tensor:
        """One call on every rank, rank 0 last; the flags of ranks that have not run yet are set to their
        coming epoch + ``ahead`` - 1. Returns rank 0's output."""
        grid = -(-xs[0].numel() * xs[0].element_size() // push.CHUNK_BYTES)  # the programs that run
        for r in range(self.world - 1, 0, -1):
            for src in range(r):  # the ranks still to run: "arrived" by hand
                self.flags(r)[:grid, src] = self.states[r].epochs[:grid] + ahead
            push.launch(xs[r], self.states[r])
        return push.launch(xs[0], self.states[0])


def _matches_rank_order_sum(out: torch.Tensor, xs: list[torch.Tensor]) -> bool:
    """out is the float32 sum in rank order, rounded to x's dtype: to nearest (the GPU's cast); for bfloat16
    truncation is accepted too (the interpreter's float32 -> bfloat16 cast truncates)."""
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc = acc + x.float()
    if out.dtype != torch.bfloat16:
        return torch.equal(out, acc.to(out.dtype))
    truncated = (acc.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: low bits 0
    return bool(((out == acc.to(torch.bfloat16)) | (out == truncated)).all())


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rank_zero_gets_the_rank_order_float32_sum(world, dtype):
    gen = torch.Generator().manual_seed(world * 7 + dtype.itemsize)
    ranks = Ranks(world)
    block = push.CHUNK_BYTES // dtype.itemsize
    for n in (1, 4097, 3 * block + 5):  # one element; a chunk and a bit; several programs, a ragged tail
        xs = [torch.randn(n, generator=gen).to(dtype) for _ in range(world)]
        out = ranks.all_reduce(xs)
        assert out.dtype == dtype and out.shape == (n,)
        assert _matches_rank_order_sum(out, xs), (world, dtype, n)
        want = sum(x.double() for x in xs)
        assert (out.double() - want).abs().max() <= TOL[dtype] * want.abs().max() + 1e-6


def test_a_two_dimensional_strided_input_keeps_its_shape():
    ranks = Ranks(2)
    xs = [torch.randn(9, 12).t() for _ in range(2)]  # [12, 9], not contiguous
    out = ranks.all_reduce(xs)
    assert out.shape == (12, 9) and torch.equal(out, xs[0] + xs[1])


def test_parities_alternate_and_only_the_programs_with_a_chunk_advance():
    ranks = Ranks(2)
    block = push.CHUNK_BYTES // 4
    big = [torch.full((2 * block + 1,), float(r + 1)) for r in range(2)]  # three programs
    small = [torch.full((5,), 10.0 * (r + 1)) for r in range(2)]  # program 0 only
    assert torch.equal(ranks.all_reduce(big), torch.full_like(big[0], 3.0))
    assert ranks.states[0].epochs[:4].tolist() == [1, 1, 1, 0]
    assert torch.equal(ranks.all_reduce(small), torch.full((5,), 30.0))
    assert ranks.states[0].epochs[:4].tolist() == [2, 1, 1, 0]
    # call 1 (parity 1) left the first chunk of both slots in rank 0's buffer; call 2 wrote parity 0
    assert torch.equal(ranks.slot(0, 1, 1, 5, torch.float32), torch.full((5,), 2.0))
    assert torch.equal(ranks.slot(0, 0, 1, 5, torch.float32), torch.full((5,), 20.0))
    # rank 0 pushed into rank 1's buffer too, at its own slot, and raised rank 1's flags
    assert torch.equal(ranks.slot(1, 0, 0, 5, torch.float32), torch.full((5,), 10.0))
    assert ranks.flags(1)[:4, 0].tolist() == [2, 1, 1, 0]
    assert torch.equal(ranks.all_reduce(big), torch.full_like(big[0], 3.0))  # program 0's epoch 3: parity 1
    assert ranks.states[0].epochs[:4].tolist() == [3, 2, 2, 0]


def test_a_peer_one_call_ahead_does_not_stall_the_wait():
    ranks = Ranks(2)
    xs = [torch.arange(7.0), torch.ones(7)]
    # rank 0's flag from rank 1 is set to epoch + 1, as when rank 1 already started its next call
    ranks.flags(0)[:, 1] = ranks.states[0].epochs + 2
    ranks.slot(0, 1, 1, 7, torch.float32).copy_(xs[1])  # rank 1's push of this call (parity 1)
    out = push.launch(xs[0], ranks.states[0])
    assert torch.equal(out, xs[0] + 1.0)


def test_the_int32_epoch_wraps_without_a_stall():
    ranks = Ranks(2)
    for s in ranks.states:
        s.epochs[0] = 2**31 - 1  # the next call's epoch wraps to -2**31: parity 0, still "reached"
    xs = [torch.full((3,), 1.5), torch.full((3,), 2.0)]
    assert torch.equal(ranks.all_reduce(xs), torch.full((3,), 3.5))
    assert ranks.states[0].epochs[0].item() == -(2**31)
    assert torch.equal(ranks.slot(0, 0, 1, 3, torch.float32), xs[1])
