"""Shapes of the H200 sweep (benchmarks/sweep.py), their seeded inputs, and float64 reference slices.

A :class:`Shape` is one call: ``lz.attention`` prefill (causal, Sq == Skv) or decode (Sq = 1, not causal), or
``lz.paged_attention`` decode / append over a paged KV cache (page = block_size tokens). :func:`full_shapes`
spreads the combinations of the issue (heads, head dims, dtypes) over the (batch, length) grid instead of
taking their product; :func:`quick_shapes` are tiny CPU shapes for tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

import layerzero as lz
from layerzero.core.errors import InvalidInputError, expected_got

__all__ = [
    "DTYPES",
    "Inputs",
    "check_common",
    "Shape",
    "build_inputs",
    "full_shapes",
    "quick_shapes",
    "reference_error",
    "scores_bytes",
]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PHASES = ("prefill", "decode", "paged_decode", "paged_append")
HEADS = ((32, 8), (32, 32), (64, 8), (16, 2))
HEAD_DIMS = (128, 64, 256)
KV_BYTES_MAX = 8 << 30
"""Largest KV cache (K + V bytes) of one generated shape: 8 GiB (the copy-bandwidth buffer doubles it)."""


def check_common(what: str, dtype: str, sizes: dict[str, int], hq: int, hkv: int) -> None:
    """Checks every benchmark shape shares: ``dtype`` one of :data:`DTYPES`, each of ``sizes`` >= 1, ``hq``
    divisible by ``hkv`` (when ``hkv``). ``what`` names the shape in the message (``sweep Shape``).

    Raises:
        InvalidInputError: the first check that fails, expected vs got.
    """
    if dtype not in DTYPES:
        raise InvalidInputError(expected_got(f"{what} dtype", f"one of {sorted(DTYPES)}", repr(dtype)))
    for name, n in sizes.items():
        if n < 1:
            raise InvalidInputError(expected_got(f"{what} {name}", ">= 1", n))
    if hkv and hq % hkv:
        raise InvalidInputError(expected_got(f"{what} heads", "hq divisible by hkv", f"{hq}/{hkv}"))


@dataclass(frozen=True, slots=True)
class Shape:
    """One call of the sweep.

    Attributes:
        phase: ``prefill`` / ``decode`` (``lz.attention``) or ``paged_decode`` / ``paged_append``
            (``lz.paged_attention``).
        batch: B, sequences. q_len: query tokens per sequence (Sq; 1 for decode). kv_len: KV tokens per
            sequence (Skv; for paged shapes the maximum, lengths are drawn in
            ``[ceil(0.75 kv_len), kv_len]``).
        hq, hkv: query / KV heads. head_dim: D. dtype: ``bfloat16`` / ``float16`` / ``float32``.
        page: tokens per KV block (0 for non-paged). seed: input seed.

    Raises:
        InvalidInputError: unknown phase or dtype, a size < 1, ``hq % hkv``, ``q_len > kv_len``, decode with
            ``q_len != 1``, a paged shape without a page size.
    """

    phase: str
    batch: int
    q_len: int
    kv_len: int
    hq: int
    hkv: int
    head_dim: int
    dtype: str
    page: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(what: str, expected: Any, got: Any) -> InvalidInputError:
            return InvalidInputError(expected_got(f"sweep Shape {what}", expected, got))

        if self.phase not in PHASES:
            raise bad("phase", f"one of {PHASES}", repr(self.phase))
        check_common(
            "sweep Shape",
            self.dtype,
            {n: getattr(self, n) for n in ("batch", "q_len", "kv_len", "hq", "hkv", "head_dim")},
            self.hq,
            self.hkv,
        )
        if self.q_len > self.kv_len:
            raise bad("q_len", f"<= kv_len {self.kv_len}", self.q_len)
        if self.phase.endswith("decode") and self.q_len != 1:
            raise bad("q_len (decode)", 1, self.q_len)
        if self.paged != (self.page > 0):
            raise bad("page", "> 0 exactly for paged phases", self.page)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Shape:
        """The shape of a sweep.csv row (its phase, B, Sq, Skv, Hq, Hkv, D, dtype and page columns; seed 0).

        Raises:
            InvalidInputError: the row does not describe a valid shape (see the class docstring).
        """
        return cls(
            row["phase"],
            int(row["B"]),
            int(row["Sq"]),
            int(row["Skv"]),
            int(row["Hq"]),
            int(row["Hkv"]),
            int(row["D"]),
            row["dtype"],
            int(row["page"] or 0),
        )

    @property
    def op(self) -> str:
        """``attention`` or ``paged_attention``."""
        return "paged_attention" if self.paged else "attention"

    @property
    def paged(self) -> bool:
        """A paged phase."""
        return self.phase.startswith("paged")

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPES[self.dtype].itemsize

    def label(self) -> str:
        """A short readable id, e.g. ``prefill B4 S2048/2048 H32/8 D128 bf16``."""
        dt = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[self.dtype]
        page = f" P{self.page}" if self.page else ""
        return (
            f"{self.phase} B{self.batch} S{self.q_len}/{self.kv_len} H{self.hq}/{self.hkv} "
            f"D{self.head_dim} {dt}{page}"
        )

    def kv_bytes_max(self) -> int:
        """K + V bytes of ``batch`` sequences of ``kv_len`` tokens (an upper bound of what is read)."""
        return 2 * self.batch * self.kv_len * self.hkv * self.head_dim * self.itemsize


def _spread(phase: str, grid: list[tuple[int, ...]], offset: int, page: int = 0) -> list[Shape]:
    """One shape per grid point, cycling heads / head dims / dtypes (coprime cycles, so the combinations
    spread); a combination over :data:`KV_BYTES_MAX` moves on to the next one."""
    out = []
    for i, point in enumerate(grid):
        b, kv, *rest = point
        q = rest[0] if rest else (kv if phase == "prefill" else 1)
        for j in range(len(HEADS) * len(HEAD_DIMS)):
            n = i + offset + j
            hq, hkv = HEADS[n % len(HEADS)]
            d = HEAD_DIMS[(n // 2 + j) % len(HEAD_DIMS)]
            s = Shape(
                phase, b, q, kv, hq, hkv, d, ("bfloat16", "float16")[(i + offset) % 2], page, seed=len(out)
            )
            if s.kv_bytes_max() <= KV_BYTES_MAX:
                out.append(s)
                break
    return out


def full_shapes() -> list[Shape]:
    """The H200 sweep: 60 shapes. Prefill B 1-16, S 128-16384 causal with ``B * S^2 <= 16384^2`` (no call
    past ~50 ms); decode B 1-256, KV 128-32768; paged decode (B 1-256) and append (page 16); Hq/Hkv in
    {32/8, 32/32, 64/8, 16/2}, D in {64, 128, 256}, bf16 and fp16, spread (not the product)."""
    prefill = [
        (1, 128),
        (1, 512),
        (1, 1024),
        (1, 2048),
        (1, 4096),
        (1, 8192),
        (1, 16384),
        (2, 256),
        (2, 1024),
        (2, 4096),
        (2, 8192),
        (4, 512),
        (4, 2048),
        (4, 4096),
        (8, 256),
        (8, 1024),
        (8, 2048),
        (16, 128),
        (16, 512),
        (16, 1024),
    ]
    decode = [
        (1, 128),
        (1, 4096),
        (1, 32768),
        (2, 16384),
        (4, 1024),
        (8, 8192),
        (16, 2048),
        (16, 32768),
        (32, 4096),
        (64, 1024),
        (64, 8192),
        (128, 2048),
        (128, 8192),
        (256, 128),
        (256, 1024),
        (256, 4096),
    ]
    paged_decode = [
        (1, 1024),
        (4, 4096),
        (8, 32768),
        (16, 8192),
        (32, 2048),
        (64, 1024),
        (64, 4096),
        (64, 16384),
        (128, 2048),
        (128, 8192),
        (256, 512),
        (256, 2048),
        (256, 4096),
        (2, 128),
    ]
    append = [
        (1, 512, 128),
        (1, 4096, 512),
        (2, 2048, 256),
        (4, 8192, 128),
        (8, 1024, 64),
        (16, 512, 16),
        (4, 1024, 1024),
        (2, 16384, 2048),
        (8, 4096, 512),
        (16, 2048, 128),
    ]
    return (
        _spread("prefill", prefill, 0)
        + _spread("decode", decode, 1)
        + _spread("paged_decode", paged_decode, 2, 16)
        + _spread("paged_append", append, 3, 16)
    )


def quick_shapes(dtypes: tuple[str, ...] = ("bfloat16", "float32")) -> list[Shape]:
    """Tiny shapes (CPU, tests): every phase, GQA and MHA, both given dtypes; each call well under 10 ms."""
    a, b = dtypes[0], dtypes[-1]
    return [
        Shape("prefill", 1, 64, 64, 4, 2, 32, a),
        Shape("prefill", 2, 32, 32, 4, 4, 16, b, seed=1),
        Shape("decode", 2, 1, 128, 4, 1, 32, a, seed=2),
        Shape("decode", 4, 1, 64, 4, 4, 16, b, seed=3),
        Shape("paged_decode", 3, 1, 80, 4, 2, 32, a, 16, seed=4),
        Shape("paged_decode", 64, 1, 32, 4, 4, 16, b, 16, seed=5),
        Shape("paged_append", 2, 16, 64, 4, 2, 32, a, 16, seed=6),
    ]


@dataclass(frozen=True, slots=True)
class Inputs:
    """Seeded inputs of one shape: ``args``/``kwargs`` of ``lz.<op>`` and what the reference needs.

    Attributes:
        args, kwargs: ``lz.attention(q [B, Hq, Sq, D], k, v [B, Hkv, Skv, D], is_causal=...)`` or
            ``lz.paged_attention(q [T, Hq, D], kv_cache [N, 2, P, Hkv, D] (NHD), block_tables [B, M] int32,
            seq_lens [B] int32, cu_seqlens_q=None | [B + 1] int32)``.
        seq_lens: KV tokens per sequence (host ints). q_lens: query tokens per sequence (host ints).
        kv_bytes: K + V bytes the op reads (sum of seq_lens x 2 x Hkv x D x itemsize).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    kv_bytes: int


