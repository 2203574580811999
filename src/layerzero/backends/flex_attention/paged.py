"""``flex_attention.paged_attention``: ``lz.paged_attention`` on FlexAttention block masks, without gathering
KV per sequence.

Idea (the same as PyTorch's experimental ``torch/nn/attention/experimental/_paged_attention.py``, written here
for LayerZero's canonical paged arguments; FlexAttention: He et al. 2024, arXiv:2412.05496; paging: vLLM
PagedAttention, Kwon et al. 2023): the physical cache is one long KV sequence of ``N * P`` slots (slot ``x`` =
block ``x // P``, offset ``x % P``); every query token of the batch is one row of a single flex call (batch 1,
``[1, Hq, T, D]``), and a ``mask_mod(b, h, q_idx, kv_idx)`` decides which physical slots a query sees:

- ``s = seq_of_q[q_idx]`` (the query's sequence), ``page = kv_idx // P``;
- ``logical = inverse[s, page]``: the index of ``page`` in sequence ``s``'s block table, or -1 when the page
  is not one of its *used* blocks (the inverse page table ``[B, N]`` is built with torch ops each call, from
  the first ``ceil(seq_len / P)`` entries of each row only, so garbage ids in the unused entries are never
  read);
- ``pos = logical * P + kv_idx % P`` (the key's position in its sequence), allowed iff ``logical >= 0``,
  ``pos < seq_len[s]`` and, when ``is_causal``, ``pos <= q_pos[q_idx]`` (the query's absolute position
  ``seq_len - q_len + i``: bottom-right alignment, as the op defines it).

GQA runs through ``enable_gqa``; ``scale`` is passed through (default ``1/sqrt(D)``).

Costs per call (why this kernel is opt-in, priority -1):

- **One explicit copy of the cache**: ``2 * N * P * Hkv * D * itemsize`` bytes written (the whole cache, not
  only the used slots). Two reasons: (1) a zero-copy ``[1, Hkv, N*P, D]`` view does not exist for either
  layout, because K and V interleave at dim 1 (``stride(N) = 2 * P * stride(P)``: the block and offset dims
  cannot be merged); (2) FlexAttention multiplies the masked probabilities (exactly 0) by V, so a NaN in any
  unused slot that shares a tile with used ones would leak (``0 * NaN = NaN``; checked with torch 2.13's eager
  flex). The copy is a single ``torch.where(slot_used, cache, 0)`` pass into a ``[2, Hkv, N, P, D]`` buffer:
  unused slots become 0, used ones are copied bit for bit.
- **One block mask per call** (CUDA: ``create_block_mask`` over ``T x N*P``, ``O(T * N * P)`` mask_mod
  evaluations and bools, ``BLOCK_SIZE`` 128, a multiple of every power-of-two page size up to 128; CPU: a
  dense all-tiles structure, since eager flex ignores the structure anyway) plus the index tensors
  ``inverse [B, N]`` (int64), ``seq_of_q``/``q_pos`` ``[T]``, ``slot_used [N * P]``. Block masks are not
  cached: they depend on the index *values*, not only on shapes.
- CPU eager flex is dense (``T x N*P`` scores per head); CUDA runs ``torch.compile(flex_attention)``, which
  compiles again for each new ``(T, N*P)`` shape (run ``lz.warmup``) and is not CUDA-graph safe.

Limitation: a sequence must not list the same block twice among its used blocks (no allocator does); this is
checked on CPU tensors (InvalidInputError) and undefined on CUDA (the check would cost a device sync).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.errors import InvalidInputError, expected_got
from layerzero.core.kv_layout import KV_LAYOUTS, cache_dims, nhd_view
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

from .kernels import CPU_DTYPES, CUDA_DTYPES, CUDA_HEAD_DIM_MAX, CUDA_HEAD_DIM_MIN, LazyFlex, missing

log = logging.getLogger("layerzero.backends.flex_attention")
R = ReasonCode

PAGED_KERNEL = "flex_attention.paged_attention"
PAGED_PRIORITY = -1
"""Opt-in (``lz.lock`` / ``lz.prefer`` / ``lz.tune``): on CPU eager flex is dense over every slot of the cache
(measured 23 ms against 1.3 ms for ``torch_sdpa.paged_attention`` and 1.4 ms for the reference: decode, B=8,
Hq=8, Hkv=2, D=64, P=16, N=64, torch 2.13, 1 thread), and compiled flex on the H200 image failed to lower for
some shapes (see ``kernels.PRIORITY``)."""
KV_BLOCK_SIZE = 128
"""FlexAttention block size (tokens) of the per-call block mask; 128 is flex's default and a multiple of every
power-of-two page size up to 128, so a block never splits a page. Other page sizes stay correct (the mask_mod
is exact per slot); only fewer tiles are skipped."""


def _bad(what: str, expected: Any, got: Any, fix: str | None = None) -> InvalidInputError:
    return InvalidInputError(expected_got(f"flex_attention.paged_attention: {what}", expected, got, fix))


def paged_index(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    check_duplicates: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The index tensors of one paged call, built with torch ops on the tables' device (no host sync unless
    ``check_duplicates``).

    Args:
        block_tables: ``[B, M]`` int32 block ids; only the first ``ceil(seq_lens[s] / P)`` of row s are read.
        seq_lens: ``[B]`` int32 KV lengths in tokens (new tokens included).
        cu_seqlens_q: ``[B + 1]`` int32 query prefix sums, or None (decode: one query per sequence).
        num_tokens: T, query tokens in the batch.
        num_blocks: N, blocks in the cache; block_size: P, tokens per block.
        check_duplicates: raise when a sequence lists a block twice among its used blocks (reads a value on
            the host: a sync on CUDA).

    Returns:
        ``(inverse [B, N] int64, seq_of_q [T] int64, q_pos [T] int64, slot_used [N * P] bool)``: ``inverse[s,
        n]`` is the logical index of block n in sequence s (-1: not one of its used blocks); ``seq_of_q[t]``
        the sequence of query t; ``q_pos[t]`` its absolute position ``seq_len - q_len + i``; ``slot_used[x]``
        whether any sequence reads physical slot x.

    Raises:
        InvalidInputError: ``check_duplicates`` and a sequence uses the same block id twice.
    """
    device = block_tables.device
    batch, max_blocks = block_tables.shape
    lens = seq_lens.long()
    cols = torch.arange(max_blocks, device=device)
    used = cols[None, :] * block_size < lens[:, None]  # [B, M]
    ids = torch.where(used, block_tables.long(), num_blocks)  # unused -> dump column N
    inverse = torch.full((batch, num_blocks + 1), -1, dtype=torch.long, device=device)
    inverse.scatter_(1, ids, cols.expand(batch, max_blocks).contiguous())
    if check_duplicates and batch:
        counts = torch.zeros(batch, num_blocks + 1, dtype=torch.long, device=device)
        counts.scatter_add_(1, ids, torch.ones_like(ids))
        dup = counts[:, :num_blocks] > 1
        if bool(dup.any()):
            s, n = (int(x) for x in dup.nonzero()[0])
            raise _bad(
                f"block_tables row {s}",
                "distinct block ids among a sequence's used blocks",
                f"block {n} listed {int(counts[s, n])} times",
                "Fix the block allocator, or use another paged kernel (lz.unlock).",
            )
    inverse = inverse[:, :num_blocks]
    if cu_seqlens_q is None:
        seq_of_q = torch.arange(batch, device=device)
        q_pos = lens - 1
    else:
        cu = cu_seqlens_q.long()
        seq_of_q = torch.repeat_interleave(
            torch.arange(batch, device=device), cu[1:] - cu[:-1], output_size=num_tokens
        )
        q_pos = lens[seq_of_q] - cu[seq_of_q + 1] + torch.arange(num_tokens, device=device)
    offsets = torch.arange(block_size, device=device)
    pos = inverse[:, :, None] * block_size + offsets  # [B, N, P]
    slot_used = ((inverse[:, :, None] >= 0) & (pos < lens[:, None, None])).any(0).reshape(-1)
    return inverse, seq_of_q, q_pos, slot_used


