"""xFormers ``memory_efficient_attention`` as the kernel ``xformers.attention``.

Sources read (xformers 0.0.35, ``xformers/ops/fmha``):

- ``__init__.py``: ``memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *,
  op=None, output_dtype=None)``, tensors ``[B, M, H, K]`` (BMHK = our BSHD), or ``[B, M, G, H, K]`` (BMGHK)
  for GQA/MQA with k/v *expanded* over H ("xFormers will not automatically broadcast"); GQA is forward-only.
  Returns ``[B, Mq, H, Kv]`` (``[B, Mq, G, H, Kv]``).
- ``dispatch.py``: CUDA forward priority ``flash3.FwOp`` (if built) -> ``flash.FwOp`` -> ``cutlass.FwOp``.
- ``flash.py``: SM >= 8.0, fp16/bf16, K == Kv <= 256, no tensor bias, ``LowerTriangularMask`` only when
  Mq == Mkv (``_check_needs_no_topleft``).
- ``cutlass.py`` (PyTorch's ``aten::_efficient_attention_forward``): SM 5.0-9.0 (``CUDA_MAXIMUM_COMPUTE_
  CAPABILITY = (9, 0)``), fp32/fp16/bf16, any K, Kv, tensor bias whose non-last strides are multiples of
  ``128 / bits`` elements (8 for fp16/bf16, 4 for fp32) with stride(-1) == 1, top-left causal for any Mq, Mkv.
- ``attn_bias.py``: ``LowerTriangularMask`` is top-left aligned (``torch.tril(..., diagonal=0)``), like SDPA
  and ``lz.attention``: no Sq != Sk mismatch, but only cutlass runs it when Sq != Sk.
- ``common.py``: every operator refuses CUDA inputs when the C++ library did not load (``_built_with_cuda``),
  the Triton split-k operator included.

Decisions: bool masks are refused (``MASK_UNSUPPORTED``; converting would allocate a float copy of the mask on
every call, and the SDPA kernels take bool masks natively); float masks are expanded to ``[B, Hq, Sq, Sk]``
views and, when their strides are not aligned (Sk not a multiple of 8 / 4), copied once into a padded buffer
and sliced, as xFormers' own hint says. Mask + causal is refused (SDPA semantics keep them exclusive).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core.context import SelectionContext, dtype_name
from layerzero.core.errors import BackendNotAvailableError
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec, Layout, MaskKind

R = ReasonCode
KERNEL_ID = "xformers.attention"
PRIORITY = 75
"""Below SDPA flash (80) and cuDNN (85), whose kernels xFormers' flash path shares; above SDPA efficient (70),
so xFormers serves float-bias and other cases that only the efficient kernels take. PerfDB timings decide
more."""
HALF = frozenset({torch.float16, torch.bfloat16})
FLASH_SM = ((8, 0), (12, 1))
CUTLASS_SM_MAX = (9, 0)
FLASH_MAX_K = 256
INSTALL_HINT = "pip install xformers (a wheel built for this torch and CUDA)"


@dataclass(frozen=True, slots=True)
class XformersOps:
    """Which xFormers forward operators load here (``FwOp.is_available()``)."""

    flash: bool
    cutlass: bool
    flash3: bool = False


def aligned_bias(mask: torch.Tensor, b: int, h: int, sq: int, sk: int) -> torch.Tensor:
    """An additive mask broadcastable to ``[B, H, Sq, Sk]`` as a ``[B, H, Sq, Sk]`` tensor xFormers' cutlass
    operator accepts: stride(-1) == 1 and every other stride a multiple of 16 bytes. Broadcast dims stay
    stride-0 views; a misaligned mask (Sk not a multiple of 8 for fp16/bf16, 4 for fp32) is copied once into a
    buffer whose last dim is padded to the alignment, then sliced back to Sk."""
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    e = m.expand(b, h, sq, sk)
    align = max(1, 16 // e.element_size())
    if e.stride(-1) == 1 and not e.data_ptr() % 16 and all(st % align == 0 for st in e.stride()[:-1]):
        return e
    padded = -(-sk // align) * align
    buf = m.new_empty(*m.shape[:-1], padded)[..., :sk]
    buf.copy_(m.expand(*m.shape[:-1], sk))
    return buf.expand(b, h, sq, sk)


def xformers_call(mea: Callable[..., Any], causal_mask: Callable[[], Any]) -> Callable[..., torch.Tensor]:
    """Wrap ``memory_efficient_attention`` as a canonical attention kernel on BSHD tensors (q
    ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D/Dv]`` -> ``[B, Sq, Hq, Dv]``). Causal -> ``causal_mask()``
    (``LowerTriangularMask``); float masks -> :func:`aligned_bias`; GQA (Hq = G * r, Hkv = G) -> BMGHK: q
    viewed ``[B, Sq, G, r, D]``, k/v expanded ``[B, Sk, G, r, D]`` (stride 0 over r, no copy), the bias viewed
    ``[B, G, r, Sq, Sk]``; KV head j serves query heads ``j*r .. j*r + r - 1`` as in ``lz.attention``."""

    def run(q, k, v, attn_mask, is_causal, scale, dropout_p):
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        bias: Any = None
        if attn_mask is not None:
            bias = aligned_bias(attn_mask, b, hq, sq, sk)
        elif is_causal:
            bias = causal_mask()
        if hq == hkv:
            return mea(q, k, v, attn_bias=bias, p=dropout_p, scale=scale)
        r = hq // hkv
        q5 = q.unflatten(2, (hkv, r))
        k5 = k.unsqueeze(3).expand(b, sk, hkv, r, k.shape[-1])
        v5 = v.unsqueeze(3).expand(b, sk, hkv, r, v.shape[-1])
        if isinstance(bias, torch.Tensor):
            bias = bias.unflatten(1, (hkv, r))
        return mea(q5, k5, v5, attn_bias=bias, p=dropout_p, scale=scale).flatten(2, 3)

    run.__name__ = "xformers_memory_efficient_attention"
    return run


def _sm(t: tuple[int, int]) -> str:
    return f"{t[0]}.{t[1]}"


def flash_reasons(ctx: SelectionContext, ops: XformersOps) -> list[Reason]:
    """Why xFormers' ``flash.FwOp`` cannot run ``ctx`` (empty: it can)."""
    if not ops.flash:
        return [Reason(R.BACKEND_IMPORT_FAILED, "xFormers flash.FwOp did not load here")]
    out = []
    sm = ctx.device.sm
    if sm is not None and not FLASH_SM[0] <= sm <= FLASH_SM[1]:
        code = R.SM_TOO_OLD if sm < FLASH_SM[0] else R.SM_TOO_NEW
        out.append(
            Reason(
                code, f"xFormers flash needs SM {_sm(FLASH_SM[0])}-{_sm(FLASH_SM[1])}, device is SM {_sm(sm)}"
            )
        )
    if ctx.dtype not in HALF:
        out.append(Reason(R.DTYPE_UNSUPPORTED, f"xFormers flash runs fp16/bf16, not {dtype_name(ctx.dtype)}"))
    if ctx.head_dim_v not in (None, ctx.head_dim):
        out.append(Reason(R.HEAD_DIM_MISMATCH, "xFormers flash needs equal q/k and v head dims"))
    if max(ctx.head_dim or 0, ctx.head_dim_v or 0) > FLASH_MAX_K:
        out.append(Reason(R.HEAD_DIM_TOO_LARGE, f"xFormers flash supports head_dim <= {FLASH_MAX_K}"))
    if ctx.mask is not MaskKind.NONE:
        out.append(Reason(R.MASK_UNSUPPORTED, "xFormers flash takes no tensor bias"))
    if ctx.is_causal and not ctx.seq_equal:
        out.append(
            Reason(
                R.CAUSAL_SEQ_MISMATCH,
                "xFormers flash runs LowerTriangularMask only when Sq == Sk (FlashAttention aligns "
                "causal bottom-right); the top-left case needs the cutlass operator",
            )
        )
    return out


