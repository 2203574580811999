"""The block tables of :class:`~layerzero.engine.kv.KVCacheManager` mirrored as rows of one int32 numpy
matrix, so a step's ``[B, max blocks]`` table (``ForwardBatch.block_tables``) is one gather instead of
converting every request's whole Python list (256 requests x 137 blocks: ~35k ints per decode step, ~1 ms of
host time on the CI CPU).

Tables only grow while a request holds them (blocks are appended, never replaced) and a request's row is
zeroed when it is freed, so a row holds exactly its table followed by zeros. vLLM v1 keeps its block tables
the same way (a persistent ``BlockTable`` array per request slot, appended to as blocks are allocated).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np


class BlockTableMirror:
    """Rows of block ids: :meth:`assign` a request's table, :meth:`extend` it, :meth:`release` it,
    :meth:`gather` the tables of a step. Rows and columns grow by doubling (amortized O(1) per block).

    >>> m = BlockTableMirror()
    >>> m.assign("a", [3, 4]); m.assign("b", [7]); m.extend("b", [9, 11])
    >>> m.gather(["b", "a"]).tolist()
    [[7, 9, 11], [3, 4, 0]]
    >>> m.release("b"); m.assign("c", [5]); m.gather(["c"]).tolist()
    [[5]]
    """

    def __init__(self, rows: int = 64, cols: int = 64) -> None:
        self._m = np.zeros((rows, cols), dtype=np.int32)
        self._len = np.zeros(rows, dtype=np.int64)
        self._row: dict[Hashable, int] = {}
        self._free = list(range(rows - 1, -1, -1))  # pop() hands out the lowest row first

    def assign(self, req_id: Hashable, blocks: Sequence[int]) -> None:
        """Give ``req_id`` (not holding a row) a row holding ``blocks``."""
        if not self._free:
            self._grow_rows()
        row = self._row[req_id] = self._free.pop()
        self._write(row, 0, blocks)

    def extend(self, req_id: Hashable, blocks: Sequence[int]) -> None:
        """Append ``blocks`` to ``req_id``'s row."""
        if blocks:
            row = self._row[req_id]
            self._write(row, int(self._len[row]), blocks)

    def release(self, req_id: Hashable) -> None:
        """Zero ``req_id``'s row and hand it back."""
        row = self._row.pop(req_id)
        self._m[row, : self._len[row]] = 0
        self._len[row] = 0
        self._free.append(row)

    def gather(self, req_ids: Iterable[Hashable]) -> np.ndarray:
        """``[B, W]`` int32: the tables of ``req_ids`` in order, rows padded with 0 to the longest (W >=
        1)."""
        rows = np.fromiter(map(self._row.__getitem__, req_ids), dtype=np.int64)
        width = max(int(self._len[rows].max()), 1) if len(rows) else 1
        return self._m[rows, :width]

    def _write(self, row: int, start: int, blocks: Sequence[int]) -> None:
        end = start + len(blocks)
        if end > self._m.shape[1]:
            grown = np.zeros((self._m.shape[0], max(end, 2 * self._m.shape[1])), dtype=np.int32)
            grown[:, : self._m.shape[1]] = self._m
            self._m = grown
        self._m[row, start:end] = blocks
        self._len[row] = end

    def _grow_rows(self) -> None:
        n = self._m.shape[0]
        self._m = np.concatenate([self._m, np.zeros_like(self._m)])
        self._len = np.concatenate([self._len, np.zeros_like(self._len)])
        self._free = list(range(2 * n - 1, n - 1, -1))
