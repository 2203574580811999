"""Reference token samplers (greedy, top-k, top-p / nucleus, batched per-row sampling): the oracles for
sampling kernels.

Plain PyTorch: probabilities in float32 (float64 for float64 logits). ``sample_topk`` / ``sample_topp`` draw
with ``torch.multinomial`` on the caller's ``torch.Generator`` so a fixed seed gives the same tokens;
``sample`` draws by the exponential race, with per-row counter-based noise for seeded rows
(:func:`seeded_exponential`).
"""

from __future__ import annotations

import math

import torch

from layerzero.backends._sampling_common import (  # the shared math, re-exported
    GOLDEN32,
    GREEDY_BELOW,
    MASK32,
    counter_hash,
    exponential_race,
    lowbias32,
    mul32,
    scaled_cut,
    seeded_exponential,
)

__all__ = [
    "GOLDEN32",
    "GREEDY_BELOW",
    "MASK32",
    "counter_hash",
    "exponential_race",
    "lowbias32",
    "mul32",
    "sample",
    "sample_greedy",
    "sample_topk",
    "sample_topp",
    "scaled_cut",
    "seeded_exponential",
]


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` over the vocabulary, float32 (float64 for float64 logits), computed
    as ``softmax((logits - rowmax) / temperature)``: equal in exact arithmetic, but a tiny temperature sends
    the non-maximal entries to ``-inf`` (probability 0) instead of overflowing ``logits / T`` to ``inf``
    (NaN)."""
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(cdt)
    return torch.softmax((x - x.amax(dim=-1, keepdim=True)) / float(temperature), dim=-1)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1).to(torch.int64)


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy decoding: per row the index of the first maximum of the logits, NaN rules written out.

    Per row: the index of its first NaN when it holds one (as ``torch.argmax`` answers on the builds we know,
    but computed here explicitly, so the oracle does not depend on one build's NaN handling); otherwise the
    first index of the maximum (ties -> the lowest index: ``torch.argmax``'s documented rule, applied to
    NaN-free values), so an all ``-inf`` row gives 0 and ``+inf`` is a maximum like any other. float16 /
    bfloat16 are compared in float32 (an exact cast: the answer is ``argmax`` of ``logits.float()``), float64
    in float64.

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
            greedy: ``argmax`` of the logits (first index on ties), no random draw and ``generator``
            untouched.
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
    ``< p``); min-p on the softmax after those cuts (keep ``prob >= min_p * max prob``); draw by the
    exponential race ``argmax(z - log E)`` (= ``argmax(probs / E)``, ``E ~ Exp(1)`` per token: a draw from the
    kept distribution). ``E`` is counter-based (:func:`seeded_exponential`) for rows with ``seed >= 0``, from
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
