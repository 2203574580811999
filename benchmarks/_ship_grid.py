"""Cases of ``ship_timings.py`` and ``hidden_shapes.py``: one call of an op, its seeded inputs, and the grids.

A :class:`Case` is one ``lz.<op>`` call: dense attention ``prefill`` (causal, Sq == Sk), ``decode`` (Sq = 1)
or ``cross`` (non-causal, Sq < Sk) in BHSD; ragged ``paged_decode`` / ``paged_append`` over an NHD paged KV
cache whose per-sequence lengths follow a named distribution (:data:`DISTRIBUTIONS`); ``rms_norm`` / ``rope``
/ ``swiglu``. :func:`gpu_grid` and :func:`cpu_grid` are the measured grids; hidden shapes must avoid their
points.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from _sweep_shapes import DTYPES, check_common

import layerzero as lz
from layerzero.core.errors import InvalidInputError, expected_got

__all__ = [
    "DISTRIBUTIONS",
    "DTYPES",
    "KINDS",
    "Case",
    "build",
    "cpu_grid",
    "gpu_grid",
    "quick_grid",
    "rope_tables",
    "ragged_lengths",
    "scores_bytes",
]

KINDS = ("prefill", "decode", "cross", "paged_decode", "paged_append", "rms_norm", "rope", "swiglu")
DISTRIBUTIONS = ("uniform", "narrow", "skewed", "bimodal", "equal")
"""Ragged KV lengths around a mean m: ``uniform`` U[1, 2m-1], ``narrow`` U[0.75m, 1.25m], ``skewed`` lognormal
(sigma 1) with mean m clipped to [1, 8m], ``bimodal`` half near m/4 and half near 1.75m (+-10%), ``equal`` all
m."""
GQA_HEADS = {1: (32, 32), 4: (32, 8), 8: (64, 8)}
"""(Hq, Hkv) measured per GQA ratio for dense attention."""
PAGED_HEADS = ((32, 8), (16, 2), (64, 8))
HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True, slots=True)
class Case:
    """One call. Attention: ``batch`` B, ``q_len`` Sq, ``kv_len`` Sk (paged: the mean KV length per sequence,
    drawn by ``dist``), ``hq``/``hkv`` heads, ``head_dim`` D, ``page`` tokens per block (paged). rms_norm /
    swiglu: ``batch`` x ``q_len`` rows of ``kv_len`` (hidden or intermediate size); ``residual`` (rms_norm) as
    ``page`` = 1. rope: q ``[B, hq, q_len, head_dim]``, k with ``hkv`` heads.

    Raises:
        InvalidInputError: unknown kind, dtype or distribution, a size < 1, ``hq % hkv``.
    """

    kind: str
    batch: int
    q_len: int
    kv_len: int
    hq: int = 0
    hkv: int = 0
    head_dim: int = 0
    dtype: str = "bfloat16"
    page: int = 0
    dist: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(what: str, expected: Any, got: Any) -> InvalidInputError:
            return InvalidInputError(expected_got(f"ship Case {what}", expected, got))

        if self.kind not in KINDS:
            raise bad("kind", f"one of {KINDS}", repr(self.kind))
        check_common(
            "ship Case",
            self.dtype,
            {"batch": self.batch, "q_len": self.q_len, "kv_len": self.kv_len},
            self.hq,
            self.hkv,
        )
        if self.kind.startswith("paged") and (self.dist not in DISTRIBUTIONS or self.page < 1):
            raise bad("paged dist/page", f"one of {DISTRIBUTIONS} and page >= 1", (self.dist, self.page))

    @property
    def op(self) -> str:
        """The op id the case calls."""
        if self.kind.startswith("paged"):
            return "paged_attention"
        return self.kind if self.kind in ("rms_norm", "rope", "swiglu") else "attention"

    @property
    def signature(self) -> tuple[Any, ...]:
        """What selects a JIT kernel variant (FlashInfer / Triton): kind, dtype, head dim, heads, page."""
        return (self.kind, self.dtype, self.head_dim, self.hq, self.hkv, self.page)

    def tiny(self) -> Case:
        """The smallest case with the same :attr:`signature` (compiles the same JIT kernels)."""
        small = {
            "prefill": (2, 16, 16),
            "decode": (2, 1, 64),
            "cross": (2, 8, 64),
            "paged_decode": (2, 1, 64),
            "paged_append": (2, 8, 64),
        }
        b, q, kv = small.get(self.kind, (1, 2, self.kv_len))
        return Case(
            self.kind,
            b,
            q,
            kv,
            self.hq,
            self.hkv,
            self.head_dim,
            self.dtype,
            self.page,
            self.dist or "",
            self.seed,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)

    def label(self) -> str:
        """A short readable id, e.g. ``paged_decode B7 Sq1 Skv~700 H32/8 D128 bf16 P16 skewed``."""
        dt = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[self.dtype]
        if self.op in ("rms_norm", "swiglu"):
            return f"{self.kind} {self.batch}x{self.q_len}x{self.kv_len} {dt}" + (
                " residual" if self.page else ""
            )
        if self.op == "rope":
            return f"rope B{self.batch} S{self.q_len} H{self.hq}/{self.hkv} D{self.head_dim} {dt}"
        tail = f" P{self.page} {self.dist}" if self.page else ""
        kv = f"~{self.kv_len}" if self.page else str(self.kv_len)
        return (
            f"{self.kind} B{self.batch} Sq{self.q_len} Skv{kv} H{self.hq}/{self.hkv} D{self.head_dim} "
            f"{dt}{tail}"
        )


def ragged_lengths(dist: str, batch: int, mean: int, gen: torch.Generator, minimum: int = 1) -> list[int]:
    """``batch`` KV lengths >= ``minimum`` drawn from ``dist`` around ``mean`` (see :data:`DISTRIBUTIONS`)."""
    m = float(mean)
    if dist == "equal":
        xs = [m] * batch
    elif dist == "uniform":
        xs = (1 + torch.rand(batch, generator=gen) * (2 * m - 2)).tolist()
    elif dist == "narrow":
        xs = (0.75 * m + torch.rand(batch, generator=gen) * 0.5 * m).tolist()
    elif dist == "skewed":  # lognormal sigma 1: mean = exp(mu + 1/2)
        xs = torch.exp(torch.randn(batch, generator=gen) + math.log(m) - 0.5).clamp(1, 8 * m).tolist()
    elif dist == "bimodal":
        centre = torch.where(torch.arange(batch) % 2 == 0, torch.tensor(0.25 * m), torch.tensor(1.75 * m))
        xs = (centre * (0.9 + 0.2 * torch.rand(batch, generator=gen))).tolist()
    else:
        raise InvalidInputError(
            expected_got("ragged length distribution", f"one of {DISTRIBUTIONS}", repr(dist))
        )
    return [max(minimum, int(round(x))) for x in xs]


def rope_tables(
    batch: int, seq: int, rotary_dim: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real gathered RoPE tables ``cos, sin [B, S, R]`` (theta 10000, ``cat(f, f)`` halves as transformers
    builds them) at a random start position per row: random cos/sin values are not RoPE (their halves differ,
    which kernels that read one half, Liger's, rightly ignore, and |cos| > 1 inflates bf16 rounding)."""
    start = torch.randint(0, 4096, (batch, 1), generator=torch.Generator().manual_seed(seed))
    pos = (start + torch.arange(seq)).double()
    inv = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    f = pos[..., None] * inv
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def build(case: Case, device: torch.device, values: bool = True) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Seeded random inputs of ``case`` on ``device``: ``(args, kwargs)`` of ``lz.<case.op>``. Paged cases get
    a cache with one spare block, block tables that are a random permutation of the blocks, table width
    ``ceil(max length / page)``; append cases ``cu_seqlens_q`` with ``q_len`` new tokens per sequence.
    ``values=False``: the floating-point tensors are left uninitialized (``torch.empty``; for selection, which
    reads shapes, dtypes and strides only: a 12,000-token KV cache's ``randn`` takes ~0.4 s on a CPU core)."""
    dt = DTYPES[case.dtype]
    g = torch.Generator(device=device).manual_seed(case.seed)

    def rnd(*dims: int) -> torch.Tensor:
        if not values:
            return torch.empty(*dims, device=device, dtype=dt)
        return torch.randn(*dims, generator=g, device=device, dtype=dt)

    b, hq, hkv, d = case.batch, case.hq, case.hkv, case.head_dim
    if case.kind in ("prefill", "decode", "cross"):
        sk = case.kv_len
        return (rnd(b, hq, case.q_len, d), rnd(b, hkv, sk, d), rnd(b, hkv, sk, d)), {
            "is_causal": case.kind == "prefill"
        }
    if case.kind == "rms_norm":
        x, w = rnd(case.batch, case.q_len, case.kv_len), rnd(case.kv_len)
        return (x, w), ({"residual": rnd(case.batch, case.q_len, case.kv_len)} if case.page else {})
    if case.kind == "swiglu":
        return (rnd(case.batch, case.q_len, case.kv_len), rnd(case.batch, case.q_len, case.kv_len)), {}
    if case.kind == "rope":
        q, k = rnd(b, hq, case.q_len, d), rnd(b, hkv, case.q_len, d)
        return (q, k, *rope_tables(b, case.q_len, d, dt, device, case.seed)), {}
    cpu = torch.Generator().manual_seed(case.seed)
    q_len = case.q_len if case.kind == "paged_append" else 1
    lens = ragged_lengths(case.dist, b, case.kv_len, cpu, minimum=q_len)
    p = case.page
    need = [math.ceil(n / p) for n in lens]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=cpu)
    table = torch.zeros(b, max(need), dtype=torch.int32)
    at = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[at : at + n].to(torch.int32)
        at += n
    cache = lz.allocate_kv_cache(num_blocks, p, hkv, d, dt, "NHD", device)
    cache.normal_(generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    cu = None
    if case.kind == "paged_append":
        cu = torch.arange(0, (b + 1) * q_len, q_len, dtype=torch.int32, device=device)
    return (rnd(b * q_len, hq, d), cache, table.to(device), seq_lens), {"cu_seqlens_q": cu, "is_causal": True}


def scores_bytes(case: Case) -> int:
    """Bytes of the float32 score matrix a materializing kernel builds for ``case`` (0 for non-attention)."""
    if case.op != "attention":
        return 0
    return case.batch * case.hq * case.q_len * case.kv_len * 4


def _dense(dtypes: tuple[str, ...], ratios: tuple[int, ...], dims: tuple[int, ...]) -> list[Case]:
    prefill = [
        (b, s) for s in (128, 256, 512, 1024, 2048, 4096, 8192, 16384) for b in (1, 4, 16) if b * s <= 32768
    ]
    decode = [(b, s) for s in (128, 512, 2048, 8192, 32768) for b in (1, 4, 16, 64) if b * s <= 262144]
    cross = [(b, sq, sk) for sq in (16, 128, 512) for sk in (1024, 4096, 8192) for b in (1, 4, 16)]
    out = []
    for dtype in dtypes:
        for d in dims:
            for r in ratios:
                hq, hkv = GQA_HEADS[r]
                out += [Case("prefill", b, s, s, hq, hkv, d, dtype) for b, s in prefill]
                out += [Case("decode", b, 1, s, hq, hkv, d, dtype) for b, s in decode]
                out += [Case("cross", b, sq, sk, hq, hkv, d, dtype) for b, sq, sk in cross]
    return out


def _paged(
    dtypes: tuple[str, ...],
    heads: tuple[tuple[int, int], ...],
    dims: tuple[int, ...],
    batches: tuple[int, ...],
    means: tuple[int, ...],
    kv_bytes_max: float,
) -> list[Case]:
    out = []
    for dtype in dtypes:
        for d in dims:
            for hq, hkv in heads:
                for b in batches:
                    for i, m in enumerate(means):
                        if 2 * b * m * hkv * d * DTYPES[dtype].itemsize * 2 > kv_bytes_max:  # 2x: ragged tail
                            continue
                        out.append(
                            Case(
                                "paged_decode",
                                b,
                                1,
                                m,
                                hq,
                                hkv,
                                d,
                                dtype,
                                16,
                                ("uniform", "narrow")[(b + i) % 2],
                                seed=b * 7 + i,
                            )
                        )
                for b, q, m in ((1, 512, 2048), (4, 128, 1024), (8, 64, 4096)):
                    out.append(Case("paged_append", b, q, m, hq, hkv, d, dtype, 16, "narrow", seed=b))
    return out


def _small_ops(dtypes: tuple[str, ...]) -> list[Case]:
    out = []
    for dtype in dtypes:
        for hidden in (2048, 4096, 8192):
            for rows in (1, 256, 4096):
                out += [
                    Case("rms_norm", 1, rows, hidden, dtype=dtype),
                    Case("rms_norm", 1, rows, hidden, dtype=dtype, page=1),
                ]
        for inter in (11008, 14336):
            out += [Case("swiglu", 1, rows, inter, dtype=dtype) for rows in (1, 512, 4096)]
        for hq, hkv in ((32, 8), (64, 8)):
            out += [Case("rope", b, s, 1, hq, hkv, 128, dtype) for b, s in ((1, 1), (1, 2048), (8, 512))]
    return out


def gpu_grid(dtypes: tuple[str, ...] = ("bfloat16", "float16")) -> list[Case]:
    """The GPU grid: dense prefill (causal, S 128..16384, B 1/4/16, at most 32k tokens), decode (Sk
    128..32768, B 1..64), cross (Sq 16/128/512 x Sk 1024/4096/8192, B 1/4/16: at B 1/8 the H200's cross B2
    Sq100 Sk3000 was picked from batch 1 at 0.83 of the best), GQA 1/4/8 (Hq/Hkv 32/32, 32/8, 64/8), D
    64/128/256; ragged paged decode (page 16, B 1/4/8/16/32/64/128/256: the FlashInfer / Triton crossover
    moves with the batch, and B 24 between grid points 16 and 64 was picked at 0.65 of the best on the H200;
    mean KV 128..8192, Hq/Hkv 32/8, 16/2, 64/8) plus a few appends; rms_norm / rope / swiglu at a few
    sizes."""
    return (
        _dense(dtypes, (1, 4, 8), HEAD_DIMS)
        + _paged(
            dtypes, PAGED_HEADS, HEAD_DIMS, (1, 4, 8, 16, 32, 64, 128, 256), (128, 512, 2048, 8192), 8 << 30
        )
        + _small_ops(dtypes)
    )


def cpu_grid(dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[Case]:
    """The CPU grid (minutes on 2 cores): dense prefill / decode (B 1/4, S 64..1024, Sk 64..4096, Hq/Hkv 8/2
    and 8/8, D 64/128), ragged paged decode in float32 (B 1..16, mean 32..512, Hq/Hkv 8/2 and 16/2, D 64/128),
    rms_norm, rope and swiglu at small sizes."""
    out = []
    for dtype in dtypes:
        for d in (64, 128):
            for hq, hkv in ((8, 2), (8, 8)):
                out += [
                    Case("prefill", b, s, s, hq, hkv, d, dtype)
                    for s in (64, 128, 256, 512, 1024)
                    for b in (1, 4)
                    if b * s <= 1024
                ]
                out += [
                    Case("decode", b, 1, s, hq, hkv, d, dtype) for s in (64, 256, 1024, 4096) for b in (1, 4)
                ]
        for hidden in (1024, 4096):
            out += [Case("rms_norm", 1, rows, hidden, dtype=dtype) for rows in (1, 64)]
            out += [Case("swiglu", 1, rows, hidden * 2, dtype=dtype) for rows in (1, 64)]
        out += [Case("rope", 1, s, 1, 8, 2, 64, dtype) for s in (1, 128)]
    for d in (64, 128):
        for hq, hkv in ((8, 2), (16, 2)):
            for b in (1, 2, 4, 8, 16):
                for i, m in enumerate((32, 128, 512)):
                    out.append(
                        Case(
                            "paged_decode",
                            b,
                            1,
                            m,
                            hq,
                            hkv,
                            d,
                            "float32",
                            16,
                            ("uniform", "narrow")[i % 2],
                            seed=b * 7 + i,
                        )
                    )
    return out


def quick_grid() -> list[Case]:
    """A few tiny CPU cases of every kind (tests)."""
    return [
        Case("prefill", 1, 32, 32, 4, 2, 16, "float32"),
        Case("decode", 2, 1, 64, 4, 2, 16, "float32"),
        Case("cross", 1, 8, 64, 4, 4, 16, "float32"),
        Case("paged_decode", 3, 1, 40, 4, 2, 16, "float32", 16, "uniform", seed=1),
        Case("paged_append", 2, 4, 40, 4, 2, 16, "float32", 16, "narrow", seed=2),
        Case("rms_norm", 1, 4, 64, dtype="float32"),
        Case("swiglu", 1, 4, 64, dtype="float32"),
        Case("rope", 1, 4, 1, 4, 2, 16, "float32"),
    ]
