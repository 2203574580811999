"""The step's input batch: :class:`~.attn_metadata.ForwardBatch` built from the scheduled chunks (host arrays,
one host-to-device copy), plain or packed into a CUDA-graph bucket's buffers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from layerzero import InvalidInputError

from .attn_metadata import CascadeBatch, ForwardBatch
from .cascade import CascadePolicy, plan_cascade
from .staging import stage, to_device

__all__ = ["ForwardBatch", "ScheduledChunk", "build_forward_batch", "build_packed_decode_batch"]


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's share of a step: the tokens at positions ``start .. start + length - 1``, whose ids are
    ``token_ids[start - offset : start - offset + length]`` (``offset`` 0: ``token_ids`` holds the whole
    sequence; ``offset == start``: only the chunk's ids, as a :class:`SchedulerOutput
    <layerzero.engine.core.sched.output.SchedulerOutput>` sends them), its block table (block ids, enough
    for ``start + length`` tokens), and whether the step samples its next token (the chunk reaches the end
    of its known tokens).

    ``pending_src`` not None (async scheduling): the chunk's last token is pending, not in ``token_ids`` yet;
    its id is row ``pending_src`` of the previous step's sampled tokens, gathered on the device.

    ``num_spec`` > 0 (speculative decoding): the chunk's last ``num_spec`` tokens are drafts; a sampled chunk
    then has logits at its last ``num_spec + 1`` positions (the verification's), in order."""

    token_ids: Sequence[int]
    start: int
    length: int
    block_table: Sequence[int]
    sample: bool
    pending_src: int | None = None
    offset: int = 0
    num_spec: int = 0


def build_forward_batch(
    chunks: Sequence[ScheduledChunk],
    block_size: int,
    device: torch.device,
    prev_tokens: torch.Tensor | None = None,
    cascade: CascadePolicy | None = None,
    tables: np.ndarray | None = None,
) -> ForwardBatch:
    """The :class:`ForwardBatch` of ``chunks`` (in order), built on the host with numpy and copied to
    ``device`` in one non-blocking transfer (:func:`layerzero.engine.staging.to_device`). A pure decode step
    (one token per chunk) takes a scalar path: no per-chunk numpy arrays, ~4x less host time at 256 sequences.

    ``prev_tokens`` ``[S_prev]`` int64 on ``device``: the previous step's sampled tokens, where chunks with a
    ``pending_src`` find their last input id (one gather on the device, no host synchronization).

    ``cascade``: plan the step (decode or mixed) as cascade attention when :func:`~.cascade.plan_cascade` says
    it pays (None: never).

    ``tables`` ``[B, W]`` int32: the chunks' block tables as one matrix, rows padded with 0 (the engine's
    :meth:`~layerzero.engine.kv.KVCacheManager.block_tables`, one gather); the chunks' ``block_table`` is then
    not read. None: built from each chunk's ``block_table``.

    Raises:
        InvalidInputError: ``tables`` without one row per chunk.
        RuntimeError: a chunk with a pending token and no ``prev_tokens``."""
    decode = all(c.length == 1 for c in chunks)
    if tables is None:
        tables = _table_matrix(chunks)
    elif tables.shape[0] != len(chunks):
        raise InvalidInputError(
            f"build_forward_batch: tables: expected {len(chunks)} rows (one per chunk), got "
            f"{tables.shape[0]}. Gather the tables of the step's chunks, in chunk order."
        )
    arrays, rows = (_decode_arrays if decode else _mixed_arrays)(chunks, block_size, tables)
    if rows and prev_tokens is None:
        raise RuntimeError(
            "a chunk with a pending token needs the previous step's sampled tokens (prev_tokens)"
        )
    plan = None
    if cascade is not None:
        plan = plan_cascade(arrays[3], arrays[4], block_size, cascade, None if decode else np.diff(arrays[5]))
    return _assemble(
        arrays, rows, plan, device, prev_tokens, decode, len(chunks), decode and all(c.sample for c in chunks)
    )


def _assemble(
    arrays: list[np.ndarray],
    rows: list[tuple[int, int]],
    plan: Any,
    device: torch.device,
    prev_tokens: torch.Tensor | None,
    decode: bool,
    n: int,
    logits_all: bool,
) -> ForwardBatch:
    """The :class:`ForwardBatch` of a step's host arrays (``_decode_arrays`` / ``_mixed_arrays``), its
    pending-id rows and its cascade plan (or None), in one host-to-device copy."""
    if rows:
        arrays.append(
            np.asarray(rows, dtype=np.int64).T.copy()
        )  # [2, P]: (row of input_ids, row of prev_tokens)
    if plan is not None:
        arrays.extend(plan[0])
    t = to_device(arrays, device)
    ids, pos, slots, tables, seq_lens, cu, sample = t[:7]
    if rows:
        ids.index_copy_(0, t[7][0], prev_tokens.index_select(0, t[7][1]))
    casc = None
    if plan is not None:
        c = t[len(t) - len(plan[0]) :]
        casc = CascadeBatch(*c[:6], saved_tokens=plan[1], cu_seqlens_q=c[6] if len(c) > 6 else None)
    return ForwardBatch(
        ids, pos, slots, tables, seq_lens, None if decode else cu, sample, n, casc, logits_all=logits_all
    )


