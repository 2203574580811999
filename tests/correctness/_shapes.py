"""Shared by the kernel correctness tests (CPU and GPU): tolerances, seeded cases, float64 oracles, runner.

- ``TOL`` per dtype; :func:`mismatch` compares with a float64 oracle using ``atol = TOL * max|ref|`` and
  ``rtol = TOL`` (tolerances relative to the output scale).
- Seeded cases (frozen dataclasses) and their tensors: attention (head dims 8..256 incl. 21/72/203, sequences
  1..587 mostly short, GQA, bool/float masks with fully masked rows, causal with Sq != Sk, BHSD/BSHD, sliced
  and stride(-1) == 2 inputs), norms (hidden 1..5120, residual, mixed-precision weights), RoPE (both styles,
  partial rotary, tables / position ids, BHSD/BSHD, GQA), SwiGLU (intermediate 1..4096, fused gate_up halves,
  transposed and stride(-1) == 2 views).
- float64 oracles from the formulas, independent of ``layerzero``: attention as an explicit einsum softmax
  (GQA by ``repeat_interleave``, top-left causal, fully masked row -> 0), RMSNorm / LayerNorm, RoPE as complex
  multiplication.
- :func:`run_kernel`: lock an op to one kernel, run the cases ``lz.validate`` accepts, compare with the
  oracle; each case first gets the features the kernel requires (:data:`REQUIRED`, :func:`fit_call`: ALiBi
  slopes and :func:`with_alibi`'s oracle for ``triton.attention``, which serves ALiBi calls only).

Sampling oracles live in ``test_lz_ops.py``; the SDPA constraint grid in
``tests/unit/test_sdpa_constraints.py``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

F64 = torch.float64
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MIN_CASES = 200  # cases run per (broadly eligible kernel, dtype)
MAX_CANDIDATES = 5000  # cases drawn at most while looking for MIN_CASES eligible ones
HALF = (torch.float16, torch.bfloat16)


def dname(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def mismatch(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "", floor: float = 0.0
) -> str | None:
    """None when ``out`` matches the float64 ``ref`` within ``TOL[dtype]`` (NaN only where ref is NaN), else a
    one-line description of the worst element. The output scale is ``max(max|ref|, floor)``."""
    if tuple(out.shape) != tuple(ref.shape) or out.dtype != dtype:
        return f"{what} got {out.dtype} {tuple(out.shape)}, expected {dtype} {tuple(ref.shape)}"
    o, r, tol = out.to(F64), ref.to(F64), TOL[dtype]
    finite = torch.isfinite(r)
    scale = max(float(r[finite].abs().max()) if finite.any() else 0.0, floor)
    err = (o - r).abs()
    ok = (err <= tol * scale + tol * r.abs()) | (o == r) | (torch.isnan(o) & torch.isnan(r))
    if bool(ok.all()):
        return None
    bad = tuple((~ok).nonzero()[0].tolist())
    worst = float(err.nan_to_num(1e300).max())
    return (
        f"{what} {int((~ok).sum())}/{ok.numel()} elements off; worst |err|={worst:.3g}"
        f" (tol {tol:g} x max|ref| {scale:.3g}); first at {list(bad)}: got {float(o[bad]):.6g}, "
        f"oracle {float(r[bad]):.6g}"
    )


def randn(
    shape: tuple[int, ...], gen: torch.Generator, device, dtype: torch.dtype, std: float = 1.0
) -> torch.Tensor:
    """Seeded normal samples drawn on the CPU in float32 (same values on every device), then cast."""
    return (torch.randn(shape, generator=gen) * std).to(device=device, dtype=dtype)


# ============================================================================================ attention
@dataclass(frozen=True, slots=True)
class AttnCase:
    """One attention call. ``mask``: none/bool/float, with dims ``mask_shape`` (of B, H, Sq, Sk); ``dead``:
    some query rows have every key masked; ``pad``: q/k/v are ``[..., :D]`` slices of ``D + pad`` wide rows (0
    = contiguous; 3 = rows not 16-byte aligned, 8 = aligned); ``strided``: stride(-1) == 2."""

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
    pad: int
    strided: bool


HEAD_DIMS = (8, 16, 21, 32, 40, 64, 72, 80, 96, 128, 160, 192, 203, 256)


def attention_case(seed: int) -> AttnCase:
    """The seeded case ``seed``: every 25th is long (Sq/Sk up to 587), the rest short; see
    :class:`AttnCase`."""
    rng = random.Random(seed * 7919 + 17)
    long = seed % 25 == 7
    hkv = rng.randint(1, 2 if long else 3)
    hq = hkv * rng.choice((1, 1, 2, 4))
    d = rng.choice(HEAD_DIMS)
    dv = d if rng.random() < 0.9 else rng.choice((8, 24, 72))
    if long:
        sq, sk = rng.randint(100, 587), rng.randint(100, 587)
    else:
        sq, sk = rng.choice((1, 1, 2, 3, rng.randint(1, 64), rng.randint(1, 64))), rng.randint(1, 64)
    sk = sq if rng.random() < 0.35 else sk
    mask = rng.choice(("none", "none", "bool", "float"))
    causal = rng.random() < (0.08 if mask != "none" else 0.45)
    batch, form = 1 if long else rng.randint(1, 3), rng.choice(("SS", "B1SS", "1HSS", "BHSS"))
    dead, layout = mask != "none" and rng.random() < 0.2, rng.choice(("BHSD", "BSHD"))
    scale = None if rng.random() < 0.7 else rng.uniform(0.05, 0.5)
    sliced, strided = rng.random() < 0.12, rng.random() < 0.04
    pad = (3 if rng.random() < 0.5 else 8) if sliced else 0
    return AttnCase(
        seed, batch, hq, hkv, sq, sk, d, dv, mask, form, dead, causal, layout, scale, pad, strided
    )


def _qkv_tensor(shape: tuple[int, ...], gen, device, dtype, pad: int, strided: bool) -> torch.Tensor:
    if strided:  # stride(-1) == 2
        return randn((*shape[:-1], 2 * shape[-1]), gen, device, dtype)[..., ::2]
    return randn((*shape[:-1], shape[-1] + pad), gen, device, dtype)[..., : shape[-1]]


def attention_inputs(case: AttnCase, dtype: torch.dtype, device="cpu"):
    """``(q, k, v, attn_mask)`` for ``case`` in its layout; the mask is bool or additive in ``dtype``."""
    gen = torch.Generator().manual_seed(case.seed)
    b, hq, hkv, sq, sk, d, dv = case.batch, case.hq, case.hkv, case.sq, case.sk, case.d, case.dv
    shapes = ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv))
    if case.layout == "BSHD":
        shapes = tuple((x[0], x[2], x[1], x[3]) for x in shapes)
    q, k, v = (_qkv_tensor(s, gen, device, dtype, case.pad, case.strided) for s in shapes)
    return q, k, v, make_mask(case.mask, case.mask_shape, case.dead, b, hq, sq, sk, gen, device, dtype)


def make_mask(
    kind: str,
    form: str,
    dead: bool,
    b: int,
    hq: int,
    sq: int,
    sk: int,
    gen: torch.Generator,
    device,
    dtype: torch.dtype,
) -> torch.Tensor | None:
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
    return torch.randn(shape, generator=gen, dtype=F64).masked_fill(~keep, float("-inf")).to(device, dtype)


def attention_oracle(q, k, v, attn_mask=None, is_causal=False, scale=None, layout="BHSD") -> torch.Tensor:
    """float64 ``softmax(q k^T * scale + mask) v`` by explicit einsum; GQA by ``repeat_interleave``; bool mask
    True = attend; ``is_causal`` top-left (key j visible to query i iff j <= i); a row with no visible key
    -> 0."""
    if layout == "BSHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    group, sq, sk, dev = q.shape[1] // k.shape[1], q.shape[2], k.shape[2], q.device
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    visible = torch.ones(sq, sk, dtype=torch.bool, device=dev)
    if is_causal:
        visible = torch.arange(sk, device=dev)[None, :] <= torch.arange(sq, device=dev)[:, None]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        visible = visible & attn_mask
    elif attn_mask is not None:
        s = s + attn_mask.to(F64)
    s = torch.where(visible, s, torch.tensor(float("-inf"), dtype=F64, device=dev))
    alive = torch.isfinite(s).any(-1, keepdim=True) | torch.isnan(s).any(-1, keepdim=True)
    e = torch.exp(s - torch.where(alive, s.amax(-1, keepdim=True), torch.zeros((), dtype=F64, device=dev)))
    p = torch.where(alive, e / torch.where(alive, e.sum(-1, keepdim=True), 1.0), 0.0)
    out = torch.einsum("bhij,bhjd->bhid", p, v)
    return out.transpose(1, 2) if layout == "BSHD" else out


# ============================================================================================ norms
@dataclass(frozen=True, slots=True)
class NormCase:
    """One norm call: x ``[*lead, hidden]`` with ``std``; ``extra`` = residual (rms_norm) or bias
    (layer_norm); ``weight_f32``: float32 weight/bias for half x (mixed precision); ``layout``:
    contiguous/sliced/transposed."""

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
    return NormCase(
        seed,
        lead,
        hidden,
        rng.choice((1e-6, 1e-5, 1e-3)),
        rng.random() < 0.5,
        rng.random() < 0.2,
        rng.choice(("contiguous",) * 6 + ("sliced", "transposed")),
        rng.choice((0.1, 1.0, 3.0, 30.0)),
    )


def norm_inputs(case: NormCase, dtype: torch.dtype, device="cpu"):
    """``(x, weight, extra)``: extra is the residual (like x) or None."""
    gen = torch.Generator().manual_seed(case.seed)
    shape, lead, h = (*case.lead, case.hidden), case.lead, case.hidden
    if case.layout == "sliced":
        x = randn((*lead, h + 5), gen, device, dtype, case.std)[..., 2 : 2 + h]
    elif case.layout == "transposed" and lead:
        x = randn((*lead[:-1], h, lead[-1]), gen, device, dtype, case.std).transpose(-1, -2)
    else:
        x = randn(shape, gen, device, dtype, case.std)
    wdt = torch.float32 if case.weight_f32 and dtype in HALF else dtype
    weight = (1.0 + randn((h,), gen, device, F64, 0.5)).to(wdt)
    return x, weight, randn(shape, gen, device, dtype, case.std) if case.extra else None


def rms_oracle(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 ``x / sqrt(mean(x^2) + eps) * weight``."""
    x = x.to(F64)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight.to(F64)


