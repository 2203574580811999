"""Constraint mirroring on CPU: for every point of a grid (dtypes x head dims {8, 21, 64, 72, 203, 256, 512} x
GQA x mask none/bool/float x causal x dropout x stride(-1) == 1 or not x layout x (Sq, Sk) in {6x6, 6x9, 1x9,
6x1}), ``lz.validate("torch_sdpa.<x>", "attention", ...) == []`` must imply that torch itself runs that
sub-backend (``sdpa_kernel(SDPBackend.X)`` on the BHSD views LayerZero passes it). LayerZero may be stricter
than torch only in the cases of ``CPU_ALLOW``, each with its reason; an allowlist entry no grid point needs is
stale. The grid, the judge and :func:`mirror` are shared with ``tests/gpu/test_gpu_sdpa_constraints.py``."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import layerzero as lz
from layerzero.core.reasons import Reason, ReasonCode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from _shapes import DTYPES, _qkv_tensor, attention_oracle, dname, make_mask, mismatch, randn  # noqa: E402

pytestmark = pytest.mark.unit


# ============================================================================================ SDPA grid
SEQS = {
    "6x6": (6, 6),
    "6x9": (6, 9),
    "1x9": (1, 9),
    "6x1": (6, 1),
}  # (Sq, Sk): square, long keys, decode, 1 key


@dataclass(frozen=True, slots=True)
class SdpaCtx:
    """One point of the SDPA constraint grid (B=2, Hq=4, Hkv=2 with GQA else 4; ``seq`` names (Sq, Sk))."""

    dtype: torch.dtype
    d: int
    gqa: bool
    mask: str
    causal: bool
    dropout: bool
    stride1: bool
    layout: str
    seq: str

    def __str__(self) -> str:
        return (
            f"{dname(self.dtype)} d={self.d} gqa={self.gqa} mask={self.mask} causal={self.causal} "
            f"dropout={self.dropout} stride1={self.stride1} layout={self.layout} SqxSk={self.seq}"
        )


def sdpa_grid(dtypes=DTYPES) -> list[SdpaCtx]:
    """dtypes x head dims {8,21,64,72,203,256,512} x GQA x mask x causal x dropout x stride x layout x seq."""
    return [
        SdpaCtx(*c)
        for c in itertools.product(
            dtypes,
            (8, 21, 64, 72, 203, 256, 512),
            (False, True),
            ("none", "bool", "float"),
            (False, True),
            (False, True),
            (True, False),
            ("BHSD", "BSHD"),
            tuple(SEQS),
        )
    ]


@functools.lru_cache(maxsize=64)
def sdpa_inputs(c: SdpaCtx, device="cpu"):
    """``(q, k, v, mask)`` in ``c.layout`` for grid point ``c`` (memoized: causal/dropout don't change
    them)."""
    gen = torch.Generator().manual_seed(c.d * 31 + 7)
    (sq, sk), b, hq, hkv = SEQS[c.seq], 2, 4, 2 if c.gqa else 4
    dims = ((b, hq, sq), (b, hkv, sk), (b, hkv, sk))
    if c.layout == "BSHD":
        dims = tuple((x[0], x[2], x[1]) for x in dims)
    q, k, v = (_qkv_tensor((*x, c.d), gen, device, c.dtype, 0, not c.stride1) for x in dims)
    return q, k, v, make_mask(c.mask, "B1SS", False, b, hq, sq, sk, gen, device, c.dtype)


def torch_sdpa_error(backend, q, k, v, mask, causal: bool, dropout: bool, layout: str) -> str | None:
    """Run torch SDPA forced to ``backend`` (``SDPBackend``) on BHSD views of the inputs (as LayerZero calls
    it); None if it ran, else torch's error (first line). CUDA is synchronized so errors surface here."""
    if layout == "BSHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    try:
        with warnings.catch_warnings(), sdpa_kernel(backend):
            warnings.simplefilter("ignore")
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=causal,
                dropout_p=0.1 if dropout else 0.0,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            if q.is_cuda:
                torch.cuda.synchronize(q.device)
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0][:300]
    return None