def build_inputs(shape: Shape, device: torch.device) -> Inputs:
    """Random normal inputs of ``shape`` on ``device`` (a generator on the device, seeded by ``shape.seed``);
    paged shapes get a cache with one spare block and block tables that are a random permutation of the
    blocks (unread table entries are 0). Raises ``InvalidInputError`` from ``lz.allocate_kv_cache``."""
    dt = DTYPES[shape.dtype]
    g = torch.Generator(device=device).manual_seed(shape.seed)
    b, hq, hkv, d = shape.batch, shape.hq, shape.hkv, shape.head_dim

    def rnd(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=g, device=device, dtype=dt)

    if not shape.paged:
        q, k, v = rnd(b, hq, shape.q_len, d), rnd(b, hkv, shape.kv_len, d), rnd(b, hkv, shape.kv_len, d)
        return Inputs(
            (q, k, v),
            {"is_causal": shape.phase == "prefill"},
            (shape.kv_len,) * b,
            (shape.q_len,) * b,
            shape.kv_bytes_max(),
        )
    cpu = torch.Generator().manual_seed(shape.seed)
    low = max(shape.q_len, math.ceil(0.75 * shape.kv_len))
    lens = torch.randint(low, shape.kv_len + 1, (b,), generator=cpu).tolist()
    p = shape.page
    need = [math.ceil(n / p) for n in lens]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=cpu)
    table = torch.zeros(b, math.ceil(shape.kv_len / p), dtype=torch.int32)
    at = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[at : at + n].to(torch.int32)
        at += n
    cache = lz.allocate_kv_cache(num_blocks, p, hkv, d, dt, "NHD", device)
    cache.normal_(generator=g)
    q_lens = [shape.q_len] * b
    cu = None
    if shape.phase == "paged_append":
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = rnd(sum(q_lens), hq, d)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    kv_bytes = 2 * sum(lens) * hkv * d * shape.itemsize
    return Inputs(
        (q, cache, table.to(device), seq_lens),
        {"cu_seqlens_q": cu, "is_causal": True},
        tuple(lens),
        tuple(q_lens),
        kv_bytes,
    )


