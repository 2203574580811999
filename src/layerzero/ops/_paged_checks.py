"""The checks of ``lz.paged_attention`` (and of its lse form, ``lz.rope_paged_attention``'s attention):
:func:`prepare` (shapes, dtypes, layout, scale, the shape-only bounds of :func:`_check_token_bounds` and the
index values of :func:`_check_paged_values`) and the :class:`PagedKey` it builds. Its own module so that
:mod:`layerzero.ops.paged` (which re-exports every name here) holds the op, its selection context and its
dispatch; the op itself, with its conventions, is documented there."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from layerzero.core.context import bucket
from layerzero.core.kv_quant import KV_QUANT_DTYPES

from ._common import check_same, check_tensor, fail, flags, scope_token
from .kv_cache import (
    KVLayout,
    check_cache,
    check_index,
    check_kv_scale,
    check_values,
    parse_layout,
)

OP = "paged_attention"


class PagedKey(NamedTuple):
    """The selection-cache key of one ``lz.paged_attention`` call (fields named as the
    :class:`SelectionContext` fields :func:`context` fills from them; ``batch``, ``num_tokens`` and
    ``max_blocks`` bucketed to powers of two). ``kv_dtype``: the cache's dtype when quantized (float8_e4m3fn,
    int8), else None; the scale values are not keyed (they are arguments). ``stride_last_1``: q, kv_cache,
    block_tables and seq_lens all have stride(-1) == 1 (kernels that index them with a unit stride, e.g.
    ``triton.paged_decode``, declare ``requires_stride_last_1``). ``capture`` and ``scope`` close every op's
    key (second to last and last; ``core.dispatch.capture_key`` flips ``capture``)."""

    op: str
    device: torch.device
    dtype: torch.dtype
    batch: int
    num_tokens: int
    max_blocks: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    page_size: int
    kv_layout: KVLayout
    decode: bool
    is_causal: bool
    scale_default: bool
    kv_dtype: torch.dtype | None
    stride_last_1: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def _check_paged_values(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu: torch.Tensor | None,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    is_causal: bool = True,
    op: str = OP,
) -> None:
    """Index values: seq_lens in [0, max_blocks * block_size], cu_seqlens monotonic from 0 to num_tokens with
    q_len <= seq_len (causal only), decode seq_lens >= 1, used block ids in [0, num_blocks). Syncs on a
    GPU."""
    batch, max_blocks = block_tables.shape
    if batch == 0:
        if cu is not None and int(cu[0]) != 0:
            raise fail(
                op, "cu_seqlens_q (batch 0)", "[0]", cu.tolist(), "cu_seqlens_q is the prefix sum of q_lens."
            )
        return
    lens = seq_lens.long()
    cap = max_blocks * block_size
    if int(lens.min()) < 0 or int(lens.max()) > cap:
        i = int(((lens < 0) | (lens > cap)).nonzero()[0, 0])
        raise fail(
            op,
            f"seq_lens[{i}]",
            f"in [0, max_blocks * block_size] = [0, {cap}] (max_blocks={max_blocks}, "
            f"block_size={block_size})",
            int(lens[i]),
            "seq_lens counts every KV token of the sequence, new ones included; widen block_tables.",
        )
    if cu is None:
        if int(lens.min()) < 1:
            i = int((lens < 1).nonzero()[0, 0])
            raise fail(
                op,
                f"seq_lens[{i}] (decode)",
                ">= 1: the new token is counted in seq_lens",
                int(lens[i]),
                "Write the token with lz.reshape_and_cache first and count it, or pass cu_seqlens_q to "
                "give a sequence no query tokens.",
            )
    else:
        c = cu.long()
        first, last = int(c[0]), int(c[-1])
        if first != 0 or last != num_tokens:
            raise fail(
                op,
                "cu_seqlens_q ends",
                f"cu_seqlens_q[0] == 0 and cu_seqlens_q[-1] == num_tokens ({num_tokens})",
                f"[{first}, ..., {last}]",
                "cu_seqlens_q is the prefix sum of q_lens.",
            )
        qlen = c[1:] - c[:-1]
        if bool((qlen < 0).any()):
            i = int((qlen < 0).nonzero()[0, 0])
            raise fail(
                op,
                "cu_seqlens_q",
                "non-decreasing (monotonic) offsets",
                f"cu_seqlens_q[{i}]={int(c[i])} > cu_seqlens_q[{i + 1}]={int(c[i + 1])}",
            )
        if is_causal and bool((qlen > lens).any()):
            i = int((qlen > lens).nonzero()[0, 0])
            raise fail(
                op,
                f"q_len of sequence {i}",
                f"<= its seq_len {int(lens[i])} (seq_lens counts the new tokens too)",
                int(qlen[i]),
            )
    used = torch.arange(max_blocks, device=lens.device) * block_size < lens[:, None]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
        s, j = (int(x) for x in bad.nonzero()[0])
        raise fail(
            op,
            f"block_tables[{s}, {j}]",
            f"a block id in [0, num_blocks) = [0, {num_blocks}) for a block "
            f"sequence {s} uses (seq_len {int(lens[s])})",
            int(block_tables[s, j]),
            "Only the first ceil(seq_len / block_size) entries of a row are read; fix the block allocator.",
        )


def _check_token_bounds(
    num_tokens: int,
    batch: int,
    max_blocks: int,
    num_blocks: int,
    block_size: int,
    is_causal: bool = True,
    op: str = OP,
) -> None:
    """Shape-only consequences of the contract (no index value is read, so they hold on CUDA too): every query
    token belongs to a sequence (``q_len <= seq_len <= max_blocks * block_size``), so ``num_tokens <= batch *
    max_blocks * block_size``, and a query token needs at least one KV token, so a cache of 0 blocks admits no
    query token. ``num_tokens > 0`` with ``batch == 0`` is the first case. Without a causal mask a sequence
    may have more query tokens than keys (none at all: its rows get 0 and lse -inf), so only the first case
    applies."""
    if not num_tokens:
        return
    if batch == 0:
        raise fail(
            op,
            "num_tokens (batch 0)",
            "0 query tokens when block_tables, seq_lens have 0 rows and cu_seqlens_q is [0]",
            f"q.shape[0] = {num_tokens}",
            "Every query token belongs to a sequence: pass one block_tables row and seq_lens entry per "
            "sequence, and cu_seqlens_q [batch + 1].",
        )
    cap = max_blocks * block_size
    if is_causal and num_tokens > batch * cap:
        raise fail(
            op,
            "num_tokens",
            f"<= batch * max_blocks * block_size = {batch} * {max_blocks} * {block_size} "
            f"= {batch * cap} (q_len <= seq_len <= max_blocks * block_size per sequence)",
            f"q.shape[0] = {num_tokens}",
            "Widen block_tables (max_blocks) or check cu_seqlens_q / q.",
        )
    if num_blocks == 0:
        raise fail(
            op,
            "kv_cache num_blocks",
            ">= 1 when there are query tokens (each needs its own KV, written by lz.reshape_and_cache first)",
            f"0 (kv_cache shape [0, ...], {num_tokens} query tokens)",
            "Allocate the cache with lz.allocate_kv_cache(num_blocks >= 1, ...).",
        )


def prepare(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = True,
    kv_layout: str | KVLayout = "NHD",
    k_scale: Any = None,
    v_scale: Any = None,
    op: str = OP,
) -> tuple[PagedKey, tuple[Any, ...]]:
    """Validate ``lz.paged_attention`` inputs; return (cache key, canonical kernel args
    ``(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout)``, plus ``(k_scale,
    v_scale)`` (None -> 1.0) when the cache is quantized). ``op``: the op named in errors and in the key
    (``lz.rope_paged_attention`` checks its attention here)."""
    check_tensor(op, "q", q, 3)
    lay = parse_layout(op, kv_layout)
    nb, bs, hkv, dk = check_cache(op, kv_cache, lay)
    quant = kv_cache.dtype in KV_QUANT_DTYPES
    check_same(op, "q", q, "kv_cache", kv_cache, dtype=not quant)
    ks, vs = (
        check_kv_scale(op, "k_scale", k_scale, kv_cache),
        check_kv_scale(op, "v_scale", v_scale, kv_cache),
    )
    num_tokens, hq, d = q.shape
    if hq == 0 or d == 0:
        raise fail(op, "q shape", "[num_tokens, Hq, D] with Hq, D >= 1", list(q.shape))
    if dk != d:
        raise fail(
            op,
            "kv_cache head_dim",
            f"q's head_dim D={d}",
            f"{dk} (kv_cache shape {list(kv_cache.shape)}, {lay.value})",
            "Check kv_layout and the cache's head_dim.",
        )
    if hq % hkv:
        raise fail(
            op,
            "heads",
            "Hq divisible by Hkv (GQA/MQA)",
            f"Hq={hq}, Hkv={hkv}",
            "Check kv_layout: NHD is [num_blocks, 2, block_size, Hkv, D], HND [num_blocks, 2, Hkv, "
            "block_size, D].",
        )
    check_index(op, "block_tables", block_tables, 2, q.device)
    check_index(op, "seq_lens", seq_lens, 1, q.device)
    batch, max_blocks = block_tables.shape
    if seq_lens.shape[0] != batch:
        raise fail(op, "seq_lens shape", f"[batch] = [{batch}] (rows of block_tables)", list(seq_lens.shape))
    decode = cu_seqlens_q is None
    if decode:
        if num_tokens != batch:
            raise fail(
                op,
                "num_tokens (decode)",
                f"one query token per sequence: q.shape[0] == batch = {batch}",
                num_tokens,
                "For prefill/append pass cu_seqlens_q [batch + 1] (int32 prefix sums of q_lens).",
            )
    else:
        check_index(op, "cu_seqlens_q", cu_seqlens_q, 1, q.device)
        if cu_seqlens_q.shape[0] != batch + 1:
            raise fail(
                op,
                "cu_seqlens_q shape",
                f"[batch + 1] = [{batch + 1}] (rows of block_tables + 1)",
                list(cu_seqlens_q.shape),
            )
    if is_causal is not True and is_causal is not False:
        raise fail(op, "is_causal", "a bool", repr(is_causal))
    _check_token_bounds(num_tokens, batch, max_blocks, nb, bs, is_causal, op)
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise fail(op, "scale", "None (1/sqrt(D)) or a finite float > 0", repr(scale))
    if check_values(seq_lens):
        _check_paged_values(block_tables, seq_lens, cu_seqlens_q, num_tokens, nb, bs, is_causal, op)
    grad, det, capture, stride = flags(q, kv_cache, block_tables, seq_lens, cu_seqlens_q)
    key = PagedKey(
        op,
        q.device,
        q.dtype,
        bucket(batch),
        bucket(num_tokens),
        bucket(max_blocks),
        hq,
        hkv,
        d,
        bs,
        lay,
        decode,
        is_causal,
        scale is None,
        kv_cache.dtype if quant else None,
        stride,
        grad,
        det,
        capture,
        scope_token(),
    )
    args = (q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, lay)
    return key, (args + (ks, vs) if quant else args)
