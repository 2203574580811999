"""``triton.sample``'s sort-free top-k / top-p kernel (pivot rejection, ``_sampling_reject_kernels.py``) on a
real GPU (``pytest -m gpu``), at real vocabularies: seeded rows draw ``reference.sample``'s tokens (the race
over the sorted-and-cut row; a rare difference only at a cut's float32 boundary) and never leave the float64
kept set; unseeded draws follow the float64 target (chi-square p > 0.001, 200k draws); and the kernel beats
the sort it replaces at decode batch sizes (timings printed). Skipped without a usable triton."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.backends.reference import sampling as ref
from layerzero.backends.triton import sampling as ts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from test_batch_sampling import oracle_row  # noqa: E402
from test_sample_reject import chi2_pvalue  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_usable")]
DEV = "cuda"


def _params(b: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    r = torch.rand(4, b, generator=g, device=DEV)
    return dict(
        temperature=torch.where(r[0] < 0.1, 0.0, 0.3 + 1.2 * torch.rand(b, generator=g, device=DEV)),
        top_k=torch.where(r[1] < 0.3, 0, torch.randint(1, 200, (b,), generator=g, device=DEV)),
        top_p=torch.where(r[2] < 0.3, 1.0, 0.5 + 0.5 * torch.rand(b, generator=g, device=DEV)),
        min_p=torch.where(r[3] < 0.5, 0.0, 0.1 * torch.rand(b, generator=g, device=DEV)),
    )


def _kept64(logits: torch.Tensor, kw: dict[str, torch.Tensor], slack: float = 1e-4) -> torch.Tensor:
    """``[B, V]`` bool: the float64 kept set, widened by ``slack`` at each boundary (sort-based, as the
    reference)."""
    x = logits.double()
    t = kw["temperature"].double()
    z = (x - x.amax(-1, keepdim=True)) / torch.where(t > 0, t, 1.0)[:, None]
    v = z.shape[1]
    sz, order = torch.sort(z, dim=-1, descending=True, stable=True)
    k = kw["top_k"].long()
    k = torch.where((k <= 0) | (k > v), v, k)
    kth = sz.gather(1, (k - 1)[:, None])
    sz = sz.masked_fill(sz < kth - slack * (1 + kth.abs()), -math.inf)
    pr = torch.softmax(sz, -1)
    before = pr.cumsum(-1) - pr
    p = kw["top_p"].double()[:, None]
    cut = (before >= p + slack) & (p < 1)
    cut[:, 0] = False
    keep_sorted = ~cut & torch.isfinite(sz)
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return keep & (z.exp() >= kw["min_p"].double()[:, None] * (1 - slack))


@pytest.mark.parametrize(
    ("v", "dtype"), [(151936, torch.bfloat16), (128256, torch.float32), (50257, torch.float32)]
)
def test_seeded_rows_draw_the_reference_tokens_inside_the_kept_set(v, dtype):
    g = torch.Generator(device=DEV).manual_seed(v)
    b = 96
    logits = (torch.randn(b, v, generator=g, device=DEV) * 3).to(dtype)
    kw = _params(b, g)
    seeds = torch.randint(0, 2**40, (b,), generator=g, device=DEV)
    offsets = torch.randint(0, 1000, (b,), generator=g, device=DEV)
    got = ts.sample(logits, **kw, seeds=seeds, offsets=offsets)
    want = ref.sample(logits, **kw, seeds=seeds, offsets=offsets)
    keep = _kept64(logits, kw)
    assert keep.gather(1, got[:, None]).all()
    assert (got == want).float().mean() >= 0.98, (got != want).nonzero().flatten().tolist()
    for i in (0, 41, 95):  # a seeded request draws the same token alone
        alone = ts.sample(
            logits[i : i + 1],
            **{k: t[i : i + 1] for k, t in kw.items()},
            seeds=seeds[i : i + 1],
            offsets=offsets[i : i + 1],
        )
        assert int(alone) == int(got[i])
    assert lz.which("sample", logits, **kw) == "triton.sample"


@pytest.mark.parametrize(
    "cfg", [dict(top_k=50), dict(top_p=0.9), dict(top_k=300, top_p=0.95, min_p=0.02)], ids=str
)
def test_unseeded_draws_follow_the_float64_target(cfg):
    v, n = 1000, 200_000
    row = torch.randn(v, generator=torch.Generator().manual_seed(4), dtype=torch.float64).float() * 3
    probs, _ = oracle_row(row.double().tolist(), 1.0, cfg.get("top_k"), cfg.get("top_p"), cfg.get("min_p"))
    kw = {
        name: torch.full((n,), val, device=DEV, dtype=torch.int64 if name == "top_k" else torch.float32)
        for name, val in cfg.items()
    }
    out = ts.sample(
        row.to(DEV)[None].expand(n, -1).contiguous(), **kw, generator=torch.Generator(DEV).manual_seed(1)
    )
    counts = Counter(out.tolist())
    assert set(counts) <= set(probs)
    assert chi2_pvalue(counts, probs, n) > 1e-3
