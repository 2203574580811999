"""The distribution ``lz.sample`` draws from and the random streams of its seeded rows, as public functions:
code that must agree with ``lz.sample`` exactly (speculative decoding's rejection sampler, a draft model's
proposals, tests) reads them here instead of re-deriving the warpers or the counter hash. One definition
(``backends/_sampling_common.py``) serves these functions and every ``lz.sample`` kernel, so a seed gives the
same stream everywhere. Not dispatched ops: plain tensor math in float32 (float64 for float64 logits), on
the logits' device."""

from __future__ import annotations

from typing import Any

import torch

from .ops._common import fail as _bad

__all__ = ["sampling_probs", "seeded_exponential", "seeded_uniform"]

UNIFORM_INDEX = 0xFFFFFFFF
"""The counter index of :func:`seeded_uniform`'s default stream: token indices ``[0, V)`` key
:func:`seeded_exponential`'s noise, so the two never share a draw."""


def _rows(fn: str, name: str, t: Any, n: int, device: torch.device, ints: bool) -> None:
    """``t`` None or a ``[n]`` tensor on ``device``, integer when ``ints`` else float."""
    if t is None:
        return
    if not (
        isinstance(t, torch.Tensor)
        and tuple(t.shape) == (n,)
        and t.device == device
        and t.dtype != torch.bool
        and t.is_floating_point() != ints
    ):
        got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        want = f"a [{n}] {'integer' if ints else 'float'} tensor on {device}"
        raise _bad(fn, name, want, got, "Pass one value per row, on the logits' device.")


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The probabilities ``lz.sample(logits, temperature=, top_k=, top_p=, min_p=)`` draws each row's token
    from (vLLM v1's ``Sampler`` semantics, Hugging Face ``generate``'s warper order): ``z = (logits -
    rowmax) / T``; top-k (keep ``z >=`` the k-th largest, ties kept; 0 or ``>= V`` = off); top-p on the
    top-k-renormalized softmax (keep tokens whose mass ranked above is ``< p``; the first always kept); min-p
    on the softmax after those cuts (keep ``prob >= min_p * max prob``); softmax of what is kept. Rows with
    ``T`` below float32's smallest normal (0 included) are greedy: one-hot at the first argmax.

    Args:
        logits: ``[B, V]`` (B rows, V vocabulary), any float dtype.
        temperature: ``[B]`` float or None (1 for every row).
        top_k: ``[B]`` integer or None; top_p: ``[B]`` float in (0, 1] or None; min_p: ``[B]`` float in
            [0, 1] or None. On logits' device.

    Returns:
        ``[B, V]`` float32 (float64 for float64 logits), each row summing to 1 (0 where cut).

    Raises:
        InvalidInputError: logits not a 2-D float tensor; a parameter not a ``[B]`` tensor of the right kind
            on logits' device.
    """
    from .backends._sampling_common import scaled_cut

    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        got = f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor) else type(logits)
        raise _bad("sampling_probs", "logits", "a [B, V] float tensor", got)
    n = logits.shape[0]
    for name, t, ints in (("temperature", temperature, False), ("top_k", top_k, True)):
        _rows("sampling_probs", name, t, n, logits.device, ints)
    for name, t in (("top_p", top_p), ("min_p", min_p)):
        _rows("sampling_probs", name, t, n, logits.device, False)
    x, z, greedy = scaled_cut(logits, temperature, top_k, top_p)
    probs = torch.softmax(z, dim=-1)
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p.to(z.dtype)[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if greedy is not None and bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def _counter_args(fn: str, seeds: Any, offsets: Any) -> tuple[torch.Tensor, torch.Tensor]:
    for name, t in (("seeds", seeds), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dtype == torch.bool:
            got = f"{t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise _bad(fn, name, "an integer tensor (int64 values >= 0)", got)
    try:
        s, o = torch.broadcast_tensors(seeds.to(torch.int64), offsets.to(torch.int64))
    except RuntimeError:
        got = f"{tuple(seeds.shape)} and {tuple(offsets.shape)}"
        raise _bad(fn, "seeds / offsets shapes", "broadcastable", got) from None
    return s, o


def seeded_exponential(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The Exp(1) noise ``lz.sample`` races a seeded row's tokens with: ``E = -log u``, ``u = (h + 0.5) /
    2**32`` with ``h`` the 32-bit counter hash of (seed, offset, token index) (``lowbias32`` folds; Wellons'
    hash-prospector). A function of those three alone: the same on any device, in any batch. ``lz.sample``
    with ``seeds=s, offsets=o`` draws ``argmax(log probs - log E)`` with this ``E``.

    Args:
        seeds: ``[...]`` int64 (``>= 0``); offsets: ``[...]`` int64, broadcastable with ``seeds`` (the
            output position the draw decides); vocab: V >= 1 (int).

    Returns:
        ``[..., V]`` float64 on the seeds' device.

    Raises:
        InvalidInputError: non-integer or non-broadcastable seeds / offsets, vocab not an int >= 1.
    """
    from .backends._sampling_common import counter_hash

    s, o = _counter_args("seeded_exponential", seeds, offsets)
    if vocab.__class__ is not int or vocab < 1:
        raise _bad("seeded_exponential", "vocab", "an int >= 1", repr(vocab))
    idx = torch.arange(vocab, dtype=torch.int64, device=s.device)
    h = counter_hash(s[..., None], o[..., None], idx)
    return -torch.log((h.to(torch.float64) + 0.5) * 2.0**-32)


def seeded_uniform(seeds: torch.Tensor, offsets: torch.Tensor, index: int = UNIFORM_INDEX) -> torch.Tensor:
    """Uniforms in (0, 1) from (seed, offset, ``index``) alone, the stream :func:`seeded_exponential` uses
    for token ``index``: ``(h + 0.5) / 2**32``. The default index (2**32 - 1, :data:`UNIFORM_INDEX`) is no
    token's, so e.g. speculative decoding's acceptance test draws independently of the token noise. A
    counter-based generator (Salmon et al. 2011, "Parallel Random Numbers: As Easy as 1, 2, 3"; the hash is
    Wellons' ``lowbias32``).

    Args:
        seeds, offsets: broadcastable int64 tensors (as :func:`seeded_exponential`); index: an int in
            ``[0, 2**32)``.

    Returns:
        float64, the broadcast shape, on the seeds' device.

    Raises:
        InvalidInputError: as :func:`seeded_exponential`; index out of range.
    """
    from .backends._sampling_common import counter_hash

    s, o = _counter_args("seeded_uniform", seeds, offsets)
    if index.__class__ is not int or not 0 <= index <= 0xFFFFFFFF:
        raise _bad("seeded_uniform", "index", "an int in [0, 2**32)", repr(index))
    h = counter_hash(s, o, torch.full_like(s, index))
    return (h.to(torch.float64) + 0.5) * 2.0**-32
