"""FlexAttention kernels (PyTorch ``torch.nn.attention.flex_attention``, torch >= 2.5): callables, block-mask
cache and constraints as data.

FlexAttention (He et al., "FlexAttention: The Flexibility of PyTorch with the Performance of FlashAttention",
PyTorch blog 2024, arXiv:2412.05496) expresses a mask as a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` compiled
into a *block mask* (which tiles to skip) and a bias as a ``score_mod(score, b, h, q_idx, kv_idx) -> score``.
``lz.attention`` maps onto it as follows (BHSD tensors, the kernel's native layout):

- ``is_causal``: a block mask built from the top-left causal ``mask_mod`` (``q_idx >= kv_idx``, like SDPA when
  Sq != Sk), cached per ``(Sq, Sk, causal, dense, device)`` in a small LRU (:class:`BlockMaskCache`), so it is
  built once per shape, not per call.
- bool ``attn_mask`` (True = attend): a ``mask_mod`` indexing the mask broadcast to ``[B, Hq, Sq, Sk]`` (an
  ``expand`` view, no copy), on a cached *dense* block structure (every non-empty tile partial, so the
  mask_mod is applied everywhere); combined with causal when both are given (SDPA refuses that, flex does
  not).
- float ``attn_mask``: a ``score_mod`` adding the (broadcast) bias; ``-inf`` masks out.
- ``window=(left, right)`` (sliding window, FlashAttention's ``window_size`` convention, top-left aligned): a
  ``mask_mod`` ``q_idx - left <= kv_idx <= q_idx + right`` (-1 = unbounded side) ANDed with causal and the
  bool mask; its block mask is cached like the causal one (the key includes the window), so tiles outside the
  band are skipped.
- ``softcap`` (Gemma 2): a ``score_mod`` ``softcap * tanh(score / softcap)`` on the scaled score, applied
  before a float mask's bias.
- GQA/MQA: ``enable_gqa=True``; custom ``scale`` passed through; dropout is not supported (rejected).
- A query row whose keys are all masked returns 0 (flex's convention, the same as ``lz.attention``'s).

Two kernels, one implementation (:class:`FlexAttention`):

- ``flex_attention.attention`` (CPU): flex runs *eagerly* (torch traces the mods with dynamo's eager backend
  on the first call of each shape, ~0.1-0.3 s, then a few ms per call for small shapes: an unfused, dense
  implementation). Priority -1, below every ``torch_sdpa`` kernel and the reference (see :data:`PRIORITY`):
  it runs only when locked or preferred. CPU flex has no backward (torch raises), so ``requires_grad`` is
  refused.
- ``flex_attention.compiled`` (CUDA): ``torch.compile(flex_attention)`` compiled lazily on the first call
  (Inductor generates a fused Triton kernel; each new shape may compile again): run ``lz.warmup`` before
  serving. Priority 60: below cuDNN/flash/efficient, above math. Triton's ``tl.dot`` needs head dims >= 16
  (torch ``_inductor/kernel/flex/flex_attention.py``); float64 is not claimed.

Neither is graph-safe: the first call of a shape compiles (CUDA) or traces (CPU), which must never happen
inside a CUDA-graph capture.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.errors import BackendNotAvailableError, InvalidInputError, expected_got
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec, Layout, MaskKind

log = logging.getLogger("layerzero.backends.flex_attention")
R = ReasonCode

CPU_KERNEL = "flex_attention.attention"
CUDA_KERNEL = "flex_attention.compiled"
KERNEL_IDS: tuple[str, ...] = (CPU_KERNEL, CUDA_KERNEL)
PRIORITY = {CPU_KERNEL: -1, CUDA_KERNEL: -1}
"""CPU: -1, below every torch_sdpa kernel *and* the reference (0): eager flex on CPU is an unfused dense
implementation, measured 3.4x slower than the reference on a mask + causal call (B=1, H=8, S=256, D=64, torch
2.13, 1 thread), so it is never chosen by default, only by ``lz.lock`` / ``lz.prefer``. CUDA: also -1 (opt-in
only): on the H200 image (torch 2.11.0+cu130, Triton 3.6) Inductor fails to lower compiled flex_attention for
some shapes (``NoValidChoicesError``), so it must not be picked by default until that is understood; measured
choices (``lz.tune``) can still promote it where it compiles."""

CPU_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
CUDA_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
CUDA_HEAD_DIM_MIN = 16
CUDA_HEAD_DIM_MAX = 256
BLOCK_MASK_CACHE_SIZE = 64


class BlockMaskCache:
    """A small thread-safe LRU of FlexAttention ``BlockMask`` structures, keyed by
    ``(Sq, Sk, causal, dense, device, window)`` (Sq/Sk in tokens, exact: a block mask is only valid for its
    lengths).

    ``causal`` selects the top-left causal ``mask_mod`` (``q_idx >= kv_idx``) or an all-true one, ANDed with
    the sliding ``window`` ``(left, right)`` when given (:func:`structure_mod`); ``dense`` builds it with
    ``separate_full_blocks=False`` (every non-empty tile partial), the structure a bool-mask ``mask_mod`` is
    attached to. Batch and head dims are broadcast (``B=None, H=None``).

    Args:
        create_block_mask: ``torch.nn.attention.flex_attention.create_block_mask``.
        maxsize: entries kept (least recently used evicted), > 0.
    """

    def __init__(self, create_block_mask: Callable[..., Any], maxsize: int = BLOCK_MASK_CACHE_SIZE) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize <= 0:
            raise InvalidInputError(expected_got("BlockMaskCache maxsize", "an int > 0", repr(maxsize)))
        self._create = create_block_mask
        self.dense_ok = "separate_full_blocks" in inspect.signature(create_block_mask).parameters
        self.maxsize = maxsize
        self._entries: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self,
        sq: int,
        sk: int,
        causal: bool,
        dense: bool,
        device: torch.device,
        window: tuple[int, int] | None = None,
    ) -> Any:
        """The cached ``BlockMask`` for these lengths (built on a miss; ``self.builds`` counts builds)."""
        key = (sq, sk, causal, dense, device, window)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        kwargs = {"separate_full_blocks": False} if dense and self.dense_ok else {}
        mask = self._create(structure_mod(causal, window), None, None, sq, sk, device=device, **kwargs)
        with self._lock:
            self.builds += 1
            self._entries[key] = mask
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return mask


def _causal_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Top-left causal (SDPA's ``is_causal``): query i sees keys j <= i."""
    return q_idx >= kv_idx


