"""``backends/triton/_launch.FastLaunch`` on a real GPU (``pytest -m gpu``): launches through the cached
compiled kernel give bit-identical outputs to Triton's own ``kernel[grid](...)`` path, across calls whose
specialization differs (a row stride divisible by 16 or not, another dtype), each of which gets its own
compiled entry; the float64 reference bounds both."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.backends.triton import _launch
from layerzero.core.knobs import knobs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_usable")]
DEV = "cuda"


def _rms64(x, w, eps=1e-6):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def test_fast_and_plain_launches_agree_across_specializations():
    g = torch.Generator(device=DEV).manual_seed(0)
    cases = []
    for hidden, dtype in (
        (4096, torch.bfloat16),
        (4095, torch.bfloat16),
        (1000, torch.float16),
        (64, torch.float32),
    ):
        x = torch.randn(7, hidden + 3, device=DEV, dtype=dtype, generator=g)[
            :, :hidden
        ]  # row stride hidden + 3
        xc = x.contiguous()
        w = torch.rand(hidden, device=DEV, dtype=dtype, generator=g) + 0.5
        cases += [(x, w), (xc, w)]
    lz.lock("rms_norm", "triton.rms_norm")
    try:
        fast_out = [
            [lz.rms_norm(x, w) for x, w in cases] for _ in range(3)
        ]  # 1st: compile; then fast launches
        launchers = [la for la in _launch._LAUNCHERS.values() if "rms_norm" in getattr(la.fn, "__name__", "")]
        assert launchers and launchers[0].hits > 0 and len(launchers[0].kernels) >= 4
        for la in launchers:
            la.broken = True  # Triton's own path from here on
        plain = [lz.rms_norm(x, w) for x, w in cases]
    finally:
        lz.unlock("rms_norm")
        for la in _launch._LAUNCHERS.values():
            la.broken = type(la.fn).__name__ == "InterpretedFunction"
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}
    for rnd in fast_out:
        for (x, w), f, p in zip(cases, rnd, plain, strict=True):
            assert torch.equal(f, p)
            torch.testing.assert_close(f.double(), _rms64(x, w), rtol=tol[x.dtype], atol=tol[x.dtype])


def test_paged_decode_fast_launch_matches_the_plain_launch():
    from layerzero.backends.triton import paged as tp

    g = torch.Generator(device=DEV).manual_seed(1)
    cache = lz.allocate_kv_cache(80, 16, 4, 128, torch.bfloat16, "NHD", DEV)
    cache.normal_(generator=g)
    q = torch.randn(6, 16, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    table = (
        torch.randperm(80, generator=torch.Generator().manual_seed(2))[:60]
        .view(6, 10)
        .to(torch.int32)
        .to(DEV)
    )
    outs = []
    for lens in ([160, 1, 77, 33, 150, 16], [5, 5, 5, 5, 5, 5], [160, 160, 1, 2, 3, 4]):
        sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
        outs.append([tp.paged_decode(q, cache, table, sl) for _ in range(3)])
    for la in _launch._LAUNCHERS.values():
        la.broken = True
    try:
        for i, lens in enumerate(([160, 1, 77, 33, 150, 16], [5, 5, 5, 5, 5, 5], [160, 160, 1, 2, 3, 4])):
            plain = tp.paged_decode(q, cache, table, torch.tensor(lens, dtype=torch.int32, device=DEV))
            assert all(torch.equal(o, plain) for o in outs[i])
    finally:
        for la in _launch._LAUNCHERS.values():
            la.broken = type(la.fn).__name__ == "InterpretedFunction"
    assert sum(la.hits for la in _launch._LAUNCHERS.values()) > 0


def test_pinned_paged_decode_keys_on_alignment_and_matches_the_plain_launch():
    """``triton.paged_decode`` launches through ``FastLaunch.pinned`` (its plan is the pin): a q of the same
    shape and strides but 2 bytes off 16-byte alignment gets its own entry, and every pinned launch (fused
    merge, two kernels, one split) equals Triton's own path bit for bit; the float64 reference bounds them."""
    from layerzero.backends.reference.paged import paged_attention as reference_paged
    from layerzero.backends.triton import paged as tp

    g = torch.Generator(device=DEV).manual_seed(3)
    cache = lz.allocate_kv_cache(90, 16, 4, 128, torch.bfloat16, "NHD", DEV)
    cache.normal_(generator=g)
    table = (
        torch.randperm(90, generator=torch.Generator().manual_seed(4))[:72]
        .view(6, 12)
        .to(torch.int32)
        .to(DEV)
    )
    lens = torch.tensor([190, 1, 77, 33, 150, 16], dtype=torch.int32, device=DEV)
    buf = torch.randn(6 * 16 * 128 + 1, device=DEV, dtype=torch.bfloat16, generator=g)
    q_aligned, q_odd = buf[:-1].view(6, 16, 128), buf[1:].view(6, 16, 128)
    assert q_odd.data_ptr() % 16 and q_aligned.stride() == q_odd.stride()
    calls = [(q, splits) for q in (q_aligned, q_odd) for splits in (None, 1, 5)]
    fast = [[tp.paged_decode(q, cache, table, lens, num_splits=s) for _ in range(3)] for q, s in calls]
    split = _launch.launcher_of(tp._KERNELS.get().paged_decode_split)
    assert split.hits > 0 and len({k[2] for k in split.pins}) >= 2  # two alignments of q, separate entries
    for la in _launch._LAUNCHERS.values():
        la.broken = True
    try:
        plain = [tp.paged_decode(q, cache, table, lens, num_splits=s) for q, s in calls]
    finally:
        for la in _launch._LAUNCHERS.values():
            la.broken = type(la.fn).__name__ == "InterpretedFunction"
    for (q, _), outs, want in zip(calls, fast, plain, strict=True):
        assert all(torch.equal(o, want) for o in outs)
        ref = reference_paged(q.double(), cache.double(), table, lens, None, None, True, "NHD")
        torch.testing.assert_close(want.double(), ref, rtol=2e-2, atol=2e-2)