def build_packed_decode_batch(
    chunks: Sequence[ScheduledChunk],
    block_size: int,
    tables: np.ndarray,
    prev_tokens: torch.Tensor | None,
    target: Any,
    cascade: CascadePolicy | None = None,
) -> ForwardBatch:
    """A pure decode step (every chunk one token, every chunk sampled) written straight into a CUDA-graph
    bucket's packed input buffer (``target``: a :class:`~.cuda_graph.PackTarget`; bucket ``bs`` rows, tables
    ``width`` wide) in one host-to-device copy (``staging.stage``'s layout), read through the bucket's own
    views: the step's rows, then the padding rows a graph replay expects (slot -1, seq_len 1, block table 0),
    the tables' unused columns 0; pending ids gathered from ``prev_tokens`` into it on the device, except in a
    chained step (every row pending from the same row of the previous step, which was the bucket's greedy
    graph of the other lane: ``prev_tokens`` are this lane's ids), whose ids that graph already wrote into
    this lane: nothing is gathered, and the copy starts after them, on the side stream ``target.h2d`` (CUDA),
    overlapping the step before. A step that ``cascade`` plans as cascade attention is built as
    :func:`build_forward_batch` builds it, from the same arrays and plan (its graphs have their own buffers,
    which a replay copies into): planned once.

    Raises:
        InvalidInputError: ``tables`` without one row per chunk, or wider than ``target.width``, or more
            chunks than ``target.bs``.
        RuntimeError: a chunk with a pending token and no ``prev_tokens``."""
    n, bs, width = len(chunks), target.bs, target.width
    if tables.shape[0] != n or tables.shape[1] > width or n > bs:
        raise InvalidInputError(
            f"build_packed_decode_batch: tables [{tables.shape[0]}, {tables.shape[1]}] for {n} "
            f"chunks: expected one row per chunk, at most {width} wide, at most {bs} chunks. "
            "Take the target from CUDAGraphRunner.pack_for(num_seqs, width)."
        )
    arrays, rows = _decode_arrays(chunks, block_size, tables)
    if rows and prev_tokens is None:
        raise RuntimeError(
            "a chunk with a pending token needs the previous step's sampled tokens (prev_tokens)"
        )
    if cascade is not None:
        plan = plan_cascade(arrays[3], arrays[4], block_size, cascade, None)
        if plan is not None:
            return _assemble(arrays, rows, plan, target.buffer.device, prev_tokens, True, n, True)
    ids, pos, slots = (np.zeros(bs, dtype=np.int64) for _ in range(3))
    slots[:] = -1
    table = np.zeros((bs, width), dtype=np.int32)
    lens = np.ones(bs, dtype=np.int32)
    ids[:n], pos[:n], slots[:n], lens[:n] = arrays[0], arrays[1], arrays[2], arrays[4]
    table[:n, : tables.shape[1]] = tables
    packed = [ids, pos, slots, table, lens]
    chained = _chained(rows, n, prev_tokens, target)
    if rows and not chained:
        packed.append(
            np.asarray(rows, dtype=np.int64).T.copy()
        )  # [2, P]: (row of input_ids, row of prev_tokens)
    host, offs = stage(packed, target.buffer.device)
    if (
        chained
    ):  # the ids are in place (the other lane's greedy graph wrote them): copy the rest, on the side stream
        _copy_aside(target, host, offs[1])
    else:
        target.wait_sent()  # the id slots may still be on their way to the host
        if rows and _shares(prev_tokens, target.buffer):  # the previous step's ids are this lane's id slots
            prev_tokens = prev_tokens.clone()  # read before the copy below overwrites them
        target.buffer[: host.numel()].copy_(host, non_blocking=target.buffer.is_cuda)
    ids_t, pos_t, slots_t, table_t, lens_t = (
        target.views
    )  # the bucket's views: made once, what its graph reads
    if rows and not chained:
        pend = target.buffer[offs[5] : offs[5] + packed[5].nbytes].view(torch.int64).view(packed[5].shape)
        if len(rows) == n and all(r == i for i, (r, _) in enumerate(rows)):
            torch.index_select(
                prev_tokens, 0, pend[1], out=ids_t[:n]
            )  # every id pending (decode): one gather
        else:
            ids_t.index_copy_(0, pend[0], prev_tokens.index_select(0, pend[1]))
    return ForwardBatch(
        ids_t[:n],
        pos_t[:n],
        slots_t[:n],
        table_t[:n],
        lens_t[:n],
        None,
        target.rows[:n],
        n,
        packed=True,
        logits_all=True,
        lane=target.lane,
    )


