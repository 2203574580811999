"""FlashInfer (flashinfer-python 0.5.3) kernels: ``flashinfer.attention`` and ``flashinfer.paged_attention``.

Sources read (``flashinfer/decode.py``, ``prefill.py``, ``utils.py``, ``page.py``; C++
``csrc/batch_decode.cu``, ``batch_prefill.cu``, ``include/flashinfer/page.cuh``, ``utils.cuh``):

- ``BatchDecodeWithPagedKVCacheWrapper(float_workspace, kv_layout, use_tensor_cores=False)``;
  ``plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, ...,
  q_data_type, kv_data_type, sm_scale)``; ``run(q [B, Hq, D], paged_kv_cache) -> [B, Hq, D]``. The CUDA-core
  decode kernel is instantiated for GQA group sizes 1, 2, 3, 4, 8 only (``DISPATCH_GQA_GROUP_SIZE``); with
  ``use_tensor_cores=True`` decode runs the prefill kernel and takes any group size. We use tensor cores when
  Hq / Hkv > 4 (vLLM's rule: faster for large groups, and it covers every group size).
- ``BatchPrefillWithPagedKVCacheWrapper`` ``plan(qo_indptr, paged_kv_indptr, paged_kv_indices,
  paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=, sm_scale=,
  q_data_type=, kv_data_type=)``, ``run(q [T, Hq, D], paged_kv_cache) -> [T, Hq, D]``; causal is aligned
  bottom-right per request (exactly ``lz.paged_attention``'s contract).
- ``BatchPrefillWithRaggedKVCacheWrapper`` ``plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads,
  head_dim_qk, causal=, sm_scale=, q_data_type=, kv_data_type=)``, ``run(q [nnz_q, Hq, D], k, v [nnz_kv,
  Hkv, D])``: one launch for a whole batch (``single_prefill_with_kv_cache`` would be one launch per row).
- ``paged_kv_cache`` may be ONE 5-D tensor ``[num_pages, 2, P, Hkv, D]`` (NHD) / ``[num_pages, 2, Hkv, P,
  D]`` (HND), split with ``unbind(1)`` (``utils._unpack_paged_kv_cache``): LayerZero's cache layout, passed
  as is. The kernels read the cache through its strides (``paged_kv_t(..., kv_strides, ...)``), k and v
  strides must be equal.
- Head dims: the FA2 templates need ``head_dim % 64 == 0`` (``NUM_MMA_D_QK % 4``) and the SM90 (FA3) path,
  picked automatically on Hopper for fp16/bf16, is instantiated for 64/128/256: we claim {64, 128, 256}.
  fp16/bf16 (fp8 KV is not an lz dtype), SM 8.0+.
- ``plan()`` copies lengths to the host (a sync) and JIT-compiles the kernel on its first use for a new
  (dtype, head dim, ...) combination (~6 s): calling the kernel once, e.g. through ``lz.warmup`` or
  ``lz.tune``, compiles it. Neither kernel is CUDA-graph safe (``plan`` syncs; run-time layout checks).

``flashinfer.attention`` (dense ``lz.attention``, native layout BSHD; the op's adapter transposes BHSD views
and charges the transform): decode (Sq == 1) uses the batch decode wrapper with the dense KV viewed as pages
— k/v ``[B, Sk, Hkv, D]`` ARE an NHD paged cache of B pages of Sk tokens (indptr ``0..B``, indices ``0..B-1``,
last page length Sk), zero copy for BSHD and (through strides) for transposed BHSD views — one launch with
split-KV for long contexts, which single_decode (one request per call) cannot do for B > 1. Prefill (Sq > 1)
uses the ragged wrapper with ``qo_indptr = [0, Sq, 2 Sq, ...]``, ``kv_indptr = [0, Sk, ...]`` (q/k/v
reshaped to ``[B*S, H, D]``: a view for contiguous BSHD, a copy otherwise). No masks but causal, and causal
only for Sq == Sk (FlashInfer aligns it bottom-right, lz.attention top-left like SDPA:
``CAUSAL_SEQ_MISMATCH``); no dropout, no backward.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from layerzero.backends._optional import missing_kernel
from layerzero.core.context import SelectionContext
from layerzero.core.kv_layout import cache_dims, parse_kv_layout
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec, Layout, MaskKind

from .plan import DEFAULT_CAPACITY, PlanCache, PlanStats, paged_csr, tensor_identity

R = ReasonCode
HALF = frozenset({torch.float16, torch.bfloat16})
CUDA = frozenset({"cuda"})
HEAD_DIMS = (64, 128, 256)
"""Head dims FlashInfer 0.5.3 instantiates on every path we use (FA2 templates and the SM90 kernels)."""
SM_MIN = (8, 0)
TENSOR_CORE_GROUP = 4
"""Decode uses tensor cores when Hq / Hkv exceeds this (CUDA-core decode only has groups 1, 2, 3, 4, 8)."""
WORKSPACE_BYTES = 128 * 1024 * 1024
"""Float workspace per device (split-KV partial results), the size FlashInfer's examples use; allocated
once per device and shared by every wrapper (runs are stream ordered)."""
INT_WORKSPACE_BYTES = 8 * 1024 * 1024
"""FlashInfer's own int workspace per wrapper (plan metadata), plus as much pinned host memory."""
PRIORITY_PAGED = 60
"""Above triton.paged_decode (40) and torch_sdpa.paged_attention (10)."""
PRIORITY_ATTENTION = 55
"""Priority is one number per kernel (not per context): below SDPA's fused kernels (efficient 70, flash 80,
cuDNN 85) so dense prefill stays on them; ``lz.tune`` measures and promotes FlashInfer where it is faster
(decode at large batch, long KV)."""
LN2 = math.log(2.0)
"""FlashInfer's lse is base 2 (vLLM: ``is_lse_base_on_e=False``); ours is natural: multiply by ln 2."""
KERNEL_IDS = ("flashinfer.attention", "flashinfer.paged_attention", "flashinfer.paged_attention_lse")
INSTALL_HINT = "pip install flashinfer-python (needs a CUDA build of torch and nvcc for its JIT)"


