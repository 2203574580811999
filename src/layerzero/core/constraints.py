"""The one shared filter: check a KernelSpec's data constraints against a SelectionContext.

Returns *every* reason that applies (never stops at the first), so a report shows all obstacles at once.
A kernel's own ``check`` function runs after these, for what data cannot express.
"""

from __future__ import annotations

from .context import SelectionContext, dtype_name
from .reasons import Reason, ReasonCode
from .specs import KernelSpec, Layout, MaskKind

R = ReasonCode


def _sm(t: tuple[int, int]) -> str:
    return f"{t[0]}.{t[1]}"


def check_constraints(spec: KernelSpec, ctx: SelectionContext) -> list[Reason]:
    """All reasons ``spec`` cannot run ``ctx`` according to its data constraints (empty list = can run).

    Layout is not checked here: dispatch converts between layouts and charges a transform cost instead.
    """
    out: list[Reason] = []
    dev = ctx.device
    if dev.device_type not in spec.device_types:
        out.append(
            Reason(
                R.DEVICE_TYPE_UNSUPPORTED,
                f"runs on {sorted(spec.device_types)}, inputs are on {dev.device_type}",
            )
        )
    if ctx.dtype not in spec.dtypes:
        out.append(
            Reason(
                R.DTYPE_UNSUPPORTED,
                f"dtype {dtype_name(ctx.dtype)} not in {sorted(dtype_name(d) for d in spec.dtypes)}",
            )
        )
    if dev.device_type == "cuda" and dev.sm is not None:
        if spec.sm_min is not None and dev.sm < spec.sm_min:
            out.append(Reason(R.SM_TOO_OLD, f"needs SM >= {_sm(spec.sm_min)}, device is SM {_sm(dev.sm)}"))
        if spec.sm_max is not None and dev.sm > spec.sm_max:
            out.append(Reason(R.SM_TOO_NEW, f"supports SM <= {_sm(spec.sm_max)}, device is SM {_sm(dev.sm)}"))
        if spec.generations is not None and dev.generation not in spec.generations:
            names = sorted(g.name for g in spec.generations)
            out.append(
                Reason(R.GPU_GENERATION_UNSUPPORTED, f"runs on {names}, device is {dev.generation.name}")
            )
    if spec.cpu_isa and dev.device_type == "cpu":
        missing = spec.cpu_isa - dev.cpu_isa
        if missing:
            out.append(
                Reason(
                    R.CPU_ISA_MISSING,
                    f"needs CPU ISA {sorted(spec.cpu_isa)}; missing {sorted(missing)} "
                    f"(this CPU has {sorted(dev.cpu_isa) or 'none detected'})",
                )
            )
    if ctx.head_dim is not None:
        _check_head_dim(spec, ctx, out)
    if ctx.num_heads_q is not None and ctx.num_heads_kv is not None and ctx.num_heads_q != ctx.num_heads_kv:
        if not spec.supports_gqa:
            out.append(
                Reason(
                    R.GQA_UNSUPPORTED, f"needs Hq == Hkv, got Hq={ctx.num_heads_q}, Hkv={ctx.num_heads_kv}"
                )
            )
    if ctx.mask not in spec.mask_kinds:
        out.append(
            Reason(
                R.MASK_UNSUPPORTED,
                f"mask kind {ctx.mask.value!r} not in {sorted(m.value for m in spec.mask_kinds)}",
            )
        )
    if ctx.is_causal and not spec.supports_causal:
        out.append(Reason(R.CAUSAL_UNSUPPORTED, "is_causal=True is not supported"))
    if ctx.is_causal and ctx.mask is not MaskKind.NONE and not spec.mask_with_causal:
        out.append(Reason(R.MASK_WITH_CAUSAL, "cannot combine attn_mask with is_causal=True"))
    if ctx.dropout and not spec.supports_dropout:
        out.append(Reason(R.DROPOUT_UNSUPPORTED, "dropout_p > 0 is not supported"))
    if (ctx.window_left is not None or ctx.window_right is not None) and not spec.supports_window:
        out.append(
            Reason(
                R.SLIDING_WINDOW_UNSUPPORTED,
                f"sliding window (left={ctx.window_left}, right={ctx.window_right}) is not supported",
            )
        )
    if ctx.has_softcap and not spec.supports_softcap:
        out.append(Reason(R.SOFTCAP_UNSUPPORTED, "logit soft-capping (softcap=...) is not supported"))
    if ctx.has_alibi and not spec.supports_alibi:
        out.append(Reason(R.ALIBI_UNSUPPORTED, "ALiBi position bias (alibi_slopes=...) is not supported"))
    if ctx.kv_dtype is not None and ctx.kv_dtype not in spec.kv_cache_dtypes:
        have = sorted(dtype_name(d) for d in spec.kv_cache_dtypes) or "none"
        out.append(
            Reason(
                R.KV_CACHE_DTYPE_UNSUPPORTED,
                f"quantized KV cache dtype {dtype_name(ctx.kv_dtype)} "
                f"not readable (quantized caches supported: {have})",
            )
        )
    if spec.requires_stride_last_1 and not ctx.stride_last_1:
        out.append(Reason(R.STRIDE_LAST_DIM_NOT_1, "needs stride(-1) == 1 on every input"))
    if spec.requires_aligned_16 and not ctx.aligned_16:
        out.append(
            Reason(
                R.ALIGNMENT_INVALID,
                "needs 16-byte aligned data pointers and row strides "
                "(pass .contiguous() tensors, not slices of wider ones)",
            )
        )
    if spec.max_seq_len is not None:
        longest = max(ctx.seq_len_q or 0, ctx.seq_len_kv or 0)
        if longest > spec.max_seq_len:
            out.append(
                Reason(
                    R.SEQ_LEN_TOO_LONG,
                    f"sequence bucket up to {longest} tokens exceeds max_seq_len={spec.max_seq_len}",
                )
            )
    if ctx.deterministic and not spec.deterministic:
        out.append(
            Reason(R.NON_DETERMINISTIC, "torch deterministic mode is on and this kernel is not deterministic")
        )
    if ctx.graph_capture and not spec.graph_safe:
        out.append(
            Reason(R.CUDA_GRAPH_UNSAFE, "a CUDA graph is being captured and this kernel is not graph-safe")
        )
    if ctx.requires_grad and not spec.supports_backward:
        out.append(Reason(R.BACKWARD_UNSUPPORTED, "inputs require grad and this kernel has no backward"))
    return out