def _chained(rows: list[tuple[int, int]], n: int, prev_tokens: torch.Tensor | None, target: Any) -> bool:
    """Whether a packed step's input ids are already in its lane's slots: every row's id pending from the same
    row of the previous step (steady decode), and that step was the bucket's greedy graph of the other lane
    (its sampled ids are this lane's id slots, where it wrote them: no other tensor can live there)."""
    if prev_tokens is None or len(rows) != n or prev_tokens.data_ptr() != target.views[0].data_ptr():
        return False
    return all(r == i and src == i for i, (r, src) in enumerate(rows))


def _shares(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Whether tensor ``a`` lives in ``b``'s storage."""
    return a is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _copy_aside(target: Any, host: torch.Tensor, start: int) -> None:
    """Copy ``host[start:]`` into ``target.buffer`` at ``start``: on CUDA on the side stream ``target.h2d``
    once the last replay that read this lane is done (``target.free``), so it overlaps the step before (which
    reads the other lane), the current stream waiting for it; elsewhere in place."""
    dst, src = target.buffer[start : host.numel()], host[start:]
    h2d = target.h2d
    if h2d is None:
        dst.copy_(src, non_blocking=dst.is_cuda)
        return
    h2d.wait_event(target.free)
    with torch.cuda.stream(h2d):
        dst.copy_(src, non_blocking=True)
    torch.cuda.current_stream(dst.device).wait_stream(h2d)


def _table_matrix(chunks: Sequence[ScheduledChunk]) -> np.ndarray:
    """``[B, W]`` int32: the chunks' block tables, rows padded with 0."""
    tables = np.zeros((len(chunks), max(len(c.block_table) for c in chunks)), dtype=np.int32)
    for i, c in enumerate(chunks):
        tables[i, : len(c.block_table)] = c.block_table
    return tables


def _mixed_arrays(
    chunks: Sequence[ScheduledChunk], block_size: int, tables: np.ndarray
) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    """The host arrays of a step with prefill chunks (ids, positions, slots, tables, seq_lens, cu_seqlens_q,
    sampled rows) and the (row, pending_src) pairs of its pending ids. Positions, slots, lengths and sampled
    rows are whole-array numpy; the only per-chunk Python is placing the ids (a mixed step of 255 decode
    rows and one 256-token prefill: 1.36 -> 0.21 ms, ``benchmarks/results/engine/host_step_mixed_cpu.md``)."""
    n = len(chunks)
    lengths = np.fromiter((c.length for c in chunks), dtype=np.int64, count=n)
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    total = int(cu[-1])
    owner = np.repeat(np.arange(n), lengths)  # [T]: the chunk of each token
    pos = np.arange(total, dtype=np.int64) + np.repeat(starts - cu[:-1], lengths)
    slots = tables[owner, pos // block_size].astype(np.int64) * block_size + pos % block_size
    ids = np.zeros(total, dtype=np.int64)  # a pending id stays 0 until the device gather
    one_rows, one_ids, rows = [], [], []  # one-token chunks' ids go in with one scatter
    for i, c in enumerate(chunks):
        a, end = c.start - c.offset, int(cu[i + 1])
        if c.pending_src is not None:
            rows.append((end - 1, c.pending_src))
            if c.length > 1:
                ids[end - c.length : end - 1] = c.token_ids[a : a + c.length - 1]
        elif c.length == 1:
            one_rows.append(end - 1)
            one_ids.append(c.token_ids[a])
        else:
            ids[end - c.length : end] = c.token_ids[a : a + c.length]
    if one_rows:
        ids[one_rows] = one_ids
    sampled = np.fromiter((c.sample for c in chunks), dtype=bool, count=n)
    spec = np.fromiter((c.num_spec for c in chunks), dtype=np.int64, count=n)
    count = np.where(sampled, spec + 1, 0)  # logits rows per chunk: its last num_spec + 1 tokens, if sampled
    first = np.repeat(cu[1:] - count, count)
    sample = first + np.arange(len(first)) - np.repeat(np.cumsum(count) - count, count)
    seq_lens = (starts + lengths).astype(np.int32)
    return [ids, pos, slots, tables, seq_lens, cu.astype(np.int32), sample], rows


def _decode_arrays(
    chunks: Sequence[ScheduledChunk], block_size: int, tables: np.ndarray
) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    """:func:`_mixed_arrays` of chunks of one token each (cu_seqlens_q is left out of the batch: a pure decode
    step)."""
    pos = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
    ids = [c.token_ids[c.start - c.offset] if c.pending_src is None else 0 for c in chunks]
    rows = [(i, c.pending_src) for i, c in enumerate(chunks) if c.pending_src is not None]
    slots = tables[np.arange(len(chunks)), pos // block_size].astype(np.int64) * block_size + pos % block_size
    sample = [i for i, c in enumerate(chunks) if c.sample]
    p32 = pos.astype(np.int32)
    return [
        np.asarray(ids, dtype=np.int64),
        pos,
        slots,
        tables,
        p32 + 1,
        p32[:0],
        np.asarray(sample, dtype=np.int64),
    ], rows
