"""Shared by the kernel correctness tests (CPU and GPU) and the SDPA constraint-mirroring tests.

What is here, all independent of ``layerzero``'s own kernels:

- ``TOL``: per-dtype relative tolerance; :func:`mismatch` compares an output with a float64 oracle using
  ``atol = TOL * max|ref|`` and ``rtol = TOL`` (tolerances relative to the output scale).
- Seeded case generators (frozen dataclasses, no tensors) and builders that turn a case into tensors:
  attention (odd head dims 8..256 incl. 21/72/203, sequences 1..587 mostly short, GQA, bool/float masks with
  some fully masked rows, causal with Sq != Sk, BHSD/BSHD, non-contiguous and stride(-1) != 1 inputs), norms,
  RoPE and sampling.
- float64 oracles written from the formulas: attention as an explicit einsum softmax (GQA by
  ``repeat_interleave``, top-left causal, a fully masked row gives 0), RMSNorm / LayerNorm, RoPE as complex
  multiplication, and the token sets top-k / nucleus sampling may draw from.
- The SDPA sub-backend grid and a runner that asks torch itself whether a sub-backend runs a context.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

F64 = torch.float64
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MIN_CASES = 200  # cases run per (broadly eligible kernel, dtype)
MAX_CANDIDATES = 3000  # cases drawn at most while looking for MIN_CASES eligible ones


def dname(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def mismatch(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "", floor: float = 0.0) -> str | None:
    """None when ``out`` matches the float64 ``ref`` within ``TOL[dtype]`` (NaN only where ref is NaN), else a
    one-line description of the worst element. The output scale is ``max(max|ref|, floor)``."""
    if tuple(out.shape) != tuple(ref.shape):
        return f"{what} shape {tuple(out.shape)} != oracle {tuple(ref.shape)}"
    if out.dtype != dtype:
        return f"{what} dtype {out.dtype} != {dtype}"
    o, r = out.to(F64), ref.to(F64)
    tol = TOL[dtype]
    finite = torch.isfinite(r)
    scale = max(float(r[finite].abs().max()) if finite.any() else 0.0, floor)
    err = (o - r).abs()
    ok = (err <= tol * scale + tol * r.abs()) | (o == r) | (torch.isnan(o) & torch.isnan(r))
    if bool(ok.all()):
        return None
    bad = (~ok).nonzero()[0].tolist()
    return (f"{what} {int((~ok).sum())}/{ok.numel()} elements off; worst |err|={float(err.nan_to_num(1e300).max()):.3g} "
            f"(tol {tol:g} x max|ref| {scale:.3g}); first at {bad}: got {float(o[tuple(bad)]):.6g}, "
            f"oracle {float(r[tuple(bad)]):.6g}")


def randn(shape: tuple[int, ...], gen: torch.Generator, device: torch.device | str, dtype: torch.dtype,
          std: float = 1.0) -> torch.Tensor:
    """Seeded normal samples drawn on the CPU in float64 (same values on every device), then cast."""
    return (torch.randn(shape, generator=gen, dtype=F64) * std).to(device=device, dtype=dtype)


# ============================================================================================ attention
@dataclass(frozen=True, slots=True)
class AttnCase:
    """One attention call. ``mask``: none/bool/float; ``mask_shape``: which dims the mask has (of B, H, Sq, Sk);
    ``dead``: some query rows have every key masked; ``strided``: stride(-1) == 2; ``noncontig``: a slice."""

    seed: int
    batch: int
    hq: int
    hkv: int
    sq: int
    sk: int
    d: int
    dv: int
    mask: str
    mask_shape: str
    dead: bool
    causal: bool
    layout: str
    scale: float | None
    noncontig: bool
    strided: bool


HEAD_DIMS = (8, 16, 21, 32, 40, 64, 72, 80, 96, 128, 160, 192, 203, 256)


def attention_case(seed: int) -> AttnCase:
    """The seeded case ``seed``: every 25th is long (Sq/Sk up to 587), the rest short; see :class:`AttnCase`."""
    rng = random.Random(seed * 7919 + 17)
    long = seed % 25 == 7
    hkv = rng.randint(1, 2 if long else 3)
    hq = hkv * rng.choice((1, 1, 2, 4))
    d = rng.choice(HEAD_DIMS)
    dv = d if rng.random() < 0.9 else rng.choice((8, 24, 72))
    if long:
        sq, sk = rng.randint(100, 587), rng.randint(100, 587)
    else:
        sq = rng.choice((1, 1, 2, 3, rng.randint(1, 64), rng.randint(1, 64)))
        sk = rng.randint(1, 64)
    if rng.random() < 0.35:
        sk = sq
    mask = rng.choice(("none", "none", "bool", "float"))
    causal = rng.random() < (0.08 if mask != "none" else 0.45)
    return AttnCase(
        seed=seed, batch=1 if long else rng.randint(1, 3), hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, dv=dv, mask=mask,
        mask_shape=rng.choice(("SS", "B1SS", "1HSS", "BHSS")), dead=mask != "none" and rng.random() < 0.2,
        causal=causal, layout=rng.choice(("BHSD", "BSHD")), scale=None if rng.random() < 0.7 else rng.uniform(0.05, 0.5),
        noncontig=rng.random() < 0.12, strided=rng.random() < 0.04)


def attention_cases(start: int = 0) -> Iterator[AttnCase]:
    """Cases ``start, start+1, ...`` up to ``MAX_CANDIDATES``."""
    return (attention_case(s) for s in range(start, start + MAX_CANDIDATES))


def _qkv_tensor(shape: tuple[int, ...], gen, device, dtype, noncontig: bool, strided: bool) -> torch.Tensor:
    if strided:  # stride(-1) == 2
        return randn((*shape[:-1], 2 * shape[-1]), gen, device, dtype)[..., ::2]
    if noncontig:  # stride(-1) == 1 but a slice of a wider tensor
        return randn((*shape[:-1], shape[-1] + 3), gen, device, dtype)[..., : shape[-1]]
    return randn(shape, gen, device, dtype)


def attention_inputs(case: AttnCase, dtype: torch.dtype, device: torch.device | str = "cpu"):
    """``(q, k, v, attn_mask)`` for ``case`` in its layout; the mask is bool or additive in ``dtype``."""
    gen = torch.Generator().manual_seed(case.seed)
    b, hq, hkv, sq, sk = case.batch, case.hq, case.hkv, case.sq, case.sk
    if case.layout == "BHSD":
        shapes = ((b, hq, sq, case.d), (b, hkv, sk, case.d), (b, hkv, sk, case.dv))
    else:
        shapes = ((b, sq, hq, case.d), (b, sk, hkv, case.d), (b, sk, hkv, case.dv))
    q, k, v = (_qkv_tensor(s, gen, device, dtype, case.noncontig, case.strided) for s in shapes)
    return (q, k, v, make_mask(case.mask, case.mask_shape, case.dead, b, hq, sq, sk, gen, device, dtype))


def make_mask(kind: str, form: str, dead: bool, b: int, hq: int, sq: int, sk: int, gen: torch.Generator,
              device, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool (True = attend, ~75% kept) or additive float mask (N(0,1) and ~25% -inf) of dims ``form``;
    with ``dead`` some query rows (at least one) are fully masked."""
    if kind == "none":
        return None
    shape = {"SS": (sq, sk), "B1SS": (b, 1, sq, sk), "1HSS": (1, hq, sq, sk), "BHSS": (b, hq, sq, sk)}[form]
    keep = torch.rand(shape, generator=gen) < 0.75
    if dead:
        rows = torch.rand(shape[:-1], generator=gen) < 0.3
        rows.view(-1)[0] = True
        keep &= ~rows.unsqueeze(-1)
    if kind == "bool":
        return keep.to(device)
    add = torch.randn(shape, generator=gen, dtype=F64).masked_fill(~keep, float("-inf"))
    return add.to(device=device, dtype=dtype)