@dataclass(frozen=True, slots=True)
class Allow:
    """A documented case where LayerZero is stricter than torch: ``kernel_id`` on ``device_type`` may be
    rejected with reason codes within ``codes`` at grid points where ``when(ctx)`` holds, because ``why``."""

    kernel_id: str
    device_type: str
    codes: frozenset
    when: Callable[[SdpaCtx], bool]
    why: str


def judge(
    kernel_id: str,
    device_type: str,
    ctx: SdpaCtx,
    reasons: list,
    torch_error: str | None,
    allow: tuple[Allow, ...],
) -> tuple[str | None, Allow | None]:
    """Compare LayerZero's verdict (``reasons``, empty = can run) with torch's (``torch_error``, None = ran).
    Returns (mismatch message or None, the allowlist entry that excused a stricter verdict or None)."""
    if not reasons and torch_error is not None:
        return f"UNSAFE {kernel_id} [{ctx}]: LayerZero says it can run; torch raised: {torch_error}", None
    if reasons and torch_error is None:
        codes = {r.code.value for r in reasons}
        for a in allow:
            if a.kernel_id == kernel_id and a.device_type == device_type and codes <= a.codes and a.when(ctx):
                return None, a
        why = "; ".join(str(r) for r in reasons)
        return (
            f"STRICTER {kernel_id} [{ctx}]: torch runs it, LayerZero rejects it ({why}); not allowlisted",
            None,
        )
    return None, None


SDPA_BACKENDS = {
    "torch_sdpa.flash": "FLASH_ATTENTION",
    "torch_sdpa.efficient": "EFFICIENT_ATTENTION",
    "torch_sdpa.math": "MATH",
    "torch_sdpa.cudnn": "CUDNN_ATTENTION",
}


def mirror(
    kernel_id: str, grid: list[SdpaCtx], device: str, allow: tuple[Allow, ...], stricter_every: int = 1
) -> tuple[list[str], set]:
    """Judge ``grid`` for ``kernel_id`` on ``device``: (mismatch messages, allowlist entries used). Every
    point LayerZero accepts is run by torch; of those it rejects, a fixed 1-in-``stricter_every`` sample (by a
    hash of the point) is, to bound the cost of backends whose every successful call builds a new plan
    (cuDNN)."""
    backend, out, used = getattr(SDPBackend, SDPA_BACKENDS[kernel_id]), [], set()
    for c in grid:
        q, k, v, m = sdpa_inputs(dataclasses.replace(c, causal=False, dropout=False), device)
        kw = {
            "attn_mask": m,
            "is_causal": c.causal,
            "dropout_p": 0.1 if c.dropout else 0.0,
            "layout": c.layout,
        }
        reasons = lz.validate(kernel_id, "attention", q, k, v, **kw)
        if reasons and zlib.crc32(str(c).encode()) % stricter_every:
            continue
        msg, excused = judge(
            kernel_id,
            torch.device(device).type,
            c,
            reasons,
            torch_sdpa_error(backend, q, k, v, m, c.causal, c.dropout, c.layout),
            allow,
        )
        if msg:
            out.append(msg)
        if excused is not None:
            used.add(excused)
    return out, used


# torch documents attn_mask and is_causal as mutually exclusive for F.scaled_dot_product_attention ("an error
# is thrown if both are set"; the math kernel enforces it). LayerZero keeps that contract for every
# sub-backend, even where a fused kernel happens to accept both (CPU flash; CUDA efficient and cuDNN).
MASK_AND_CAUSAL_WHY = (
    "SDPA documents attn_mask and is_causal as mutually exclusive; LayerZero keeps the contract "
    "for every sub-backend (the reference kernel serves mask + causal)"
)


CPU_ALLOW = (
    Allow(
        "torch_sdpa.flash",
        "cpu",
        frozenset({"MASK_WITH_CAUSAL"}),
        lambda c: c.mask != "none" and c.causal,
        MASK_AND_CAUSAL_WHY
        + "; CPU flash does combine them correctly (test_cpu_flash_combines_mask_and_causal_"
        "correctly), so relaxing mask_with_causal for CPU flash would only win speed",
    ),
)


GRID = sdpa_grid()


def test_grid_has_every_combination():
    """The grid is the full product of the axes the brief lists (plus 4 (Sq, Sk) shapes)."""
    assert len(GRID) == 4 * 7 * 2 * 3 * 2 * 2 * 2 * 2 * 4
    assert {c.d for c in GRID} == {8, 21, 64, 72, 203, 256, 512}