def cutlass_reasons(ctx: SelectionContext, ops: XformersOps) -> list[Reason]:
    """Why xFormers' ``cutlass.FwOp`` cannot run ``ctx`` (empty: it can)."""
    if not ops.cutlass:
        return [Reason(R.BACKEND_IMPORT_FAILED, "xFormers cutlass.FwOp did not load here")]
    sm = ctx.device.sm
    if sm is not None and sm > CUTLASS_SM_MAX:
        return [
            Reason(
                R.SM_TOO_NEW, f"xFormers cutlass supports SM <= {_sm(CUTLASS_SM_MAX)}, device is SM {_sm(sm)}"
            )
        ]
    return []


def make_check(ops: XformersOps) -> Callable[[SelectionContext], list[Reason]]:
    """The kernel's ``check``: some forward operator xFormers would dispatch to (flash, else cutlass) must
    accept ``ctx``; plus the wrapper's own limits (GQA forward-only and not graph-safe, no deterministic
    backward). Every operator's reasons are returned when none can run."""

    def check(ctx: SelectionContext) -> list[Reason]:
        out = []
        gqa = (
            ctx.num_heads_q is not None
            and ctx.num_heads_kv is not None
            and ctx.num_heads_q != ctx.num_heads_kv
        )
        if gqa and ctx.requires_grad:
            out.append(Reason(R.BACKWARD_UNSUPPORTED, "xFormers' GQA (BMGHK) form is forward-only"))
        if gqa and ctx.graph_capture:
            out.append(
                Reason(
                    R.CUDA_GRAPH_UNSAFE,
                    "xFormers' cutlass GQA path creates a CUDA stream per KV group on every call",
                )
            )
        if ctx.deterministic and ctx.requires_grad:
            out.append(Reason(R.NON_DETERMINISTIC, "xFormers' flash backward is not deterministic"))
        flash, cutlass = flash_reasons(ctx, ops), cutlass_reasons(ctx, ops)
        if flash and cutlass:
            out.extend(Reason(r.code, f"flash: {r.message}") for r in flash)
            out.extend(Reason(r.code, f"cutlass: {r.message}") for r in cutlass)
        return out

    return check