def _all_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Every key visible (the structure of a dense block mask)."""
    return q_idx >= 0


def structure_mod(causal: bool, window: tuple[int, int] | None) -> Callable[..., Any]:
    """The ``mask_mod`` of top-left causality and/or a sliding ``window=(left, right)`` (tokens, -1 =
    unbounded side): query i sees key j iff ``(not causal or j <= i) and i - left <= j <= i + right``."""
    if window is None:
        return _causal_mod if causal else _all_mod
    left, right = window

    def mask_mod(b, h, q_idx, kv_idx):
        ok = q_idx >= kv_idx if causal else q_idx >= 0
        if left >= 0:
            ok = ok & (q_idx - kv_idx <= left)
        if right >= 0:
            ok = ok & (kv_idx - q_idx <= right)
        return ok

    return mask_mod


def _softcap_mod(softcap: float, inner: Callable[..., Any] | None) -> Callable[..., Any]:
    """A score_mod capping the scaled score to ``softcap * tanh(score / softcap)`` (Gemma 2), then applying
    ``inner`` (a float mask's bias or the bool-mask fallback) when given."""

    def score_mod(score, b, h, q_idx, kv_idx):
        capped = torch.tanh(score / softcap) * softcap
        return capped if inner is None else inner(capped, b, h, q_idx, kv_idx)

    return score_mod


def _alibi_mod(slopes: torch.Tensor, offset: int, inner: Callable[..., Any] | None) -> Callable[..., Any]:
    """A score_mod adding ALiBi (Press et al. 2022) as flash-attn defines it: ``-slopes[b, h] * |q_idx +
    offset - kv_idx|`` with ``offset = Sk - Sq`` (bottom-right aligned positions), ``slopes`` float32 ``[B,
    Hq]`` (an expand view); then ``inner`` (a float mask's bias or the bool-mask fallback) when given."""

    def score_mod(score, b, h, q_idx, kv_idx):
        biased = (score - slopes[b, h] * (q_idx + offset - kv_idx).abs()).to(score.dtype)
        return biased if inner is None else inner(biased, b, h, q_idx, kv_idx)

    return score_mod


def _bool_mod(mask: torch.Tensor, causal: bool, window: tuple[int, int] | None = None) -> Callable[..., Any]:
    """A mask_mod reading a bool ``mask`` of shape ``[B, Hq, Sq, Sk]`` (an expand view), AND causal and the
    sliding window when asked."""
    if window is not None:
        local = structure_mod(causal, window)

        def mask_mod(b, h, q_idx, kv_idx):
            return mask[b, h, q_idx, kv_idx] & local(b, h, q_idx, kv_idx)
    elif causal:

        def mask_mod(b, h, q_idx, kv_idx):
            return mask[b, h, q_idx, kv_idx] & (q_idx >= kv_idx)
    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return mask[b, h, q_idx, kv_idx]

    return mask_mod


def _bool_score_mod(mask: torch.Tensor) -> Callable[..., Any]:
    """A score_mod setting scores where the bool ``mask`` (``[B, Hq, Sq, Sk]`` view) is False to ``-inf`` (the
    bool-mask path when ``create_block_mask`` cannot build dense structures: torch without
    ``separate_full_blocks``)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(mask[b, h, q_idx, kv_idx], score, -float("inf"))

    return score_mod


def _bias_mod(bias: torch.Tensor) -> Callable[..., Any]:
    """A score_mod adding a float ``bias`` of shape ``[B, Hq, Sq, Sk]`` (an expand view) to the scores."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx]

    return score_mod


def _with_mask_mod(block_mask_cls: Any, structure: Any, mask_mod: Callable[..., Any]) -> Any:
    """``structure`` (a dense BlockMask, no full blocks) with its ``mask_mod`` replaced by ``mask_mod``."""
    return block_mask_cls.from_kv_blocks(
        structure.kv_num_blocks,
        structure.kv_indices,
        None,
        None,
        structure.BLOCK_SIZE,
        mask_mod,
        structure.seq_lengths,
    )


def direct_eager(module: Any) -> Callable[..., Any] | None:
    """An eager FlexAttention call that skips dynamo: ``flex_attention_hop`` called directly, as torch's own
    ``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` mode does, without setting that process-wide flag.

    Public eager ``flex_attention`` wraps the same higher-order op in ``torch.compile(backend="eager")`` on
    every call, which re-traces each new shape/stride/mod combination (0.1-0.3 s each on CPU, and it spends
    dynamo's recompile budget of the process); calling the op directly costs 1-4 ms for small shapes with
    identical results (checked by tests/correctness/test_flex_attention.py). Forward only: torch documents the
    debug mode as unfit for backward, and CPU flex has no backward anyway (``requires_grad`` is refused).

    Args:
        module: ``torch.nn.attention.flex_attention``.

    Returns:
        ``run(q, k, v, *, score_mod, block_mask, scale, enable_gqa) -> out``, or None when the private pieces
        it uses (``_identity``, ``_create_empty_block_mask``, ``_apply_kernel_options``,
        ``torch._higher_order_ops.flex_attention.flex_attention``) are missing in this torch.
    """
    try:
        from torch._higher_order_ops.flex_attention import flex_attention as hop
    except ImportError:
        return None
    identity = getattr(module, "_identity", None)
    empty = getattr(module, "_create_empty_block_mask", None)
    options = getattr(module, "_apply_kernel_options", None)
    if hop is None or identity is None or empty is None or options is None:
        return None

    def run(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
        kernel_options = options(q, k, v, False, None)
        out = hop(
            q,
            k,
            v,
            identity if score_mod is None else score_mod,
            (empty(q, k) if block_mask is None else block_mask).as_tuple(),
            1.0 / math.sqrt(q.size(-1)) if scale is None else scale,
            kernel_options,
        )
        return out[0]

    return run


class LazyFlex:
    """The flex function a kernel calls: the eager one, or ``torch.compile(flex_attention)`` built once on
    first use (thread-safe; checked without the lock once built). ``what`` names the kernel in the one INFO
    log line."""

    def __init__(
        self, flex_attention: Callable[..., Any], eager: Callable[..., Any] | None, compiled: bool, what: str
    ) -> None:
        self._flex = flex_attention
        self._eager = eager or flex_attention
        self.compiled = compiled
        self._what = what
        self._compiled_fn: Callable[..., Any] | None = None
        self._compile_lock = threading.Lock()

    def function(self) -> Callable[..., Any]:
        """The flex function to call: ``torch.compile(flex_attention)`` (built on first use) or the eager
        one."""
        if not self.compiled:
            return self._eager
        fn = self._compiled_fn
        if fn is None:
            with self._compile_lock:
                if self._compiled_fn is None:
                    log.info(
                        "LayerZero %s: wrapping flex_attention in torch.compile (first use; the first call "
                        "of each shape compiles: call lz.warmup before serving)",
                        self._what,
                    )
                    self._compiled_fn = torch.compile(self._flex, dynamic=False)
                fn = self._compiled_fn
        return fn


class FlexAttention(LazyFlex):
    """A canonical attention kernel on FlexAttention: ``(q, k, v, attn_mask, is_causal, scale, dropout_p[,
    window, softcap])`` (window ``(left, right)`` tokens or None, softcap float > 0 or None) with q
    ``[B, Hq, Sq, D]``, k ``[B, Hkv, Sk, D]``, v ``[B, Hkv, Sk, Dv]`` (BHSD) -> ``[B, Hq, Sq, Dv]`` in q's
    dtype.

    ``compiled=True`` wraps ``flex_attention`` in ``torch.compile`` on the first call (lazily, once per
    instance, thread-safe) — the CUDA path; ``False`` calls ``eager`` (:func:`direct_eager`, when given) or
    ``flex_attention`` eagerly (CPU). Block masks come from
    :class:`BlockMaskCache`. Semantics: see the module docstring (top-left causal, bool/float masks, GQA,
    fully masked rows -> 0).

    Raises:
        InvalidInputError: ``dropout_p > 0`` (FlexAttention has no dropout; selection never routes it here).
    """

    def __init__(
        self,
        flex_attention: Callable[..., Any],
        create_block_mask: Callable[..., Any],
        block_mask_cls: Any,
        *,
        compiled: bool,
        eager: Callable[..., Any] | None = None,
        cache_size: int = BLOCK_MASK_CACHE_SIZE,
    ) -> None:
        super().__init__(flex_attention, eager, compiled, "flex_attention")
        self._block_mask_cls = block_mask_cls
        self.block_masks = BlockMaskCache(create_block_mask, cache_size)
        self.__name__ = "flex_attention_compiled" if compiled else "flex_attention_eager"

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        scale: float | None,
        dropout_p: float,
        window: tuple[int, int] | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if dropout_p:
            raise InvalidInputError(
                expected_got(
                    "flex_attention dropout_p",
                    "0.0 (FlexAttention has no dropout)",
                    dropout_p,
                    "Use a torch_sdpa kernel for attention dropout.",
                )
            )
        if q.device.type == "cpu" and not torch.is_grad_enabled():
            # CPU flex refuses inputs that merely *have* requires_grad, even under no_grad; no graph is
            # recorded.
            q, k, v = q.detach(), k.detach(), v.detach()
        b, hq, sq, _ = q.shape
        sk = k.shape[2]
        block_mask = score_mod = None
        if attn_mask is not None and attn_mask.dtype == torch.bool and self.block_masks.dense_ok:
            # a dense bool mask becomes the block mask's mask_mod on the causal/window structure
            structure = self.block_masks.get(sq, sk, is_causal, True, q.device, window)
            block_mask = _with_mask_mod(
                self._block_mask_cls, structure, _bool_mod(attn_mask.expand(b, hq, sq, sk), is_causal, window)
            )
        else:
            if attn_mask is not None:  # a bool mask the block mask cannot hold, or an additive bias
                expanded = attn_mask.expand(b, hq, sq, sk)
                score_mod = (
                    _bool_score_mod(expanded) if attn_mask.dtype == torch.bool else _bias_mod(expanded)
                )
            if is_causal or window is not None:
                block_mask = self.block_masks.get(sq, sk, is_causal, False, q.device, window)
        if alibi_slopes is not None:
            # float64 inputs get float64 slopes: slope * distance rounded in float32 would cost ~1e-7 relative
            slopes = alibi_slopes.to(torch.float64) if q.dtype == torch.float64 else alibi_slopes
            score_mod = _alibi_mod(slopes.expand(b, hq), sk - sq, score_mod)
        if softcap is not None:
            score_mod = _softcap_mod(softcap, score_mod)
        return self.function()(
            q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=hq != k.shape[1]
        )


def missing(reason: str) -> Callable[..., Any]:
    """The callable of a flex kernel when FlexAttention is unavailable; selection never picks it (the backend
    is unavailable), so reaching it means someone called the spec's ``fn`` directly.

    Raises:
        BackendNotAvailableError: always, with ``reason``.
    """

    def run(*args: Any) -> Any:
        raise BackendNotAvailableError(
            f"flex_attention cannot run: {reason}. Let lz.attention pick another "
            "kernel, or upgrade torch to >= 2.5."
        )

    return run


def _cuda_check(ctx: SelectionContext) -> list[Reason]:
    """What data cannot say for the compiled CUDA kernel: its backward is not claimed deterministic, and in
    float32 a head dim above 128 needs more shared memory than an H200 SM has (Inductor's flex template asked
    for 344,320 bytes at D=203 against a 232,448-byte limit, torch 2.11)."""
    out = []
    if ctx.deterministic and ctx.requires_grad:
        out.append(
            Reason(R.NON_DETERMINISTIC, "FlexAttention's compiled backward is not claimed deterministic")
        )
    if ctx.dtype == torch.float32 and max(ctx.head_dim or 0, ctx.head_dim_v or 0) > 128:
        out.append(
            Reason(R.HEAD_DIM_TOO_LARGE, "compiled flex in float32 supports head_dim <= 128 (shared memory)")
        )
    return out


def kernel_specs(cpu_fn: Callable[..., Any], cuda_fn: Callable[..., Any]) -> list[KernelSpec]:
    """The two FlexAttention KernelSpecs: ``flex_attention.attention`` (CPU, eager) and
    ``flex_attention.compiled`` (CUDA, torch.compile). ``cpu_fn``/``cuda_fn`` are :class:`FlexAttention`
    instances (or :func:`missing` stubs when FlexAttention is unavailable). ALiBi (``supports_alibi``) on the
    eager CPU kernel only: compiling the ALiBi ``score_mod`` (slopes indexed ``[b, h]``) failed in Inductor on
    the H200 (torch 2.11: ``LoweringException: NoValidChoicesError``), so the compiled kernel is refused with
    ``ALIBI_UNSUPPORTED``."""
    common: dict[str, Any] = dict(
        layouts=frozenset({Layout.BHSD}),
        supports_gqa=True,
        mask_kinds=frozenset(MaskKind),
        mask_with_causal=True,
        supports_causal=True,
        supports_dropout=False,
        supports_window=True,
        supports_softcap=True,
        graph_safe=False,
    )
    return [
        KernelSpec(
            CPU_KERNEL,
            "attention",
            cpu_fn,
            priority=PRIORITY[CPU_KERNEL],
            description="FlexAttention, eager on CPU (block-mask causal and sliding window, bool mask_mod, "
            "float score_mod, softcap, GQA; mask + causal together; no dropout, no backward)",
            device_types=frozenset({"cpu"}),
            dtypes=CPU_DTYPES,
            supports_backward=False,
            deterministic=True,
            supports_alibi=True,
            **common,
        ),
        KernelSpec(
            CUDA_KERNEL,
            "attention",
            cuda_fn,
            priority=PRIORITY[CUDA_KERNEL],
            description="FlexAttention compiled with torch.compile (Triton) on CUDA SM 8.0+ (head dims "
            "16-256, fp32/fp16/bf16; compiles per shape: warm up before serving)",
            device_types=frozenset({"cuda"}),
            dtypes=CUDA_DTYPES,
            sm_min=(8, 0),
            head_dim_min=CUDA_HEAD_DIM_MIN,
            head_dim_max=CUDA_HEAD_DIM_MAX,
            requires_stride_last_1=True,
            supports_backward=True,
            deterministic=True,
            check=_cuda_check,
            **common,
        ),
    ]
