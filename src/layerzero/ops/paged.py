"""``lz.paged_attention`` and ``lz.reshape_and_cache``: attention over a paged KV cache (the serving op).

Follows vLLM's PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention") and its ``reshape_and_cache`` / FlashInfer's paged KV conventions; the cache layouts
(``KVLayout``, ``cache_dims``) live in :mod:`layerzero.core.kv_layout`, :func:`allocate_kv_cache` and the
shared cache checks in :mod:`layerzero.ops.kv_cache`. See docs/paged_attention.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core import config as _config
from layerzero.core.context import SelectionContext, bucket
from layerzero.core.dispatch import MISS
from layerzero.core.kv_quant import KV_QUANT_DTYPES
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import (
    check_same,
    check_tensor,
    deterministic_enabled,
    device_spec,
    fail,
    flags,
    inference_only,
    is_grad_enabled,
    scope_layers,
    scope_token,
    scope_token_of,
    stream_capturing,
)
from .kv_cache import (
    KVLayout,
    check_cache,
    check_index,
    check_kv_scale,
    check_values,
    parse_layout,
)
from .reshape_and_cache import CACHE_OP, CACHE_SPEC, CacheKey, context_cache, prepare_cache, reshape_and_cache  # noqa: F401

_TENSOR = torch.Tensor
_LAYOUTS = {"NHD": KVLayout.NHD, "HND": KVLayout.HND, KVLayout.NHD: KVLayout.NHD, KVLayout.HND: KVLayout.HND}

OP = "paged_attention"
LSE_OP = "paged_attention_lse"


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


# ------------------------------------------------------------------------------------------ paged_attention
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
    if num_tokens > batch * cap:
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


def context(key: PagedKey) -> SelectionContext:
    """The :class:`SelectionContext` of a paged_attention key: ``seq_len_q`` is 1 for decode (phase DECODE),
    else the num_tokens bucket (an upper bound of every q_len), at least 2: a call with ``cu_seqlens_q`` is
    never phase DECODE, even with one query token (decode-only kernels ignore cu_seqlens_q; cascade
    attention's shared level at batch 1 is such a call); ``seq_len_kv`` is ``bucket(max_blocks) * block_size``
    (an upper bound of every seq_len); ``kv_layout``, ``page_size`` (= block_size) and ``stride_last_1``
    exact."""
    return SelectionContext(
        op=OP,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.batch,
        num_heads_q=key.num_heads_q,
        num_heads_kv=key.num_heads_kv,
        head_dim=key.head_dim,
        head_dim_v=key.head_dim,
        seq_len_q=1 if key.decode else max(2, key.num_tokens),
        seq_len_kv=key.max_blocks * key.page_size,
        seq_equal=False,
        is_causal=key.is_causal,
        scale_default=key.scale_default,
        stride_last_1=key.stride_last_1,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
        kv_layout=key.kv_layout.value,
        page_size=key.page_size,
        kv_dtype=key.kv_dtype,
    )


SHIPPED_TIE_MARGIN = 0.10
"""Shipped paged-attention timings within 10% of a bucket's fastest count as tied (``OperationSpec``): the key
holds the block-table width (the longest sequence), not the lengths, which stay on the device (reading them
would synchronize). The grid measured uniform and narrow length spreads; on a skewed batch the kernels' order
can flip inside one bucket: on the H200, ``triton.paged_decode`` 6% faster than FlashInfer at the grid point
(B4, width 8192, D256) was 16% slower at B3 with lognormal lengths around 5000. FlashInfer's plan balances
work over the real lengths; the margin lets its priority decide near-ties. (Dense attention's key holds the
exact shape up to the power-of-two buckets; a margin there flipped an H100 decode shape to 0.895:
``benchmarks/replay_hidden.py``.)"""

SPEC = OperationSpec(
    OP,
    "attention over a paged KV cache (decode and prefill/append, GQA, bottom-right causal)",
    ("q", "kv_cache", "block_tables", "seq_lens"),
    "reference.paged_attention",
    shipped_tie_margin=SHIPPED_TIE_MARGIN,
)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = True,
    kv_layout: str = "NHD",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of new query tokens over a paged KV cache (vLLM PagedAttention, Kwon et al. 2023;
    FlashInfer's batch decode/prefill with paged KV), dispatched to the fastest eligible kernel.

    Shapes (T = num_tokens, B = batch, Hq/Hkv heads, D head dim, N = num_blocks, P = block_size in tokens,
    M = max_blocks per sequence):

    - q ``[T, Hq, D]``: the new tokens of every sequence, concatenated in sequence order.
    - kv_cache ``[N, 2, P, Hkv, D]`` (``kv_layout="NHD"``) or ``[N, 2, Hkv, P, D]`` (``"HND"``), K at index 0
      and V at 1 of dim 1, q's dtype and device (see :func:`lz.allocate_kv_cache`). The new tokens' K/V must
      already be written (:func:`lz.reshape_and_cache`).
    - block_tables ``[B, M]`` int32: sequence s's token t is at block ``block_tables[s, t // P]``, offset
      ``t % P``. Only the first ``ceil(seq_lens[s] / P)`` entries of a row are read (the rest may be padding).
    - seq_lens ``[B]`` int32: KV length of each sequence in tokens, INCLUDING the new tokens; ``<= M * P``.
    - cu_seqlens_q: None for decode (one query token per sequence, ``T == B``), else ``[B + 1]`` int32 prefix
      sums of the q_lens (``cu[0] == 0``, non-decreasing, ``cu[-1] == T``, ``q_len <= seq_len`` per sequence
      when causal). A sequence may be empty (q_len 0, seq_len 0); with ``is_causal=False`` it may have query
      tokens and no keys (seq_len 0: those rows are 0, and their lse -inf).

    ``is_causal``: aligned BOTTOM-RIGHT to each sequence's KV: query i of a sequence with q_len new tokens and
    kv_len keys attends keys ``j <= kv_len - q_len + i`` (decode sees every key). ``scale``: default
    ``1/sqrt(D)``. GQA/MQA: ``Hq % Hkv == 0``; KV head h serves query heads ``h*Hq/Hkv ... (h+1)*Hq/Hkv - 1``.
    Returns ``[T, Hq, D]`` in q's dtype (fresh tensor). Values in cache slots that no sequence uses (other
    blocks, the tail of a last block) never reach the output, even NaN.

    Quantized cache (vLLM ``kv_cache_dtype="fp8"``): a ``torch.float8_e4m3fn`` or ``torch.int8`` cache holds
    codes; keys are read as ``codes.float() * k_scale`` and values as ``codes.float() * v_scale`` (per-tensor
    scales: a finite float > 0 or a 0-d/1-element float32 tensor on the cache's device; None = 1.0, vLLM's
    default). q may be any float dtype; the output has q's dtype. Only kernels that declare the cache dtype
    run (the others are refused with ``KV_CACHE_DTYPE_UNSUPPORTED``). Scales with an unquantized cache raise.

    ``return_lse=True`` (cascade attention, see :func:`lz.merge_attention_states
    <layerzero.merge_attention_states>`) returns ``(out, lse)``: lse ``[T, Hq]`` float32 is each row's
    natural-log sum of ``exp(scale * q·k)`` over the keys it attends (-inf, with an output row of 0, where it
    attends none: e.g. ``is_causal=False`` never masks, so only a zero-length sequence has such rows). It
    dispatches as op ``paged_attention_lse``, whose kernels declare the lse
    (``lz.explain("paged_attention_lse", ...)``); the inputs are checked as here.

    Index values (seq_lens, cu_seqlens_q, used block ids) are checked on CPU tensors always; on CUDA only when
    ``lz.get_config().strict`` is True, because reading them costs a device sync (out-of-range ids on CUDA
    without strict mode are undefined behaviour, as in vLLM).

    Raises:
        InvalidInputError: ranks/shapes per layout, dtypes (q and cache float and equal; index tensors int32
            on q's device), ``Hq % Hkv != 0``, head_dim mismatch, unknown ``kv_layout``, bad
            ``scale``/``is_causal``, B disagreeing between block_tables, seq_lens and cu_seqlens_q, ``T != B``
            for decode, ``T > B * M * P`` (so any query token with ``B == 0`` or ``M == 0``), query tokens
            with an empty (``N == 0``) cache (these from shapes only, on every device), and (see above)
            seq_lens outside ``[0, M * P]``, non-monotonic or inconsistent cu_seqlens_q, ``q_len > seq_len``,
            used block ids outside ``[0, N)``.
        NoKernelFoundError: a lock names a kernel that cannot run these inputs (e.g. during CUDA graph
            capture).

    >>> import torch, layerzero as lz
    >>> cache = lz.allocate_kv_cache(4, 16, 2, 64, torch.float32)
    >>> q = torch.randn(3, 8, 64)                                    # decode: 3 sequences, 1 token each
    >>> bt = torch.tensor([[0, 1], [2, 0], [3, 0]], dtype=torch.int32)
    >>> lens = torch.tensor([20, 5, 1], dtype=torch.int32)
    >>> lz.paged_attention(q, cache, bt, lens).shape
    torch.Size([3, 8, 64])
    """
    if return_lse is not False:
        if return_lse is not True:
            raise fail(OP, "return_lse", "a bool", repr(return_lse))
        return paged_attention_lse(
            q,
            kv_cache,
            block_tables,
            seq_lens,
            cu_seqlens_q=cu_seqlens_q,
            scale=scale,
            is_causal=is_causal,
            kv_layout=kv_layout,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    if (
        (is_dynamo_compiling() or is_exporting())
        and k_scale is None
        and v_scale is None
        and inference_only(q, kv_cache)
    ):  # torch.compile, torch.export: one custom-op node (layerzero/custom_ops/_ops.py)
        return traced("paged_attention")(
            q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout
        )
    return run(
        OP,
        prepare,
        context,
        q,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        is_causal,
        kv_layout,
        k_scale,
        v_scale,
    )


def run(
    op: str,
    prepare_fn: Any,
    context_fn: Any,
    q: Any,
    kv_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    cu: Any,
    scale: Any,
    is_causal: Any,
    kv_layout: Any,
    k_scale: Any,
    v_scale: Any,
) -> Any:
    """Dispatch a paged-attention call of ``op`` (``paged_attention`` or ``paged_attention_lse``): the hot
    path on an exact-key hit (:func:`_hot_key` of ``op``), else ``prepare_fn`` (full checks) and the runtime's
    selection with ``context_fn``."""
    hot_key = _hot_key(
        q, kv_cache, block_tables, seq_lens, cu, scale, is_causal, kv_layout, k_scale, v_scale, op=op
    )
    if hot_key is not None:
        args = (q, kv_cache, block_tables, seq_lens, cu, scale, is_causal, _LAYOUTS[kv_layout])
        if hot_key[-1] is not None:  # quantized cache: the scales (None -> 1.0) close the canonical args
            args += (1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale)
        out = RUNTIME.run_hot(hot_key, args)
        if out is not MISS:
            return out
    key, args = prepare_fn(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q=cu,
        scale=scale,
        is_causal=is_causal,
        kv_layout=kv_layout,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return RUNTIME.run(key, context_fn, args, hot_key)


def _scale_kind(s: Any, device: torch.device) -> str | None:
    """What a quantized cache's scale is, for the hot key: ``"none"``, ``"float"`` (a finite float > 0:
    checked here, its value is not keyed) or ``"tensor"`` (float32, one element, on ``device``; its value is
    checked as :func:`check_values` says); None for anything else (the full checks then run and raise)."""
    if s is None:
        return "none"
    if s.__class__ is float:
        return "float" if 0.0 < s < math.inf else None
    if (
        s.__class__ is _TENSOR
        and s.dtype is torch.float32
        and s.numel() == 1
        and s.dim() <= 1
        and s.device == device
    ):
        return "tensor"
    return None


def _hot_key(
    q: Any,
    kv_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    cu: Any,
    scale: Any,
    is_causal: Any,
    kv_layout: Any,
    k_scale: Any = None,
    v_scale: Any = None,
    *,
    op: str = OP,
) -> tuple[Any, ...] | None:
    """The exact key of a non-CPU call for ``Runtime.run_hot`` (as ``lz.attention``'s): every fact
    :func:`prepare` checks and the key depends on (exact shapes, dtypes, the devices equal, strides, flags,
    scale and layout as passed), so a hit proves a call with these facts passed the checks before, and skips
    them (measured on an H200 host: 62 µs per eager call locked to ``triton.paged_decode`` against 38 µs for
    the kernel alone). None (full checks every call) for CPU tensors and in strict mode, where index *values*
    are checked on every call (:func:`check_values`), and for anything but plain tensors, a bool
    ``is_causal``, a float or None ``scale``. The last item is None for an unquantized cache, else ``(cache
    dtype, k_scale kind, v_scale kind)`` (:func:`_scale_kind`: presence and type, never the value)."""
    if not (
        q.__class__ is _TENSOR
        and kv_cache.__class__ is _TENSOR
        and block_tables.__class__ is _TENSOR
        and seq_lens.__class__ is _TENSOR
        and (cu is None or cu.__class__ is _TENSOR)
        and (is_causal is True or is_causal is False)
        and (scale is None or scale.__class__ is float)
        and (kv_layout.__class__ is str or kv_layout.__class__ is KVLayout)
        and kv_layout in _LAYOUTS
    ):
        return None
    device = q.device
    if device.type == "cpu" or _config.get_config().strict:
        return None
    dtype = q.dtype
    if (
        kv_cache.device != device
        or block_tables.device != device
        or seq_lens.device != device
        or (cu is not None and cu.device != device)
    ):
        return None
    quant = None
    if kv_cache.dtype is not dtype:
        if kv_cache.dtype not in KV_QUANT_DTYPES:
            return None
        quant = (kv_cache.dtype, _scale_kind(k_scale, device), _scale_kind(v_scale, device))
        if quant[1] is None or quant[2] is None:
            return None
    elif k_scale is not None or v_scale is not None:
        return None
    tensors = (
        (q, kv_cache, block_tables, seq_lens) if cu is None else (q, kv_cache, block_tables, seq_lens, cu)
    )
    layers = scope_layers()
    return (
        op,
        device,
        dtype,
        q.shape,
        kv_cache.shape,
        block_tables.shape,
        block_tables.dtype,
        seq_lens.shape,
        seq_lens.dtype,
        None if cu is None else (cu.shape, cu.dtype),
        scale,
        is_causal,
        kv_layout,
        all(t.stride(-1) == 1 for t in tensors),
        is_grad_enabled() and any(t.requires_grad for t in tensors),
        deterministic_enabled(),
        q.is_cuda and stream_capturing(),
        scope_token_of(layers) if layers else (),
        quant,
    )


# ------------------------------------------------------------------------------------- paged_attention_lse
def prepare_lse(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, **kwargs: Any
) -> tuple[PagedKey, tuple[Any, ...]]:
    """Validate as :func:`layerzero.ops.paged.prepare` (same arguments, same canonical kernel args); the key's
    op is ``paged_attention_lse``."""
    key, args = prepare(q, kv_cache, block_tables, seq_lens, **kwargs)
    return key._replace(op=LSE_OP), args


def context_lse(key: PagedKey) -> SelectionContext:
    """:func:`layerzero.ops.paged.context` with op ``paged_attention_lse``."""
    return dataclasses.replace(context(key), op=LSE_OP)


LSE_SPEC = OperationSpec(
    LSE_OP,
    "paged attention that also returns each row's log-sum-exp (cascade attention's levels)",
    ("q", "kv_cache", "block_tables", "seq_lens"),
    "reference.paged_attention_lse",
    shipped_tie_margin=SHIPPED_TIE_MARGIN,
)


def paged_attention_lse(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = True,
    kv_layout: str = "NHD",
    k_scale: Any = None,
    v_scale: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lz.paged_attention(..., return_lse=True)`` (documented there): ``(out [T, Hq, D] in q's dtype, lse
    [T, Hq] float32)``, lse the natural-log sum of ``exp(scale * q·k)`` over the keys each row attends (-inf,
    with out 0, for a row that attends none)."""
    if (
        (is_dynamo_compiling() or is_exporting())
        and k_scale is None
        and v_scale is None
        and inference_only(q, kv_cache)
    ):
        return traced("paged_attention_lse")(
            q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout
        )
    return run(
        LSE_OP,
        prepare_lse,
        context_lse,
        q,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        is_causal,
        kv_layout,
        k_scale,
        v_scale,
    )


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        paged_attention,
        prepare,
        context,
        kernel_args=(
            "q",
            "kv_cache",
            "block_tables",
            "seq_lens",
            "cu_seqlens_q",
            "scale",
            "is_causal",
            "layout",
        ),
        custom_ops=("paged_attention",),
    ),
    OpDef(
        LSE_SPEC,
        None,
        prepare_lse,
        context_lse,
        kernel_args=(
            "q",
            "kv_cache",
            "block_tables",
            "seq_lens",
            "cu_seqlens_q",
            "scale",
            "is_causal",
            "layout",
        ),
        custom_ops=("paged_attention_lse",),
    ),
)