def test_pdl_launched_kernels_in_a_graph_replay_eagers_bits():
    """Under capture (SM 9.0+) our decode kernels are PDL-launched (``_launch.pdl_kwargs``: each waits for the
    previous grid before touching memory); a graph of rms_norm -> gemv -> SwiGLU -> gemv replays, bit for bit,
    the same kernels run eagerly without PDL (``lz.capture_selection()`` selects what the capture runs; PDL
    off for that eager run), with inputs changed between replays; the captured kernels are the PDL
    variants."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs SM 9.0+")
    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(2, 1024, device=DEV, dtype=torch.bfloat16, generator=g)
    res = torch.randn(2, 1024, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.rand(1024, device=DEV, dtype=torch.bfloat16, generator=g) + 0.5
    w_up = torch.randn(6144, 1024, device=DEV, dtype=torch.bfloat16, generator=g) / 32
    w_down = torch.randn(1024, 3072, device=DEV, dtype=torch.bfloat16, generator=g) / 32

    def step():
        h, r = lz.rms_norm(x, w, residual=res)
        gate, up = lz.linear(h, w_up).chunk(2, dim=-1)
        return lz.linear(lz.swiglu(gate, up), w_down) + r

    def eager_without_pdl():
        with knobs(_launch.KNOBS, pdl=False), lz.capture_selection():
            return step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), lz.capture_selection():
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for i in range(3):
        if i:
            x.copy_(torch.randn(x.shape, device=DEV, dtype=x.dtype, generator=g))
        want = eager_without_pdl()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, want)
        h64 = _rms64(x.float() + res.float(), w)
        ref = (
            torch.nn.functional.silu(h64 @ w_up[:3072].double().T) * (h64 @ w_up[3072:].double().T)
        ) @ w_down.double().T + (x.double() + res.double())
        torch.testing.assert_close(static.double(), ref, rtol=5e-2, atol=5e-2)
    pdl = [
        k
        for la in _launch._LAUNCHERS.values()
        for k in la.kernels.values()
        if getattr(getattr(k, "metadata", None), "launch_pdl", False)
    ]
    assert pdl, "no kernel was compiled with launch_pdl"