def paged_mask_mod(
    inverse: torch.Tensor,
    seq_of_q: torch.Tensor,
    q_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    is_causal: bool,
) -> Callable[..., Any]:
    """The FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` of a paged call (tensors from
    :func:`paged_index`; ``kv_idx`` is a physical slot ``block * P + offset``): True iff the slot's block is
    one of the query's sequence's used blocks, the slot's logical position is ``< seq_len`` and, when
    ``is_causal``, ``<=`` the query's absolute position (bottom-right causal)."""
    lens = seq_lens.long()

    def mask_mod(b, h, q_idx, kv_idx):
        s = seq_of_q[q_idx]
        logical = inverse[s, kv_idx // block_size]
        pos = logical * block_size + kv_idx % block_size
        ok = (logical >= 0) & (pos < lens[s])
        return ok & (pos <= q_pos[q_idx]) if is_causal else ok

    return mask_mod


class FlexPagedAttention(LazyFlex):
    """The canonical ``lz.paged_attention`` kernel on FlexAttention: ``(q, kv_cache, block_tables, seq_lens,
    cu_seqlens_q, scale, is_causal, kv_layout)`` with q ``[T, Hq, D]``, kv_cache ``[N, 2, P, Hkv,
    D]`` (NHD) or ``[N, 2, Hkv, P, D]`` (HND), block_tables ``[B,
    M]`` int32, seq_lens ``[B]`` int32, cu_seqlens_q ``[B + 1]`` int32 or None (decode) -> ``[T, Hq, D]`` in
    q's dtype (a fresh tensor). Semantics and costs: see the module docstring.

    ``compiled=True`` (CUDA) calls ``torch.compile(flex_attention)`` (built lazily once per instance,
    thread-safe); ``False`` (CPU) calls ``eager`` (the dynamo-free :func:`~.kernels.direct_eager`) or public
    eager flex.

    Raises:
        InvalidInputError: a sequence lists the same block twice among its used blocks (checked on CPU only).
    """

    def __init__(
        self,
        flex_attention: Callable[..., Any],
        create_block_mask: Callable[..., Any],
        block_mask_cls: Any,
        *,
        compiled: bool,
        eager: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__(flex_attention, eager, compiled, PAGED_KERNEL)
        self._create = create_block_mask
        self._block_mask_cls = block_mask_cls
        self.__name__ = "flex_paged_attention_compiled" if compiled else "flex_paged_attention_eager"

    def block_mask(
        self, mask_mod: Callable[..., Any], num_tokens: int, num_slots: int, device: torch.device
    ) -> Any:
        """The BlockMask of one call (``num_tokens`` query rows x ``num_slots`` = N * P cache slots).

        Compiled (CUDA): ``create_block_mask`` evaluates ``mask_mod`` on the device (``O(T * N * P)``) so the
        kernel skips the tiles no query of a row block may see (other sequences' pages, unused pages). Eager
        (CPU): a *dense* structure with every tile partial, built without evaluating ``mask_mod`` (torch's
        eager flex is a dense implementation that applies ``mask_mod`` to every score and ignores the tile
        structure, so building the real one would only add ~60% to the call, measured on the correctness
        cases).
        """
        if self.compiled:
            return self._create(
                mask_mod, None, None, num_tokens, num_slots, device=device, BLOCK_SIZE=KV_BLOCK_SIZE
            )
        rows, cols = -(-num_tokens // KV_BLOCK_SIZE), -(-num_slots // KV_BLOCK_SIZE)
        num = torch.full((1, 1, rows), cols, dtype=torch.int32, device=device)
        idx = torch.arange(cols, dtype=torch.int32, device=device).expand(1, 1, rows, cols).contiguous()
        return self._block_mask_cls.from_kv_blocks(
            num, idx, None, None, KV_BLOCK_SIZE, mask_mod, (num_tokens, num_slots)
        )

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor | None,
        scale: float | None,
        is_causal: bool,
        kv_layout: Any,
    ) -> torch.Tensor:
        num_tokens, hq, d = q.shape
        nb, p, hkv, _ = cache_dims(kv_cache, kv_layout)
        if num_tokens == 0:
            return q.new_empty(0, hq, d)
        if q.device.type == "cpu" and not torch.is_grad_enabled():
            q, kv_cache = (
                q.detach(),
                kv_cache.detach(),
            )  # CPU flex refuses inputs that merely have requires_grad
        inverse, seq_of_q, q_pos, slot_used = paged_index(
            block_tables, seq_lens, cu_seqlens_q, num_tokens, nb, p, check_duplicates=q.device.type == "cpu"
        )
        # The one copy: [2, Hkv, N, P, D] with unused slots zeroed (see the module docstring for why).
        src = nhd_view(kv_cache, kv_layout).permute(1, 3, 0, 2, 4)  # [2, Hkv, N, P, D] view
        kv = torch.empty((2, hkv, nb, p, d), dtype=kv_cache.dtype, device=kv_cache.device)
        torch.where(
            slot_used.view(1, 1, nb, p, 1), src, torch.zeros((), dtype=kv.dtype, device=kv.device), out=kv
        )
        k = kv[0].reshape(1, hkv, nb * p, d)
        v = kv[1].reshape(1, hkv, nb * p, d)
        mask_mod = paged_mask_mod(inverse, seq_of_q, q_pos, seq_lens, p, is_causal)
        block_mask = self.block_mask(mask_mod, num_tokens, nb * p, q.device)
        qb = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        if self.compiled:
            qb = qb.contiguous()  # the compiled (Triton) kernel wants stride(-1) == 1; q is small
        out = self.function()(
            qb,
            k,
            v,
            block_mask=block_mask,
            scale=1.0 / math.sqrt(d) if scale is None else scale,
            enable_gqa=hq != hkv,
        )
        return out[0].transpose(0, 1).contiguous()


def _check(ctx: SelectionContext) -> list[Reason]:
    """Per-device rules one KernelSpec cannot hold as data (its ``sm_min`` applies to CUDA only): on CUDA no
    float64, head dims in [16, 256] (Triton ``tl.dot``; as ``flex_attention.compiled``) and in float32 <= 128
    (compiled flex's shared memory on the H200); everywhere a known paged layout and a page size >= 1."""
    out = []
    if ctx.device.device_type == "cuda":
        d = max(ctx.head_dim or 0, ctx.head_dim_v or 0)
        if ctx.dtype not in CUDA_DTYPES:
            out.append(
                Reason(R.DTYPE_UNSUPPORTED, f"compiled flex on CUDA supports fp32/fp16/bf16, got {ctx.dtype}")
            )
        if d < CUDA_HEAD_DIM_MIN:
            out.append(
                Reason(
                    R.HEAD_DIM_INVALID,
                    f"compiled flex needs head_dim >= {CUDA_HEAD_DIM_MIN} (Triton tl.dot), got {d}",
                )
            )
        elif d > CUDA_HEAD_DIM_MAX:
            out.append(
                Reason(
                    R.HEAD_DIM_TOO_LARGE, f"compiled flex supports head_dim <= {CUDA_HEAD_DIM_MAX}, got {d}"
                )
            )
        elif ctx.dtype == torch.float32 and d > 128:
            out.append(
                Reason(
                    R.HEAD_DIM_TOO_LARGE, "compiled flex in float32 supports head_dim <= 128 (shared memory)"
                )
            )
    if ctx.kv_layout not in KV_LAYOUTS:
        out.append(Reason(R.KV_LAYOUT_UNSUPPORTED, f"kv_layout {ctx.kv_layout!r} is not NHD or HND"))
    if ctx.page_size is not None and ctx.page_size < 1:
        out.append(Reason(R.SHAPE_MISMATCH, f"page size {ctx.page_size} < 1"))
    return out


def paged_kernel_spec(cpu_fn: Callable[..., Any], cuda_fn: Callable[..., Any]) -> KernelSpec:
    """The KernelSpec ``flex_attention.paged_attention`` (op ``paged_attention``): CPU eager
    (fp32/fp64/fp16/bf16, any head dim) and CUDA compiled (SM 8.0+, fp32/fp16/bf16, head dims 16-256, fp32 <=
    128, stride(-1) == 1); NHD and HND, any page size, GQA, decode and prefill/append; priority -1 (opt-in),
    not graph-safe, deterministic, no backward. Selection picks the device's callable: ``cpu_fn`` /
    ``cuda_fn`` are :class:`FlexPagedAttention` instances (or ``kernels.missing`` stubs when FlexAttention is
    unavailable)."""

    def route(*args: Any) -> Any:
        return (cuda_fn if args[0].device.type == "cuda" else cpu_fn)(*args)

    route.__name__ = "flex_paged_attention"
    return KernelSpec(
        PAGED_KERNEL,
        "paged_attention",
        route,
        priority=PAGED_PRIORITY,
        description="FlexAttention over the whole paged cache as one KV sequence: per-call block mask from "
        "an inverse page table (no per-sequence gather; one sanitizing copy of the cache), eager on CPU, "
        "torch.compile on CUDA SM 8.0+ (head dims 16-256); NHD/HND, any page size, GQA",
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=CPU_DTYPES | CUDA_DTYPES,
        sm_min=(8, 0),
        supports_backward=False,
        supports_dropout=False,
        deterministic=True,
        graph_safe=False,
        check=_check,
    )


def paged_spec(
    api: tuple[Callable[..., Any], Callable[..., Any], Any] | None, eager: Callable[..., Any] | None, why: str
) -> KernelSpec:
    """The ``flex_attention.paged_attention`` KernelSpec for a probe's result: ``api`` is ``(flex_attention,
    create_block_mask, BlockMask)`` or None when FlexAttention is unavailable (then both callables raise
    ``BackendNotAvailableError`` with ``why``); ``eager`` the dynamo-free eager call or None."""
    if api is None:
        cpu_fn = cuda_fn = missing(why)
    else:
        flex, create, block_mask_cls = api
        cpu_fn = FlexPagedAttention(flex, create, block_mask_cls, compiled=False, eager=eager)
        cuda_fn = FlexPagedAttention(flex, create, block_mask_cls, compiled=True)
    return paged_kernel_spec(cpu_fn, cuda_fn)