def _head_dim_reasons(ctx: SelectionContext) -> list[Reason]:
    if ctx.head_dim is not None and ctx.head_dim not in HEAD_DIMS:
        return [
            Reason(
                R.HEAD_DIM_INVALID,
                f"FlashInfer kernels are instantiated for head_dim in {list(HEAD_DIMS)}, got {ctx.head_dim}",
            )
        ]
    return []


def attention_check(ctx: SelectionContext) -> list[Reason]:
    """What data cannot say for ``flashinfer.attention``: head dim in {64, 128, 256} and causal only with
    Sq == Sk (FlashInfer's causal mask is bottom-right aligned, lz.attention's top-left)."""
    out = _head_dim_reasons(ctx)
    if ctx.is_causal and not ctx.seq_equal:
        out.append(
            Reason(
                R.CAUSAL_SEQ_MISMATCH,
                "FlashInfer aligns the causal mask bottom-right when Sq != Sk (query i sees keys "
                "j <= i + Sk - Sq), lz.attention aligns it top-left like SDPA (j <= i); "
                "the results would differ",
            )
        )
    return out


def paged_check(ctx: SelectionContext) -> list[Reason]:
    """What data cannot say for ``flashinfer.paged_attention``: head dim in {64, 128, 256}."""
    return _head_dim_reasons(ctx)


def _workspace(ctx: SelectionContext) -> int:
    return WORKSPACE_BYTES + INT_WORKSPACE_BYTES


