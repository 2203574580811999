"""``triton.rope``: our Triton rotary position embedding for ``lz.rope``, CUDA only (SM >= 8.0); and
``triton.qk_norm_rope`` for ``lz.qk_norm_rope``, the same kernel with a per-head RMSNorm first (one launch
where the engine's Qwen3 layers took three: q_norm, k_norm, rope).

Both pair layouts (GPT-NeoX/Llama half rotation and GPT-J interleaved pairs), partial rotary (dims >= R
copied), every cos/sin form ``lz.rope`` accepts (a ``[max_pos, R]`` table with ``position_ids [B or 1, S]``,
the table read at positions 0..S-1, or gathered ``[B or 1, S, R]``), BHSD and BSHD inputs read through their
strides (no copies, any strides). Returns new tensors; the inputs are never written. Math in float32 with one
rounding to the input dtype, like the reference (``backends/reference/rope.py``); kernel in
``_rope_kernels.py``.

Graph safety: no host synchronization (the position gather happens inside the kernel), outputs from
``torch.empty_like``; capturable once the specialization was compiled by ``lz.warmup`` or an eager call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core import knobs
from layerzero.core.knobs import check_types, require
from layerzero.core.specs import KernelSpec, Layout

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, cdiv, missing, next_pow2
from ._launch import launch, pdl_kwargs

KERNEL_ID = "triton.rope"
QK_NORM_KERNEL_ID = "triton.qk_norm_rope"
QK_NORM_CACHE_KERNEL_ID = "triton.qk_norm_rope_cache"
CACHE_PRIORITY = PRIORITY = 60
"""Above ``composite.qk_norm_rope_cache`` (52, the two launches it fuses) and torch_native (50, several
elementwise launches in the input dtype) and liger (40): fastest of the three on the H200 for decode and
4096-token prefill shapes (benchmarks/results/norm_rope_h200.md; qk_norm_rope_cache:
benchmarks/results/history.md)."""
MAX_HEAD_DIM = 1024
KNOBS = "triton.rope"
"""The name :class:`RopeKnobs` is registered under (``layerzero.core.knobs``)."""
_KERNELS = LazyModule("_rope_kernels")


@dataclass(frozen=True, slots=True)
class RopeKnobs:
    """Tuning choices of ``triton.rope`` / ``triton.qk_norm_rope`` / ``triton.qk_norm_rope_cache``, registered
    as ``"triton.rope"``; read once per launch (:func:`block_h_for`). Raises ``ConfigurationError`` for a
    field of the wrong type or out of range."""

    block_h_max: int = 4
    """Most heads one program rotates (a power of two; fewer when a head's tile is large): 4 made the
    engine's batch-1 decode graph fastest of 1-16 (``benchmarks/results/knobs/triton_rope.md``)."""

    def __post_init__(self) -> None:
        check_types(self)
        bh = self.block_h_max
        require(bh >= 1 and next_pow2(bh) == bh, self, "block_h_max", "a power of two >= 1")


knobs.register(KNOBS, RopeKnobs())


def block_h_for(hq: int, hk: int, per_head: int, kn: RopeKnobs | None = None) -> int:
    """Heads one program rotates (a power of two): at most the knobs' ``block_h_max`` (``kn``, default those
    in force), the larger head count's next power of two, and about 2048 tile elements over ``per_head`` (the
    elements of one head's tile). Pure arithmetic: raises nothing.

    >>> block_h_for(16, 8, 128), block_h_for(2, 1, 128), block_h_for(16, 8, 2048)
    (4, 2, 1)
    """
    bh_max = (kn or knobs.get(KNOBS)).block_h_max
    return min(next_pow2(max(hq, hk)), bh_max, max(1, next_pow2(2048 // per_head + 1) // 2))


def _bhsd_strides(t: torch.Tensor, bshd: bool) -> tuple[int, int, int, int]:
    """Strides of a 4-D q/k tensor in logical (b, h, s, d) order."""
    sb, s1, s2, sd = t.stride()
    return (sb, s2, s1, sd) if bshd else (sb, s1, s2, sd)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    layout: str | Layout = "BHSD",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embeddings (RoFormer, Su et al. 2021) on q and k in one Triton launch.

    Args:
        q: ``[B, Hq, S, D]`` (``layout="BHSD"``) or ``[B, S, Hq, D]`` (``"BSHD"``), float16/bfloat16/float32,
            any strides.
        k: like q with Hkv heads (same B, S, D and dtype).
        cos, sin: ``[max_pos, R]`` table (with ``position_ids``, or positions 0..S-1 without) or gathered
            ``[B or 1, S, R]``; R even, R <= D; any float dtype (read as float32).
        position_ids: None or ``[B or 1, S]`` int64/int32 rows of the table (values are not range-checked on
            the GPU: ``lz.rope`` checks them for CPU tensors; out-of-range ids read out of bounds).
        interleaved: False = half rotation (pairs (i, i + R/2)), True = GPT-J pairs (2i, 2i + 1).
        layout: ``"BHSD"`` or ``"BSHD"`` (or the :class:`Layout` member).

    Returns:
        ``(q_out, k_out)``: new tensors with q's and k's shapes, dtypes and (when dense) strides.

    Raises:
        Nothing of its own (inputs are validated by ``lz.rope``); triton's compile/launch errors propagate.
    """
    return _launch(q, k, cos, sin, position_ids, interleaved, layout, None, None, 0.0)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    layout: str | Layout = "BHSD",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lz.qk_norm_rope`` in one Triton launch: :func:`rope`'s kernel with each head RMS-normalized over its
    D dims first (float32, the normalized values rotated without a rounding in between, ``_rope_kernels.py``).

    Args:
        q, k, cos, sin, position_ids, interleaved, layout: as :func:`rope`.
        q_weight, k_weight: ``[D]`` RMSNorm weights (any float dtype, read as float32), contiguous.
        eps: added to each head's mean square (unitless, > 0).

    Returns:
        ``(q_out, k_out)`` as :func:`rope`.

    Raises:
        Nothing of its own (``lz.qk_norm_rope`` validates); triton's compile/launch errors propagate.
    """
    return _launch(
        q, k, cos, sin, position_ids, interleaved, layout, q_weight.contiguous(), k_weight.contiguous(), eps
    )


def qk_norm_rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    position_ids: torch.Tensor,
    interleaved: bool,
    kv_layout: Any,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lz.qk_norm_rope_cache`` in one Triton launch: :func:`qk_norm_rope`'s kernel on the token-major q
    ``[T, Hq, D]`` / k ``[T, Hkv, D]`` (viewed as BSHD with B = 1), whose k programs also store the rotated k
    and the token's v ``[T, Hkv, D]`` into ``kv_cache`` (``[N, 2, P, Hkv, D]`` NHD or ``[N, 2, Hkv, P, D]``
    HND) at ``slot_mapping`` ``[T]`` (-1: skipped). ``position_ids`` ``[T]``.

    Returns:
        ``(q_out, k_out)`` like q and k (new tensors); the cache is written in place.

    Raises:
        Nothing of its own (``lz.qk_norm_rope_cache`` validates); triton's compile/launch errors propagate.
    """
    hnd = getattr(kv_layout, "value", kv_layout) == "HND"
    c = kv_cache.stride()
    cache = dict(
        V=v,
        KV=kv_cache,
        SLOTS=slot_mapping,
        sv_s=v.stride(0),
        sv_h=v.stride(1),
        sv_d=v.stride(2),
        c_blk=c[0],
        c_kv=c[1],
        c_tok=c[3] if hnd else c[2],
        c_h=c[2] if hnd else c[3],
        c_d=c[4],
        page=kv_cache.shape[3] if hnd else kv_cache.shape[2],
        CACHE=True,
        BLOCK_D=next_pow2(q.shape[-1]),
    )
    qo, ko = _launch(
        q.unsqueeze(0),
        k.unsqueeze(0),
        cos,
        sin,
        position_ids.view(1, -1),
        interleaved,
        "BSHD",
        q_weight.contiguous(),
        k_weight.contiguous(),
        eps,
        cache,
    )
    return qo.squeeze(0), ko.squeeze(0)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    layout: str | Layout,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cache: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    bshd = layout is Layout.BSHD or layout == "BSHD"
    qo = torch.empty_like(q)
    ko = torch.empty_like(k)
    if bshd:
        b, s, hq, d = q.shape
        hk = k.shape[2]
    else:
        b, hq, s, d = q.shape
        hk = k.shape[1]
    if qo.numel() == 0 and ko.numel() == 0:
        return qo, ko
    mod = _KERNELS.get()
    r = cos.shape[-1]
    if cos.dim() == 3:
        sc = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), cos.stride(2))
        ss = (sin.stride(0) if sin.shape[0] > 1 else 0, sin.stride(1), sin.stride(2))
    else:
        sc = (0, cos.stride(0), cos.stride(1))
        ss = (0, sin.stride(0), sin.stride(1))
    if position_ids is not None:
        pos = position_ids
        sp = (pos.stride(0) if pos.shape[0] > 1 else 0, pos.stride(1))
    else:
        pos, sp = cos, (0, 0)  # unused pointer (HAS_POS=False)
    block_half = next_pow2(r // 2)
    block_pass = next_pow2(d - r) if d > r else 0
    per_head = block_half * 2 + block_pass  # elements of one head in the tile
    block_h = block_h_for(hq, hk, per_head)
    grid = (b * s, cdiv(hq, block_h) + cdiv(hk, block_h))
    norm = q_weight is not None
    launch(
        mod._rope_fwd,
        grid,
        q,
        k,
        qo,
        ko,
        cos,
        sin,
        pos,
        q_weight if norm else cos,
        k_weight if norm else cos,
        *_bhsd_strides(q, bshd),
        *_bhsd_strides(k, bshd),
        *_bhsd_strides(qo, bshd),
        *_bhsd_strides(ko, bshd),
        *sc,
        *ss,
        *sp,
        s,
        hq,
        hk,
        r,
        d,
        float(eps),
        HAS_POS=position_ids is not None,
        INTERLEAVED=bool(interleaved),
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_PASS=block_pass,
        NORM=norm,
        num_warps=4 if block_h * per_head >= 2048 else 2,
        **pdl_kwargs(q, b * s),
        **(cache or {}),
    )
    return qo, ko


def kernel_specs(available: bool, why: str) -> list[KernelSpec]:
    """``[triton.rope, triton.qk_norm_rope, triton.qk_norm_rope_cache]``; their callables raise
    ``BackendNotAvailableError`` (with ``why``) when ``available`` is False."""
    common = dict(
        priority=PRIORITY,
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        layouts=frozenset({Layout.BHSD, Layout.BSHD}),
        head_dim_max=MAX_HEAD_DIM,
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
    )
    rope_fn: Callable[..., Any] = rope if available else missing(KERNEL_ID, why)
    norm_fn: Callable[..., Any] = qk_norm_rope if available else missing(QK_NORM_KERNEL_ID, why)
    cache_fn: Callable[..., Any] = qk_norm_rope_cache if available else missing(QK_NORM_CACHE_KERNEL_ID, why)
    # token-major q/k/v, either KV layout (strides)
    cache_common = {**common, "layouts": None, "priority": CACHE_PRIORITY}
    return [
        KernelSpec(
            KERNEL_ID,
            "rope",
            rope_fn,
            description="LayerZero Triton RoPE: half rotation and GPT-J pairs, partial rotary, table/"
            "position_ids/gathered cos-sin, BHSD/BSHD strided, float32 math, new outputs",
            **common,
        ),
        KernelSpec(
            QK_NORM_KERNEL_ID,
            "qk_norm_rope",
            norm_fn,
            description="LayerZero Triton per-head RMSNorm + RoPE in one launch (the triton.rope kernel "
            "with a norm prologue), float32 math, one rounding, new outputs",
            **common,
        ),
        KernelSpec(
            QK_NORM_CACHE_KERNEL_ID,
            "qk_norm_rope_cache",
            cache_fn,
            description="LayerZero Triton per-head RMSNorm + RoPE whose k programs also write k and v "
            "into the paged KV cache (one launch where two were)",
            **cache_common,
        ),
    ]
