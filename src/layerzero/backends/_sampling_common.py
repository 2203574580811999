"""The sampling math every backend shares (not a backend): the counter-based noise of seeded rows
(:func:`counter_hash`, :func:`seeded_exponential`), the exponential race and the temperature / top-k / top-p
cut (:func:`scaled_cut`). One definition, so a seed gives the same stream in the reference, torch_native and
Triton samplers; each backend imports it from here, never from another backend (import-linter's independence
contract)."""

from __future__ import annotations

import math

import torch

__all__ = [
    "GOLDEN32",
    "GREEDY_BELOW",
    "MASK32",
    "counter_hash",
    "exponential_race",
    "kth_mass",
    "lowbias32",
    "mul32",
    "ranked_above",
    "scaled_cut",
    "seeded_exponential",
]


GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)
"""Temperatures below this (float32's smallest normal, ~1.18e-38; ``lz.sample_*`` already maps them to 0) are
greedy: ``1 / T`` would not fit in float32, and the T -> 0+ limit of the softmax is one-hot at the maximum."""


MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
"""2**32 / golden ratio: added before each hash step so that all-zero inputs do not hash to 0 (lowbias32(0) =
0)."""


def mul32(x, c: int):
    """``(x * c) mod 2**32`` for ``0 <= x, c < 2**32`` without leaving int64: ``c`` is split into 16-bit
    halves, so no product exceeds ``2**48`` (signed int64 overflow would be undefined behaviour on some
    devices). ``x`` is a Python int or an int64 tensor."""
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
    """32-bit hash of (seed, offset, token index): both 32-bit halves of the int64 ``seed`` and ``offset`` and
    the index, each folded in by one ``lowbias32`` step. Python ints or broadcastable int64 tensors; every
    intermediate value stays in ``[0, 2**49)``."""
    h = _mix(0, seed & MASK32)
    h = _mix(h, (seed >> 32) & MASK32)
    h = _mix(h, offset & MASK32)
    h = _mix(h, (offset >> 32) & MASK32)
    return _mix(h, index & MASK32)


def seeded_exponential(seeds: torch.Tensor, offsets: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[B, V]`` float64 from (seed, offset, token index) alone: ``u = (h + 0.5) / 2**32`` in
    (0, 1), ``E = -log(u)``. The same (seed, offset) gives the same row on any device and in any batch."""
    seeds = seeds.to(torch.int64)[:, None]
    offsets = torch.zeros_like(seeds) if offsets is None else offsets.to(torch.int64)[:, None]
    index = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    h = counter_hash(seeds, offsets, index)
    return -torch.log((h.to(torch.float64) + 0.5) * 2.0**-32)


def _cut_sorted(
    sorted_z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
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


def scaled_cut(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The first steps of :func:`sample`: ``(x, z, greedy)`` with ``x`` the logits ``[B, V]`` in float32
    (float64 for float64), ``z = (x - rowmax) / T`` with top-k then top-p cuts applied as ``-inf``, and
    ``greedy`` the ``[B]`` bool rows with ``T <`` :data:`GREEDY_BELOW` (None without ``temperature``; those
    rows divide by 1)."""
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


# ----------------------------------------------------------- sort-free cuts (pivot rejection: torch_native)
def ranked_above(z: torch.Tensor, pz: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` bool: the tokens ranked above the pivot token ``(pz, pi)`` (``[B]`` value and index) in the
    cuts' order -- larger ``z`` first, equal ``z`` by lower token id (the stable descending sort of
    :func:`_cut_sorted`). The pivot ``(-inf, V)`` ranks below every token."""
    idx = torch.arange(z.shape[-1], device=z.device)[None, :]
    return (z > pz[:, None]) | ((z == pz[:, None]) & (idx < pi[:, None]))


def kth_mass(z: torch.Tensor, e: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[B]``: the mass ``sum(e)`` of each row's top-k set ``z >= `` its k-th largest value (ties at the
    k-th kept; ``k`` ``[B]`` int64 in ``[1, V]``). Uses ``torch.topk`` of the largest k of the batch (k values
    per row, not a sort of the row); ``k.max()`` is read on the host."""
    kmax = int(k.max())
    kth = torch.topk(z, kmax, dim=-1).values.gather(-1, (k - 1)[:, None])
    return torch.where(z >= kth, e, torch.zeros_like(e)).sum(dim=-1)