def attention_oracle(q, k, v, attn_mask=None, is_causal=False, scale=None, layout="BHSD") -> torch.Tensor:
    """float64 ``softmax(q k^T * scale + mask) v`` by explicit einsum; GQA by ``repeat_interleave``; bool mask
    True = attend; ``is_causal`` top-left (key j visible to query i iff j <= i); a row with no visible key -> 0."""
    if layout == "BSHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    sq, sk = q.shape[2], k.shape[2]
    s = torch.einsum("bhid,bhjd->bhij", q, k) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if is_causal:
        visible = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible = visible & attn_mask
        else:
            s = s + attn_mask.to(F64)
    s = torch.where(visible, s, torch.tensor(float("-inf"), dtype=F64, device=q.device))
    alive = torch.isfinite(s).any(-1, keepdim=True) | torch.isnan(s).any(-1, keepdim=True)
    m = torch.where(alive, s.amax(-1, keepdim=True), torch.zeros((), dtype=F64, device=q.device))
    e = torch.exp(s - m)
    p = torch.where(alive, e / torch.where(alive, e.sum(-1, keepdim=True), 1.0), 0.0)
    out = torch.einsum("bhij,bhjd->bhid", p, v)
    return out.transpose(1, 2) if layout == "BSHD" else out


# ============================================================================================ norms
@dataclass(frozen=True, slots=True)
class NormCase:
    """One norm call: x ``[*lead, hidden]`` with ``std``; ``extra`` = residual (rms_norm) or bias (layer_norm);
    ``weight_f32``: float32 weight (and bias) for float16/bfloat16 x (mixed-precision models); ``layout``: contiguous / sliced / transposed x."""

    seed: int
    lead: tuple[int, ...]
    hidden: int
    eps: float
    extra: bool
    weight_f32: bool
    layout: str
    std: float


