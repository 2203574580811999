"""Liger-Kernel kernels on a real GPU against float64 oracles (``pytest -m gpu tests/gpu/test_gpu_liger.py``).

``liger.rms_norm`` (plain and fused residual add) and ``liger.rope`` (both layouts, gathered / table / indexed
cos-sin, partial rotary) are locked with ``lz.lock`` and run on >= 50 seeded cases per dtype; skipped with the
backend's reason when liger_kernel is not installed or does not import here.
"""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# |out - ref| <= ATOL + RTOL * |ref|: Llama order rounds twice in half precision (cast, weight multiply)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 3.2e-2)}


def _usable() -> None:
    RUNTIME.ensure_ready()
    backend = RUNTIME.registry.backend("liger")
    if not backend.available:
        pytest.skip(f"liger not usable here: {'; '.join(str(r) for r in backend.reasons)}")


def _close(out, ref, dtype, what):
    atol, rtol = TOL[dtype]
    bad = (out.double() - ref).abs() > atol + rtol * ref.abs()
    assert not bad.any(), f"{what}: max err {(out.double() - ref).abs().max().item():.3g}"


def _rms64(x, w, eps):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_liger_rms_norm_matches_float64(dtype):
    _usable()
    g = torch.Generator(device="cuda").manual_seed(0)
    lz.lock("rms_norm", "liger.rms_norm")
    try:
        cases = 0
        for h in (8, 127, 1024, 4096, 5120):
            for rows in ((1,), (3, 7), (2, 33), (4096,), (1, 1, 9)):
                for residual in (False, True):
                    x = torch.randn(*rows, h, device="cuda", dtype=dtype, generator=g)
                    w = torch.randn(h, device="cuda", dtype=dtype, generator=g)
                    if residual:
                        r = torch.randn(*rows, h, device="cuda", dtype=dtype, generator=g)
                        y, s = lz.rms_norm(x, w, 1e-6, residual=r)
                        torch.testing.assert_close(s, x + r)
                        _close(y, _rms64(x + r, w, 1e-6), dtype, f"fused h={h} rows={rows}")
                    else:
                        _close(lz.rms_norm(x, w, 1e-6), _rms64(x, w, 1e-6), dtype, f"h={h} rows={rows}")
                    cases += 1
        assert cases >= 50
    finally:
        lz.unlock("rms_norm")


def _rope64(x, cos, sin, layout):
    """float64 half rotation; x in ``layout``, cos/sin gathered ``[b, S, R]``."""
    x = x.double() if layout == "BHSD" else x.double().transpose(1, 2)
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    r = c.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    rotated = torch.cat((-rot[..., r // 2 :], rot[..., : r // 2]), -1)
    out = torch.cat((rot * c + rotated * s, rest), -1)
    return out if layout == "BHSD" else out.transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_liger_rope_matches_float64(dtype):
    _usable()
    g = torch.Generator(device="cuda").manual_seed(1)
    lz.lock("rope", "liger.rope")
    try:
        cases = 0
        for d, r in ((64, 64), (128, 128), (128, 64), (80, 80)):
            for hq, hkv in ((8, 8), (8, 2), (5, 1)):
                for s in (1, 17, 64):
                    for layout in ("BHSD", "BSHD"):
                        b = 2
                        inv = 1.0 / (10000 ** (torch.arange(0, r, 2, device="cuda", dtype=torch.float64) / r))
                        ang = torch.arange(128, device="cuda", dtype=torch.float64)[:, None] * inv
                        table_c, table_s = (
                            torch.cat([ang.cos()] * 2, -1).float(),
                            torch.cat([ang.sin()] * 2, -1).float(),
                        )
                        qs = (b, hq, s, d) if layout == "BHSD" else (b, s, hq, d)
                        ks = (b, hkv, s, d) if layout == "BHSD" else (b, s, hkv, d)
                        q = torch.randn(qs, device="cuda", dtype=dtype, generator=g)
                        k = torch.randn(ks, device="cuda", dtype=dtype, generator=g)
                        q0, k0 = q.clone(), k.clone()
                        pos = torch.randint(0, 128, (b, s), device="cuda", generator=g)
                        qo, ko = lz.rope(q, k, table_c, table_s, position_ids=pos, layout=layout)
                        gc, gs = table_c[pos], table_s[pos]
                        _close(qo, _rope64(q0, gc, gs, layout), dtype, f"q d={d} r={r} {layout}")
                        _close(ko, _rope64(k0, gc, gs, layout), dtype, f"k d={d} r={r} {layout}")
                        assert torch.equal(q, q0) and torch.equal(k, k0), "inputs were modified"
                        qo2, _ = lz.rope(
                            q, k, table_c[:s].unsqueeze(0), table_s[:s].unsqueeze(0), layout=layout
                        )
                        _close(
                            qo2,
                            _rope64(q0, table_c[:s].unsqueeze(0), table_s[:s].unsqueeze(0), layout),
                            dtype,
                            f"gathered d={d} {layout}",
                        )
                        cases += 1
        assert cases >= 50
    finally:
        lz.unlock("rope")


def test_liger_ranked_below_torch_native_unless_preferred():
    """Liger's priority (40) follows the H200 measurements (124-139 us per call, slowest rms_norm there), so
    the default pick is F.rms_norm; lz.prefer("liger") must still route to it (preferences never lie)."""
    _usable()
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    assert lz.which("rms_norm", x, w) == "torch_native.rms_norm"
    with lz.prefer("liger"):
        assert lz.which("rms_norm", x, w) == "liger.rms_norm"


def test_liger_rms_norm_backward_matches_torch():
    _usable()
    x = torch.randn(8, 512, device="cuda", requires_grad=True)
    w = torch.randn(512, device="cuda", requires_grad=True)
    lz.lock("rms_norm", "liger.rms_norm")
    try:
        lz.rms_norm(x, w, 1e-6).sum().backward()
    finally:
        lz.unlock("rms_norm")
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.rms_norm(x2, (512,), w2, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad, w2.grad, atol=1e-3, rtol=1e-4)