def layer_norm_oracle(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """float64 ``(x - mean) / sqrt(biased var + eps) * weight + bias``."""
    x = x.to(F64)
    mu = x.sum(-1, keepdim=True) / x.shape[-1]
    y = (x - mu) / torch.sqrt(((x - mu) ** 2).sum(-1, keepdim=True) / x.shape[-1] + eps) * weight.to(F64)
    return y if bias is None else y + bias.to(F64)


# ============================================================================================ rope
@dataclass(frozen=True, slots=True)
class RopeCase:
    """One rope call: ``rot`` even <= ``d``; ``form``: gathered [B|1,S,R] / table / table + position_ids
    [B|1,S]."""

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
    return RopeCase(
        seed,
        rng.randint(1, 3),
        hkv * rng.choice((1, 2, 4)),
        hkv,
        rng.choice((1, rng.randint(1, 80))),
        d,
        rot,
        rng.choice(("gathered", "gathered1", "table", "ids", "ids1", "ids32")),
        rng.random() < 0.5,
        rng.choice(("BHSD", "BSHD")),
        rng.random() < 0.5,
        rng.choice((10000.0, 500000.0)),
    )


def rope_inputs(case: RopeCase, dtype: torch.dtype, device="cpu"):
    """``(q, k, cos, sin, position_ids)``; tables like HF (``cat(f, f)``) or GPT-J
    (``repeat_interleave(f, 2)``)."""
    gen = torch.Generator().manual_seed(case.seed)
    b, s = case.batch, case.s
    shapes = ((b, case.hq, s, case.d), (b, case.hkv, s, case.d))
    if case.layout == "BSHD":
        shapes = tuple((x[0], x[2], x[1], x[3]) for x in shapes)
    q, k = (randn(sh, gen, device, dtype) for sh in shapes)
    inv = case.base ** (-torch.arange(0, case.rot, 2, dtype=F64) / case.rot)
    ang = torch.arange(s + 40, dtype=F64)[:, None] * inv[None, :]  # [max_pos, R/2]
    expand = (lambda t: t.repeat_interleave(2, -1)) if case.interleaved else (lambda t: torch.cat((t, t), -1))
    cos_t, sin_t = expand(torch.cos(ang)), expand(torch.sin(ang))
    pos = torch.randint(0, s + 40, (1 if case.form in ("gathered1", "ids1") else b, s), generator=gen)
    ids = None
    if case.form.startswith("gathered"):
        cos_t, sin_t = cos_t[pos], sin_t[pos]
    elif case.form.startswith("ids"):
        ids = pos.to(torch.int32 if case.form == "ids32" else torch.int64).to(device)
    tdt = torch.float32 if case.table_f32 else dtype
    return q, k, cos_t.to(device=device, dtype=tdt), sin_t.to(device=device, dtype=tdt), ids


def rope_oracle(x, cos, sin, position_ids, interleaved: bool, layout: str) -> torch.Tensor:
    """float64 RoPE by complex multiplication with the given tables' angles: pairs ``(x_i, x_{i+R/2})``
    (NeoX) or ``(x_2i, x_2i+1)`` (GPT-J) are complex numbers rotated by ``cos + i sin``; dims >= R pass."""
    if cos.dim() == 2:
        s = x.shape[2] if layout == "BHSD" else x.shape[1]
        idx = torch.arange(s, device=cos.device)[None] if position_ids is None else position_ids.long()
        cos, sin = cos[idx], sin[idx]
    r = cos.shape[-1]
    pick = (lambda t: t[..., 0::2]) if interleaved else (lambda t: t[..., : r // 2])
    rot = torch.complex(pick(cos).to(F64), pick(sin).to(F64)).unsqueeze(1 if layout == "BHSD" else 2)
    x = x.to(F64)
    head, tail = x[..., :r], x[..., r:]
    a, b = (head[..., 0::2], head[..., 1::2]) if interleaved else (head[..., : r // 2], head[..., r // 2 :])
    z = torch.complex(a, b) * rot
    out = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((out, tail), -1)


# ============================================================================================ swiglu
@dataclass(frozen=True, slots=True)
class SwigluCase:
    """One swiglu call: gate/up ``[*lead, inter]`` with values of std ``std``. ``layout``: contiguous;
    ``fused`` (gate, up = the two halves of one ``[*lead, 2 * inter]`` gate_up tensor, row stride 2I);
    ``transposed`` (the first two leading dims swapped, a non-mergeable view); ``strided`` (stride(-1) ==
    2)."""

    seed: int
    lead: tuple[int, ...]
    inter: int
    layout: str
    std: float


INTER = (
    1,
    2,
    3,
    7,
    8,
    16,
    21,
    63,
    64,
    100,
    127,
    128,
    255,
    256,
    511,
    1000,
    1024,
    1025,
    1376,
    2048,
    2753,
    4096,
)


def swiglu_case(seed: int) -> SwigluCase:
    """The seeded swiglu case ``seed`` (odd and even intermediate sizes 1..4096, 0-3 leading dims)."""
    rng = random.Random(seed * 15485863 + 11)
    lead = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
    layout = rng.choice(("contiguous",) * 5 + ("fused", "fused", "transposed", "strided"))
    return SwigluCase(seed, lead, rng.choice(INTER), layout, rng.choice((0.1, 1.0, 3.0, 30.0)))


def swiglu_inputs(case: SwigluCase, dtype: torch.dtype, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of ``case`` in ``dtype`` on ``device``, laid out as ``case.layout`` says."""
    gen = torch.Generator().manual_seed(case.seed)
    lead, i = case.lead, case.inter
    if case.layout == "fused":
        gate_up = randn((*lead, 2 * i), gen, device, dtype, case.std)
        return gate_up[..., :i], gate_up[..., i:]
    if case.layout == "strided":
        return tuple(randn((*lead, 2 * i), gen, device, dtype, case.std)[..., ::2] for _ in range(2))
    if case.layout == "transposed" and len(lead) >= 2:
        swapped = (lead[1], lead[0], *lead[2:], i)
        return tuple(randn(swapped, gen, device, dtype, case.std).transpose(0, 1) for _ in range(2))
    return randn((*lead, i), gen, device, dtype, case.std), randn((*lead, i), gen, device, dtype, case.std)


def swiglu_oracle(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """float64 ``silu(gate) * up = gate * sigmoid(gate) * up`` (sigmoid as ``1 / (1 + exp(-g))``)."""
    g = gate.to(F64)
    return g / (1.0 + torch.exp(-g)) * up.to(F64)


# ============================================================================================ runners
@dataclass(frozen=True, slots=True)
class Call:
    """One op call: its case, the ``lz.<op>`` arguments and a float64 oracle of its output(s)."""

    case: Any
    args: tuple
    kwargs: dict
    oracle: Callable[[], Any]  # -> tensor or tuple of tensors
    floor: float = 0.0  # least output scale for the tolerance (see mismatch)


def attention_call(seed: int, dtype: torch.dtype, device="cpu") -> Call:
    """The attention :class:`Call` of case ``seed``."""
    c = attention_case(seed)
    q, k, v, mask = attention_inputs(c, dtype, device)
    kw = {"attn_mask": mask, "is_causal": c.causal, "scale": c.scale, "layout": c.layout}
    return Call(c, (q, k, v), kw, lambda: attention_oracle(q, k, v, mask, c.causal, c.scale, c.layout))


def with_alibi(call: Call, device="cpu") -> Call:
    """``call`` (an attention call) with ALiBi: per-head float32 slopes ``[Hq]`` (even case seeds) or
    ``[B, Hq]`` (odd; Press et al. 2022's ``2**(-8 (h + 1) / Hq)``, scaled per batch row), and an oracle that
    adds flash-attn's bias ``-slope * |i + Sk - Sq - j|`` to the float64 scores as an additive mask
    (lz.attention's top-left causal mask unchanged), folded with the call's own mask. Sizes come from the
    tensors (``call.case`` may be None: then ``[Hq]`` slopes). What kernels that serve ALiBi calls only
    (``ALIBI_REQUIRED``, ``triton.attention``) are swept on (:data:`REQUIRED`)."""
    q, k, v = call.args
    kw = call.kwargs
    layout, causal, scale, mask = (
        kw.get("layout", "BHSD"),
        kw.get("is_causal", False),
        kw.get("scale"),
        kw.get("attn_mask"),
    )
    b, hq, sq = (
        (q.shape[0], q.shape[1], q.shape[2]) if layout == "BHSD" else (q.shape[0], q.shape[2], q.shape[1])
    )
    sk = k.shape[2] if layout == "BHSD" else k.shape[1]
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)], dtype=torch.float32)
    per_batch = getattr(call.case, "seed", 0) % 2 == 1
    slopes = base[None, :] * torch.linspace(0.5, 1.5, b)[:, None] if per_batch else base
    i, j = torch.arange(sq, dtype=F64)[:, None], torch.arange(sk, dtype=F64)[None, :]
    dist = (i + sk - sq - j).abs()
    per = slopes.to(F64) if per_batch else slopes.to(F64)[None, :]
    bias = -per[:, :, None, None] * dist  # [B or 1, Hq, Sq, Sk]

    def oracle():
        add = bias.to(q.device)
        if mask is not None:  # fold the call's own mask in (bool: -inf where hidden)
            m = (
                mask
                if mask.dtype != torch.bool
                else torch.zeros(mask.shape, dtype=F64, device=q.device).masked_fill(~mask, float("-inf"))
            )
            add = add + m.to(F64)
        return attention_oracle(q, k, v, add, causal, scale, layout)

    return Call(call.case, call.args, {**kw, "alibi_slopes": slopes.to(device)}, oracle, call.floor)


REQUIRED: dict[str, dict[str, Callable[[Call, Any], Call]]] = {"attention": {"ALIBI_REQUIRED": with_alibi}}
"""Per op: the refusals (``ReasonCode`` values) that say "this kernel serves only calls with feature X", each
with the transform ``(call, device) -> call`` that adds X to a drawn call, oracle included. A kernel that such
a refusal rules out on every drawn case (``triton.attention``: ALiBi calls only) would run none of them (0 of
5,000 on the H200): :func:`fit_call` adds what it requires. Add a row with its reason code when a kernel
requires another feature (``tests/correctness/test_sweep_coverage.py`` fails until then)."""

Refusals = Callable[
    [Call], "list[str]"
]  # a call -> the codes of the reasons a kernel cannot run it ([] = it can)


def validate_codes(op: str, kernel_id: str) -> Refusals:
    """:data:`Refusals` of ``kernel_id`` by ``lz.validate`` (this machine, policy included)."""
    import layerzero as lz

    return lambda call: [r.code.value for r in lz.validate(kernel_id, op, *call.args, **call.kwargs)]


def fit_call(op: str, call: Call, refusals: Refusals, device="cpu") -> tuple[Call, list[str]]:
    """``(call, codes)``: ``call`` with every feature the kernel requires added (:data:`REQUIRED`: while
    ``refusals`` names one not yet added) and the codes ``refusals`` gives for the result (empty: it can run
    it)."""
    codes, adds, added = refusals(call), REQUIRED.get(op, {}), set()
    while todo := [code for code in dict.fromkeys(codes) if code in adds and code not in added]:
        for code in todo:
            call = adds[code](call, device)
            added.add(code)
        codes = refusals(call)
    return call, codes


def rms_call(seed: int, dtype: torch.dtype, device="cpu") -> Call:
    """The rms_norm :class:`Call` of case ``seed`` (fused residual when ``case.extra``: oracle
    ``(y, x + r)``)."""
    c = norm_case(seed)
    x, w, res = norm_inputs(c, dtype, device)

    def oracle():
        """float64 y, or (y, h) with the residual sum h kept in x's dtype."""
        if res is None:
            return rms_oracle(x, w, c.eps)
        h = (x.to(F64) + res.to(F64)).to(dtype)  # the residual stream stays in x's dtype
        return rms_oracle(h, w, c.eps), h.to(F64)

    return Call(c, (x, w, c.eps), {"residual": res}, oracle)


def layer_call(seed: int, dtype: torch.dtype, device="cpu") -> Call:
    """The layer_norm :class:`Call` of case ``seed`` (bias [H] in the weight's dtype when ``case.extra``)."""
    c = norm_case(seed)
    x, w, extra = norm_inputs(c, dtype, device)
    bias = None if extra is None else extra[(0,) * (extra.dim() - 1)].to(w.dtype).contiguous()
    # hidden = 1 normalizes 0 / sqrt(eps): the output scale is the weight's, not max|ref| = |bias| or 0
    return Call(
        c, (x, w, bias, c.eps), {}, lambda: layer_norm_oracle(x, w, bias, c.eps), float(w.abs().max())
    )


def rope_call(seed: int, dtype: torch.dtype, device="cpu") -> Call:
    """The rope :class:`Call` of case ``seed``: oracle ``(q_rot, k_rot)``."""
    c = rope_case(seed)
    q, k, cos, sin, ids = rope_inputs(c, dtype, device)
    kw = {"position_ids": ids, "interleaved": c.interleaved, "layout": c.layout}
    return Call(
        c,
        (q, k, cos, sin),
        kw,
        lambda: tuple(rope_oracle(t, cos, sin, ids, c.interleaved, c.layout) for t in (q, k)),
    )


def qk_norm_rope_call(seed: int, dtype: torch.dtype, device="cpu") -> Call:
    """The qk_norm_rope :class:`Call` of case ``seed`` (the rope case's q/k scaled by 0.05-20, so the norm
    matters; weights in [0.5, 1.5) in q's dtype; eps 1e-6 or 1e-5): oracle ``(q_out, k_out)``, each head
    RMS-normalized in float64 from the given values, then :func:`rope_oracle`."""
    c = rope_case(seed)
    q, k, cos, sin, ids = rope_inputs(c, dtype, device)
    gen = torch.Generator().manual_seed(seed + 7)
    scale = float(torch.empty(()).uniform_(-3, 3, generator=gen).exp())
    q, k = (q.float() * scale).to(dtype), (k.float() * scale * 0.5).to(dtype)
    qw, kw = ((torch.rand(c.d, generator=gen) + 0.5).to(device=device, dtype=dtype) for _ in range(2))
    eps = (1e-6, 1e-5)[seed % 2]

    def norm(x, w):
        x = x.to(F64)
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.to(F64)

    kw_ = {"eps": eps, "position_ids": ids, "interleaved": c.interleaved, "layout": c.layout}
    return Call(
        c,
        (q, k, qw, kw, cos, sin),
        kw_,
        lambda: tuple(
            rope_oracle(norm(t, w), cos, sin, ids, c.interleaved, c.layout) for t, w in ((q, qw), (k, kw))
        ),
    )


def swiglu_call(seed: int, dtype: torch.dtype, device="cpu") -> Call:
    """The swiglu :class:`Call` of case ``seed``: oracle ``silu(gate) * up`` in float64."""
    c = swiglu_case(seed)
    gate, up = swiglu_inputs(c, dtype, device)
    return Call(c, (gate, up), {}, lambda: swiglu_oracle(gate, up))


CALLS = {
    "attention": attention_call,
    "rms_norm": rms_call,
    "layer_norm": layer_call,
    "rope": rope_call,
    "qk_norm_rope": qk_norm_rope_call,
    "swiglu": swiglu_call,
}
KnownBug = Callable[[str, Call], "str | None"]  # (kernel_id, call) -> why the call is excluded, or None


@dataclass(frozen=True, slots=True)
class KernelRun:
    """What :func:`run_kernel` did: cases run and drawn, rejection codes (and known-bug exclusions) seen,
    failure messages, and how many calls ``lz.trace`` saw served by the kernel."""

    kernel_id: str
    dtype: torch.dtype
    ran: int
    drawn: int
    rejected: dict
    failures: list
    traced: int

    def report(self) -> str:
        """A multi-line summary with the first 12 failures."""
        more = [f"... {len(self.failures) - 12} more"] if len(self.failures) > 12 else []
        return "\n  ".join(
            [
                f"{self.kernel_id} {dname(self.dtype)}: {self.ran} cases run of {self.drawn} drawn, "
                f"{self.traced} traced; skipped: {self.rejected}",
                *self.failures[:12],
                *more,
            ]
        )


def skip_if_off_on_this_cpu(kernel_id: str, ran: int, drawn: int, rejected: dict) -> None:
    """``pytest.skip`` when this host's CPU rules ``kernel_id`` out for every one of the ``drawn`` cases
    (``ran`` 0, PLATFORM_UNSUPPORTED each time: ``torch_sdpa.cpu_fp32_upcast`` on an ``avx512_fp16`` CPU,
    bfloat16 SDPA kernels on an AMX CPU whose ATen dispatch is forced below AVX-512); the kernels' own tests
    cover those rules."""
    import pytest

    if ran == 0 and drawn > 0 and rejected.get("PLATFORM_UNSUPPORTED") == drawn:
        pytest.skip(f"{kernel_id} is off on this CPU (PLATFORM_UNSUPPORTED for all {drawn} cases)")


def run_kernel(
    op: str,
    kernel_id: str,
    dtype: torch.dtype,
    device="cpu",
    target: int = MIN_CASES,
    known_bug: KnownBug | None = None,
    first_seed: int = 0,
) -> KernelRun:
    """Lock ``op`` to ``kernel_id`` and run seeded cases until ``target`` ran (cases ``lz.validate`` rejects,
    or ``known_bug`` excludes, are skipped and counted), comparing each output with the float64 oracle. Each
    case gets the features the kernel requires (:func:`fit_call`: ALiBi slopes for ``triton.attention``), so a
    kernel that serves only such calls is swept too. CUDA work is synchronized per case so an error names its
    case; a CUDA error ends the run. ``first_seed``: where the seeds start (a part of a sweep split across
    processes draws its own seeds)."""
    import layerzero as lz

    fn, make, cuda = getattr(lz, op), CALLS[op], torch.device(device).type == "cuda"
    refusals = validate_codes(op, kernel_id)
    ran = drawn = 0
    skipped: dict[str, int] = {}
    failures: list[str] = []
    lz.lock(op, kernel_id)
    try:
        with lz.trace() as tr:
            for seed in range(first_seed, first_seed + MAX_CANDIDATES):
                if ran >= target:
                    break
                drawn += 1
                call, codes = fit_call(op, make(seed, dtype, device), refusals, device)
                bug = None if codes or known_bug is None else known_bug(kernel_id, call)
                for code in codes or ([f"known bug: {bug}"] if bug else []):
                    skipped[code] = skipped.get(code, 0) + 1
                if codes or bug:
                    continue
                ran += 1
                try:
                    out = fn(*call.args, **call.kwargs)
                    if cuda:
                        torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - reported as a failure with the case
                    failures.append(
                        f"[{call.case}] validate() says it can run; it raised {type(exc).__name__}: "
                        f"{str(exc)[:400]}"
                    )
                    if "CUDA error" in str(exc):
                        failures.append("CUDA context is broken: run stopped")
                        break
                    continue
                ref = call.oracle()
                outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
                for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
                    msg = mismatch(o, r, dtype, f"output {i}", call.floor)
                    if msg:
                        failures.append(f"[{call.case}] {msg}")
    finally:
        lz.unlock(op)
    return KernelRun(kernel_id, dtype, ran, drawn, skipped, failures, tr.counts[(op, kernel_id)])


def kernel_dtype_params(ops, device_type: str, dtypes=DTYPES) -> list[tuple[str, str, torch.dtype]]:
    """``(op, kernel_id, dtype)`` for every kernel of ``ops`` whose backend is available, that runs on
    ``device_type``, and every dtype of ``dtypes`` it declares (``lz.list_kernels``)."""
    import layerzero as lz

    return [
        (op, k["kernel_id"], dt)
        for op in ops
        for k in lz.list_kernels(op)
        for dt in dtypes
        if k["available"] and device_type in k["device_types"] and dname(dt) in k["dtypes"]
    ]


def kept_oracle(logits, temperature, k=None, p=None):
    """float64 probabilities and the reference's kept set, in the kernel's candidate order: ``(order, probs)``
    with ``order`` the kept token ids (descending probability, lower id first on ties; token order when
    nothing is cut) and ``probs`` their renormalized float64 probabilities (on CPU; ``logits`` may be
    anywhere)."""
    prob = torch.softmax(logits.cpu().to(torch.float64) / temperature, -1)
    vocab = prob.shape[-1]
    if k is not None and k < vocab:
        order = torch.topk(prob, k).indices
    elif p is not None and p < 1.0:
        sp, order = torch.sort(prob, descending=True, stable=True)
        before = torch.cumsum(sp, 0) - sp
        order = order[(before < p) | (torch.arange(vocab) == 0)]
    else:
        order = torch.arange(vocab)
    kept = prob[order]
    return order, kept / kept.sum()
