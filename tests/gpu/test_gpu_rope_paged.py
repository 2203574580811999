"""``lz.rope_paged_attention`` on a real GPU (``pytest -m gpu
tests/gpu/test_gpu_rope_paged.py``): the compiled ``triton.rope_paged_decode`` on the interpreter test's cases
against their float64 oracle (the splits run concurrently here, so split 0's KV write races the other splits'
reads of that slot: the new token's K/V must come from registers), chosen when preferred (it is opt in:
``rope_paged.PRIORITY``) and equal to the unfused calls, and replayed in a CUDA graph (PDL-launched on SM
9.0+) bit for bit as computed eagerly. Skipped with the backend's reason when triton is not usable here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.backends.triton import rope_paged as trp
from layerzero.core.knobs import knobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from test_triton_rope_paged_interpret import CASES, case, oracle  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_usable")]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def cuda_case(*a, **kw):
    return tuple(None if t is None else t.cuda() for t in case(*a, **kw))


def call(args, interleaved, layout):
    q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens = args
    return lz.rope_paged_attention(
        q,
        k,
        v,
        cos,
        sin,
        cache,
        slots,
        bt,
        lens,
        position_ids=pos,
        q_weight=qw,
        k_weight=kw,
        eps=1e-6,
        interleaved=interleaved,
        kv_layout=layout,
    )


@pytest.mark.parametrize(
    ("seed", "dtype", "b", "hq", "hkv", "d", "page", "layout", "norm", "interleaved", "splits", "skip"),
    CASES,
    ids=lambda x: str(x).replace("torch.", ""),
)
@pytest.mark.parametrize("default_splits", [False, True], ids=["forced", "default"])
def test_kernel_matches_float64(
    seed, dtype, b, hq, hkv, d, page, layout, norm, interleaved, splits, skip, default_splits
):
    args = cuda_case(seed, dtype, b, hq, hkv, d, page, layout, norm, interleaved, skip)
    cpu = [None if t is None else t.cpu() for t in args]
    want, want_cache = oracle(*cpu[:10], cpu[10], cpu[11], d**-0.5, 1e-6, interleaved, layout)
    q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens = args
    with lz.prefer(trp.KERNEL_ID):  # opt in (rope_paged.PRIORITY)
        assert (
            lz.which(
                "rope_paged_attention",
                q,
                k,
                v,
                cos,
                sin,
                cache,
                slots,
                bt,
                lens,
                position_ids=pos,
                q_weight=qw,
                k_weight=kw,
                interleaved=interleaved,
                kv_layout=layout,
            )
            == trp.KERNEL_ID
        )
        with knobs(trp.KNOBS, num_splits=None if default_splits else splits):
            got = call(args, interleaved, layout)
    err = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
    assert err <= TOL[dtype], err
    diff = (cache.double().cpu() - want_cache.double()).abs().max().item()
    assert diff <= TOL[dtype] * 2 * want_cache.double().abs().max().item(), diff


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_equals_the_unfused_calls_and_replays_in_a_graph(dtype, layout):
    """Qwen3-0.6B's attention shape (16 / 8 heads of 128), lengths 1 to ~1000 in a 2048-token-wide table: the
    fused kernel against ``lz.qk_norm_rope_cache`` + ``lz.paged_attention`` (same tiles and splits: rounding
    only), then a CUDA graph of it replayed on a fresh copy of the cache equals the eager call bit for bit."""
    b, hq, hkv, d, page = 4, 16, 8, 128, 16
    g = torch.Generator(device="cuda").manual_seed(3)
    lens = torch.tensor([1, 17, 384, 1000], dtype=torch.int32, device="cuda")
    width = 2048 // page
    bt = torch.randperm(b * width, generator=g, device="cuda").view(b, width).to(torch.int32)
    slots = torch.stack([bt[i, (lens[i] - 1) // page].long() * page + (lens[i] - 1) % page for i in range(b)])
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g, device="cuda").to(dtype)
    q, k, v = (t.view(b, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    qw, kw = (torch.rand(2, d, generator=g, device="cuda") + 0.5).to(dtype).unbind(0)
    t = torch.arange(4096, device="cuda").float()[:, None] / (
        1e6 ** (torch.arange(0, d, 2, device="cuda") / d)
    )
    cos, sin = torch.cat([t, t], -1).cos().to(dtype), torch.cat([t, t], -1).sin().to(dtype)
    pos = (lens - 1).long()
    cache = lz.allocate_kv_cache(b * width, page, hkv, d, dtype, layout, device="cuda")
    cache.normal_(generator=g)
    before = cache.clone()
    ref_cache = cache.clone()
    qr, _ = lz.qk_norm_rope_cache(
        q, k, v, qw, kw, cos, sin, ref_cache, slots, position_ids=pos, kv_layout=layout
    )
    want = lz.paged_attention(qr, ref_cache, bt, lens, kv_layout=layout)
    args = (q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens)
    with lz.prefer(trp.KERNEL_ID):
        got = call(args, False, layout)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    # the same slots written (every other one equal), with values within a rounding (the norm's order of
    # operations)
    torch.testing.assert_close(cache, ref_cache, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(cache != before, ref_cache != before)
    ref_cache = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with lz.prefer(trp.KERNEL_ID):
        with lz.capture_selection():
            call(args, False, layout)  # compiles the PDL variant before the capture
        with torch.cuda.graph(graph):
            out = call(args, False, layout)
    cache.copy_(before)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got) and torch.equal(cache, ref_cache)