def _check_head_dim(spec: KernelSpec, ctx: SelectionContext, out: list[Reason]) -> None:
    d = ctx.head_dim
    dims = [d] if ctx.head_dim_v in (None, d) else [d, ctx.head_dim_v]
    if spec.head_dims_equal and ctx.head_dim_v not in (None, d):
        out.append(
            Reason(R.HEAD_DIM_MISMATCH, f"needs equal q/k and v head dims, got {d} and {ctx.head_dim_v}")
        )
    for dim in dims:
        if spec.head_dim_max is not None and dim > spec.head_dim_max:
            out.append(Reason(R.HEAD_DIM_TOO_LARGE, f"head_dim {dim} > max {spec.head_dim_max}"))
        if spec.head_dim_min is not None and dim < spec.head_dim_min:
            out.append(Reason(R.HEAD_DIM_INVALID, f"head_dim {dim} < min {spec.head_dim_min}"))
        if spec.head_dim_multiple and dim % spec.head_dim_multiple:
            out.append(
                Reason(
                    R.HEAD_DIM_NOT_ALIGNED, f"head_dim {dim} is not a multiple of {spec.head_dim_multiple}"
                )
            )


def native_layout(spec: KernelSpec, layout: Layout | None) -> Layout | None:
    """The layout ``spec`` will be called with: the input's own if supported, else the first it supports."""
    if layout is None or spec.layouts is None or layout in spec.layouts:
        return layout
    return Layout.BHSD if Layout.BHSD in spec.layouts else next(iter(sorted(spec.layouts)))