@pytest.mark.parametrize("kernel_id", sorted(SDPA_BACKENDS))
def test_validate_mirrors_torch_on_cpu(kernel_id):
    # efficient/cuDNN are CUDA-only: LayerZero rejects every CPU point, so a 1-in-8 sample of torch calls
    # suffices
    """validate() == [] implies torch runs the sub-backend; a stricter verdict needs an allowlist entry."""
    every = 8 if kernel_id in ("torch_sdpa.efficient", "torch_sdpa.cudnn") else 1
    mismatches, used = mirror(kernel_id, GRID, "cpu", CPU_ALLOW, stricter_every=every)
    assert not mismatches, (
        f"{len(mismatches)} grid points where LayerZero and torch {torch.__version__} disagree "
        f"about {kernel_id} on CPU:\n" + "\n".join(mismatches[:25])
    )
    stale = [a.why for a in CPU_ALLOW if a.kernel_id == kernel_id and a not in used]
    assert not stale, f"allowlist entries no grid point needed (remove them): {stale}"


def test_cpu_flash_combines_mask_and_causal_correctly():
    """Backs CPU_ALLOW: torch's CPU flash with attn_mask + is_causal equals the oracle's mask AND top-left
    causal."""
    gen = torch.Generator().manual_seed(0)
    for kind, (sq, sk) in (("bool", (6, 6)), ("float", (5, 9)), ("bool", (9, 4))):
        q, k, v = (
            randn((2, 4, sq, 32), gen, "cpu", torch.float32),
            *(randn((2, 2, sk, 32), gen, "cpu", torch.float32) for _ in range(2)),
        )
        mask = make_mask(kind, "B1SS", False, 2, 4, sq, sk, gen, "cpu", torch.float32)
        mask[..., 0] = True if kind == "bool" else 0.0  # keep key 0 so no row is fully masked
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True)
        ref = attention_oracle(q, k, v, mask, True)
        assert mismatch(out, ref, torch.float32) is None, (kind, sq, sk, mismatch(out, ref, torch.float32))


# ------------------------------------------------------------------------------ the judge itself can fail
CTX = SdpaCtx(torch.float16, 64, False, "none", True, False, True, "BHSD", "6x9")
REJECT = [Reason(ReasonCode.MASK_WITH_CAUSAL, "cannot combine attn_mask with is_causal=True")]


def test_judge_flags_can_run_that_torch_refuses():
    """'can run' with a torch error is reported as UNSAFE with the point and torch's message."""
    msg, _ = judge("torch_sdpa.flash", "cpu", CTX, [], "No available kernel.", ())
    assert msg is not None and msg.startswith("UNSAFE") and "No available kernel" in msg and "d=64" in msg


def test_judge_flags_unlisted_stricter_verdict_and_accepts_allowlisted_one():
    """A rejection torch does not share is reported unless an entry covers its kernel, device and codes."""
    msg, used = judge("torch_sdpa.flash", "cpu", CTX, REJECT, None, ())
    assert msg is not None and msg.startswith("STRICTER") and "MASK_WITH_CAUSAL" in msg and used is None
    masked = SdpaCtx(torch.float16, 64, False, "bool", True, False, True, "BHSD", "6x9")
    assert judge("torch_sdpa.flash", "cpu", masked, REJECT, None, CPU_ALLOW) == (None, CPU_ALLOW[0])
    # the entry covers only its own codes, kernel and device
    other = [Reason(ReasonCode.HEAD_DIM_MISMATCH, "x")]
    assert judge("torch_sdpa.flash", "cpu", masked, other, None, CPU_ALLOW)[0] is not None
    assert judge("torch_sdpa.math", "cpu", masked, REJECT, None, CPU_ALLOW)[0] is not None
    assert judge("torch_sdpa.flash", "cuda", masked, REJECT, None, CPU_ALLOW)[0] is not None


def test_judge_agreements_are_silent():
    """Both run or both refuse: no message."""
    assert judge("torch_sdpa.math", "cpu", CTX, [], None, ()) == (None, None)
    assert judge("torch_sdpa.math", "cpu", CTX, REJECT, "refused", ()) == (None, None)
