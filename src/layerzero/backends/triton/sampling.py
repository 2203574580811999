"""``triton.sample_topk`` / ``triton.sample_topp``: token sampling with a Triton inverse-CDF draw,
``triton.sample`` (``lz.sample``: the exponential race fused, see :func:`sample`) and ``triton.sample_greedy``
(``lz.sample_greedy``: a split-vocabulary first argmax, see :func:`sample_greedy`); CUDA only.

What runs where (one call, logits ``[B, V]``):

- torch: ``u = torch.rand([B], generator=generator, dtype=float32)`` (one uniform per row from the caller's
  generator, so the same seed gives the same tokens); the candidate set: ``torch.topk(logits, k)`` for top-k
  (sorted descending), ``torch.sort(logits, descending=True, stable=True)`` for top-p; ``torch.argmax`` for
  greedy calls (``temperature == 0``, and ``k == 1``).
- Triton (``_sampling_kernels.py``), one program per row, one launch: temperature scaling, the online
  softmax statistics, the top-p cut and the inverse-CDF draw over the kept set. Without a cut (``k >= V`` or
  ``p >= 1``) it reads the raw logits in token order with no sort at all.

Against the reference (softmax over V in float32, ``topk``/``sort`` of the probabilities, renormalization,
``torch.multinomial``: 6-8 launches and several ``[B, V]`` float32 temporaries) this does no full-vocabulary
softmax pass or temporary: the top-k path reads V once (``topk``) and k values three times; the no-cut path
reads V twice and allocates nothing but the ``[B]`` outputs.

Ordering (how equal values are drawn): selection is made on the logits, not on rounded probabilities; the
top-k set and its ties at the k-th place follow ``torch.topk`` on the logits; top-p ranks equal logits by
lower token id first (stable sort), as the reference does. ``temperature == 0`` and ``k == 1`` return
``argmax`` (first index on ties). Rows whose logits are all ``-inf`` or contain NaN return position 0 of the
candidate list (the reference's ``torch.multinomial`` raises there).

Not graph-safe: a user ``torch.Generator`` must be registered with the CUDA graph to be captured
(``torch.cuda.CUDAGraph.register_generator_state``), which LayerZero does not do. ``triton.sample_greedy``
draws nothing and is graph-safe.

This module holds the inverse-CDF samplers (:func:`draw`, :func:`sample_topk`, :func:`sample_topp`) and the
KernelSpecs, and re-exports the names of the modules it was split into: ``_sampling_knobs.py``
(:class:`SamplingKnobs`, registered there, and the row-chunk rule), ``_sampling_race.py`` (:func:`sample`) and
``_sampling_greedy.py`` (:func:`sample_greedy`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from layerzero.core import knobs
from layerzero.core.specs import KernelSpec

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, missing, next_pow2
from ._launch import launch
from ._sampling_greedy import greedy_chunks, sample_greedy  # noqa: F401 - re-exported
from ._sampling_knobs import GREEDY_BELOW, KNOBS, SamplingKnobs, row_chunks  # noqa: F401 - re-exported
from ._sampling_race import chunk_pad, sample, split_chunks  # noqa: F401 - re-exported

KERNEL_IDS = ("triton.sample_topk", "triton.sample_topp", "triton.sample", "triton.sample_greedy")
PRIORITY = 60
"""Above the reference sampler (the only other sampling kernel on CUDA)."""
PRIORITY_SAMPLE = 5
"""``triton.sample`` ranks above ``reference.sample`` (priority 0) on CUDA: faster on the H200 for
temperature-only sampling (1.15x-3.1x), about even with top-p; ``lz.tune`` / autotune measure the top-p
contexts per machine (``benchmarks/results/knobs/triton_sampling.md``)."""
PRIORITY_GREEDY = 60
"""``triton.sample_greedy`` ranks above ``reference.sample_greedy`` (0), the only other kernel: on CUDA it is
the default, eagerly and under capture (H200: 2.67 µs at 1 row against 11.29 for the float32 cast + argmax;
``benchmarks/results/knobs/triton_sampling.md``)."""

_KERNELS = LazyModule("_sampling_kernels")


def uniforms(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One float32 uniform in [0, 1) per row: ``torch.rand([B], generator=generator,
    device=logits.device)``."""
    return torch.rand((logits.shape[0],), generator=generator, device=logits.device, dtype=torch.float32)


