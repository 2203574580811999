"""The Triton kernel of ``symm_mem.one_shot_push`` (imported on the first call: importing this module imports
triton). The protocol, layout and why one flag per call is enough are in :mod:`.push`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def one_shot_push_all_reduce(
    x_ptr,
    out_ptr,
    bases_ptr,
    epochs_ptr,
    n,
    rank,
    FLAGS_OFFSET: tl.constexpr,
    PARITY_BYTES: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    CHUNK_BYTES: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = sum over the ranks of x (float32 accumulation, in rank order: bitwise equal on every rank).

    Program ``pid`` owns chunk ``pid`` of ``BLOCK`` elements (``CHUNK_BYTES`` bytes) of every message (one
    program per chunk), always the same bytes of the buffer; its own call counter ``epochs[pid]`` picks the
    parity. It stores its chunk of x into slot ``rank`` of every rank's buffer (its own included), then, after
    a CTA barrier, sets flag ``[pid, rank]`` of every rank to the new epoch (release, system scope), waits
    until its own flags ``[pid, 0..WORLD)`` reached that epoch (acquire), and sums the WORLD slots of its own
    buffer.
    """
    pid = tl.program_id(0)
    e = tl.load(epochs_ptr + pid) + 1
    tl.store(epochs_ptr + pid, e)
    parity = e & 1
    elem = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mine = parity * PARITY_BYTES + rank * SLOT_BYTES  # this rank's slot, the same offset in every buffer
    idx = pid * BLOCK + offs  # program pid's chunk: the grid has one program per chunk
    m = idx < n
    v = tl.load(x_ptr + idx, mask=m)
    for p in tl.static_range(WORLD):
        dst = tl.multiple_of(
            (tl.load(bases_ptr + p) + mine + pid * CHUNK_BYTES).to(tl.pointer_type(elem)), 16
        )
        tl.store(dst + offs, v, mask=m)
    tl.debug_barrier()  # every thread's stores before the release below
    for p in tl.static_range(WORLD):
        flag = (tl.load(bases_ptr + p) + FLAGS_OFFSET + (pid * WORLD + rank) * 4).to(
            tl.pointer_type(tl.int32)
        )
        tl.atomic_xchg(flag, e, sem="release", scope="sys")
    own = tl.load(bases_ptr + rank)
    for p in tl.static_range(WORLD):
        flag = (own + FLAGS_OFFSET + (pid * WORLD + p) * 4).to(tl.pointer_type(tl.int32))
        # a peer may already be one call ahead (e + 1): wait until the wrap-safe difference is >= 0
        while tl.atomic_add(flag, 0, sem="acquire", scope="sys") - e < 0:
            pass
    tl.debug_barrier()
    base = own + parity * PARITY_BYTES + pid * CHUNK_BYTES
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(WORLD):
        src = tl.multiple_of((base + s * SLOT_BYTES).to(tl.pointer_type(elem)), 16)  # 16-byte vectors
        acc += tl.load(src + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + idx, acc.to(elem), mask=m)