HIDDEN = (1, 2, 3, 7, 8, 16, 21, 63, 64, 100, 127, 128, 255, 256, 512, 768, 1000, 1024, 2048, 4096, 5120)


def norm_case(seed: int) -> NormCase:
    """The seeded norm case ``seed`` (odd and even hidden sizes 1..5120, 0-3 leading dims)."""
    rng = random.Random(seed * 104729 + 3)
    hidden = rng.choice(HIDDEN)
    lead = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
    return NormCase(seed, lead, hidden, rng.choice((1e-6, 1e-5, 1e-3)), rng.random() < 0.5, rng.random() < 0.2,
                    rng.choice(("contiguous",) * 6 + ("sliced", "transposed")), rng.choice((0.1, 1.0, 3.0, 30.0)))


def norm_inputs(case: NormCase, dtype: torch.dtype, device="cpu"):
    """``(x, weight, extra)``: extra is the residual/bias tensor or None."""
    gen = torch.Generator().manual_seed(case.seed)
    shape = (*case.lead, case.hidden)
    if case.layout == "sliced":
        x = randn((*case.lead, case.hidden + 5), gen, device, dtype, case.std)[..., 2: 2 + case.hidden]
    elif case.layout == "transposed" and case.lead:
        x = randn((*case.lead[:-1], case.hidden, case.lead[-1]), gen, device, dtype, case.std).transpose(-1, -2)
    else:
        x = randn(shape, gen, device, dtype, case.std)
    wdt = torch.float32 if case.weight_f32 and dtype in (torch.float16, torch.bfloat16) else dtype
    weight = (1.0 + randn((case.hidden,), gen, device, F64, 0.5)).to(wdt)
    extra = randn(shape, gen, device, dtype, case.std) if case.extra else None
    return x, weight, extra