def _lse_bytes(ctx: SelectionContext) -> int:
    """The float32 log-sum-exp xFormers' forward writes: ``[B, Hq, Sq]`` x 4 bytes (bucket bounds)."""
    return 4 * (ctx.batch or 0) * (ctx.num_heads_q or 0) * (ctx.seq_len_q or 0)


def _missing(why: str) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        raise BackendNotAvailableError(
            f"{KERNEL_ID} cannot run: {why}. Install a working xFormers ({INSTALL_HINT}) or let lz.attention "
            "pick another kernel."
        )

    return run


def kernel_spec(
    mea: Callable[..., Any] | None,
    causal_mask: Callable[[], Any] | None,
    ops: XformersOps | None,
    why: str = "xformers is not available",
) -> KernelSpec:
    """The ``xformers.attention`` KernelSpec (native layout BSHD).

    Args:
        mea: ``xformers.ops.fmha.memory_efficient_attention``, or None when unusable (the spec is still
            registered; its callable raises ``BackendNotAvailableError`` with ``why``).
        causal_mask: ``xformers.ops.fmha.attn_bias.LowerTriangularMask``.
        ops: which forward operators load (routes the check); None when unusable.
    """
    ops = ops or XformersOps(flash=False, cutlass=False)
    fn = xformers_call(mea, causal_mask) if mea is not None and causal_mask is not None else _missing(why)
    dtypes = frozenset(HALF | {torch.float32}) if ops.cutlass else HALF
    return KernelSpec(
        KERNEL_ID,
        "attention",
        fn,
        priority=PRIORITY,
        description="xFormers memory_efficient_attention (flash / cutlass operators, BSHD, GQA via BMGHK, "
        "float bias, top-left causal)",
        device_types=frozenset({"cuda"}),
        dtypes=dtypes,
        sm_min=FLASH_SM[0],
        layouts=frozenset({Layout.BSHD}),
        head_dim_multiple=8,
        supports_gqa=True,
        mask_kinds=frozenset({MaskKind.NONE, MaskKind.FLOAT}),
        mask_with_causal=False,
        supports_causal=True,
        supports_dropout=True,
        supports_backward=True,
        requires_stride_last_1=True,
        requires_aligned_16=True,
        deterministic=True,
        graph_safe=True,
        check=make_check(ops),
        workspace=_lse_bytes,
    )