class FlashInferKernels:
    """The kernels of one ``flashinfer`` backend instance: FlashInfer's module, the float workspace per
    device and the :class:`PlanCache` (LRU of ``capacity`` planned wrappers, thread-safe).

    Args:
        module: the imported ``flashinfer`` module (or a stand-in with the same three wrapper classes).
        capacity: plans kept (default 8).
    """

    def __init__(self, module: Any, capacity: int = DEFAULT_CAPACITY) -> None:
        self.module = module
        self.plans = PlanCache(capacity)
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()

    def workspace(self, device: torch.device) -> torch.Tensor:
        """The 128 MiB uint8 float workspace of ``device`` (zero-initialized once, as FlashInfer requires)."""
        with self._lock:
            buf = self._workspaces.get(device)
            if buf is None:
                buf = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
                self._workspaces[device] = buf
            return buf

    def plan_stats(self) -> PlanStats:
        """Hits, misses, evictions and size of the plan cache."""
        return self.plans.stats()

    # ------------------------------------------------------------------------------------------ dense
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Any,
        is_causal: bool,
        scale: float | None,
        dropout_p: float,
    ) -> torch.Tensor:
        """Canonical attention kernel in BSHD: q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` (fp16/bf16, CUDA)
        -> ``[B, Sq, Hq, D]``. ``attn_mask`` must be None and ``dropout_p`` 0 (selection guarantees it).
        Decode (Sq == 1) through the batch decode wrapper over the KV viewed as B pages; prefill through the
        ragged batch prefill wrapper. Plans are cached by (B, Sq, Sk, heads, D, dtype, causal, scale)."""
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        dev, dtype = q.device, q.dtype
        fi = self.module
        if sq == 1:
            tc = hq // hkv > TENSOR_CORE_GROUP
            if k.stride() != v.stride():  # FlashInfer reads k and v of a paged cache with one set of strides
                k, v = k.contiguous(), v.contiguous()
            key = ("attention.decode", dev, b, sk, hq, hkv, d, dtype, scale, tc)

            def make() -> Any:
                return fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace(dev), "NHD", use_tensor_cores=tc)

            def plan(w: Any) -> None:
                w.plan(
                    torch.arange(b + 1, dtype=torch.int32),
                    torch.arange(b, dtype=torch.int32),
                    torch.full((b,), sk, dtype=torch.int32),
                    hq,
                    hkv,
                    d,
                    sk,
                    q_data_type=dtype,
                    kv_data_type=dtype,
                    sm_scale=scale,
                )

            out = self.plans.run(
                key, ("decode", dev, "NHD", tc), (), make, plan, lambda w: w.run(q[:, 0], (k, v))
            )
            return out.unsqueeze(1)
        key = ("attention.prefill", dev, b, sq, sk, hq, hkv, d, dtype, is_causal, scale)

        def make_ragged() -> Any:
            return fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace(dev), "NHD")

        def plan_ragged(w: Any) -> None:
            w.plan(
                torch.arange(b + 1, dtype=torch.int32) * sq,
                torch.arange(b + 1, dtype=torch.int32) * sk,
                hq,
                hkv,
                d,
                causal=is_causal,
                sm_scale=scale,
                q_data_type=dtype,
                kv_data_type=dtype,
            )

        qf, kf, vf = q.reshape(b * sq, hq, d), k.reshape(b * sk, hkv, d), v.reshape(b * sk, hkv, v.shape[-1])
        out = self.plans.run(key, ("ragged", dev), (), make_ragged, plan_ragged, lambda w: w.run(qf, kf, vf))
        return out.view(b, sq, hq, out.shape[-1])

    # ------------------------------------------------------------------------------------------ paged
    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor | None,
        scale: float | None,
        is_causal: bool,
        kv_layout: Any,
        return_lse: bool = False,
    ) -> Any:
        """Canonical ``lz.paged_attention`` kernel (see :func:`layerzero.ops.paged.paged_attention`): q
        ``[T, Hq, D]``, kv_cache ``[N, 2, P, Hkv, D]`` (NHD) / ``[N, 2, Hkv, P, D]`` (HND) passed to
        FlashInfer as is, block_tables ``[B, M]`` / seq_lens ``[B]`` converted to CSR (:func:`paged_csr`) once
        per plan. Decode (``cu_seqlens_q`` None) through the batch decode wrapper, prefill/append through the
        paged batch prefill wrapper (causal bottom-right per sequence). Returns ``[T, Hq, D]`` in q's dtype.

        The plan is cached by the metadata tensors' identities and versions plus heads, D, P, layout, dtype,
        causal and scale: every layer of a step after the first reuses it; an in-place update of
        block_tables / seq_lens / cu_seqlens_q or new tensors re-plan.

        ``return_lse`` (``flashinfer.paged_attention_lse``, see :meth:`paged_attention_lse`): also
        FlashInfer's log-sum-exp, which is base 2: returned as ``(out, lse * ln 2)``, float32 ``[T, Hq]``."""
        t, hq, d = q.shape
        if t == 0:
            out = q.new_empty(0, hq, d)
            return (out, q.new_empty(0, hq, dtype=torch.float32)) if return_lse else out
        lay = parse_kv_layout(kv_layout).value  # FlashInfer's kv_layout string
        _, p, hkv, _ = cache_dims(kv_cache, lay)
        dev, dtype = q.device, q.dtype
        fi = self.module
        decode = cu_seqlens_q is None
        tc = decode and hq // hkv > TENSOR_CORE_GROUP
        tensors = (block_tables, seq_lens, cu_seqlens_q)
        key = (
            "paged.decode" if decode else "paged.prefill",
            dev,
            lay,
            p,
            hq,
            hkv,
            d,
            dtype,
            bool(is_causal) and not decode,
            scale,
            tc,
            *(tensor_identity(x) for x in tensors),
        )
        if q.stride(-1) != 1:
            q = q.contiguous()
        if decode:

            def make() -> Any:
                return fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace(dev), lay, use_tensor_cores=tc)

            def plan(w: Any) -> None:
                indptr, indices, last = paged_csr(block_tables, seq_lens, p)
                w.plan(
                    indptr,
                    indices,
                    last,
                    hq,
                    hkv,
                    d,
                    p,
                    q_data_type=dtype,
                    kv_data_type=dtype,
                    sm_scale=scale,
                )

            kind: tuple[Any, ...] = ("decode", dev, lay, tc)
        else:

            def make() -> Any:
                return fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace(dev), lay)

            def plan(w: Any) -> None:
                indptr, indices, last = paged_csr(block_tables, seq_lens, p)
                w.plan(
                    cu_seqlens_q.to(torch.int32),
                    indptr,
                    indices,
                    last,
                    hq,
                    hkv,
                    d,
                    p,
                    causal=bool(is_causal),
                    sm_scale=scale,
                    q_data_type=dtype,
                    kv_data_type=dtype,
                )

            kind = ("prefill", dev, lay)
        if not return_lse:
            return self.plans.run(key, kind, tensors, make, plan, lambda w: w.run(q, kv_cache))
        out, lse2 = self.plans.run(
            key, kind, tensors, make, plan, lambda w: w.run(q, kv_cache, return_lse=True)
        )
        return out, lse2 * LN2

    def paged_attention_lse(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor | None,
        scale: float | None,
        is_causal: bool,
        kv_layout: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Canonical ``lz.paged_attention(..., return_lse=True)`` kernel: :meth:`paged_attention` with the
        natural-log lse ``[T, Hq]`` float32 (FlashInfer's ``run(..., return_lse=True)`` gives base 2)."""
        return self.paged_attention(
            q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, return_lse=True
        )


def kernel_specs(
    kernels: FlashInferKernels | None, why: str = "flashinfer is not available"
) -> list[KernelSpec]:
    """The three FlashInfer KernelSpecs.

    Args:
        kernels: the backend instance's :class:`FlashInferKernels`, or None when FlashInfer is missing (the
            specs still exist, with callables raising ``BackendNotAvailableError``).
        why: the unavailability reason shown by those callables.

    Returns:
        ``[flashinfer.attention, flashinfer.paged_attention, flashinfer.paged_attention_lse]``.
    """
    common: dict[str, Any] = dict(
        device_types=CUDA,
        dtypes=HALF,
        sm_min=SM_MIN,
        supports_gqa=True,
        head_dim_min=HEAD_DIMS[0],
        head_dim_max=HEAD_DIMS[-1],
        head_dims_equal=True,
        supports_dropout=False,
        supports_backward=False,
        deterministic=False,
        graph_safe=False,
        workspace=_workspace,
    )
    att_fn = kernels.attention if kernels is not None else missing_kernel(KERNEL_IDS[0], why, INSTALL_HINT)
    paged_fn = (
        kernels.paged_attention if kernels is not None else missing_kernel(KERNEL_IDS[1], why, INSTALL_HINT)
    )
    lse_fn = (
        kernels.paged_attention_lse
        if kernels is not None
        else missing_kernel(KERNEL_IDS[2], why, INSTALL_HINT)
    )
    return [
        KernelSpec(
            KERNEL_IDS[0],
            "attention",
            att_fn,
            priority=PRIORITY_ATTENTION,
            description="FlashInfer batch decode (KV as pages) / ragged batch prefill (SM 8.0+, fp16/bf16, "
            "D 64/128/256, GQA, causal only with Sq == Sk, no mask)",
            layouts=frozenset({Layout.BSHD}),
            mask_kinds=frozenset({MaskKind.NONE}),
            mask_with_causal=False,
            requires_stride_last_1=True,
            requires_aligned_16=True,
            check=attention_check,
            **common,
        ),
        KernelSpec(
            KERNEL_IDS[1],
            "paged_attention",
            paged_fn,
            priority=PRIORITY_PAGED,
            description="FlashInfer paged batch decode / prefill-append, plan once per batch, run per layer "
            "(SM 8.0+, fp16/bf16, D 64/128/256, NHD/HND, any page size, GQA)",
            check=paged_check,
            **common,
        ),
        KernelSpec(
            KERNEL_IDS[2],
            "paged_attention_lse",
            lse_fn,
            priority=PRIORITY_PAGED,
            description="flashinfer.paged_attention returning its log-sum-exp too (run(return_lse=True), "
            "base 2 converted to natural log)",
            check=paged_check,
            **common,
        ),
    ]