def rms_oracle(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 ``x / sqrt(mean(x^2) + eps) * weight``."""
    x = x.to(F64)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight.to(F64)


def layer_norm_oracle(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """float64 ``(x - mean) / sqrt(biased var + eps) * weight + bias``."""
    x = x.to(F64)
    mu = x.sum(-1, keepdim=True) / x.shape[-1]
    var = ((x - mu) ** 2).sum(-1, keepdim=True) / x.shape[-1]
    y = (x - mu) / torch.sqrt(var + eps) * weight.to(F64)
    return y if bias is None else y + bias.to(F64)


# ============================================================================================ rope
@dataclass(frozen=True, slots=True)
class RopeCase:
    """One rope call: ``rot`` even <= ``d``; ``form``: gathered [B|1,S,R] / table / table + position_ids [B|1,S]."""

    seed: int
    batch: int
    hq: int
    hkv: int
    s: int
    d: int
    rot: int
    form: str
    interleaved: bool
    layout: str
    table_f32: bool
    base: float


def rope_case(seed: int) -> RopeCase:
    """The seeded rope case ``seed`` (head dims 2..256 incl. odd 21/203, partial rotary ~40%)."""
    rng = random.Random(seed * 15485863 + 11)
    d = rng.choice((2, 8, 16, 21, 32, 64, 72, 80, 96, 128, 203, 256))
    full = d - d % 2
    rot = full if rng.random() < 0.6 else 2 * rng.randint(1, full // 2)
    hkv = rng.randint(1, 3)
    return RopeCase(seed, rng.randint(1, 3), hkv * rng.choice((1, 2, 4)), hkv, rng.choice((1, rng.randint(1, 80))), d,
                    rot, rng.choice(("gathered", "gathered1", "table", "ids", "ids1", "ids32")),
                    rng.random() < 0.5, rng.choice(("BHSD", "BSHD")), rng.random() < 0.5,
                    rng.choice((10000.0, 500000.0)))


def rope_inputs(case: RopeCase, dtype: torch.dtype, device="cpu"):
    """``(q, k, cos, sin, position_ids)`` for ``case``; tables follow HF (``cat(f, f)``) or GPT-J
    (``repeat_interleave(f, 2)``) in float32 or ``dtype``."""
    gen = torch.Generator().manual_seed(case.seed)
    b, s = case.batch, case.s
    shapes = ((b, case.hq, s, case.d), (b, case.hkv, s, case.d))
    if case.layout == "BSHD":
        shapes = tuple((x[0], x[2], x[1], x[3]) for x in shapes)
    q, k = (randn(sh, gen, device, dtype) for sh in shapes)
    max_pos = s + 40
    inv = case.base ** (-torch.arange(0, case.rot, 2, dtype=F64) / case.rot)
    ang = torch.arange(max_pos, dtype=F64)[:, None] * inv[None, :]  # [max_pos, R/2]
    expand = (lambda t: t.repeat_interleave(2, -1)) if case.interleaved else (lambda t: torch.cat((t, t), -1))
    cos_t, sin_t = expand(torch.cos(ang)), expand(torch.sin(ang))
    tdt = torch.float32 if case.table_f32 else dtype
    pos_b = 1 if case.form in ("gathered1", "ids1") else b
    pos = torch.randint(0, max_pos, (pos_b, s), generator=gen)
    ids = None
    if case.form.startswith("gathered"):
        cos_t, sin_t = cos_t[pos], sin_t[pos]
    elif case.form.startswith("ids"):
        ids = pos.to(torch.int32 if case.form == "ids32" else torch.int64).to(device)
    return q, k, cos_t.to(device=device, dtype=tdt), sin_t.to(device=device, dtype=tdt), ids


def rope_oracle(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None,
                interleaved: bool, layout: str) -> torch.Tensor:
    """float64 RoPE by complex multiplication with the given tables' angles: pairs ``(x_i, x_{i+R/2})``
    (NeoX) or ``(x_2i, x_2i+1)`` (GPT-J) are complex numbers rotated by ``cos + i sin``; dims >= R pass."""
    s = x.shape[2] if layout == "BHSD" else x.shape[1]
    if cos.dim() == 2:
        idx = torch.arange(s, device=cos.device)[None] if position_ids is None else position_ids.long()
        cos, sin = cos[idx], sin[idx]
    r = cos.shape[-1]
    pick = (lambda t: t[..., 0::2]) if interleaved else (lambda t: t[..., : r // 2])
    rot = torch.complex(pick(cos).to(F64), pick(sin).to(F64)).unsqueeze(1 if layout == "BHSD" else 2)
    x = x.to(F64)
    head, tail = x[..., :r], x[..., r:]
    a, b = (head[..., 0::2], head[..., 1::2]) if interleaved else (head[..., : r // 2], head[..., r // 2:])
    z = torch.complex(a, b) * rot
    if interleaved:
        out = torch.stack((z.real, z.imag), -1).flatten(-2)
    else:
        out = torch.cat((z.real, z.imag), -1)
    return torch.cat((out, tail), -1)


# ============================================================================================ sampling
def probs64(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float64 ``softmax(logits / temperature)`` written out."""
    z = logits.to(F64) / temperature
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def argmax_set(logits: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` bool: tokens whose logit equals the row maximum (greedy may pick any on ties)."""
    lg = logits.to(F64)
    return lg == lg.amax(-1, keepdim=True)


def topk_allowed(logits: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    """``[B, V]`` bool superset of what top-k may draw: probability >= the k-th largest (ties included)."""
    p = probs64(logits, temperature)
    kth = p.topk(min(k, p.shape[-1]), -1).values[..., -1:]
    return (p >= kth * (1 - 1e-6)) & (p > 0)


def topp_allowed(logits: torch.Tensor, top_p: float, temperature: float, slack: float = 1e-4) -> torch.Tensor:
    """``[B, V]`` bool superset of what nucleus sampling may draw: tokens whose strictly-more-probable mass is
    < p (+ slack for float32 rounding); the most probable token is always allowed."""
    p = probs64(logits, temperature)
    asc = p.sort(-1).values
    suffix = torch.cat((asc.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(asc[:, :1])), -1)  # sum of asc[j:]
    above = suffix.gather(-1, torch.searchsorted(asc, p * (1 + 1e-9), right=True))  # mass strictly above token
    return (above < top_p + slack) | (p >= p.amax(-1, keepdim=True))


# ============================================================================================ SDPA grid
@dataclass(frozen=True, slots=True)
class SdpaCtx:
    """One point of the SDPA constraint grid (B=2, Sq/Sk small)."""

    dtype: torch.dtype
    d: int
    gqa: bool
    mask: str
    causal: bool
    dropout: bool
    stride1: bool
    layout: str
    square: bool

    def __str__(self) -> str:
        return (f"{dname(self.dtype)} d={self.d} gqa={self.gqa} mask={self.mask} causal={self.causal} "
                f"dropout={self.dropout} stride1={self.stride1} layout={self.layout} Sq==Sk={self.square}")


GRID_HEAD_DIMS = (8, 21, 64, 72, 203, 256, 512)


def sdpa_grid(dtypes=DTYPES) -> list[SdpaCtx]:
    """Every combination of dtypes x head dims x GQA x mask x causal x dropout x stride x layout x Sq==Sk."""
    return [SdpaCtx(*c) for c in itertools.product(dtypes, GRID_HEAD_DIMS, (False, True), ("none", "bool", "float"),
                                                     (False, True), (False, True), (True, False), ("BHSD", "BSHD"),
                                                     (True, False))]


@functools.lru_cache(maxsize=32)
def sdpa_inputs(c: SdpaCtx, device="cpu"):
    """``(q, k, v, mask)`` in ``c.layout`` (what ``lz.attention`` gets) for grid point ``c`` (memoized: call it
    with ``causal`` and ``dropout`` False, which do not change the tensors)."""
    gen = torch.Generator().manual_seed(c.d * 31 + 7)
    b, hq, hkv, sq = 2, 4, 2 if c.gqa else 4, 6
    sk = sq if c.square else 9
    dims = ((b, hq, sq), (b, hkv, sk), (b, hkv, sk))
    if c.layout == "BSHD":
        dims = tuple((x[0], x[2], x[1]) for x in dims)
    q, k, v = (_qkv_tensor((*x, c.d), gen, device, c.dtype, False, not c.stride1) for x in dims)
    mask = make_mask(c.mask, "B1SS", False, b, hq, sq, sk, gen, device, c.dtype)
    return q, k, v, mask


def torch_sdpa_error(backend, q, k, v, mask, causal: bool, dropout: bool, layout: str) -> str | None:
    """Run torch SDPA forced to ``backend`` (a ``torch.nn.attention.SDPBackend``) on BHSD views of the inputs;
    None if it ran, else torch's error (first line). CUDA work is synchronized so errors surface here."""
    from torch.nn.attention import sdpa_kernel

    if layout == "BSHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                               dropout_p=0.1 if dropout else 0.0, enable_gqa=q.shape[1] != k.shape[1])
            if q.is_cuda:
                torch.cuda.synchronize(q.device)
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0][:300]
    return None


# ============================================================================================ runners
@dataclass(frozen=True, slots=True)
class Call:
    """One op call: a label for messages, the ``lz.<op>`` arguments and a float64 oracle of its output(s)."""

    label: str
    args: tuple
    kwargs: dict
    oracle: object  # () -> tensor or tuple of tensors
    floor: float = 0.0  # least output scale for the tolerance (see mismatch)


def attention_call(seed: int, dtype: torch.dtype, device="cpu") -> Call:
    """The attention :class:`Call` of case ``seed``."""
    c = attention_case(seed)
    q, k, v, mask = attention_inputs(c, dtype, device)
    kw = {"attn_mask": mask, "is_causal": c.causal, "scale": c.scale, "layout": c.layout}
    return Call(str(c), (q, k, v), kw, lambda: attention_oracle(q, k, v, mask, c.causal, c.scale, c.layout))


def rms_call(seed: int, dtype: torch.dtype, device="cpu") -> Call:
    """The rms_norm :class:`Call` of case ``seed`` (fused residual when ``case.extra``: oracle ``(y, x + r)``)."""
    c = norm_case(seed)
    x, w, res = norm_inputs(c, dtype, device)

    def oracle():
        if res is None:
            return rms_oracle(x, w, c.eps)
        h = (x.to(F64) + res.to(F64)).to(dtype)  # the residual stream stays in x's dtype
        return rms_oracle(h, w, c.eps), h.to(F64)

    return Call(str(c), (x, w, c.eps), {"residual": res}, oracle)


def layer_call(seed: int, dtype: torch.dtype, device="cpu") -> Call:
    """The layer_norm :class:`Call` of case ``seed`` (with bias when ``case.extra``)."""
    c = norm_case(seed)
    x, w, bias = norm_inputs(c, dtype, device)
    if bias is not None:  # [H], in the weight's dtype like nn.LayerNorm's parameters
        bias = bias[(0,) * (bias.dim() - 1)].to(w.dtype).contiguous()
    # hidden = 1 normalizes 0 / sqrt(eps): the output scale is the weight's, not max|ref| = |bias| or 0
    return Call(str(c), (x, w, bias, c.eps), {}, lambda: layer_norm_oracle(x, w, bias, c.eps),
                float(w.abs().max()))


def rope_call(seed: int, dtype: torch.dtype, device="cpu") -> Call:
    """The rope :class:`Call` of case ``seed``: oracle ``(q_rot, k_rot)``."""
    c = rope_case(seed)
    q, k, cos, sin, ids = rope_inputs(c, dtype, device)
    kw = {"position_ids": ids, "interleaved": c.interleaved, "layout": c.layout}
    return Call(str(c), (q, k, cos, sin), kw,
                lambda: tuple(rope_oracle(t, cos, sin, ids, c.interleaved, c.layout) for t in (q, k)))


CALLS = {"attention": attention_call, "rms_norm": rms_call, "layer_norm": layer_call, "rope": rope_call}


@dataclass(frozen=True, slots=True)
class KernelRun:
    """What :func:`run_kernel` did: cases run and drawn, rejection codes seen, failure messages, and how many
    calls ``lz.trace`` saw served by the kernel."""

    kernel_id: str
    dtype: torch.dtype
    ran: int
    drawn: int
    rejected: dict
    failures: list
    traced: int

    def report(self) -> str:
        """A multi-line summary with the first 12 failures."""
        head = (f"{self.kernel_id} {dname(self.dtype)}: {self.ran} cases run of {self.drawn} drawn, "
                f"{self.traced} traced; rejected by code: {self.rejected}")
        return "\n  ".join([head, *self.failures[:12]] + ([f"... {len(self.failures) - 12} more"]
                                                         if len(self.failures) > 12 else []))


def run_kernel(op: str, kernel_id: str, dtype: torch.dtype, device="cpu", target: int = MIN_CASES) -> KernelRun:
    """Lock ``op`` to ``kernel_id`` and run seeded cases until ``target`` ran (cases ``lz.validate`` rejects are
    skipped and counted), comparing each output with the float64 oracle."""
    import layerzero as lz

    fn, make = getattr(lz, op), CALLS[op]
    ran = drawn = 0
    rejected: dict[str, int] = {}
    failures: list[str] = []
    lz.lock(op, kernel_id)
    try:
        with lz.trace() as tr:
            for seed in range(MAX_CANDIDATES):
                if ran >= target:
                    break
                drawn += 1
                call = make(seed, dtype, device)
                reasons = lz.validate(kernel_id, op, *call.args, **call.kwargs)
                if reasons:
                    for r in reasons:
                        rejected[r.code.value] = rejected.get(r.code.value, 0) + 1
                    continue
                ran += 1
                try:
                    out = fn(*call.args, **call.kwargs)
                except Exception as exc:  # noqa: BLE001 - reported as a failure with the case
                    failures.append(f"[{call.label}] validate() says it can run, but it raised {type(exc).__name__}: "
                                    f"{str(exc)[:300]}")
                    continue
                ref = call.oracle()
                outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
                for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
                    msg = mismatch(o, r, dtype, f"output {i}", call.floor)
                    if msg:
                        failures.append(f"[{call.label}] {msg}")
    finally:
        lz.unlock(op)
    return KernelRun(kernel_id, dtype, ran, drawn, rejected, failures, tr.counts[(op, kernel_id)])


def kernels_on(op: str, device_type: str) -> list[dict]:
    """``lz.list_kernels(op)`` entries whose backend is available and that run on ``device_type``."""
    import layerzero as lz

    return [k for k in lz.list_kernels(op) if k["available"] and device_type in k["device_types"]]


def kernel_dtype_params(ops, device_type: str, dtypes=DTYPES) -> list[tuple[str, str, torch.dtype]]:
    """``(op, kernel_id, dtype)`` for every available kernel of ``ops`` on ``device_type`` and dtype it declares."""
    return [(op, k["kernel_id"], dt) for op in ops for k in kernels_on(op, device_type) for dt in dtypes
            if dname(dt) in k["dtypes"]]


# ============================================================================================ sampling runs
def sampling_logits(seed: int, dtype: torch.dtype, device="cpu") -> tuple[torch.Tensor, int, float, float]:
    """``(logits [B, V], k, p, temperature)`` of seeded sampling case ``seed``: B 1..8, V 1..32000, logit std
    0.5..8 (so both flat and peaked rows), temperature 0 (greedy) ~15% of the time."""
    rng = random.Random(seed * 2654435761 % 2**32)
    b, v = rng.randint(1, 8), 32000 if seed % 25 == 3 else rng.choice((1, 2, 5, 32, 100, 1000, 4096))
    gen = torch.Generator().manual_seed(seed)
    logits = randn((b, v), gen, device, dtype, rng.choice((0.5, 2.0, 8.0)))
    k = rng.choice((1, 2, 5, 40, v, v + 3))
    return logits, k, rng.choice((1e-6, 0.1, 0.5, 0.9, 0.99, 1.0)), rng.choice((0.0, 0.3, 1.0, 1.0, 1.7))


def run_sampling_kernel(op: str, kernel_id: str, dtype: torch.dtype, device="cpu", n: int = MIN_CASES,
                        draws: int = 4) -> tuple[int, list[str]]:
    """Lock ``op`` to ``kernel_id``; on ``n`` seeded cases draw ``draws`` times and check every token is in the
    oracle's allowed set (argmax set when temperature is 0 or k is 1), and that the same generator seed gives
    the same tokens. Returns (cases run, failure messages)."""
    import layerzero as lz

    fn = getattr(lz, op)
    failures: list[str] = []
    ran = 0
    lz.lock(op, kernel_id)
    try:
        for seed in range(n):
            logits, k, p, temp = sampling_logits(seed, dtype, device)
            arg = k if op == "sample_topk" else p
            if lz.validate(kernel_id, op, logits, arg, temperature=temp):
                continue
            ran += 1
            if temp == 0 or (op == "sample_topk" and k == 1):
                allowed = argmax_set(logits)
            else:
                allowed = topk_allowed(logits, k, temp) if op == "sample_topk" else topp_allowed(logits, p, temp)
            gen = torch.Generator(device=device).manual_seed(seed)
            tokens = torch.stack([fn(logits, arg, temperature=temp, generator=gen) for _ in range(draws)], 1)
            again = fn(logits, arg, temperature=temp, generator=torch.Generator(device=device).manual_seed(seed))
            label = f"seed={seed} B,V={tuple(logits.shape)} k={k} p={p} T={temp}"
            if tokens.dtype != torch.int64 or tokens.shape != (logits.shape[0], draws):
                failures.append(f"[{label}] tokens {tokens.dtype} {tuple(tokens.shape)}, expected int64 [B]")
                continue
            bad = ~allowed.gather(1, tokens)
            if bad.any():
                row, col = bad.nonzero()[0].tolist()
                failures.append(f"[{label}] drew token {int(tokens[row, col])} outside the allowed set of row {row}")
            if not torch.equal(again, tokens[:, 0]):
                failures.append(f"[{label}] same generator seed gave {tokens[:, 0].tolist()} then {again.tolist()}")
    finally:
        lz.unlock(op)
    return ran, failures


def frequency_error(tokens: torch.Tensor, expected: torch.Tensor, sigmas: float = 5.0) -> str | None:
    """None if the token frequencies of ``tokens [N]`` match ``expected [V]`` probabilities within ``sigmas``
    binomial standard deviations per token (and no zero-probability token drawn), else a description."""
    n = tokens.numel()
    freq = torch.bincount(tokens.cpu(), minlength=expected.numel()).to(F64) / n
    exp = expected.cpu().to(F64)
    sd = torch.sqrt(exp * (1 - exp) / n).clamp_min(1e-12)
    off = ((freq - exp).abs() > sigmas * sd) & ~((exp == 0) & (freq == 0))
    if off.any():
        i = int(off.nonzero()[0])
        return f"token {i}: frequency {float(freq[i]):.4f} vs probability {float(exp[i]):.4f} over {n} draws"
    return None


@dataclass(frozen=True, slots=True)
class Allow:
    """A documented case where LayerZero is stricter than torch: ``kernel_id`` on ``device_type`` may be
    rejected with reason codes within ``codes`` for grid points where ``when(ctx)`` holds, because ``why``."""

    kernel_id: str
    device_type: str
    codes: frozenset
    when: object  # (SdpaCtx) -> bool
    why: str


def judge(kernel_id: str, device_type: str, ctx: SdpaCtx, reasons: list, torch_error: str | None,
          allow: tuple[Allow, ...]) -> tuple[str | None, Allow | None]:
    """Compare LayerZero's verdict (``reasons``, empty = can run) with torch's (``torch_error``, None = ran).
    Returns (mismatch message or None, the allowlist entry that excused a stricter verdict or None)."""
    codes = sorted({r.code.value for r in reasons})
    if not reasons and torch_error is not None:
        return f"UNSAFE {kernel_id} [{ctx}]: LayerZero says it can run; torch raised: {torch_error}", None
    if reasons and torch_error is None:
        for a in allow:
            if a.kernel_id == kernel_id and a.device_type == device_type and set(codes) <= a.codes and a.when(ctx):
                return None, a
        why = "; ".join(str(r) for r in reasons)
        return f"STRICTER {kernel_id} [{ctx}]: torch runs it, LayerZero rejects it ({why}) - not allowlisted", None
    return None, None


SDPA_BACKENDS = {"torch_sdpa.flash": "FLASH_ATTENTION", "torch_sdpa.efficient": "EFFICIENT_ATTENTION",
                 "torch_sdpa.math": "MATH", "torch_sdpa.cudnn": "CUDNN_ATTENTION"}


def mirror(kernel_id: str, grid: list[SdpaCtx], device: str, allow: tuple[Allow, ...]) -> tuple[list[str], set]:
    """Run the whole ``grid`` for ``kernel_id`` on ``device``: (mismatch messages, allowlist entries used)."""
    from torch.nn.attention import SDPBackend

    import layerzero as lz

    backend = getattr(SDPBackend, SDPA_BACKENDS[kernel_id])
    out, used = [], set()
    for c in grid:
        q, k, v, m = sdpa_inputs(dataclasses.replace(c, causal=False, dropout=False), device)
        kw = {"attn_mask": m, "is_causal": c.causal, "dropout_p": 0.1 if c.dropout else 0.0, "layout": c.layout}
        reasons = lz.validate(kernel_id, "attention", q, k, v, **kw)
        msg, excused = judge(kernel_id, torch.device(device).type, c, reasons,
                             torch_sdpa_error(backend, q, k, v, m, c.causal, c.dropout, c.layout), allow)
        if msg:
            out.append(msg)
        if excused is not None:
            used.add(excused)
    return out, used
