"""Reference token samplers (greedy, top-k, top-p / nucleus, batched per-row sampling): the oracles for sampling
kernels.

Plain PyTorch: probabilities in float32 (float64 for float64 logits). ``sample_topk`` / ``sample_topp`` draw with
``torch.multinomial`` on the caller's ``torch.Generator`` so a fixed seed gives the same tokens; ``sample`` draws
by the exponential race, with per-row counter-based noise for seeded rows (:func:`seeded_exponential`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["counter_hash", "lowbias32", "sample", "sample_greedy", "sample_topk", "sample_topp", "seeded_exponential"]


GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)
"""Temperatures below this (float32's smallest normal, ~1.18e-38; ``lz.sample_*`` already maps them to 0) are
greedy: ``1 / T`` would not fit in float32, and the T -> 0+ limit of the softmax is one-hot at the maximum."""


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` over the vocabulary, float32 (float64 for float64 logits), computed as
    ``softmax((logits - rowmax) / temperature)``: equal in exact arithmetic, but a tiny temperature sends the
    non-maximal entries to ``-inf`` (probability 0) instead of overflowing ``logits / T`` to ``inf`` (NaN)."""
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(cdt)
    return torch.softmax((x - x.amax(dim=-1, keepdim=True)) / float(temperature), dim=-1)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1).to(torch.int64)


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy decoding: per row the index of the first maximum of the logits, NaN rules written out.

    Per row: the index of its first NaN when it holds one (as ``torch.argmax`` answers on the builds we know, but
    computed here explicitly, so the oracle does not depend on one build's NaN handling); otherwise the first index
    of the maximum (ties -> the lowest index: ``torch.argmax``'s documented rule, applied to NaN-free values), so an
    all ``-inf`` row gives 0 and ``+inf`` is a maximum like any other. float16 / bfloat16 are compared in float32
    (an exact cast: the answer is ``argmax`` of ``logits.float()``), float64 in float64.

    Args:
        logits: ``[S, V]`` (S >= 0 rows, V >= 1 vocabulary), any float dtype, any strides.

    Returns:
        Token ids ``[S]``, int64, each in ``[0, V)``.

    Raises:
        Nothing of its own: validation is the ops layer's job (``lz.sample_greedy``).

    >>> sample_greedy(torch.tensor([[0.0, 5.0, 5.0], [1.0, float("nan"), 9.0]]))
    tensor([1, 1])
    """
    x = logits if logits.dtype == torch.float64 else logits.float()
    nan = torch.isnan(x)
    first_nan = nan.to(torch.int8).argmax(dim=-1)  # the first 1 of each row (0 when the row has none: unused)
    first_max = x.masked_fill(nan, -math.inf).argmax(dim=-1)
    return torch.where(nan.any(dim=-1), first_nan, first_max).to(torch.int64)


def sample_topk(
    logits: torch.Tensor,
    k: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Top-k sampling (Fan et al. 2018): draw from the k most probable tokens, renormalized.

    Steps: ``p = softmax(logits / temperature)``; keep the k largest (``torch.topk`` order, which also
    decides ties at the k-th place); renormalize; draw one token per row with
    ``torch.multinomial(generator=generator)``.

    Args:
        logits: ``[B, V]`` (B batch rows, V vocabulary size), any float dtype.
        k: number of tokens kept (int >= 1); ``k >= V`` means no truncation.
        temperature: softmax temperature (> 0); ``temperature == 0`` (or below :data:`GREEDY_BELOW`) means
            greedy: ``argmax`` of the logits (first index on ties), no random draw and ``generator`` untouched.
        generator: ``torch.Generator`` on logits' device, or None for the global RNG.

    Returns:
        Token ids ``[B]``, int64, each in ``[0, V)``.

    Raises:
        Nothing of its own: validation (k >= 1, temperature >= 0, rank 2) is the ops layer's job.

    >>> sample_topk(torch.tensor([[0.0, 5.0, 1.0]]), k=1)
    tensor([1])
    """
    if temperature < GREEDY_BELOW:
        return _greedy(logits)
    probs = _probs(logits, temperature)  # [B, V]
    k = min(int(k), probs.shape[-1])
    top_p, top_idx = torch.topk(probs, k, dim=-1)  # [B, k], descending
    top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    choice = torch.multinomial(top_p, 1, generator=generator)  # [B, 1] positions within the top k
    return top_idx.gather(-1, choice).squeeze(-1).to(torch.int64)


def sample_topp(
    logits: torch.Tensor,
    p: float,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Nucleus (top-p) sampling (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration").

    Steps: ``probs = softmax(logits / temperature)``; sort descending (stable: on equal probabilities the
    lower token id ranks first); keep the smallest prefix whose cumulative probability is ``>= p``, that is
    every token whose cumulative probability *before* it is ``< p`` (the most probable token is always
    kept); renormalize; draw one token per row with ``torch.multinomial(generator=generator)``.

    Args:
        logits: ``[B, V]`` (B batch rows, V vocabulary size), any float dtype.
        p: cumulative probability mass kept, in (0, 1]; ``p >= 1.0`` means no truncation (so float
            rounding in the cumulative sum never drops tail tokens).
        temperature: softmax temperature (> 0); ``temperature == 0`` (or below :data:`GREEDY_BELOW`) means
            greedy ``argmax`` (first index on ties).
        generator: ``torch.Generator`` on logits' device, or None for the global RNG.

    Returns:
        Token ids ``[B]``, int64, each in ``[0, V)``.

    Raises:
        Nothing of its own: validation (0 < p <= 1, temperature >= 0, rank 2) is the ops layer's job.

    >>> sample_topp(torch.tensor([[0.0, 9.0, 1.0]]), p=0.5)
    tensor([1])
    """
    if temperature < GREEDY_BELOW:
        return _greedy(logits)
    probs = _probs(logits, temperature)  # [B, V]
    if p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(torch.int64)
    sorted_p, sorted_idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    mass_before = torch.cat((torch.zeros_like(cum[..., :1]), cum[..., :-1]), dim=-1)  # mass ranked above
    keep = mass_before < p
    keep[..., 0] = True
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    kept = kept / kept.sum(dim=-1, keepdim=True)
    choice = torch.multinomial(kept, 1, generator=generator)  # [B, 1] positions in sorted order
    return sorted_idx.gather(-1, choice).squeeze(-1).to(torch.int64)


# ------------------------------------------------------------------------------------------- lz.sample
MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
"""2**32 / golden ratio: added before each hash step so that all-zero inputs do not hash to 0 (lowbias32(0) = 0)."""


def mul32(x, c: int):
    """``(x * c) mod 2**32`` for ``0 <= x, c < 2**32`` without leaving int64: ``c`` is split into 16-bit halves,
    so no product exceeds ``2**48`` (signed int64 overflow would be undefined behaviour on some devices). ``x``
    is a Python int or an int64 tensor."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def lowbias32(x):
    """Chris Wellons' ``lowbias32`` integer hash (hash-prospector), a 32-bit -> 32-bit bijection; ``x`` is a
    Python int or an int64 tensor of values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix(h, v):
    return lowbias32(((h ^ v) + GOLDEN32) & MASK32)


def counter_hash(seed, offset, index):
    """32-bit hash of (seed, offset, token index): both 32-bit halves of the int64 ``seed`` and ``offset`` and the
    index, each folded in by one ``lowbias32`` step. Python ints or broadcastable int64 tensors; every
    intermediate value stays in ``[0, 2**49)``."""
    h = _mix(0, seed & MASK32)
    h = _mix(h, (seed >> 32) & MASK32)
    h = _mix(h, offset & MASK32)
    h = _mix(h, (offset >> 32) & MASK32)
    return _mix(h, index & MASK32)


def seeded_exponential(seeds: torch.Tensor, offsets: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[B, V]`` float64 from (seed, offset, token index) alone: ``u = (h + 0.5) / 2**32`` in (0, 1),
    ``E = -log(u)``. The same (seed, offset) gives the same row on any device and in any batch."""
    seeds = seeds.to(torch.int64)[:, None]
    offsets = torch.zeros_like(seeds) if offsets is None else offsets.to(torch.int64)[:, None]
    index = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    h = counter_hash(seeds, offsets, index)
    return -torch.log((h.to(torch.float64) + 0.5) * 2.0**-32)


def _cut_sorted(sorted_z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k then top-p on scaled logits sorted descending (``[B, V]``): cut entries become ``-inf``."""
    vocab = sorted_z.shape[-1]
    if top_k is not None:
        k = top_k.to(torch.int64)
        k = torch.where((k <= 0) | (k > vocab), vocab, k)  # 0 or >= V: no cut
        kth = sorted_z.gather(-1, (k - 1)[:, None])
        sorted_z = sorted_z.masked_fill(sorted_z < kth, -math.inf)  # ties at the k-th value stay (as HF)
    if top_p is not None:
        probs = torch.softmax(sorted_z, dim=-1)  # the top-k-renormalized distribution
        cum = torch.cumsum(probs, dim=-1)
        before = torch.cat((torch.zeros_like(cum[:, :1]), cum[:, :-1]), dim=-1)  # mass ranked above
        p = top_p.to(sorted_z.dtype)[:, None]
        cut = (before >= p) & (p < 1.0)  # p = 1: no cut, whatever the rounding of the cumulative sum
        cut[:, 0] = False
        sorted_z = sorted_z.masked_fill(cut, -math.inf)
    return sorted_z


def exponential_race(z: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The draw of :func:`sample`: ``argmax(z - log E)`` per row (= ``argmax(probs / E)``, a draw from
    ``softmax(z)`` for ``E ~ Exp(1)``); z ``[B, V]`` scaled, cut logits, noise ``[B, V]`` Exp(1) in z's dtype
    (clamped to the smallest normal before the log). Returns int64 ``[B]``, the first index on ties."""
    return torch.argmax(z - noise.clamp_min(torch.finfo(z.dtype).tiny).log(), dim=-1)


def scaled_cut(logits: torch.Tensor, temperature: torch.Tensor | None, top_k: torch.Tensor | None,
               top_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The first steps of :func:`sample`: ``(x, z, greedy)`` with ``x`` the logits ``[B, V]`` in float32 (float64
    for float64), ``z = (x - rowmax) / T`` with top-k then top-p cuts applied as ``-inf``, and ``greedy`` the
    ``[B]`` bool rows with ``T <`` :data:`GREEDY_BELOW` (None without ``temperature``; those rows divide by 1)."""
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(cdt)
    z = x - x.amax(dim=-1, keepdim=True)
    greedy = None
    if temperature is not None:
        t = temperature.to(cdt)
        greedy = t < GREEDY_BELOW
        z = z / torch.where(greedy, torch.ones_like(t), t)[:, None]
    if top_k is not None or top_p is not None:
        sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
        z = torch.empty_like(z).scatter_(-1, order, _cut_sorted(sorted_z, top_k, top_p))
    return x, z, greedy


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Batched per-row sampling (vLLM v1 ``Sampler`` semantics, Hugging Face ``generate``'s warper order).

    Steps, each row with its own parameters: ``z = (logits - rowmax) / T``; top-k (keep ``z >= `` the k-th
    largest, ties kept); top-p on the top-k-renormalized softmax (keep tokens whose mass ranked above is
    ``< p``); min-p on the softmax after those cuts (keep ``prob >= min_p * max prob``); draw by the exponential
    race ``argmax(z - log E)`` (= ``argmax(probs / E)``, ``E ~ Exp(1)`` per token: a draw from the kept
    distribution). ``E`` is counter-based (:func:`seeded_exponential`) for rows with ``seed >= 0``, from
    ``torch.empty(B, V).exponential_(generator=generator)`` otherwise (drawn once per call for the whole
    ``[B, V]`` when any row may need it, i.e. always: no host synchronization to ask). Rows with ``T <``
    :data:`GREEDY_BELOW` (0 included) return the first argmax of the logits.

    Args:
        logits: ``[B, V]`` (B rows, V vocabulary), any float dtype; float32 math (float64 for float64 logits).
        temperature: ``[B]`` float32 or None (1 for every row).
        top_k: ``[B]`` int32/int64 or None; 0 or ``>= V`` = no cut.
        top_p: ``[B]`` float32 in (0, 1] or None; 1 = no cut.
        min_p: ``[B]`` float32 in [0, 1] or None; 0 = no cut.
        seeds: ``[B]`` int64 or None; ``>= 0`` selects counter-based noise for that row.
        offsets: ``[B]`` int64 or None (zeros): the counter of seeded rows, e.g. tokens generated so far.
        generator: ``torch.Generator`` on logits' device, or None for the global RNG (unseeded rows).

    Returns:
        Token ids ``[B]``, int64, each in ``[0, V)``.

    Raises:
        Nothing of its own: validation is the ops layer's job (``lz.sample``).

    >>> sample(torch.tensor([[0.0, 5.0, 1.0]]), temperature=torch.zeros(1))
    tensor([1])
    """
    b, v = logits.shape
    x, z, greedy = scaled_cut(logits, temperature, top_k, top_p)
    cdt = z.dtype
    if min_p is not None:
        probs = torch.softmax(z, dim=-1)
        z = z.masked_fill(probs < min_p.to(cdt)[:, None] * probs.amax(dim=-1, keepdim=True), -math.inf)
    noise = torch.empty(b, v, dtype=cdt, device=logits.device).exponential_(generator=generator)
    if seeds is not None:
        noise = torch.where((seeds >= 0)[:, None], seeded_exponential(seeds, offsets, v).to(cdt), noise)
    tokens = exponential_race(z, noise)
    if greedy is not None:
        tokens = torch.where(greedy, torch.argmax(x, dim=-1), tokens)
    return tokens.to(torch.int64)
