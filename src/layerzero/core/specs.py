"""Specs: what an operation is, what a kernel can do (as data), what a backend is, what dispatch runs.

A :class:`KernelSpec` holds its constraints as plain data (device types, dtypes, SM range, head dims,
layouts, mask kinds, GQA, causal, dropout, determinism, graph safety). One shared filter
(:mod:`layerzero.core.constraints`) checks them all and returns every reason that applies; a kernel adds a
``check`` function only for what data cannot say. This follows xFormers' ``AttentionOpBase`` and
Hugging Face kernels' device descriptors.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .reasons import Reason

# Layout, MaskKind and Phase moved to core/types.py (so specs and context need not import each other);
# re-exported
from .types import Layout as Layout
from .types import MaskKind as MaskKind
from .types import Phase as Phase

if TYPE_CHECKING:
    from .context import SelectionContext
    from .device import GPUGeneration


CPU_ISA_NAMES: frozenset[str] = frozenset(
    {
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx512",
        "avx512_bf16",
        "avx512_vnni",
        "avx512_fp16",
        "amx",
        "amx_bf16",
        "amx_int8",
        "neon",
        "sve",
        "sve2",
        "bf16",
        "sve256",
        "vsx",
        "z_vector",
    }
)
"""ISA feature names a ``KernelSpec.cpu_isa`` may require: the ``/proc/cpuinfo`` flags ``DeviceSpec.cpu_isa``
folds (``layerzero.core.device._FLAG_MAP``) plus torch's ``get_cpu_capability()`` names in that spelling."""


Adapter = Callable[
    ["KernelSpec", "SelectionContext", Callable[..., Any]], tuple[Callable[..., Any], tuple[str, ...], float]
]