def draw(
    logits: torch.Tensor,
    u: torch.Tensor,
    *,
    k: int | None = None,
    p: float | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The deterministic part of sampling: inverse-CDF draw with given uniforms (no generator involved).

    Args:
        logits: ``[B, V]`` float16/bfloat16/float32 (``stride(-1)`` any; non-unit strides are copied).
        u: ``[B]`` uniforms in [0, 1) (float32 or float64; read as float32), on logits' device.
        k: top-k cut (int >= 1) or None; ``k >= V`` means no cut.
        p: top-p cut in (0, 1] or None; ``p >= 1`` means no cut. At most one of k and p.
        temperature: > 0 (``0``, or below float32's smallest normal where ``1 / T`` overflows, returns
            ``argmax`` and ignores u); the kernel scales ``logit - max``, so a tiny T gives the argmax, never
            NaN.

    Returns:
        Token ids ``[B]``, int64: for each row the first kept token (in candidate order: descending logit,
        see the module docstring) whose cumulative probability exceeds ``u * kept_mass``.

    Raises:
        Nothing of its own (inputs are validated by ``lz.sample_topk`` / ``lz.sample_topp``).
    """
    if temperature < GREEDY_BELOW or k == 1:
        return torch.argmax(logits, dim=-1)
    block = knobs.get(KNOBS).block
    mod = _KERNELS.get()
    n_rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty((n_rows,), dtype=torch.int64, device=logits.device)
    idx: torch.Tensor | None = None
    top_p = False
    if k is not None and k < vocab:
        rows, idx = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
    elif p is not None and p < 1.0:
        rows, idx = torch.sort(logits, dim=-1, descending=True, stable=True)
        top_p = True
    else:
        rows = logits
    launch(
        mod._sample_row,
        (n_rows,),
        rows,
        idx if idx is not None else out,
        u,
        out,
        rows.stride(0),
        idx.stride(0) if idx is not None else 0,
        rows.shape[1],
        1.0 / float(temperature),
        float(p) if top_p else 1.0,
        HAS_IDX=idx is not None,
        TOP_P=top_p,
        BLOCK=min(block, next_pow2(rows.shape[1])),
        num_warps=4,
    )
    return out


def sample_topk(
    logits: torch.Tensor, k: int, temperature: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Top-k sampling (Fan et al. 2018): logits ``[B, V]`` (float16/bfloat16/float32) -> token ids ``[B]``
    int64. Draws ``u`` with :func:`uniforms` (nothing drawn when ``temperature == 0`` or ``k == 1``), then
    :func:`draw`. Raises nothing of its own (``lz.sample_topk`` validates)."""
    if temperature < GREEDY_BELOW or k == 1:
        return torch.argmax(logits, dim=-1)
    return draw(logits, uniforms(logits, generator), k=k, temperature=temperature)


def sample_topp(
    logits: torch.Tensor, p: float, temperature: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2019): logits ``[B, V]`` (float16/bfloat16/float32) -> token ids
    ``[B]`` int64. Draws ``u`` with :func:`uniforms` (not when ``temperature == 0``), then :func:`draw`.
    Raises nothing of its own (``lz.sample_topp`` validates)."""
    if temperature < GREEDY_BELOW:
        return torch.argmax(logits, dim=-1)
    return draw(logits, uniforms(logits, generator), p=p, temperature=temperature)


def kernel_specs(available: bool, why: str) -> list[KernelSpec]:
    """``[triton.sample_topk, triton.sample_topp, triton.sample, triton.sample_greedy]``; their callables
    raise ``BackendNotAvailableError`` (with ``why``) when ``available`` is False."""
    fns: tuple[Callable[..., Any], ...] = (
        (sample_topk, sample_topp, sample, sample_greedy)
        if available
        else tuple(missing(k, why) for k in KERNEL_IDS)
    )
    common: dict[str, Any] = dict(
        priority=PRIORITY,
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        deterministic=True,
        graph_safe=False,
        supports_backward=False,
    )
    return [
        KernelSpec(
            KERNEL_IDS[0],
            "sample_topk",
            fns[0],
            description="torch.topk on the logits + Triton softmax/inverse-CDF draw (caller's generator)",
            **common,
        ),
        KernelSpec(
            KERNEL_IDS[1],
            "sample_topp",
            fns[1],
            description="stable torch.sort on the logits + Triton softmax/nucleus cut/inverse-CDF draw",
            **common,
        ),
        KernelSpec(
            KERNEL_IDS[2],
            "sample",
            fns[2],
            description="lz.sample's exponential race in Triton: one launch, or three over vocabulary "
            "chunks for few rows (counter-based noise); top-k / top-p by pivot rejection, no sort",
            **{**common, "priority": PRIORITY_SAMPLE},
        ),
        KernelSpec(
            KERNEL_IDS[3],
            "sample_greedy",
            fns[3],
            description="first argmax (NaN rule explicit) over vocabulary chunks in the logits' own dtype, "
            "then a merge of the chunks' partials (graph-safe)",
            **{**common, "priority": PRIORITY_GREEDY, "graph_safe": True},
        ),
    ]