def scores_bytes(shape: Shape) -> int:
    """Bytes of one float32 score matrix a materializing kernel builds: ``B * Hq * Sq * Skv * 4`` (paged
    kernels loop over sequences: ``Hq * q_len * kv_len * 4``)."""
    per_seq = shape.hq * shape.q_len * shape.kv_len * 4
    return per_seq if shape.paged else shape.batch * per_seq


def _slices(shape: Shape) -> tuple[list[int], list[int]]:
    """Sequences {0, B-1} and query heads {0, middle of the second KV group, Hq-1} checked for correctness."""
    seqs = sorted({0, shape.batch - 1})
    group = shape.hq // shape.hkv
    heads = sorted({0, min(shape.hq - 1, group + group // 2), shape.hq - 1})
    return seqs, heads


def _attend64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int | None, rows: int = 1024
) -> torch.Tensor:
    """float64 ``softmax(q k^T / sqrt(D)) v`` for one head, q ``[Sq, D]``, k/v ``[Skv, D]``, in chunks of
    ``rows`` query rows; ``offset`` None = no mask, else query i attends keys ``j <= i + offset``."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.empty(q.shape[0], v.shape[-1], dtype=torch.float64, device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    cols = torch.arange(k.shape[0], device=q.device)
    for r0 in range(0, q.shape[0], rows):
        s = (q[r0 : r0 + rows] @ k.T) * scale
        if offset is not None:
            i = torch.arange(r0, r0 + s.shape[0], device=q.device)
            s.masked_fill_(cols[None, :] > (i[:, None] + offset), float("-inf"))
        out[r0 : r0 + rows] = torch.softmax(s, dim=-1) @ v
    return out


def reference_error(
    shape: Shape, inputs: Inputs, out: Any, memo: dict[Any, torch.Tensor] | None = None
) -> float:
    """Max ``|out - ref| / (1 + |ref|)`` of a kernel's output against a float64 reference computed on a slice
    (sequences {0, B-1}, query heads {0, mid, Hq-1}; the GQA mapping is exercised). NaN/inf -> ``inf``;
    a wrong output shape -> ``inf``. ``memo`` (a dict kept per shape) caches the reference slices so that
    checking several kernels computes them once."""
    memo = {} if memo is None else memo
    seqs, heads = _slices(shape)
    group = shape.hq // shape.hkv
    worst = 0.0
    if not isinstance(out, torch.Tensor):
        return math.inf
    if not shape.paged:
        q, k, v = inputs.args
        if out.shape != q.shape[:3] + v.shape[3:]:
            return math.inf
        for b in seqs:
            for h in heads:
                if (b, h) not in memo:
                    memo[b, h] = _attend64(
                        q[b, h], k[b, h // group], v[b, h // group], 0 if shape.phase == "prefill" else None
                    )
                ref = memo[b, h]
                worst = max(worst, _err(out[b, h], ref))
        return worst
    q, cache, table, _ = inputs.args
    if out.shape != q.shape:
        return math.inf
    starts = [0, *torch.tensor(inputs.q_lens).cumsum(0).tolist()]
    p = shape.page
    for s in seqs:
        n, ql = inputs.seq_lens[s], inputs.q_lens[s]
        if (s, heads[0]) not in memo:
            tok = torch.arange(n, device=cache.device)
            blocks = table[s].long()[tok // p]
            k_all, v_all = cache[blocks, 0, tok % p], cache[blocks, 1, tok % p]  # [n, Hkv, D]
            for h in heads:
                memo[s, h] = _attend64(
                    q[starts[s] : starts[s] + ql, h], k_all[:, h // group], v_all[:, h // group], n - ql
                )
        for h in heads:
            ref = memo[s, h]
            worst = max(worst, _err(out[starts[s] : starts[s] + ql, h], ref))
    return worst


def _err(o: torch.Tensor, ref: torch.Tensor) -> float:
    e = ((o.double() - ref).abs() / (1.0 + ref.abs())).max()
    e = float(e) if e.numel() else 0.0
    return math.inf if not math.isfinite(e) else e