@dataclass(frozen=True, slots=True)
class OperationSpec:
    """An operation LayerZero dispatches: its id, a one-line description, the names of its inputs, the
    kernel id of its reference implementation (the oracle and last fallback) and an optional ``adapter``.

    ``adapter(kernel, ctx, fn) -> (call, transform_names, transform_cost)`` wraps a kernel whose native layout
    differs from the inputs' (e.g. BSHD inputs to a BHSD-only kernel); without it kernels are called as is.
    ``capture_variants(capture_key) -> keys``: other capture-time keys that the *same* model step commonly
    makes under a CUDA-graph capture although its eager calls did not (attention: tracers such as transformers
    materialize a causal mask while capturing); dispatch prepares their choices too
    (``Runtime.prepare_capture``). ``key_type``: the ``NamedTuple`` class of the op's cache keys (first field
    ``op``). The op's hot path may build its key as a plain tuple of the same fields (equal to the named key
    and hashed alike, so the cache finds it, and ~0.7 µs cheaper to build); dispatch turns such a key into
    ``key_type`` before anything reads its fields (``Runtime._run_slow``). ``shipped_tie_margin``: shipped
    timings count this op's kernels within this fraction of a bucket's fastest as tied, so the hand priorities
    order them (``ShippedMatch.score``); for ops whose key cannot see something that decides the kernels'
    relative speed (paged attention: the batch's length distribution). 0.0: the strict rule.
    """

    op_id: str
    description: str
    inputs: tuple[str, ...]
    reference_kernel: str
    adapter: Adapter | None = None
    capture_variants: Callable[[Any], tuple[Any, ...]] | None = None
    key_type: Callable[..., Any] | None = None
    shipped_tie_margin: float = 0.0


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One kernel: identity, the callable, and its constraints as data.

    ``fn`` is called with the op's canonical positional arguments (see ``layerzero.ops``), with tensors in one
    of ``layouts`` (dispatch inserts a transpose for other layouts and charges ``transform cost`` in the
    score). ``None`` in a constraint field means "no constraint". ``sm_min``/``sm_max`` are inclusive
    ``(major, minor)`` pairs and apply to CUDA devices only. ``cpu_isa`` names ISA features a CPU context must
    *all* have (spelled as ``DeviceSpec.cpu_isa`` spells them: ``"avx2"``, ``"avx512"``, ``"avx512_bf16"``,
    ``"amx_bf16"``, ...); it applies to CPU devices only. ``supports_window`` / ``supports_softcap``: the
    kernel implements ``lz.attention``'s sliding window / logit soft-cap; such a kernel is called with two
    more canonical arguments, ``window`` (``(left, right)`` or None) and ``softcap`` (float or None), whenever
    either is set (default False: every other kernel is refused with ``SLIDING_WINDOW_UNSUPPORTED`` /
    ``SOFTCAP_UNSUPPORTED``). ``supports_alibi``: the kernel implements ``lz.attention(alibi_slopes=...)``
    (ALiBi, flash-attn's convention); such a kernel is called with three extra canonical arguments,
    ``window``, ``softcap`` and ``alibi_slopes`` (float32 ``[Hq]`` or ``[B, Hq]``, or None), whenever slopes
    are given (default False: refused with ``ALIBI_UNSUPPORTED``). ``kv_cache_dtypes``: the quantized
    paged-KV-cache dtypes (``float8_e4m3fn``, ``int8``) a paged kernel reads or writes; such a kernel is
    called with two more canonical arguments, ``k_scale`` and ``v_scale``, when the cache is quantized
    (default empty: every other kernel is refused with ``KV_CACHE_DTYPE_UNSUPPORTED``). ``max_seq_len`` is
    checked against the upper bound of the sequence-length bucket so a cached choice is valid for every length
    in its bucket. ``capture_priority``: the priority used instead of ``priority`` while a CUDA graph is being
    captured (``ctx.graph_capture``), where the host's launch cost is paid once at capture and only the device
    time counts on every replay; a kernel that loses eagerly to its launch overhead can be the faster one
    inside a graph (None: ``priority`` everywhere). ``priority_for``: a priority that depends on the context
    where one number per kernel cannot say it (e.g. a fused low-bit GEMM measured faster for some weight
    formats than the default path and slower for others): its int replaces ``priority`` / ``capture_priority``
    for that context, its None keeps them (None: no such dependence).
    """

    kernel_id: str
    op: str
    fn: Callable[..., Any]
    priority: int = 0
    capture_priority: int | None = None
    description: str = ""
    device_types: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
    sm_min: tuple[int, int] | None = None
    sm_max: tuple[int, int] | None = None
    generations: frozenset[GPUGeneration] | None = None
    cpu_isa: frozenset[str] | None = None
    layouts: frozenset[Layout] | None = None
    head_dim_min: int | None = None
    head_dim_max: int | None = None
    head_dim_multiple: int | None = None
    head_dims_equal: bool = False
    supports_gqa: bool = True
    mask_kinds: frozenset[MaskKind] = frozenset(MaskKind)
    mask_with_causal: bool = True
    supports_causal: bool = True
    supports_dropout: bool = True
    supports_window: bool = False
    supports_softcap: bool = False
    supports_alibi: bool = False
    kv_cache_dtypes: frozenset[torch.dtype] = frozenset()
    supports_backward: bool = True
    requires_stride_last_1: bool = False
    requires_aligned_16: bool = False
    max_seq_len: int | None = None
    deterministic: bool = True
    graph_safe: bool = True
    is_reference: bool = False
    check: Callable[[SelectionContext], list[Reason]] | None = None
    workspace: Callable[[SelectionContext], int] | None = None
    specialize: Callable[[SelectionContext], Callable[..., Any] | None] | None = None
    priority_for: Callable[[SelectionContext], int | None] | None = None

    @property
    def backend(self) -> str:
        """Backend id: the part of ``kernel_id`` before the first dot."""
        return self.kernel_id.split(".", 1)[0]

    def workspace_bytes(self, ctx: SelectionContext) -> int:
        """Scratch memory this kernel needs for ``ctx``, in bytes (0 when it declares none)."""
        return 0 if self.workspace is None else int(self.workspace(ctx))

    def constraints(self) -> dict[str, Any]:
        """The data constraints as JSON-ready values (for ``lz.list_kernels`` and the docs)."""
        out: dict[str, Any] = {}
        for name in (
            "priority",
            "capture_priority",
            "device_types",
            "dtypes",
            "sm_min",
            "sm_max",
            "generations",
            "layouts",
            "head_dim_min",
            "head_dim_max",
            "head_dim_multiple",
            "head_dims_equal",
            "supports_gqa",
            "mask_kinds",
            "mask_with_causal",
            "supports_causal",
            "supports_dropout",
            "supports_window",
            "supports_softcap",
            "supports_alibi",
            "supports_backward",
            "kv_cache_dtypes",
            "requires_stride_last_1",
            "requires_aligned_16",
            "max_seq_len",
            "deterministic",
            "graph_safe",
            "cpu_isa",
        ):
            value = getattr(self, name)
            if isinstance(value, frozenset):
                value = sorted(_plain(v) for v in value)
            out[name] = value
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return value.name if isinstance(value, enum.IntEnum) else value.value
    return value


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A backend: id, the Python module it needs, installed version, and whether it is usable here.

    A missing library leaves the backend registered but unavailable, with the reasons
    (``BACKEND_NOT_INSTALLED``), never an import error of ``layerzero``.
    """

    backend_id: str
    import_name: str | None
    version: str | None
    available: bool
    reasons: tuple[Reason, ...] = ()
    description: str = ""


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """What dispatch runs for one cache key: the chosen kernel and how to call it.

    ``call`` takes the op's canonical positional arguments; when the kernel needs another layout it is a
    wrapper that transposes inputs and the output (``transforms`` names them). ``fallbacks`` are the other
    eligible kernels' plans in score order, tried if this one raises at run time (never for a lock).
    ``recheck_at`` (``time.monotonic()`` seconds) asks dispatch to select again once a tripped backend's
    cooldown ends; ``trial`` marks a plan whose backend is on probation (half-open circuit breaker).

    Calling a plan (``plan(*args)``, what ``lz.select`` returns) runs the kernel directly with the op's
    canonical positional arguments (attention: ``(q, k, v, attn_mask, is_causal, scale,
    dropout_p)``; see ``docs/architecture.md``): no input checks, no cache lookup, no fallback and no
    ``lz.trace`` count, about 1 µs over the kernel on the AVX2 CI CPU
    (benchmarks/results/dispatch_cpu_avx2.md). For loops over inputs of the exact shape/flags the plan was
    selected for.
    """

    op: str
    kernel_id: str
    call: Callable[..., Any]
    transforms: tuple[str, ...] = ()
    locked: bool = False
    fallbacks: tuple[ExecutionPlan, ...] = ()
    report: Any = field(default=None, compare=False, repr=False)
    recheck_at: float | None = None
    trial: bool = False

    @property
    def backend(self) -> str:
        """Backend id of the chosen kernel."""
        return self.kernel_id.split(".", 1)[0]

    def __call__(self, *args: Any) -> Any:
        return self.call(*args)
