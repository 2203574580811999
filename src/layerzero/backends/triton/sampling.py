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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core import knobs
from layerzero.core.knobs import check_types, require
from layerzero.core.specs import KernelSpec

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, cdiv, missing, next_pow2
from ._launch import launch, launch_pinned, pdl_kwargs
from ._paged_common import sm_count

KERNEL_IDS = ("triton.sample_topk", "triton.sample_topp", "triton.sample", "triton.sample_greedy")
GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)
"""Temperatures below float32's smallest normal are greedy (as in ``lz.sample_*``): ``1 / T`` would
overflow."""
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
KNOBS = "triton.sampling"
"""The name :class:`SamplingKnobs` is registered under (``layerzero.core.knobs``)."""


@dataclass(frozen=True, slots=True)
class SamplingKnobs:
    """Tuning choices of the Triton samplers (tiles and split rules), registered as ``"triton.sampling"``;
    read once per call; measurements in ``benchmarks/results/knobs/triton_sampling.md``. Every value gives the
    same token ids. Raises ``ConfigurationError`` for a field of the wrong type or out of range."""

    block: int = 1024
    """Row tile of the inverse-CDF draw kernel (elements, a power of two); shorter rows use their next power
    of two."""
    race_block: int = 4096
    """Row tile of ``lz.sample``'s one-program-per-row race kernel (elements, a power of two)."""
    split_programs: int = 1056
    """:func:`sample` races ``B`` rows over ``ceil(split_programs / B)`` chunks a row (one program a row when
    that is one): eight programs per SM of an H100 / H200, up to 10x faster than a program a row at
    batch 1."""
    split_block: int = 2048
    """Row tile of the split-vocabulary race kernels (elements, a power of two); a chunk is a whole number of
    tiles."""
    greedy_block: int = 2048
    """Tile of ``triton.sample_greedy``'s chunk kernel (elements, a power of two: 16 a thread at 4 warps). Not
    tuned on a GPU yet."""
    greedy_programs_per_sm: int = 2
    """:func:`greedy_chunks` aims at this many chunk programs per SM: a batch-1 row over the whole GPU in one
    wave, a short vector for the merge. Not tuned on a GPU yet."""
    greedy_sms_off_gpu: int = 132
    """The SM count :func:`sample_greedy` assumes off CUDA (the CPU tests' interpreter): an H100 / H200's, so
    those tests split rows as those GPUs do."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("block", "race_block", "split_block", "greedy_block"):
            value = getattr(self, name)
            require(value >= 1 and next_pow2(value) == value, self, name, "a power of two >= 1")
        for name in ("split_programs", "greedy_programs_per_sm", "greedy_sms_off_gpu"):
            require(getattr(self, name) >= 1, self, name, "an int >= 1")


knobs.register(KNOBS, SamplingKnobs())
_KERNELS = LazyModule("_sampling_kernels")
_SPLIT_KERNELS = LazyModule("_sampling_split_kernels")
_GREEDY_KERNELS = LazyModule("_greedy_kernels")


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


def split_chunks(n_rows: int, vocab: int, kn: SamplingKnobs | None = None) -> tuple[int, int]:
    """``(n_chunks, chunk_len)`` of :func:`sample`'s split path by the ``split_programs`` rule (``kn``: the
    knobs, default those in force): ``n_chunks == 1`` means one program per row (``_race_row``). ``chunk_len``
    is a whole number of ``split_block`` tiles."""
    kn = kn or knobs.get(KNOBS)
    return row_chunks(n_rows, vocab, kn.split_programs, kn.split_block)


def row_chunks(n_rows: int, vocab: int, programs: int, block: int) -> tuple[int, int]:
    """``(n_chunks, chunk_len)``: each of ``n_rows`` rows of ``vocab`` columns cut into chunks of a whole
    number of ``block``-column tiles (the last chunk shorter), about ``programs`` chunks in all, at least one
    a row and at most one a tile; ``(1, vocab)`` when that leaves one chunk a row."""
    tiles = cdiv(vocab, block)
    want = min(tiles, cdiv(programs, max(n_rows, 1)))
    if want < 2:
        return 1, vocab
    per_chunk = cdiv(tiles, want)
    return cdiv(tiles, per_chunk), per_chunk * block


def chunk_pad(vocab: int, kn: SamplingKnobs | None = None) -> int:
    """The split kernels' compile-time chunk-vector width for a ``vocab``-column row: the next power of two of
    the most chunks any batch size gives that vocabulary (one per ``split_block`` tile), so every batch size
    runs one compiled variant (a width that changed with the batch compiled variants inside the engine's timed
    runs)."""
    return next_pow2(cdiv(vocab, (kn or knobs.get(KNOBS)).split_block))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    split: bool | None = None,
) -> torch.Tensor:
    """``lz.sample`` with the exponential race fused in Triton: the semantics of ``reference.sample`` (vLLM v1
    ``Sampler``, HF warper order), whose docstring gives them.

    Args:
        logits: ``[B, V]`` float16/bfloat16/float32 on CUDA (float32 math).
        temperature, top_k, top_p, min_p, seeds, offsets: ``[B]`` per-row tensors or None, as ``lz.sample``.
        generator: CUDA ``torch.Generator`` or None (the device's default): one int64 per call is drawn from
            it (``torch.randint``, on the device: no host synchronization) as the noise seed of unseeded rows.
        split: None (default) picks the path by the ``split_programs`` rule (:func:`split_chunks`); True
            forces the split-vocabulary path with the chunks of a one-row batch (one program per row still
            when the row fits one ``split_block`` tile), False the one-program-per-row kernel. Both give the
            same token ids.

    Returns:
        Token ids ``[B]``, int64.

    What runs where: without top-k / top-p, only Triton kernels. Few rows (``B < split_programs`` with
    ``V > split_block``; decode batches): three launches over ``(B, chunks)`` / ``(B, chunks)`` / ``(B,)``
    programs (``_sampling_split_kernels.py``: chunk maxima; row max then the race over each chunk; the merge),
    with two ``[B, 2, chunks]`` partial buffers; many rows: one launch of ``_race_row``, one program per row,
    two reads of the row. The split path returns exactly ``_race_row``'s ids (same scores, the smallest column
    among equal maxima). The reference makes about a dozen ``[B, V]`` passes. With top-k or top-p the cut
    needs the sorted row: ``torch.sort`` and the cut as the reference computes them
    (``_sampling_common._cut_sorted``), then the kernels race over the cut row. Seeded rows (``seed >= 0``)
    draw the reference's counter-based noise, so they pick the reference's token up to float32 rounding of
    ``z`` and of the logarithms (near-ties only); unseeded rows draw the same noise hashed from the call's
    random seed and their row index instead of ``torch.exponential_`` (same distribution, another stream). The
    min-p cut is ``exp(z) < min_p`` (``prob / max prob`` without the softmax sum; the reference rounds the
    normalized probabilities, which can differ exactly at the boundary). No host synchronization on either
    path; every buffer is a ``torch.empty`` on the current stream.

    Raises:
        Nothing of its own (``lz.sample`` validates).
    """
    from layerzero.backends._sampling_common import scaled_cut

    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_rows, vocab = logits.shape
    greedy = None
    if top_k is not None or top_p is not None:
        x, logits, greedy = scaled_cut(logits, temperature, top_k, top_p)
        temperature = None  # already applied (the cut row's max is 0: the kernel's (z - 0) / 1 is exact)
    if seeds is not None and offsets is None:
        offsets = torch.zeros_like(seeds)
    base = torch.randint(0, 1 << 62, (1,), generator=generator, device=logits.device, dtype=torch.int64)
    out = torch.empty((n_rows,), dtype=torch.int64, device=logits.device)
    dummy = out  # a pointer for absent tensors (their HAS_* flag keeps the kernel from reading it)
    t_arg = temperature if temperature is not None else dummy
    rest = (
        min_p if min_p is not None else dummy,
        seeds if seeds is not None else dummy,
        offsets if offsets is not None else dummy,
        base,
    )
    flags = dict(HAS_T=temperature is not None, HAS_MINP=min_p is not None, HAS_SEEDS=seeds is not None)
    tiny = float(torch.finfo(torch.float32).tiny)
    kn = knobs.get(KNOBS)
    n_chunks, chunk_len = (
        (1, vocab) if split is False or n_rows == 0 else split_chunks(1 if split else n_rows, vocab, kn)
    )
    if n_chunks > 1:
        mod = _SPLIT_KERNELS.get()
        fp = torch.empty((n_rows, 2, n_chunks), dtype=torch.float32, device=logits.device)
        ip = torch.empty((n_rows, 2, n_chunks), dtype=torch.int32, device=logits.device)
        chunks = chunk_pad(vocab, kn)
        launch(
            mod._split_max,
            (n_rows, n_chunks),
            logits,
            fp,
            ip,
            logits.stride(0),
            vocab,
            chunk_len,
            n_chunks,
            BLOCK=kn.split_block,
            num_warps=4,
        )
        launch(
            mod._split_race,
            (n_rows, n_chunks),
            logits,
            t_arg,
            *rest,
            fp,
            ip,
            logits.stride(0),
            vocab,
            chunk_len,
            n_chunks,
            GREEDY_BELOW,
            tiny,
            **flags,
            BLOCK=kn.split_block,
            CHUNKS=chunks,
            num_warps=4,
        )
        launch(
            mod._split_merge,
            (n_rows,),
            t_arg,
            fp,
            ip,
            out,
            n_chunks,
            GREEDY_BELOW,
            HAS_T=temperature is not None,
            CHUNKS=chunks,
            num_warps=1 if chunks <= 128 else 4,
        )
    else:
        launch(
            _KERNELS.get()._race_row,
            (n_rows,),
            logits,
            t_arg,
            *rest,
            out,
            logits.stride(0),
            vocab,
            GREEDY_BELOW,
            tiny,
            **flags,
            BLOCK=min(kn.race_block, next_pow2(vocab)),
            num_warps=8,
        )
    if greedy is not None:
        out = torch.where(greedy, torch.argmax(x, dim=-1), out)
    return out


def greedy_chunks(n_rows: int, vocab: int, programs: int, kn: SamplingKnobs | None = None) -> tuple[int, int]:
    """``(n_chunks, chunk_len)`` of :func:`sample_greedy`: each row is cut into ``n_chunks`` chunks of
    ``chunk_len`` columns (a whole number of ``greedy_block`` tiles; the last chunk shorter), about
    ``programs`` programs in all (at least one chunk a row, at most one a tile). ``n_chunks == 1`` means one
    program a row and no merge."""
    return row_chunks(n_rows, vocab, programs, (kn or knobs.get(KNOBS)).greedy_block)


def sample_greedy(logits: torch.Tensor, *, programs: int | None = None) -> torch.Tensor:
    """``lz.sample_greedy`` in Triton: per row the first index of the maximum, or of the first NaN when the
    row holds one (an all ``-inf`` row gives 0), as ``reference.sample_greedy`` defines it, reading the logits
    in their own dtype (no float32 copy).

    Args:
        logits: ``[S, V]`` float16/bfloat16/float32 on CUDA, any strides (a unit column stride is specialized,
            others are read strided, not copied); V below 2**31 - ``greedy_block``.
        programs: the number of chunk programs the split aims at (:func:`greedy_chunks`); None:
            ``greedy_programs_per_sm`` times the device's SMs. Every value gives the same ids.

    Returns:
        Token ids ``[S]``, int64 (a new ``torch.empty`` tensor).

    What runs where (``_greedy_kernels.py``): the ``(S, n_chunks)`` chunk programs, then one merge program a
    row over the chunks' partials (a float32 and an int32 ``[S, n_chunks]`` workspace, ``torch.empty``); with
    one chunk a row (``S >= programs`` or ``V <= greedy_block``) the chunk kernel writes the ids itself: one
    launch. No host synchronization, nothing drawn: graph-safe. PDL-launched inside captured graphs on SM >=
    9.0 for small batches (``_launch.pdl_kwargs``). ``S == 0`` launches nothing.

    Raises:
        Nothing of its own (``lz.sample_greedy`` validates).
    """
    n_rows, vocab = logits.shape
    out = torch.empty((n_rows,), dtype=torch.int64, device=logits.device)
    if n_rows == 0:
        return out
    mod = _GREEDY_KERNELS.get()
    kn = knobs.get(KNOBS)
    if programs is None:
        programs = kn.greedy_programs_per_sm * (
            sm_count(logits.device) if logits.is_cuda else kn.greedy_sms_off_gpu
        )
    n_chunks, chunk_len = greedy_chunks(n_rows, vocab, programs, kn)
    s_row, s_col = logits.stride()
    pdl = pdl_kwargs(logits, n_rows)
    block, direct = kn.greedy_block, n_chunks == 1
    # one pin per set of integer arguments and constexprs (launch_pinned's promise): tensors alone vary under
    # it
    pin = (s_row, s_col, vocab, chunk_len, n_chunks, block, bool(pdl))
    if direct:
        launch_pinned(
            mod._greedy_chunk,
            pin,
            (n_rows, 1),
            logits,
            out,
            out,
            out,
            s_row,
            s_col,
            vocab,
            chunk_len,
            1,
            BLOCK=block,
            CONTIG=s_col == 1,
            DIRECT=True,
            **pdl,
            num_warps=4,
        )
        return out
    pv = torch.empty((n_rows, n_chunks), dtype=torch.float32, device=logits.device)
    pi = torch.empty((n_rows, n_chunks), dtype=torch.int32, device=logits.device)
    launch_pinned(
        mod._greedy_chunk,
        pin,
        (n_rows, n_chunks),
        logits,
        pv,
        pi,
        out,
        s_row,
        s_col,
        vocab,
        chunk_len,
        n_chunks,
        BLOCK=block,
        CONTIG=s_col == 1,
        DIRECT=False,
        **pdl,
        num_warps=4,
    )
    chunks = next_pow2(cdiv(vocab, block))  # one compiled merge per vocabulary, whatever the batch
    launch_pinned(
        mod._greedy_merge,
        (n_chunks, chunks, bool(pdl)),
        (n_rows,),
        pv,
        pi,
        out,
        n_chunks,
        CHUNKS=chunks,
        **pdl,
        num_warps=1 if chunks <= 256 else 4,
    )
    return out


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
            "chunks for few rows (counter-based noise; torch.sort first only for top-k/top-p)",
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
